// SPDX-License-Identifier: Apache-2.0
#include "common.hpp"

namespace gradcomp::py {
namespace {

void bind_core(nb::module_& m) {
  m.def("built_with_cuda", &built_with_cuda, "True when the extension was built with CUDA.");
  m.def("cuda_device_count", &cuda_device_count, "Visible CUDA devices (0 without CUDA).");
  m.def("set_cpu_threads", &set_cpu_threads, nb::arg("n"),
        "Threads the CPU kernels use (0 = all cores).");
  m.def("cpu_threads", &cpu_threads);

  nb::class_<Payload>(m, "Payload", "One encoded tensor (wire bytes on the gradient's device).")
      .def(nb::init<>())
      .def_prop_ro("nbytes", &Payload::size)
      .def_prop_ro("kind", [](const Payload& p) {
        return std::string(payload_kind_name(PayloadKind(p.header.kind)));
      })
      .def_prop_ro("count", [](const Payload& p) { return p.header.count; })
      .def_prop_ro("numel", [](const Payload& p) { return p.header.numel; })
      .def(
          "array",
          [](Payload& p) -> nb::object {
            size_t shape[1] = {p.size()};
            auto* data = static_cast<uint8_t*>(p.bytes.data());
            if (p.device() == Device::kCUDA)  // CUDA payloads come back as torch tensors
              return nb::cast(nb::ndarray<nb::pytorch, uint8_t>(
                                  data, 1, shape, nb::handle(), nullptr, nb::dtype<uint8_t>(),
                                  nb::device::cuda::value, cuda::current_device()),
                              nb::rv_policy::reference);
            return nb::cast(nb::ndarray<nb::numpy, uint8_t>(data, 1, shape, nb::handle()),
                            nb::rv_policy::reference);
          },
          nb::keep_alive<0, 1>(),
          "A uint8 view of the wire bytes (valid until the next encode into this payload).");
}

Register reg(0, bind_core);

}  // namespace
}  // namespace gradcomp::py

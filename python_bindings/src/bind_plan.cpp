// SPDX-License-Identifier: Apache-2.0
// Plans and their collectives, for the Python driver (gradcomp.torch) that runs them over
// torch.distributed. Buffers are exposed as zero-copy views (NumPy on CPU, torch on CUDA).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"

namespace gradcomp::py {
namespace {

/// A view of a plan buffer typed for torch 1.13+ (which has no uint16/uint32): fp16 and bf16 as
/// int16 (the driver reinterprets with .view), uint32 as int32 (sums are bitwise the same mod
/// 2^32).
nb::object buffer_view(const Collective& c, const void* p, size_t elems) {
  size_t shape[1] = {elems};
  void* data = const_cast<void*>(p);
  const bool cuda = c.device == Device::kCUDA;
  auto make = [&](auto tag) -> nb::object {
    using T = decltype(tag);
    if (cuda)
      return nb::cast(
          nb::ndarray<nb::pytorch, T>(data, 1, shape, nb::handle(), nullptr, nb::dtype<T>(),
                                      nb::device::cuda::value, cuda::current_device()),
          nb::rv_policy::reference);
    return nb::cast(nb::ndarray<nb::numpy, T>(data, 1, shape, nb::handle()),
                    nb::rv_policy::reference);
  };
  switch (c.type) {
    case ElemType::kF32:
      return make(float{});
    case ElemType::kF16:
      return make(int16_t{});
    case ElemType::kBF16:
      return make(int16_t{});
    case ElemType::kU8:
      return make(uint8_t{});
    case ElemType::kU32:
      return make(int32_t{});
    case ElemType::kI64:
      return make(int64_t{});
  }
  return nb::none();
}

size_t send_elems(const Collective& c) {
  return c.kind == CollectiveKind::kAllToAll ? c.count * static_cast<size_t>(c.world) : c.count;
}
size_t recv_elems(const Collective& c) {
  return (c.kind == CollectiveKind::kAllgather || c.kind == CollectiveKind::kAllToAll)
             ? c.count * static_cast<size_t>(c.world)
             : c.count;
}

/// The canonical names of an enum's members, in enum order (gradcomp/types.hpp).
template <class E>
std::vector<std::string> member_names() {
  std::vector<std::string> v;
  for (std::size_t i = 0; i < EnumNames<E>::members; ++i) v.emplace_back(EnumNames<E>::table[i].name);
  return v;
}

void bind_plan(nb::module_& m) {
  m.def("collective_names", &member_names<CollectiveKind>,
        "The names a Collective's `kind` takes (gradcomp/types.hpp), in enum order.");
  m.def("elem_type_names", &member_names<ElemType>,
        "The names a Collective's `type` takes (gradcomp/types.hpp), in enum order.");
  nb::class_<Collective>(m, "Collective", "One collective a plan asks its driver to run.")
      .def_prop_ro("kind", [](const Collective& c) { return std::string(collective_name(c.kind)); })
      .def_prop_ro("type", [](const Collective& c) { return std::string(elem_type_name(c.type)); })
      .def_ro("count", &Collective::count)
      .def_ro("root", &Collective::root)
      .def_ro("world", &Collective::world)
      .def_prop_ro("scope", [](const Collective& c) { return std::string(scope_name(c.scope)); })
      .def_ro("tag", &Collective::tag)
      .def_prop_ro("in_place", [](const Collective& c) { return c.send == c.recv; })
      .def_prop_ro("send_bytes", &Collective::send_bytes)
      .def(
          "send", [](const Collective& c) { return buffer_view(c, c.send, send_elems(c)); },
          "Zero-copy view of the send buffer (NumPy on CPU, torch on CUDA).")
      .def(
          "recv", [](const Collective& c) { return buffer_view(c, c.recv, recv_elems(c)); },
          "Zero-copy view of the receive buffer.");

  // dynamic_attr (inherited by every plan class): the __dict__ that holds a step's arrays
  nb::class_<Plan>(m, "Plan", "A compressed allreduce as a step machine (see gradcomp/plan.hpp).",
                   nb::dynamic_attr())
      .def(
          "next",
          [](nb::pointer_and_handle<Plan> self) -> std::optional<Collective> {
            std::optional<Collective> c;
            {
              nb::gil_scoped_release nogil;
              c = self.p->next();
            }
            if (!c) nb::setattr(self.h, kStepArrays, nb::none());  // the step's arrays are free
            return c;
          },
          "Runs the next local phase; returns the next Collective, or None when done (the plan "
          "then lets go of the arrays given to begin()).")
      .def_prop_ro("name", &Plan::name);
}

Register reg(5, bind_plan);

}  // namespace
}  // namespace gradcomp::py

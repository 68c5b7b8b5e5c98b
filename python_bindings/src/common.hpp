// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the bindings: array -> TensorView without copies (DLPack via nanobind's
// ndarray: torch CPU/CUDA tensors, NumPy arrays), dtype names, and the registry of binders.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <functional>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"

namespace gradcomp::py {
namespace nb = nanobind;

using AnyArray = nb::ndarray<nb::c_contig>;

/// Views a contiguous array as a TensorView. `stream` is a cudaStream_t as an integer (torch:
/// torch.cuda.current_stream().cuda_stream); 0 = the legacy default stream.
inline TensorView to_view(const AnyArray& a, uintptr_t stream = 0, const char* what = "tensor") {
  DType t;
  const auto dt = a.dtype();
  if (dt == nb::dtype<float>())
    t = DType::kFloat32;
  else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16)
    t = DType::kFloat16;
  else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16)
    t = DType::kBFloat16;
  else
    throw InvalidArgument(detail::cat(what, ": unsupported dtype (code ", int(dt.code), ", ",
                                      int(dt.bits), " bits); expected float32, float16 or bfloat16"));
  Device dev;
  if (a.device_type() == nb::device::cpu::value)
    dev = Device::kCPU;
  else if (a.device_type() == nb::device::cuda::value)
    dev = Device::kCUDA;
  else
    throw InvalidArgument(detail::cat(what, ": unsupported device type ", a.device_type(),
                                      " (expected cpu or cuda)"));
  if (dev == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda(detail::cat(what, " on CUDA").c_str());
  std::vector<int64_t> shape(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) shape[i] = static_cast<int64_t>(a.shape(i));
  GC_CHECK_ARG(a.ndim() <= TensorView::kMaxDims, what, ": at most ", TensorView::kMaxDims,
               " dimensions, got ", a.ndim());
  return TensorView(a.data(), shape.data(), static_cast<int>(shape.size()), t, dev,
                    a.device_id(), reinterpret_cast<void*>(stream));
}

inline DType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32" || s == "float") return DType::kFloat32;
  if (s == "float16" || s == "fp16" || s == "half") return DType::kFloat16;
  if (s == "bfloat16" || s == "bf16") return DType::kBFloat16;
  throw InvalidArgument("unknown dtype '" + s + "' (expected float32, float16 or bfloat16)");
}

inline Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::kCPU;
  if (s == "cuda") return Device::kCUDA;
  throw InvalidArgument("unknown device '" + s + "' (expected cpu or cuda)");
}

inline SelectMethod parse_method(const std::string& s) {
  if (s == "exact") return SelectMethod::kExact;
  if (s == "sampled") return SelectMethod::kSampled;
  throw InvalidArgument("unknown selection method '" + s + "' (expected exact or sampled)");
}

/// The options top-k and random-k share (SparsifyConfig) from the keyword arguments of their
/// compressors and plans.
template <class C>
C sparsify_config(double ratio, double momentum, bool nesterov, bool momentum_masking,
                  double clip_norm, std::vector<double> warmup_ratios, int64_t warmup_steps,
                  const std::string& value_dtype, bool error_feedback, bool check_finite,
                  uint64_t seed, uint32_t tensor_id) {
  C c;
  c.ratio = ratio;
  c.momentum = momentum;
  c.nesterov = nesterov;
  c.momentum_masking = momentum_masking;
  c.clip_norm = clip_norm;
  c.warmup_ratios = std::move(warmup_ratios);
  c.warmup_steps = warmup_steps;
  c.value_dtype = parse_dtype(value_dtype);
  c.error_feedback = error_feedback;
  c.check_finite = check_finite;
  c.seed = seed;
  c.tensor_id = tensor_id;
  return c;
}

/// The top-k configuration from the keyword arguments shared by TopKCompressor and
/// TopKAllreducePlan.
inline TopKConfig topk_config(double ratio, const std::string& method, double sample_rate,
                              double momentum, bool nesterov, bool momentum_masking,
                              double clip_norm, std::vector<double> warmup_ratios,
                              int64_t warmup_steps, const std::string& value_dtype,
                              bool error_feedback, bool check_finite, uint64_t seed,
                              uint32_t tensor_id) {
  TopKConfig c = sparsify_config<TopKConfig>(ratio, momentum, nesterov, momentum_masking,
                                             clip_norm, std::move(warmup_ratios), warmup_steps,
                                             value_dtype, error_feedback, check_finite, seed,
                                             tensor_id);
  c.select.method = parse_method(method);
  c.select.sample_rate = sample_rate;
  return c;
}

inline nb::dict stats_dict(const CompressionStats& s) {
  nb::dict d;
  d["step"] = s.step;
  d["numel"] = s.numel;
  d["count"] = s.count;
  d["dense_bytes"] = s.dense_bytes;
  d["payload_bytes"] = s.payload_bytes;
  d["compression_ratio"] = s.compression_ratio();
  return d;
}

/// The methods every single-payload compressor (gradcomp::Compressor) has in Python: encode,
/// decode_add (GIL released), state_dict / load_state_dict (bytes), step, numel, last_stats.
template <class C>
void def_compressor_methods(nb::class_<C>& cls) {
  using ByteArray = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>;
  cls.def(
         "encode",
         [](C& c, const AnyArray& g, Payload* out, uintptr_t stream) {
           const TensorView v = to_view(g, stream, "gradient");
           nb::gil_scoped_release nogil;
           c.encode(v, *out);
         },
         nb::arg("grad"), nb::arg("out"), nb::arg("stream") = 0,
         "Compresses grad into out (updates the error-feedback state, advances the step).")
      .def(
          "decode_add",
          [](C& c, const ByteArray& payload, const AnyArray& dense, float scale, uintptr_t stream) {
            const TensorView d = to_view(dense, stream, "output");
            nb::gil_scoped_release nogil;
            c.decode_add(payload.data(), payload.shape(0), d, scale);
          },
          nb::arg("payload"), nb::arg("dense"), nb::arg("scale") = 1.0f, nb::arg("stream") = 0,
          "dense += scale * decode(payload); the payload is validated first.")
      .def("state_dict",
           [](const C& c) {
             const auto b = c.state_dict();
             return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def("load_state_dict",
           [](C& c, nb::bytes b) {
             c.load_state_dict(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
           })
      .def_prop_ro("step", [](const C& c) { return c.step(); })
      .def_prop_ro("numel", [](const C& c) { return c.numel(); })
      .def_prop_ro("last_stats", [](const C& c) { return stats_dict(c.last_stats()); });
}

/// A NumPy array owning a host copy of n floats on `dev` (for diagnostics: an explicit copy).
inline nb::object host_copy(const float* src, int64_t n, Device dev) {
  auto* v = new std::vector<float>(static_cast<size_t>(n));
  if (n > 0) device_copy(v->data(), Device::kCPU, src, dev, v->size() * sizeof(float), nullptr);
  nb::capsule owner(v, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  size_t shape[1] = {v->size()};
  return nb::cast(nb::ndarray<nb::numpy, float>(v->data(), 1, shape, owner));
}

/// Each bind_*.cpp registers its binder; module.cpp runs them all (no central list to edit).
using Binder = std::function<void(nb::module_&)>;
inline std::vector<std::pair<int, Binder>>& binders() {
  static std::vector<std::pair<int, Binder>> b;
  return b;
}
struct Register {
  Register(int order, Binder f) { binders().emplace_back(order, std::move(f)); }
};

}  // namespace gradcomp::py

// SPDX-License-Identifier: Apache-2.0
#include "common.hpp"

namespace gradcomp::py {
namespace {

/// __init__(numel, *, tensor_id, grad_dtype, device, device_index, stream, **options) of a
/// sparsifying codec: the options go through make_plan's table (`config`: topk_config or
/// randomk_config).
template <class Codec, class Config>
void def_sparse_init(nb::class_<Codec>& cls, const char* family,
                     Config (*config)(const PlanOptions&, uint32_t)) {
  cls.def(
      "__init__",
      [family, config](Codec* self, int64_t numel, uint32_t tensor_id,
                       const std::string& grad_dtype, const std::string& device, int device_index,
                       uintptr_t stream, const nb::kwargs& kw) {
        const Config c = config(to_options(family, kw), tensor_id);
        new (self) Codec(c, numel, parse_enum<DType>(grad_dtype), parse_enum<Device>(device),
                         device_index, reinterpret_cast<void*>(stream));
      },
      nb::arg("numel"), nb::kw_only(), nb::arg("tensor_id") = 0,
      nb::arg("grad_dtype") = "float32", nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      nb::arg("stream") = 0, nb::arg("kwargs"));
}

void bind_topk(nb::module_& m) {
  nb::class_<TopKCompressor> topk(
      m, "TopKCompressor",
      "Top-k / Deep Gradient Compression state for one tensor. Keyword options: the top-k "
      "plan's (gradcomp.plan_defaults('topk'): ratio, method, sample_rate, momentum, nesterov, "
      "momentum_masking, clip_norm, warmup_ratios, warmup_steps, value_dtype, error_feedback, "
      "check_finite, seed), with the same names, types and defaults; the plan-only ones (route, "
      "exchange, latency_s, bandwidth_Bps, clip_scaling) are refused.\n\n"
      "Example:\n"
      "    c = gradcomp.TopKCompressor(grad.numel(), ratio=0.001, momentum=0.9)\n"
      "    p = gradcomp.Payload()\n"
      "    c.encode(grad, p); c.decode_add(p.array(), out, 1.0)");
  def_sparse_init(topk, "topk", &topk_config);
  def_compressor_methods(topk);

  nb::class_<RandomKCompressor> randomk(
      m, "RandomKCompressor",
      "Random-k with error feedback; indices from the shared RNG. DGC's momentum correction, "
      "masking, clipping and warm-up as for top-k. Keyword options: the random-k plan's "
      "(gradcomp.plan_defaults('randomk'); clip_scaling, plan-only, is refused).");
  def_sparse_init(randomk, "randomk", &randomk_config);
  def_compressor_methods(randomk);

  m.def(
      "topk_indices",
      [](nb::handle x, int64_t k, const std::string& method, uint64_t seed, uint64_t step,
         uint32_t tensor_id) {
        const TensorView v = to_view(take_array(x, Access::kRead, "x"), 0, "x");
        GC_CHECK_ARG(v.device == Device::kCPU, "topk_indices from Python takes CPU arrays");
        GC_CHECK_ARG(k >= 0 && k <= v.numel, "k must be in [0, n] = [0, ", v.numel, "], got ", k);
        auto* out = new std::vector<uint32_t>(static_cast<size_t>(k));
        SelectOptions opt;
        opt.method = parse_enum<SelectMethod>(method);
        int64_t c;
        try {
          nb::gil_scoped_release nogil;
          c = topk_indices(v, k, opt, RngKey{seed, step, tensor_id}, out->data());
        } catch (...) {
          delete out;
          throw;
        }
        out->resize(static_cast<size_t>(c));
        nb::capsule owner(out, [](void* p) noexcept { delete static_cast<std::vector<uint32_t>*>(p); });
        size_t shape[1] = {out->size()};
        return nb::ndarray<nb::numpy, uint32_t>(out->data(), 1, shape, owner);
      },
      nb::arg("x"), nb::arg("k"), nb::arg("method") = "exact", nb::arg("seed") = 0,
      nb::arg("step") = 0, nb::arg("tensor_id") = 0,
      "Indices (ascending) of the k largest |x| of a float32 CPU array." GC_ARRAY_RULE);
}

Register reg(10, bind_topk);

}  // namespace
}  // namespace gradcomp::py

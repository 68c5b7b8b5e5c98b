// SPDX-License-Identifier: Apache-2.0
// Random-k allreduce plan: shared indices, so the values alone are summed.
#include "gradcomp/error.hpp"
#include "gradcomp/plans.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/per_rank.hpp"

namespace gradcomp {

namespace k = kernels;

RandomKAllreducePlan::RandomKAllreducePlan(const RandomKConfig& cfg, int64_t numel, int world,
                                           DType grad_dtype, Device device, int device_index,
                                           void* stream)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      comp_(detail::per_rank(cfg, world), numel, grad_dtype, device, device_index, stream),
      payload_(device),
      acc_(device, stream) {
  payload_.bytes.set_stream(stream);
  // the plan checks finiteness itself (once), so that a bad rank can tell the others
  check_finite_ = cfg.check_finite;
  comp_.set_staged(check_finite_);
}

size_t RandomKAllreducePlan::workspace_bytes() const {
  return payload_.bytes.capacity() + acc_.capacity();
}

std::optional<Collective> RandomKAllreducePlan::next() {
  require_begun();
  switch (phase_) {
    case 0: {  // encode; sum the values section of every rank in place
      bad_ = check_finite_ ? first_nonfinite() : -1;
      if (bad_ >= 0)
        comp_.encode_skipped(payload_);  // NaN values, state untouched
      else
        comp_.encode(grad_, payload_);
      const PayloadHeader& h = payload_.header;
      auto* values = static_cast<uint8_t*>(payload_.bytes.data()) + h.section_offset(1);
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(DType(h.value_dtype)), values, values,
                  static_cast<size_t>(h.count), "randomk values");
    }
    case 1: {  // one decode of the summed values, scaled by 1/P (into the gradient when fp32)
      const auto n = static_cast<size_t>(numel_);
      const PayloadHeader& h = payload_.header;
      // a bad rank sent NaN values; a sum of finite values can also overflow the value dtype
      // (fp16 sums past 65504): either way every rank holds the same non-finite sum and skips.
      // The k summed values are scanned (small next to the bucket).
      if (check_finite_ && h.count > 0 &&
          first_nonfinite(static_cast<const uint8_t*>(payload_.bytes.data()) + h.section_offset(1),
                          DType(h.value_dtype), static_cast<int64_t>(h.count)) >= 0) {
        phase_ = 2;
        end_step(true, bad_);
        return std::nullopt;
      }
      const bool direct = dtype_ == DType::kFloat32;
      float* acc = direct ? static_cast<float*>(grad_.data) : acc_.get<float>(n);
      device_zero(device_, acc, n * sizeof(float), stream_);
      comp_.decode_add(payload_.data(), payload_.size(),
                       TensorView(acc, {numel_}, DType::kFloat32, device_, device_index_, stream_),
                       1.0f / float(world_));
      if (!direct)  // saturating, as the top-k plan
        k::convert_saturating(device_, acc, grad_.data, dtype_, numel_, stream_);
      phase_ = 2;
      comp_.commit();
      end_step(false, bad_, check_finite_);
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

}  // namespace gradcomp

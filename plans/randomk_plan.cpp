// SPDX-License-Identifier: Apache-2.0
// Random-k allreduce plan: shared indices, so the values alone are summed.
#include <cstring>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/plans.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/options_hash.hpp"
#include "plans/per_rank.hpp"

namespace gradcomp {

namespace k = kernels;

namespace {

// Consensus through the sum itself. The ranks' indices come from the RNG keyed by the step, so
// ranks at different steps (one restored alone, an older state loaded into a live plan) or with
// other options would sum values of different elements and get a wrong average without any
// error. Each rank appends kSlots elements to its values: slot b holds bit b of (the step's low
// 32 bits, the options' hash) as 0 or 1. After the sum, slot b is 0 or P on every rank exactly
// when every rank's bit b is the same. Sums of 0/1 are exact while P is an integer of the value
// dtype (fp32: 2^24, fp16: 2048, bf16: 256); beyond that every rank writes 0 (no check).
constexpr int kSlots = 64;

bool exact_for(DType t, int world) {
  const int limit = t == DType::kFloat32 ? (1 << 24) : t == DType::kFloat16 ? 2048 : 256;
  return world > 1 && world <= limit;
}

uint16_t one_bits(DType t) {
  return t == DType::kFloat16 ? float_to_half(1.0f) : float_to_bf16(1.0f);
}

float slot_value(const uint8_t* p, int i, DType t) {
  if (t == DType::kFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return t == DType::kFloat16 ? half_to_float(h) : bf16_to_float(h);
}

}  // namespace

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
  detail::OptionsHash h;  // what decides the indices and the count
  h.add(numel).add(cfg.ratio).add(cfg.momentum).add(cfg.nesterov).add(cfg.momentum_masking);
  h.add(cfg.clip_norm).add(static_cast<int>(cfg.clip_scaling)).add_all(cfg.warmup_ratios);
  h.add(cfg.warmup_steps).add(static_cast<int>(cfg.value_dtype)).add(cfg.error_feedback);
  h.add(cfg.check_finite).add(cfg.seed).add(cfg.tensor_id).add_all(cfg.segments);
  h.add(cfg.dense_below);
  options_hash_ = static_cast<uint32_t>(h.value());
}

size_t RandomKAllreducePlan::put_consensus(const PayloadHeader& h) {
  const auto t = DType(h.value_dtype);
  const size_t es = dtype_size(t);
  const size_t at = h.section_offset(1) + static_cast<size_t>(h.count) * es;
  if (world_ == 1) return static_cast<size_t>(h.count);
  payload_.bytes.resize(std::max(payload_.bytes.size(), at + kSlots * es), true);
  std::vector<uint8_t> slots(kSlots * es, 0);
  if (exact_for(t, world_)) {
    const uint64_t bits =
        (static_cast<uint64_t>(options_hash_) << 32) | (static_cast<uint64_t>(h.aux) & 0xffffffffu);
    for (int b = 0; b < kSlots; ++b) {
      if (!((bits >> b) & 1)) continue;
      if (t == DType::kFloat32) {
        const float one = 1.0f;
        std::memcpy(slots.data() + 4 * b, &one, 4);
      } else {
        const uint16_t one = one_bits(t);
        std::memcpy(slots.data() + 2 * b, &one, 2);
      }
    }
  }
  device_copy(static_cast<uint8_t*>(payload_.bytes.data()) + at, device_, slots.data(),
              Device::kCPU, slots.size(), stream_);
  return static_cast<size_t>(h.count) + kSlots;
}

void RandomKAllreducePlan::check_consensus(const PayloadHeader& h) {
  if (world_ == 1) return;
  const auto t = DType(h.value_dtype);
  const size_t es = dtype_size(t);
  std::vector<uint8_t> slots(kSlots * es);
  device_copy(slots.data(), Device::kCPU,
              static_cast<const uint8_t*>(payload_.bytes.data()) + h.section_offset(1) +
                  static_cast<size_t>(h.count) * es,
              device_, slots.size(), stream_);
  const auto P = static_cast<float>(world_);
  bool step_differs = false, options_differ = false;
  for (int b = 0; b < kSlots; ++b) {
    const float v = slot_value(slots.data(), b, t);
    if (v == 0.0f || v == P) continue;
    (b < 32 ? step_differs : options_differ) = true;
  }
  if (!step_differs && !options_differ) return;
  phase_ = kDone;  // the step is over on every rank (each sees the same sums); nothing committed
  GC_CHECK_ARG(!options_differ, "plan 'randomk': the options differ across ranks (ratio, warm-up, ",
               "seed, momentum, clipping, value_dtype, dense_below or the bucket's layout must be ",
               "the same on every rank); the step failed on every rank and no state changed");
  GC_CHECK_ARG(false, "plan 'randomk': ranks are at different steps (this rank at ", h.aux,
               "); restore every rank's state, or none. The step failed on every rank and no ",
               "state changed");
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
      const size_t count = put_consensus(h);  // (may move the payload's bytes)
      auto* values = static_cast<uint8_t*>(payload_.bytes.data()) + h.section_offset(1);
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(DType(h.value_dtype)), values, values,
                  count, "randomk values");
    }
    case 1: {  // one decode of the summed values, scaled by 1/P (into the gradient when fp32)
      const auto n = static_cast<size_t>(numel_);
      const PayloadHeader& h = payload_.header;
      check_consensus(h);
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

// SPDX-License-Identifier: Apache-2.0
// Random-k allreduce plan: shared indices, so the values alone are summed.
#include "plans/randomk_plan.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/envelope.hpp"
#include "plans/options_hash.hpp"

namespace gradcomp {

namespace k = kernels;

// Consensus through the sum itself. The ranks' indices come from the RNG keyed by the step, so
// ranks at different steps (one restored alone, an older state loaded into a live plan) or with
// other options would sum values of different elements and get a wrong average without any
// error. Each rank appends the step envelope (plans/envelope.hpp) to its values, in the values'
// dtype; its flag is raised by a rank whose values did not fit the agreed count ("some rank was
// cut short").
constexpr size_t kSlots = detail::kSumEnvelopeSlots;

RandomKAllreducePlan::RandomKAllreducePlan(const RandomKConfig& cfg, int64_t numel, int world,
                                           DType grad_dtype, Device device, int device_index,
                                           void* stream)
    : SparsifyPlan(cfg, numel, world, grad_dtype, device, device_index, stream),
      payload_(device),
      acc_(device, stream) {
  payload_.bytes.set_stream(stream);
  // fp16 values are summed in fp16, whose range (65504) a sum of P values passes long before
  // the residuals do: each rank sends its share of the average, as the fp16 cast plans divide
  // by P before their sum, so that no finite residual makes an overflow step (without a loss
  // scaler every step would be skipped while a residual stays that large). fp32 and bf16 values
  // keep fp32's range and are sent as they are.
  shares_ = cfg.value_dtype == DType::kFloat16 && world > 1;
  if (shares_) comp_.set_shares(world);
  detail::OptionsHash h;  // what decides the indices and the count
  h.add(numel).add(cfg.ratio).add(cfg.momentum).add(cfg.nesterov).add(cfg.momentum_masking);
  h.add(cfg.clip_norm).add(static_cast<int>(cfg.clip_scaling)).add_all(cfg.warmup_ratios);
  h.add(cfg.warmup_steps).add(static_cast<int>(cfg.value_dtype)).add(cfg.error_feedback);
  h.add(cfg.check_finite).add(cfg.seed).add(cfg.tensor_id).add_all(cfg.segments);
  h.add(cfg.dense_below);
  options_hash_ = static_cast<uint32_t>(h.value());
  max_count_ = comp_.count_at(0);  // every stage of the warm-up, and the ratio after it
  const auto stages = static_cast<int64_t>(cfg.warmup_ratios.size());
  for (int64_t i = 1; cfg.warmup_steps > 0 && i <= stages; ++i)
    max_count_ = std::max(max_count_, comp_.count_at(i * cfg.warmup_steps));
}

size_t RandomKAllreducePlan::agreed_count() const {
  return static_cast<size_t>(agreed_step_ >= 0 ? comp_.count_at(agreed_step_) : max_count_);
}

size_t RandomKAllreducePlan::put_consensus(const PayloadHeader& h, size_t m) {
  const auto t = DType(h.value_dtype);
  const size_t es = dtype_size(t);
  const auto own = static_cast<size_t>(h.count);
  if (world_ == 1) return own;  // (one rank: its own count is the agreed one)
  const size_t values = h.section_offset(1), at = values + m * es;
  payload_.bytes.resize(std::max(payload_.bytes.size(), at + kSlots * es), true);
  if (own < m)  // fewer values than agreed (this rank's step is not the agreed one): zeros
    device_zero(device_, static_cast<uint8_t*>(payload_.bytes.data()) + values + own * es,
                (m - own) * es, stream_);
  // more: cut short, which the flag says (the envelope overwrites the values past m)
  const detail::StepEnvelope e{static_cast<int64_t>(h.aux), options_hash_, own > m};
  const std::vector<uint8_t> slots = detail::sum_envelope(e, t, world_);
  device_copy(static_cast<uint8_t*>(payload_.bytes.data()) + at, device_, slots.data(),
              Device::kCPU, slots.size(), stream_);
  return m + kSlots;
}

bool RandomKAllreducePlan::check_consensus(const PayloadHeader& h) {
  if (world_ == 1) return false;
  const auto t = DType(h.value_dtype);
  const size_t es = dtype_size(t);
  std::vector<uint8_t> slots(kSlots * es);
  device_copy(slots.data(), Device::kCPU,
              static_cast<const uint8_t*>(payload_.bytes.data()) + h.section_offset(1) +
                  (sent_ - kSlots) * es,
              device_, slots.size(), stream_);
  if (device_ == Device::kCUDA) cuda::stream_synchronize(stream_);
  const detail::EnvelopeVerdict v = detail::read_sum_envelope(slots.data(), t, world_);
  if (v.agreed()) return v.flagged;
  phase_ = kDone;  // the step is over on every rank (each sees the same sums); nothing committed
  detail::throw_disagreement(v, "randomk",
                             "ratio, warm-up, seed, momentum, clipping, value_dtype, dense_below "
                             "and the bucket's layout",
                             static_cast<int64_t>(h.aux), true);
}

size_t RandomKAllreducePlan::workspace_bytes() const {
  return payload_.bytes.capacity() + acc_.capacity();
}

std::optional<Collective> RandomKAllreducePlan::next() {
  try {
    return advance();
  } catch (const Error&) {
    // the consensus check throws before anything is committed, on every rank: the step is over,
    // and the ranks' steps are not known to agree (the next step sends the largest count)
    if (phase_ >= 0) phase_ = kDone;
    agreed_step_ = -1;
    throw;
  }
}

Collective RandomKAllreducePlan::encode_and_send() {
  if (bad_ >= 0)
    comp_.encode_skipped(payload_);  // NaN values, state untouched
  else
    comp_.encode(grad_, payload_);  // (staged: an encode not committed is dropped by the next)
  const PayloadHeader& h = payload_.header;
  sent_ = put_consensus(h, agreed_count());  // (may move the payload's bytes)
  auto* values = static_cast<uint8_t*>(payload_.bytes.data()) + h.section_offset(1);
  return make(CollectiveKind::kAllreduceSum, elem_type(DType(h.value_dtype)), values, values, sent_,
              "randomk values");
}

std::optional<Collective> RandomKAllreducePlan::advance() {
  require_begun();
  switch (phase_) {
    case 0: {  // encode; sum the values section of every rank in place
      bad_ = check_finite_ ? first_nonfinite() : -1;
      phase_ = 1;
      return encode_and_send();
    }
    case 1: {  // one decode of the summed values, scaled by 1/P (into the gradient when fp32)
      const auto n = static_cast<size_t>(numel_);
      const PayloadHeader& h = payload_.header;
      if (check_consensus(h)) {
        // every rank is at the same step, but its count exceeds the agreed one (every rank's
        // state was replaced alike): the step's values again, all of them
        agreed_step_ = comp_.step();
        return encode_and_send();
      }
      // a bad rank sent NaN values; a sum of finite values can also overflow the value dtype
      // (bf16 or fp32 values at the top of fp32's range; fp16 shares cannot): either way every
      // rank holds the same non-finite sum and skips. The k summed values are scanned (small
      // next to the bucket).
      if (check_finite_ && h.count > 0 &&
          first_nonfinite(static_cast<const uint8_t*>(payload_.bytes.data()) + h.section_offset(1),
                          DType(h.value_dtype), static_cast<int64_t>(h.count)) >= 0) {
        phase_ = 2;
        agreed_step_ = comp_.step();
        end_step(true, bad_);
        return std::nullopt;
      }
      const bool direct = dtype_ == DType::kFloat32;
      float* acc = direct ? static_cast<float*>(grad_.data) : acc_.get<float>(n);
      device_zero(device_, acc, n * sizeof(float), stream_);
      comp_.decode_add(payload_.data(), payload_.size(),
                       TensorView(acc, {numel_}, DType::kFloat32, device_, device_index_, stream_),
                       shares_ ? 1.0f : 1.0f / float(world_));
      if (!direct)  // saturating, as the top-k plan
        k::convert_saturating({device_, stream_}, acc, grad_.data, dtype_, numel_);
      phase_ = 2;
      agreed_step_ = comp_.step() + 1;  // (the consensus held: every rank was at this step)
      comp_.commit();
      end_step(false, bad_, check_finite_);
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

}  // namespace gradcomp

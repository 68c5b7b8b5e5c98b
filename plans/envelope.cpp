// SPDX-License-Identifier: Apache-2.0
// The step envelope (plans/envelope.hpp): written and read the same way by every plan that
// carries one.
#include "plans/envelope.hpp"

#include <cstring>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/error.hpp"

namespace gradcomp::detail {

namespace {

void put_one(uint8_t* slots, size_t i, DType t) {
  if (t == DType::kFloat32) {
    const float one = 1.0f;
    std::memcpy(slots + 4 * i, &one, 4);
    return;
  }
  const uint16_t one = t == DType::kFloat16 ? float_to_half(1.0f) : float_to_bf16(1.0f);
  std::memcpy(slots + 2 * i, &one, 2);
}

float get(const uint8_t* slots, size_t i, DType t) {
  if (t == DType::kFloat32) {
    float f;
    std::memcpy(&f, slots + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, slots + 2 * i, 2);
  return t == DType::kFloat16 ? half_to_float(h) : bf16_to_float(h);
}

}  // namespace

bool sum_envelope_exact(DType t, int world) {
  const int limit = t == DType::kFloat32 ? (1 << 24) : t == DType::kFloat16 ? 2048 : 256;
  return world > 1 && world <= limit;
}

std::vector<uint8_t> sum_envelope(const StepEnvelope& e, DType t, int world) {
  std::vector<uint8_t> slots(kSumEnvelopeSlots * dtype_size(t), 0);
  if (sum_envelope_exact(t, world)) {
    const uint64_t bits =
        (static_cast<uint64_t>(e.options) << 32) | (static_cast<uint64_t>(e.step) & 0xffffffffu);
    for (size_t b = 0; b < 64; ++b)
      if ((bits >> b) & 1) put_one(slots.data(), b, t);
  }
  if (e.flag) put_one(slots.data(), 64, t);
  return slots;
}

EnvelopeVerdict read_sum_envelope(const uint8_t* slots, DType t, int world) {
  EnvelopeVerdict v;
  if (sum_envelope_exact(t, world)) {
    const auto P = static_cast<float>(world);
    for (size_t b = 0; b < 64; ++b) {
      const float s = get(slots, b, t);
      if (s == 0.0f || s == P) continue;
      (b < 32 ? v.step_differs : v.options_differ) = true;
    }
  }
  v.flagged = get(slots, 64, t) != 0.0f;
  return v;
}

ByteEnvelope byte_envelope(const StepEnvelope& e) {
  ByteEnvelope b;
  b.magic = kByteEnvelopeMagic;
  b.options = e.options;
  b.step = e.step | (e.flag ? INT64_MIN : 0);
  return b;
}

EnvelopeVerdict read_byte_envelopes(const uint8_t* first, size_t stride, int world) {
  EnvelopeVerdict v;
  ByteEnvelope e0;
  for (int r = 0; r < world; ++r) {
    ByteEnvelope e;
    std::memcpy(&e, first + static_cast<size_t>(r) * stride, sizeof(e));
    // a block without the magic was not written by a plan of this kind: another plan, or
    // damaged in flight; told like options that differ (every receiver sees the same blocks)
    if (e.magic != kByteEnvelopeMagic) v.options_differ = true;
    if (e.step < 0) v.flagged = true;
    if (r == 0) {
      e0 = e;
      continue;
    }
    if (e.options != e0.options) v.options_differ = true;
    if ((e.step & INT64_MAX) != (e0.step & INT64_MAX)) v.step_differs = true;
  }
  return v;
}

void throw_disagreement(const EnvelopeVerdict& v, const char* plan, const char* must_match,
                        int64_t own_step, bool state_kept) {
  const char* outcome = state_kept ? "the step failed on every rank and no state changed"
                                   : "the step failed on every rank (check_finite is off, so "
                                     "this rank's state may hold part of it)";
  GC_CHECK_ARG(!v.options_differ, "plan '", plan, "': the options differ across ranks (",
               must_match, " must be the same on every rank); ", outcome);
  GC_CHECK_ARG(false, "plan '", plan, "': ranks are at different steps (this rank at ", own_step,
               "); restore every rank's state, or none. ", outcome);
}

}  // namespace gradcomp::detail

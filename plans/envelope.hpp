// SPDX-License-Identifier: Apache-2.0
// The step envelope: what the ranks of a plan must agree on before a step's data may be combined
// (the step each rank's state is at, and a hash of the options its collectives depend on), plus
// one flag, carried on the step's first collective so that checking costs no collective of its
// own. Ranks that disagree (a checkpoint restored on one rank only, an older state loaded into a
// live plan, other options on one rank) would otherwise average values that do not belong
// together - other random indices, another Q, another step of the warm-up - without any error.
// Every rank reads the same envelopes, so every rank reaches the same verdict and fails the step
// alike (require_agreement), the state untouched where the plan keeps a copy of it.
//
// Two carriers, one per kind of first collective:
//  - summed (allreduce-sum of fp32/fp16/bf16 values): kSumEnvelopeSlots values appended after the
//    data. Slot b < 32 holds bit b of the step's low 32 bits, slot 32 + b bit b of the options'
//    hash, each as 0 or 1; after the sum over P ranks slot b is 0 or P exactly when every rank's
//    bit b is the same. Sums of 0/1 are exact while P is an integer of the value dtype (fp32:
//    2^24, fp16: 2048, bf16: 256); beyond that every rank writes 0 there and nothing is compared.
//    Slot 64 is the flag (1 on a rank that raises it): its sum is non-zero whenever some rank
//    raised it, at any P.
//  - gathered (an all-to-all or allgather of byte blocks): a ByteEnvelope (16 bytes) in each
//    block. A rank sends the same envelope to every peer, so every receiver holds all P envelopes
//    and compares them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradcomp/types.hpp"

namespace gradcomp::detail {

/// What one rank puts in its envelope.
struct StepEnvelope {
  int64_t step = 0;      ///< the step this rank's state is at
  uint32_t options = 0;  ///< low 32 bits of the options' hash (plans/options_hash.hpp)
  bool flag = false;     ///< the plan's own meaning (a bad gradient, a payload cut short)
};

/// What the ranks' envelopes say, the same on every rank.
struct EnvelopeVerdict {
  bool step_differs = false;
  bool options_differ = false;
  bool flagged = false;  ///< some rank raised the flag
  bool agreed() const { return !step_differs && !options_differ; }
};

constexpr size_t kSumEnvelopeSlots = 65;

/// Whether 0/1 sums over `world` ranks are exact in dtype t (otherwise only the flag is carried).
bool sum_envelope_exact(DType t, int world);
/// The kSumEnvelopeSlots values of `e` in dtype t, as host bytes.
std::vector<uint8_t> sum_envelope(const StepEnvelope& e, DType t, int world);
/// Reads kSumEnvelopeSlots summed values of dtype t (host bytes).
EnvelopeVerdict read_sum_envelope(const uint8_t* slots, DType t, int world);

/// The gathered form: 16 bytes in a byte block.
struct ByteEnvelope {
  uint32_t magic = 0;    ///< kByteEnvelopeMagic: a block that lacks it was not written by a peer
  uint32_t options = 0;  ///< as StepEnvelope::options
  int64_t step = 0;      ///< bit 63: the flag (steps are never negative)
};
static_assert(sizeof(ByteEnvelope) == 16, "the byte envelope is 16 bytes on the wire");
constexpr uint32_t kByteEnvelopeMagic = 0x31766e45u;  // "Env1"

ByteEnvelope byte_envelope(const StepEnvelope& e);
/// Compares `world` envelopes (host memory; `stride` bytes apart).
EnvelopeVerdict read_byte_envelopes(const uint8_t* first, size_t stride, int world);

/// Ends a step whose envelopes disagree with the same InvalidArgument on every rank: `plan` names
/// the plan, `must_match` lists the options that must be the same on every rank, `own_step` is
/// this rank's step; `state_kept` says whether the plan's state is as before the step (a plan
/// without a copy of its state, check_finite off, may have written part of it).
[[noreturn]] void throw_disagreement(const EnvelopeVerdict& v, const char* plan,
                                     const char* must_match, int64_t own_step, bool state_kept);

/// Throws as throw_disagreement when the envelopes disagree; returns whether some rank raised
/// the flag.
inline bool require_agreement(const EnvelopeVerdict& v, const char* plan, const char* must_match,
                              int64_t own_step, bool state_kept = true) {
  if (!v.agreed()) throw_disagreement(v, plan, must_match, own_step, state_kept);
  return v.flagged;
}

}  // namespace gradcomp::detail

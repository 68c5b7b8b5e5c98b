// SPDX-License-Identifier: Apache-2.0
// The machinery of the two-phase compressed allreduce that the 1-bit plan and the multi-bit plan
// share (plans/onebit_plan.cpp, plans/quant_plan.cpp): each rank compresses its bucket in P server
// chunks and sends chunk r to rank r (all-to-all), rank r averages its chunk of every rank in rank
// order, adds its server error and compresses it again, and an allgather hands every rank every
// averaged chunk. What differs between the two is the codec; what is here is the same for both:
// the chunk layout, the rotation of the gradient before compression, and how a checkpoint's
// server errors are cut into chunks for another world size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/dispatch.hpp"

namespace gradcomp::detail {

/// Elements of one server chunk: the bucket split over `world` ranks in whole 32-element words,
/// rounded up to a multiple of `unit` (the scale block: a multiple of 32) so that chunks hold
/// whole blocks. The last chunks may be short or empty.
int64_t two_phase_chunk_elems(int64_t numel, int world, int64_t unit);

/// What phase 1 compresses: the gradient itself or its rotation (fp32).
struct TwoPhaseSource {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t bad = -1;  ///< a block that overflowed in the rotation (check), else -1
  std::string what;  ///< why, for the step's message
};

/// Rotates every full block of S elements of `grad` (numel elements) by the fixed randomized
/// Hadamard transform (kernels/onebit_math.h): in place when `in_place` (an fp32 gradient that
/// receives the average anyway), else into `scratch` (fp32). With `check`, a rotated value that
/// overflowed fp32 (gradient values above about FLT_MAX / S) is reported as `bad` (one more read
/// pass): the step must then be dropped like a non-finite one.
TwoPhaseSource two_phase_rotate(const kernels::Exec& ex, const TensorView& grad, bool in_place,
                                Buffer& scratch, int64_t S, bool check,
                                kernels::SelectWorkspace& ws);

/// The server errors of a P-rank checkpoint (`se[r]`: rank r's chunk of `ce_old` fp32 values, in
/// the average's units) laid end to end are one vector over the bucket; the chunk of rank `rank`
/// in a job whose chunks hold `ce_new` elements, exactly (zeros past the old end).
std::vector<float> rechunk_server_error(const std::vector<const uint8_t*>& se, int64_t ce_old,
                                        int64_t ce_new, int rank);

}  // namespace gradcomp::detail

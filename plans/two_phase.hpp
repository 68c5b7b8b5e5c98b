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
#include "kernels/onebit_kernels.hpp"
#include "kernels/topk_kernels.hpp"

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

/// The step state that both two-phase plans keep (their Impl derives from it): the worker and
/// server errors, double-buffered ([cur] is the state; a step writes its new values into the
/// other one, so a dropped step leaves the state as it was), the exchange buffers, the source of
/// phase 1 and the step's first bad value. Each plan adds its codec's buffers and workspace.
struct TwoPhaseState {
  TwoPhaseState(Device dev, void* s)
      : we{Buffer(dev, s), Buffer(dev, s)},
        se{Buffer(dev, s), Buffer(dev, s)},
        send(dev, s),
        recv(dev, s),
        gsend(dev, s),
        grecv(dev, s),
        avg(dev, s),
        rot(dev, s),
        sws(dev),
        stream(s),
        ex{dev, s} {}
  Buffer we[2], se[2];
  Buffer send, recv, gsend, grecv, avg;
  Buffer rot;  ///< with rotate: the rotated gradient, unless it is rotated in place
  kernels::SelectWorkspace sws;
  void* stream;
  kernels::Exec ex;
  int device_index = 0;
  int cur = 0;
  TensorView grad;
  const void* src = nullptr;  ///< what phase 1 compresses: grad, or its rotation (fp32)
  DType src_t = DType::kFloat32;
  int64_t bad = -1;  ///< this step: this rank's first bad index (the plan says which), or -1
  std::string bad_what;
  float* we_in() { return static_cast<float*>(we[cur].data()); }
  float* se_in() { return static_cast<float*>(se[cur].data()); }
};

/// Rotates every full block of S elements of `grad` (numel elements) by the fixed randomized
/// Hadamard transform (kernels/onebit_math.h): in place when `in_place` (an fp32 gradient that
/// receives the average anyway), else into `scratch` (fp32). With `check`, a rotated value that
/// overflowed fp32 (gradient values above about FLT_MAX / S) is reported as `bad` (one more read
/// pass): the step must then be dropped like a non-finite one.
TwoPhaseSource two_phase_rotate(const kernels::Exec& ex, const TensorView& grad, bool in_place,
                                Buffer& scratch, int64_t S, bool check,
                                kernels::SelectWorkspace& ws);

}  // namespace gradcomp::detail

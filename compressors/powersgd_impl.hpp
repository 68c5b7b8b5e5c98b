// SPDX-License-Identifier: Apache-2.0
// The inside of a PowerSGD state (PowerSGDState::Impl), shared by the state
// (compressors/powersgd.cpp: layout, checkpoints) and the plan that steps it (plans/powersgd.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/powersgd.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/dispatch.hpp"
#include "kernels/powersgd.hpp"

namespace gradcomp {

namespace k = kernels;

struct PowerSGDState::Impl {
  Impl(Device d, void* s)
      : mbuf(d, s),
        pbuf(d, s),
        qbuf(d, s),
        qsave(d, s),
        esave(d, s),
        scratch(d, s),
        plain(d, s),
        ids(d, s),
        ctx(d, s),
        sws(d),
        ex{d, s} {}
  // The error between steps (error feedback). CPU: M = grad + error is formed per tile and never
  // stored, the error is written in the last phase only. CUDA: holds M during a step.
  Buffer mbuf;
  Buffer pbuf;     // [P of every compressed tensor | uncompressed pack]
  Buffer qbuf;     // Q of every compressed tensor (persists with warm start)
  Buffer qsave;    // check_finite: Q before the step's fill_q, restored when the step is skipped
  Buffer esave;    // CUDA with check_finite and error feedback: the error before M is formed in
                   // mbuf, restored when the step is skipped (the CPU never writes it early)
  Buffer scratch;  // reconstruction P Q^T when it cannot go straight into the gradient
  Buffer plain;    // the whole bucket in fp32 for the steps before start_iter
  Buffer ids;      // RNG tensor ids, group by group (uint32)
  std::vector<k::PsgdGroup> groups;
  std::vector<std::vector<size_t>> members;      // tensor indices per group, in bucket order
  std::vector<std::vector<void*>> member_grads;  // the step's gradient of every member, by group
  std::vector<std::vector<int64_t>> shapes;
  int64_t total_numel = 0, max_numel = 0;
  k::PsgdContext ctx;
  k::SelectWorkspace sws;  // CUDA scratch of the non-finite scan
  k::Exec ex;
  void* stream = nullptr;
};

namespace detail {

// GPU reconstruction scratch: at most this many floats per strided-batched GEMM (one member at
// least); bounds the memory for models with many same-shape layers.
inline constexpr int64_t kGpuScratchFloats = int64_t{1} << 24;

}  // namespace detail
}  // namespace gradcomp

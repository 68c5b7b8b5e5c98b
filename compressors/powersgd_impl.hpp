// SPDX-License-Identifier: Apache-2.0
// The inside of a PowerSGD state (PowerSGDState::Impl), shared by the state
// (compressors/powersgd_state.cpp: layout, checkpoints) and the plan that steps it
// (plans/powersgd_plan.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/powersgd.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/powersgd_kernels.hpp"
#include "kernels/topk_kernels.hpp"

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
  // stored, the error is written in the last phase only; with check_finite (`dbuf`) that phase
  // writes it into the other of mbuf / esave and a kept step flips `flip`, so the error before
  // the step stays for undo_step(). CUDA: mbuf holds M during a step (esave is a copy).
  Buffer mbuf;
  Buffer pbuf;     // [P of every compressed tensor | uncompressed pack]
  Buffer qbuf;     // Q of every compressed tensor (persists with warm start)
  Buffer qsave;    // check_finite: Q before the step's fill_q, restored when the step is skipped
  Buffer esave;    // check_finite with error feedback: CUDA, the error before the step, restored
                   // when the step is skipped or undone; CPU, the second error buffer
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
  bool dbuf = false;                 // CPU, check_finite, error feedback: see mbuf
  uint64_t generation = 0;           // bumped by every step and load: what undo_step checks
  bool flip = false;                 // dbuf: the error lives in esave
  std::vector<int64_t> group_m_off;  // each group's offset in the error buffer
  float* err() { return static_cast<float*>((flip ? esave : mbuf).data()); }
  const float* err() const { return static_cast<const float*>((flip ? esave : mbuf).data()); }
  /// Points every group at the current error and, with dbuf, its finish() at the other buffer.
  void point_groups() {
    float* e = err();
    float* o = dbuf ? static_cast<float*>((flip ? mbuf : esave).data()) : nullptr;
    for (size_t i = 0; i < groups.size(); ++i) {
      groups[i].M = e + group_m_off[i];
      groups[i].M_out = o ? o + group_m_off[i] : nullptr;
    }
  }
};

namespace detail {

// GPU reconstruction scratch: at most this many floats per strided-batched GEMM (one member at
// least); bounds the memory for models with many same-shape layers.
inline constexpr int64_t kGpuScratchFloats = int64_t{1} << 24;

// Room after P (and after the plain steps' bucket) for the step envelope that PowerSGDPlan
// appends to a step's first allreduce (plans/envelope.hpp; the plan checks the two agree).
inline constexpr size_t kEnvelopeFloats = 65;

/// Resumes PowerSGD's states (one per rank of the saved job) on another world size: the mean of
/// the errors, Q and the step kept (reshard_state, gradcomp/make_plan.hpp).
std::vector<uint8_t> reshard_powersgd_state(const std::vector<std::vector<uint8_t>>& states);

}  // namespace detail
}  // namespace gradcomp

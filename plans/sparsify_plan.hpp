// SPDX-License-Identifier: Apache-2.0
// What the top-k and random-k allreduce plans share (topk_plan.hpp, randomk_plan.hpp): their
// state is their compressor's (one rank's configuration, staged when the plan checks finiteness
// itself), and each sizes its next step from the step the ranks last agreed on.
// Private to the library (not installed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "plans/gradient_plan.hpp"

namespace gradcomp::detail {

/// The compressor configuration of one rank: clip_norm becomes the rank's local threshold.
template <class Cfg>
Cfg per_rank(Cfg cfg, int world) {
  cfg.clip_norm = cfg.local_clip_norm(world);
  return cfg;
}

/// The part of a sparsifying allreduce plan that holds its compressor `Comp` (TopKCompressor,
/// RandomKCompressor) and the step bookkeeping both plans keep alike.
template <class Comp>
class SparsifyPlan : public GradientPlan {
 public:
  Comp& compressor() { return comp_; }
  bool stateful() const override { return true; }
  /// The compressor's state (residual, momentum, step).
  std::vector<uint8_t> state_dict() const override { return comp_.state_dict(); }
  /// Restores state_dict(); InvalidArgument during a step or on a mismatch (nothing changes).
  void load_state_dict(const uint8_t* data, size_t nbytes) override {
    require_idle("load_state_dict()");
    comp_.load_state_dict(data, nbytes);
    start_step();
  }

 protected:
  template <class Cfg>
  SparsifyPlan(const Cfg& cfg, int64_t numel, int world, DType grad_dtype, Device device,
               int device_index, void* stream)
      : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
        comp_(per_rank(cfg, world), numel, grad_dtype, device, device_index, stream),
        check_finite_(cfg.check_finite) {
    // the plan checks finiteness itself (once), so that a bad rank can tell the others
    comp_.set_staged(check_finite_);
  }

  void undo_state() override {
    comp_.uncommit();
    if (agreed_step_ > 0) agreed_step_ -= 1;  // every rank takes the same kept step back
  }

  Comp comp_;
  bool check_finite_ = true;
  int64_t bad_ = -1;  ///< this step: this rank's first non-finite index, or -1
  /// The step every rank was at when the last step ended (+1 when it was kept), which sizes the
  /// next step's collectives; -1 when unknown (a new plan, or the last step failed): the next
  /// step then sizes them for any step (top-k exchanges sizes, random-k sends the schedule's
  /// largest count).
  int64_t agreed_step_ = -1;
};

}  // namespace gradcomp::detail

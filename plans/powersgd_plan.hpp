// SPDX-License-Identifier: Apache-2.0
// PowerSGD as a bucket plan (powersgd_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/plan.hpp"
#include "gradcomp/powersgd.hpp"

namespace gradcomp {

/// One step of PowerSGD on a bucket, as a plan (see plan.hpp). begin() checks the gradients and
/// changes nothing when it throws; a non-finite gradient (check_finite) makes the step skipped
/// (or raising) on every rank at its first collective, changing nothing. next() runs the phases:
///   local (M, P = M Q, pack)  -> allreduce(uncompressed + P)  [or two allreduces, see config]
///   local (P /= world, orth, Q = M^T P_hat) -> allreduce(Q)
///   local (Q /= world, grad = P_hat Q^T, error = M - grad, unpack uncompressed / world)
/// Steps before start_iter: pack everything -> allreduce -> unpack / world.
///
/// Example:  gradcomp::PowerSGDPlan plan(state, 4);
///           plan.begin(grads);
///           gradcomp::run_plans_in_process({&plan0, &plan1, &plan2, &plan3});
class PowerSGDPlan : public BucketPlan {
 public:
  /// A plan over a state the caller keeps alive (several plans may step it in turn).
  PowerSGDPlan(PowerSGDState& state, int world);
  /// A plan that owns its state (what make_plan() builds).
  PowerSGDPlan(std::unique_ptr<PowerSGDState> state, int world);
  /// The bucket's gradients, in the order of the shapes given to the state; written in place.
  void begin(const std::vector<TensorView>& grads);
  /// The bucket as one flat view of its tensors laid out back to back in the state's order (a
  /// DDP bucket: its gradients are views into it); each tensor is viewed with its shape.
  void begin(const TensorView& bucket) override;
  std::optional<Collective> next() override;
  std::string name() const override { return "powersgd"; }
  /// Elements of the bucket (all its tensors), for run_plan()'s size handshake.
  int64_t numel() const override { return st_.compressed_numel() + st_.uncompressed_numel(); }
  /// The state the plan steps (error, Q, step): checkpoint it through the plan as through any
  /// other bucket plan.
  PowerSGDState& state() { return st_; }
  bool stateful() const override { return true; }
  std::vector<uint8_t> state_dict() const override { return st_.state_dict(); }
  /// Restores state_dict() into the state (see PowerSGDState::load_state_dict); throws
  /// InvalidArgument while a step is in progress.
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  enum class Phase : uint8_t { kIdle, kStart, kPlainWait, kWaitU, kWaitP, kWaitQ, kDone };
  Collective make(void* buf, size_t count, const char* tag) const;
  void phase_compress();
  void phase_project();
  void phase_finish();
  /// This rank's first bad value, for the message (CPU: a scan of the bucket).
  void find_bad();
  /// Ends a step found bad on some rank: error, Q and step restored, gradients NaN.
  std::optional<Collective> skip_step();
  /// Whether a summed buffer of n floats holds NaN or Inf (a bad rank, or an overflowing sum).
  bool sum_nonfinite(const float* buf, int64_t n);
  /// The step's first allreduce of `count` floats at buf, with the step envelope appended
  /// (plans/envelope.hpp) when world > 1.
  std::optional<Collective> first(float* buf, size_t count, const char* tag);
  /// After the first allreduce: InvalidArgument on every rank when the ranks' steps or options
  /// differ (Q and the error restored, as for a skipped step).
  void check_envelope();
  /// Puts Q (and on CUDA the error) back as they were before a compressed step.
  void restore_state();
  void undo_state() override;
  uint32_t options_hash_ = 0;  ///< what every rank's collectives depend on (envelope)
  float* envelope_ = nullptr;  ///< this step: where the summed envelope lies, until checked
  std::unique_ptr<PowerSGDState> owned_;  ///< null when the caller keeps the state
  bool bad_ = false;  ///< this step: this rank's gradient (or its P) was not finite
  bool q_ready_saved_ = false;
  bool esaved_ = false;   ///< this step copied the error (CUDA, check_finite, error feedback)
  bool flipped_ = false;  ///< this step wrote the error into the other buffer (CPU)
  bool last_compressed_ = false;  ///< the last kept step was compressed (not a plain one)
  int64_t undo_at_ = -1;          ///< the state's step count right after the last kept step
  uint64_t undo_gen_ = 0;         ///< the state's generation then (PowerSGDState::Impl)
  std::string bad_what_;
  PowerSGDState& st_;
  int world_;
  Phase phase_ = Phase::kIdle;
  std::vector<TensorView> grads_;
  std::vector<Collective> issued_;
};

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// A compressed allreduce is a plan: local op -> collective -> local op -> collective -> ...
// A plan is written once, as a step machine; every driver (MPI, NCCL, torch.distributed, and the
// in-process simulator used by tests) executes it the same way:
//
//   plan.begin(...);                          // plan-specific input (the gradient bucket)
//   while (auto c = plan.next()) driver.run(*c);  // next() runs the local op, asks for a
//   collective
//   // after next() returned nullopt the plan's output (the averaged gradient) is complete
//
// next() consumes the result of the previous collective (already in the buffers it named), does
// the local work of the phase, and returns the next collective, or std::nullopt when done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/tensor.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp {

// CollectiveKind and ElemType, with their names: gradcomp/types.hpp.

/// One collective a plan asks for. Buffers belong to the plan and stay valid until the next call
/// of next(). send and recv may be the same pointer for an in-place allreduce.
struct Collective {
  CollectiveKind kind = CollectiveKind::kAllreduceSum;
  ElemType type = ElemType::kF32;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  ///< elements per rank (allreduce/broadcast: the whole buffer)
  int root = 0;      ///< broadcast only
  Device device = Device::kCPU;
  void* stream = nullptr;
  std::string tag;  ///< what it carries ("topk sizes", "powersgd P", ...) for logs and statistics
  size_t send_bytes() const {
    return count * elem_size(type) * (kind == CollectiveKind::kAllToAll ? world : 1);
  }
  int world = 1;  ///< filled by the plan: number of ranks it was built for (in its scope)
  Scope scope = Scope::kWorld;  ///< which ranks run it (a hierarchical plan's node or cross group)
};

/// Every plan must: ask only for collectives of the vocabulary above; name buffers that stay
/// valid until its next next(); make every rank ask for the same sequence of (kind, type, count)
/// (a driver checks and reports a mismatch); and leave the same bits on every rank at the end.
class Plan {
 public:
  virtual ~Plan() = default;
  virtual std::optional<Collective> next() = 0;
  virtual std::string name() const = 0;
  /// Elements of the gradient bucket the plan averages, or -1 for a plan without one. run_plan()'s
  /// handshake compares it across ranks before the first collective.
  virtual int64_t bucket_numel() const { return -1; }
};

/// What a stateful bucket plan does when some rank's gradient holds NaN or Inf (found by the
/// plan's finiteness check, `check_finite`):
///  kSkip  (default; what plain DDP amounts to under a loss scaler) the step is skipped on every
///         rank: the averaged bucket comes out NaN everywhere (so every rank's GradScaler skips
///         the same optimizer step), no exception, and the plan's state (residuals, momenta,
///         errors, Q, step counter) is exactly as before the step; skipped() says so.
///  kRaise InvalidArgument on every rank at the end of the step (the rank that found the value
///         names its index), state as before the step.
/// The agreement rides on what the step sends anyway (a payload header flag, NaN values or
/// scales, NaN in PowerSGD's P): no extra collective. A rank whose gradient is bad sends no
/// compressed data of it and leaves its state alone; the others compute the step as usual into a
/// second copy of the state they change (double-buffered, so committing is a swap and dropping is
/// free) and keep or drop it once the step's data says whether some rank was bad.
/// With check_finite off nothing is checked: a NaN/Inf enters the state and stays there.
enum class OnNonFinite : uint8_t { kSkip = 0, kRaise = 1 };

/// A plan over one gradient bucket that knows the bucket's size (every plan make_plan() builds), so
/// that a rank that passes a different bucket is reported by run_plan() with both sizes.
///
/// Example:  int64_t n = plan.bucket_numel();  // any Plan: -1 when it has no bucket
class BucketPlan : public Plan {
 public:
  /// Elements of the gradient bucket.
  virtual int64_t numel() const = 0;
  int64_t bucket_numel() const final { return numel(); }
  /// Binds this step's bucket: numel() contiguous elements (a flat view of the bucket's tensors,
  /// laid out back to back), of the dtype and on the device the plan was built for. The average
  /// is written back into it, in its dtype, when next() returns nullopt; the caller keeps the
  /// memory alive until then. Checks before any state changes (InvalidArgument).
  virtual void begin(const TensorView& bucket) = 0;
  /// Whether the plan carries state between steps (error feedback, momentum, Q), which must be
  /// checkpointed with the model through state_dict().
  virtual bool stateful() const { return false; }
  /// The state between steps, as bytes (empty for a stateless plan).
  virtual std::vector<uint8_t> state_dict() const { return {}; }
  /// Restores state_dict(); InvalidArgument on a mismatch, and then nothing changes. A stateless
  /// plan accepts only an empty state.
  virtual void load_state_dict(const uint8_t* data, size_t nbytes);
  /// The policy for a NaN/Inf gradient on some rank (see OnNonFinite); every rank must use the
  /// same. Set it between steps.
  void set_on_nonfinite(OnNonFinite p) { on_nonfinite_ = p; }
  OnNonFinite on_nonfinite() const { return on_nonfinite_; }
  /// Whether the last finished step was skipped because some rank's bucket held NaN or Inf (the
  /// average is then NaN on every rank and no state changed). Stateless plans have nothing to
  /// protect and check nothing: their NaN simply propagates into the sum (false here).
  bool skipped() const { return skipped_; }
  /// Steps skipped so far by this plan object.
  int64_t skipped_steps() const { return skipped_steps_; }
  /// Takes back the last finished step that was kept (not skipped): every piece of state it
  /// changed (residuals, momenta, errors, Q, step counters) returns bitwise to what it was before
  /// it. This is for a training step over several buckets in which another bucket's plan
  /// skipped(): the optimizer step is then skipped as a whole (a GradScaler sees the NaN), so the
  /// buckets that were kept must not advance either (see settle_step()). The averaged gradient
  /// already written stays. Allowed once after a kept step, before the next begin() or
  /// load_state_dict(), and only with check_finite on (the plan then keeps the state before the
  /// step); InvalidArgument otherwise, and nothing changes. A stateless plan has nothing to take
  /// back: a no-op.
  void undo_step();
  /// Whether undo_step() would take a step back now.
  bool can_undo() const { return undoable_; }

 protected:
  /// Records the outcome of a finished step (skipped or not); `undoable`: a kept step whose
  /// prior state the plan still holds.
  void set_skipped(bool s, bool undoable = false) {
    skipped_ = s;
    undoable_ = !s && undoable;
    if (s) ++skipped_steps_;
  }
  /// Called by begin() (once its checks passed) and load_state_dict(): the last step's outcome
  /// no longer describes the state.
  void start_step() { skipped_ = undoable_ = false; }
  /// Restores the state before the last kept step (undo_step() checked that it may).
  virtual void undo_state() {}
  OnNonFinite on_nonfinite_ = OnNonFinite::kSkip;
  bool skipped_ = false;
  bool undoable_ = false;
  int64_t skipped_steps_ = 0;
};

/// Ends a training step over several buckets (one plan each, every plan finished): if some
/// bucket's plan skipped the step (a NaN/Inf on some rank; its average is NaN everywhere), every
/// other plan's step is taken back with undo_step(), so the whole step leaves no trace, as the
/// optimizer skips it. Returns whether the step was skipped. Every rank calls it with the same
/// buckets and gets the same answer (skipped() agrees across ranks).
///
/// Example:  for (auto* p : plans) { p->begin(bucket[i]); gradcomp::run_plan(*p, comm); }
///           if (gradcomp::settle_step(plans)) { /* the optimizer skips this step */ }
bool settle_step(const std::vector<BucketPlan*>& plans);

/// Executes one plan per simulated rank in this process, summing in rank order. For tests and
/// single-process experiments. Throws InvalidArgument if the ranks disagree on a collective.
/// Returns the collectives executed (as seen by rank 0).
std::vector<Collective> run_plans_in_process(const std::vector<Plan*>& ranks);
/// The same for hierarchical plans: ranks[r] is rank r of a job of ranks.size() / per_node nodes
/// with per_node ranks each, node-major (node r / per_node, local rank r % per_node). A
/// collective of Scope::kNode runs among the ranks of one node, kCross among the ranks of equal
/// local rank, kWorld among all; each group proceeds on its own (the cross groups of different
/// local ranks need not ask for the same collectives). Throws InvalidArgument when the members
/// of a group disagree, or when no group can proceed (naming what each rank waits for). Returns
/// the collectives executed, in the order they ran.
std::vector<Collective> run_plans_in_process(const std::vector<Plan*>& ranks, int per_node);

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<OnNonFinite> {
  static constexpr const char* what = "on_nonfinite policy";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<OnNonFinite> table[] = {{"skip", OnNonFinite::kSkip},
                                                    {"raise", OnNonFinite::kRaise}};
};

}  // namespace gradcomp

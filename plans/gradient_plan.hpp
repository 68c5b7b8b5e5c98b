// SPDX-License-Identifier: Apache-2.0
// What the flat plans share (dense, cast, shard cast, top-k, random-k, the two-level plan).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <memory>

#include "gradcomp/plan.hpp"
#include "gradcomp/plan_config.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp {

/// Shared part of the flat plans: bucket size, dtype, device, rank count, the bound
/// gradient and the phase counter.
class GradientPlan : public BucketPlan {
 public:
  GradientPlan(int64_t numel, DType dtype, int world, Device device, int device_index,
               void* stream);
  ~GradientPlan() override;
  /// Binds this step's gradient (numel, dtype and device fixed at construction; checked) and
  /// restarts the step machine. The average is written back into `grad` when next() returns
  /// nullopt.
  void begin(const TensorView& grad) override;
  int64_t numel() const override { return numel_; }
  int world() const { return world_; }
  /// Bytes of workspace this plan holds (grow-only; stable after the first steps).
  virtual size_t workspace_bytes() const = 0;

 protected:
  /// A collective on this plan's device and stream.
  Collective make(CollectiveKind kind, ElemType type, const void* send, void* recv, size_t count,
                  const char* tag) const;
  /// Checks that begin() was called; next() after completion returns nullopt.
  void require_begun() const;
  /// InvalidArgument unless no step is in progress (`what`: the refused call).
  void require_idle(const char* what) const;
  static constexpr int kDone = 1 << 20;  ///< phase_ of a finished step
  virtual void on_begin() {}
  /// The first index of the bound gradient that holds NaN or Inf, or -1.
  int64_t first_nonfinite();
  /// The same for n elements of dtype t at `data` (on the plan's device and stream).
  int64_t first_nonfinite(const void* data, DType t, int64_t n);
  /// Ends a step whose data said whether some rank's gradient was not finite (`skip`): a skipped
  /// step fills the gradient with NaN, records it and, with OnNonFinite::kRaise, throws
  /// InvalidArgument on this rank (`bad_index`: this rank's first bad index, or -1). `undoable`:
  /// a kept step whose prior state the plan still holds (see BucketPlan::undo_step()).
  void end_step(bool skip, int64_t bad_index, bool undoable = false);

  int64_t numel_;
  DType dtype_;
  int world_;
  Device device_;
  int device_index_;
  void* stream_;
  TensorView grad_;
  int phase_ = -1;  ///< -1: no step bound; 0: begun; higher: plan-specific

 private:
  struct Scan;
  std::unique_ptr<Scan> scan_;
};

}  // namespace gradcomp

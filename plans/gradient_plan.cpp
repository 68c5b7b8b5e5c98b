// SPDX-License-Identifier: Apache-2.0
// The shared part of the flat-bucket plans (GradientPlan): binding a step's gradient, checks,
// collectives on the plan's device and stream.
#include "plans/gradient_plan.hpp"

#include <algorithm>

#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/topk_kernels.hpp"

namespace gradcomp {

void BucketPlan::load_state_dict(const uint8_t*, size_t nbytes) {
  GC_CHECK_ARG(nbytes == 0, name(), " plan: carries no state between steps, but got a ", nbytes,
               "-byte state");
}

void BucketPlan::undo_step() {
  if (!stateful()) return;
  GC_CHECK_ARG(undoable_, name(), " plan: undo_step() needs a finished step that was kept, ",
               "with check_finite on, and no begin() or load_state_dict() since (",
               skipped_ ? "the last step was skipped: it changed nothing" : "nothing to undo", ")");
  undo_state();
  undoable_ = false;
}

bool settle_step(const std::vector<BucketPlan*>& plans) {
  bool skipped = false;
  for (const BucketPlan* p : plans) {
    GC_CHECK_ARG(p != nullptr, "settle_step: null plan");
    skipped = skipped || p->skipped();
  }
  if (!skipped) return false;
  std::vector<BucketPlan*> undo;  // each kept stateful plan once (a plan may be listed twice)
  for (BucketPlan* p : plans) {
    if (p->skipped() || !p->stateful() || std::find(undo.begin(), undo.end(), p) != undo.end())
      continue;
    GC_CHECK_ARG(p->can_undo(), "settle_step: another bucket skipped this step, but the ",
                 p->name(),
                 " plan cannot take its step back (check_finite off, or begun again since); ",
                 "no plan was changed");
    undo.push_back(p);
  }
  for (BucketPlan* p : undo) p->undo_step();
  return true;
}

ElemType elem_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return ElemType::kF32;
    case DType::kFloat16:
      return ElemType::kF16;
    case DType::kBFloat16:
      return ElemType::kBF16;
  }
  return ElemType::kF32;
}

struct GradientPlan::Scan {
  explicit Scan(Device d) : ws(d) {}
  kernels::SelectWorkspace ws;
};

GradientPlan::~GradientPlan() = default;

int64_t GradientPlan::first_nonfinite() { return first_nonfinite(grad_.data, grad_.dtype, numel_); }

int64_t GradientPlan::first_nonfinite(const void* data, DType t, int64_t n) {
  if (!scan_) scan_ = std::make_unique<Scan>(device_);
  return kernels::first_nonfinite({device_, stream_}, data, t, n, scan_->ws);
}

void GradientPlan::end_step(bool skip, int64_t bad_index, bool undoable) {
  phase_ = kDone;
  set_skipped(skip, undoable);
  if (!skip) return;
  device_fill_nan(device_, grad_.data, static_cast<size_t>(grad_.nbytes()), stream_);
  if (on_nonfinite_ == OnNonFinite::kRaise) {
    if (bad_index >= 0)
      GC_CHECK_ARG(false, "plan '", name(), "': gradient has a non-finite value (NaN or Inf) at ",
                   "index ", bad_index, "; the step was dropped on every rank and no state ",
                   "changed (on_nonfinite='raise')");
    GC_CHECK_ARG(false, "plan '", name(), "': another rank's gradient held a non-finite value ",
                 "(NaN or Inf), or the sum over ranks overflowed; the step was dropped on every ",
                 "rank and no state changed (on_nonfinite='raise')");
  }
}

GradientPlan::GradientPlan(int64_t numel, DType dtype, int world, Device device, int device_index,
                           void* stream)
    : numel_(numel),
      dtype_(dtype),
      world_(world),
      device_(device),
      device_index_(device_index),
      stream_(stream) {
  GC_CHECK_ARG(numel >= 0, "plan: numel must be >= 0, got ", numel);
  GC_CHECK_ARG(world >= 1, "plan: the number of ranks must be >= 1, got ", world);
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(dtype)), "plan: unsupported gradient dtype");
  if (device == Device::kCUDA && !built_with_cuda()) throw_not_built_with_cuda("a plan on CUDA");
}

void GradientPlan::begin(const TensorView& grad) {
  GC_CHECK_ARG(grad.numel == numel_, "plan '", name(), "': gradient has ", grad.numel,
               " elements, the plan was built for ", numel_, " (", grad.describe(), ")");
  GC_CHECK_ARG(grad.dtype == dtype_, "plan '", name(), "': gradient is ", dtype_name(grad.dtype),
               ", the plan was built for ", dtype_name(dtype_));
  GC_CHECK_ARG(grad.device == device_, "plan '", name(), "': gradient is on ",
               device_name(grad.device), ", the plan was built for ", device_name(device_));
  GC_CHECK_ARG(grad.data != nullptr || numel_ == 0, "plan '", name(), "': null gradient");
  grad_ = grad;
  phase_ = 0;
  start_step();
  on_begin();
}

void GradientPlan::require_idle(const char* what) const {
  GC_CHECK_ARG(phase_ < 0 || phase_ == kDone, "plan '", name(), "': ", what,
               " during a step (run next() until it returns nullopt first)");
}

void GradientPlan::require_begun() const {
  GC_CHECK_ARG(phase_ >= 0, "plan '", name(), "': next() called before begin(grad)");
}

Collective GradientPlan::make(CollectiveKind kind, ElemType type, const void* send, void* recv,
                              size_t count, const char* tag) const {
  Collective c;
  c.kind = kind;
  c.type = type;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.device = device_;
  c.stream = stream_;
  c.tag = tag;
  c.world = world_;
  return c;
}

}  // namespace gradcomp

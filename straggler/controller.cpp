// SPDX-License-Identifier: Apache-2.0
// The per-step DropCompute decision (Algorithm 1 of the paper, with a configurable check point)
// and the gradient normalisation with drops.
#include <chrono>
#include <cmath>

#include "gradcomp/error.hpp"
#include "gradcomp/straggler.hpp"

namespace gradcomp::straggler {

double monotonic_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

void ThresholdConfig::validate() const {
  GC_CHECK_ARG(!std::isnan(tau) && tau > 0.0,
               "ThresholdConfig: the compute threshold tau must be > 0 (+Inf = never drop), got ",
               tau);
  GC_CHECK_ARG(micro_batches >= 1, "ThresholdConfig: micro_batches M must be >= 1, got ",
               micro_batches);
  GC_CHECK_ARG(drop_point == DropPoint::kBeforeForward ||
                   drop_point == DropPoint::kBetweenForwardBackward ||
                   drop_point == DropPoint::kAfterBackward,
               "ThresholdConfig: unknown DropPoint ", static_cast<int>(drop_point));
  GC_CHECK_ARG(history_steps >= 0, "ThresholdConfig: history_steps must be >= 0, got ",
               history_steps);
}

ThresholdController::ThresholdController(const ThresholdConfig& cfg, ClockFn clock)
    : cfg_(cfg), clock_(clock ? std::move(clock) : ClockFn(&monotonic_seconds)) {
  cfg_.validate();
  active_tau_ = cfg_.tau;
  step_latency_.reserve(static_cast<size_t>(cfg_.micro_batches));
  history_.reserve(static_cast<size_t>(cfg_.history_steps * cfg_.micro_batches));
}

void ThresholdController::begin_step() {
  GC_CHECK_ARG(!in_step_,
               "ThresholdController::begin_step: a step is already open; call "
               "end_step() first");
  start_ = clock_();
  last_done_ = start_;
  completed_ = 0;
  stopped_ = false;
  active_tau_ = cfg_.tau;
  step_latency_.clear();
  in_step_ = true;
}

bool ThresholdController::proceed(DropPoint p) {
  GC_CHECK_ARG(in_step_, "ThresholdController::proceed: no open step; call begin_step() first");
  if (stopped_ || completed_ >= cfg_.micro_batches) return false;
  if (p != cfg_.drop_point || std::isinf(active_tau_)) return true;  // no clock read needed
  return proceed_elapsed(p, clock_() - start_);
}

bool ThresholdController::proceed_elapsed(DropPoint p, double elapsed_s) {
  GC_CHECK_ARG(in_step_,
               "ThresholdController::proceed_elapsed: no open step; call begin_step() first");
  GC_CHECK_ARG(!std::isnan(elapsed_s), "ThresholdController::proceed_elapsed: elapsed is NaN");
  if (stopped_ || completed_ >= cfg_.micro_batches) return false;
  if (p != cfg_.drop_point) return true;
  if (elapsed_s > active_tau_) stopped_ = true;
  return !stopped_;
}

void ThresholdController::micro_batch_done() {
  GC_CHECK_ARG(in_step_,
               "ThresholdController::micro_batch_done: no open step; call begin_step() first");
  GC_CHECK_ARG(completed_ < cfg_.micro_batches, "ThresholdController::micro_batch_done: already ",
               completed_, " micro-batches done in this step, M = ", cfg_.micro_batches);
  if (cfg_.history_steps > 0) {
    const double now = clock_();
    step_latency_.push_back(now - last_done_);
    last_done_ = now;
  }
  ++completed_;
}

ThresholdController::StepRecord ThresholdController::end_step() {
  GC_CHECK_ARG(in_step_, "ThresholdController::end_step: no open step");
  StepRecord r;
  r.completed = completed_;
  r.dropped = completed_ < cfg_.micro_batches;
  r.elapsed = clock_() - start_;
  in_step_ = false;
  if (cfg_.history_steps > 0 && completed_ == cfg_.micro_batches) {
    const size_t mb = static_cast<size_t>(cfg_.micro_batches);
    if (history_.size() >= static_cast<size_t>(cfg_.history_steps) * mb)
      history_.erase(history_.begin(), history_.begin() + static_cast<std::ptrdiff_t>(mb));
    history_.insert(history_.end(), step_latency_.begin(), step_latency_.end());
  }
  return r;
}

double ThresholdController::elapsed() const {
  GC_CHECK_ARG(in_step_, "ThresholdController::elapsed: no open step");
  return clock_() - start_;
}

void ThresholdController::set_tau(double tau) {
  GC_CHECK_ARG(!std::isnan(tau) && tau > 0.0,
               "ThresholdController::set_tau: tau must be > 0 (+Inf = never drop), got ", tau);
  cfg_.tau = tau;
}

int64_t ThresholdController::history_steps() const {
  return static_cast<int64_t>(history_.size()) / cfg_.micro_batches;
}

double gradient_scale(Normalization norm, int64_t workers, int64_t micro_batches,
                      int64_t total_completed) {
  GC_CHECK_ARG(workers >= 1, "gradient_scale: workers N must be >= 1, got ", workers);
  GC_CHECK_ARG(micro_batches >= 1, "gradient_scale: micro_batches M must be >= 1, got ",
               micro_batches);
  GC_CHECK_ARG(total_completed >= 0 && total_completed <= workers * micro_batches,
               "gradient_scale: total_completed must be in [0, N * M = ", workers * micro_batches,
               "], got ", total_completed);
  switch (norm) {
    case Normalization::kNominal:
      return 1.0 / static_cast<double>(workers * micro_batches);
    case Normalization::kActual:
      return total_completed == 0 ? 0.0 : 1.0 / static_cast<double>(total_completed);
  }
  GC_CHECK_ARG(false, "gradient_scale: unknown Normalization ", static_cast<int>(norm));
  return 0.0;
}

}  // namespace gradcomp::straggler

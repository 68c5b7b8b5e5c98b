// SPDX-License-Identifier: Apache-2.0
// The Quadratic Synchronization Rule (Gu et al.): Local SGD's period grows as (alpha / lr)^2.
#include <algorithm>
#include <cmath>
#include <limits>

#include "gradcomp/error.hpp"
#include "gradcomp/straggler.hpp"

namespace gradcomp::straggler {

int64_t qsr_period(double lr, double alpha, int64_t h_base) {
  GC_CHECK_ARG(std::isfinite(lr) && lr > 0.0,
               "qsr_period: the learning rate must be finite and "
               "> 0, got ",
               lr);
  GC_CHECK_ARG(std::isfinite(alpha) && alpha >= 0.0,
               "qsr_period: alpha must be finite and >= 0, got ", alpha);
  GC_CHECK_ARG(h_base >= 1, "qsr_period: h_base must be >= 1, got ", h_base);
  const double r = alpha / lr;
  const double h = std::floor(r * r);
  // 2^62 steps is beyond any training run; the caller caps by the remaining steps anyway.
  if (!(h < 0x1.0p62)) return std::numeric_limits<int64_t>::max() / 2;
  return std::max(h_base, static_cast<int64_t>(h));
}

void QsrConfig::validate() const {
  GC_CHECK_ARG(std::isfinite(alpha) && alpha >= 0.0,
               "QsrConfig: alpha must be finite and >= 0, got ", alpha);
  GC_CHECK_ARG(h_base >= 1, "QsrConfig: h_base must be >= 1, got ", h_base);
  GC_CHECK_ARG(total_steps >= 1, "QsrConfig: total_steps must be >= 1, got ", total_steps);
  GC_CHECK_ARG(warmup_steps >= 0, "QsrConfig: warmup_steps must be >= 0, got ", warmup_steps);
}

QsrScheduler::QsrScheduler(const QsrConfig& cfg, double initial_lr) : cfg_(cfg) {
  cfg_.validate();
  on_average(0, initial_lr);
}

int64_t QsrScheduler::on_average(int64_t step, double lr) {
  GC_CHECK_ARG(step >= 0 && step < cfg_.total_steps,
               "QsrScheduler::on_average: step must be in "
               "[0, total_steps = ",
               cfg_.total_steps, "), got ", step);
  // The period from lr (validates lr) even in warm-up, so a bad lr is always reported.
  const int64_t h_lr = qsr_period(lr, cfg_.alpha, cfg_.h_base);
  const int64_t h = step < cfg_.warmup_steps ? cfg_.h_base : h_lr;
  period_ = h;
  next_sync_ = step + std::min(h, cfg_.total_steps - step);
  return next_sync_;
}

bool QsrScheduler::after_step(int64_t step, double next_lr) {
  GC_CHECK_ARG(step >= 1 && step <= cfg_.total_steps,
               "QsrScheduler::after_step: step must be in "
               "[1, total_steps = ",
               cfg_.total_steps, "], got ", step);
  GC_CHECK_ARG(step <= next_sync_, "QsrScheduler::after_step: step ", step,
               " is past the scheduled averaging at step ", next_sync_,
               "; call after_step() after every local step");
  if (step != next_sync_) return false;
  if (step < cfg_.total_steps) on_average(step, next_lr);
  return true;
}

}  // namespace gradcomp::straggler

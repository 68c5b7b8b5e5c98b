// SPDX-License-Identifier: Apache-2.0
// DropCompute analytics: the paper's Eq. 4 (expected maximum of N normal step times), Eq. 5
// (expected completed micro-batches), Eq. 6 (effective speedup) and the compensation factor.
#include <algorithm>
#include <cmath>
#include <limits>

#include "gradcomp/error.hpp"
#include "gradcomp/straggler.hpp"

namespace gradcomp::straggler {

namespace {

constexpr double kSqrt2 = 1.41421356237309504880;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

bool finite(double x) { return std::isfinite(x); }

// Upper tail Q(x) = 1 - Phi(x), accurate in the far tail.
double upper_tail(double x) { return 0.5 * std::erfc(x / kSqrt2); }

// Quantile of the upper tail: the x with Q(x) = q, q in (0, 0.5]. Starting point from
// Abramowitz & Stegun 26.2.23 (error < 4.5e-4), then Halley steps on Q(x) - q.
double upper_quantile(double q) {
  const double t = std::sqrt(-2.0 * std::log(q));
  double x = t - (2.515517 + t * (0.802853 + t * 0.010328)) /
                     (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)));
  for (int it = 0; it < 3; ++it) {
    const double phi = kInvSqrt2Pi * std::exp(-0.5 * x * x);
    if (phi == 0.0) break;
    const double u = (upper_tail(x) - q) / phi;  // Newton step of g(x) = Q(x) - q is +u
    x += u / (1.0 - 0.5 * x * u);                // Halley correction
  }
  return x;
}

}  // namespace

double normal_cdf(double x) { return 0.5 * std::erfc(-x / kSqrt2); }

double normal_quantile(double p) {
  GC_CHECK_ARG(p > 0.0 && p < 1.0, "normal_quantile: p must be in (0, 1), got ", p);
  if (p == 0.5) return 0.0;
  return p > 0.5 ? upper_quantile(1.0 - p) : -upper_quantile(p);
}

double expected_max_normal(int64_t n, double mu, double sigma) {
  GC_CHECK_ARG(n >= 1, "expected_max_normal: the number of workers N must be >= 1, got ", n);
  GC_CHECK_ARG(finite(mu) && finite(sigma) && sigma >= 0.0,
               "expected_max_normal: need finite mu and sigma >= 0, got mu = ", mu,
               ", sigma = ", sigma);
  if (n == 1) return mu;
  const double nd = static_cast<double>(n);
  // Phi^-1(1 - 1/N) = upper quantile of 1/N; computed from the tail for accuracy at large N.
  const double a = upper_quantile(1.0 / nd);
  const double b = upper_quantile(1.0 / (std::exp(1.0) * nd));
  return sigma * ((1.0 - kEulerGamma) * a + kEulerGamma * b) + mu;
}

double expected_completed_microbatches(double tau, int64_t micro_batches, double mu, double sigma) {
  GC_CHECK_ARG(finite(tau) && tau > 0.0,
               "expected_completed_microbatches: the threshold tau must be finite and > 0, got ",
               tau);
  GC_CHECK_ARG(micro_batches >= 1,
               "expected_completed_microbatches: the number of micro-batches M must be >= 1, got ",
               micro_batches);
  GC_CHECK_ARG(finite(mu) && mu > 0.0 && finite(sigma) && sigma >= 0.0,
               "expected_completed_microbatches: need micro-batch latency mean mu > 0 and stddev "
               "sigma >= 0, got mu = ",
               mu, ", sigma = ", sigma);
  double sum = 0.0;
  for (int64_t m = 1; m <= micro_batches; ++m) {
    const double md = static_cast<double>(m);
    if (sigma == 0.0) {
      sum += (md * mu <= tau) ? 1.0 : 0.0;
    } else {
      sum += normal_cdf((tau - md * mu) / std::sqrt(md * sigma * sigma));
    }
  }
  return sum;
}

double effective_speedup(double m_tilde, int64_t micro_batches, double tau, double step_time,
                         double serial_time) {
  GC_CHECK_ARG(micro_batches >= 1, "effective_speedup: M must be >= 1, got ", micro_batches);
  const double md = static_cast<double>(micro_batches);
  GC_CHECK_ARG(finite(m_tilde) && m_tilde >= 0.0 && m_tilde <= md,
               "effective_speedup: the completed micro-batches M~ must be in [0, M = ", md,
               "], got ", m_tilde);
  GC_CHECK_ARG(!std::isnan(tau) && tau > 0.0, "effective_speedup: tau must be > 0, got ", tau);
  GC_CHECK_ARG(finite(step_time) && step_time >= 0.0,
               "effective_speedup: the step time T must be finite and >= 0, got ", step_time);
  GC_CHECK_ARG(finite(serial_time) && serial_time >= 0.0,
               "effective_speedup: the serial time Tc must be finite and >= 0, got ", serial_time);
  GC_CHECK_ARG(step_time + serial_time > 0.0, "effective_speedup: T + Tc must be > 0");
  return m_tilde * (step_time + serial_time) / (md * (std::min(tau, step_time) + serial_time));
}

double compensation_factor(double m_tilde, int64_t micro_batches) {
  GC_CHECK_ARG(micro_batches >= 1, "compensation_factor: M must be >= 1, got ", micro_batches);
  const double md = static_cast<double>(micro_batches);
  GC_CHECK_ARG(finite(m_tilde) && m_tilde > 0.0 && m_tilde <= md,
               "compensation_factor: the completed micro-batches M~ must be in (0, M = ", md,
               "], got ", m_tilde);
  return md / m_tilde - 1.0;
}

void AnalyticModel::validate() const {
  GC_CHECK_ARG(workers >= 1, "AnalyticModel: workers must be >= 1, got ", workers);
  GC_CHECK_ARG(micro_batches >= 1, "AnalyticModel: micro_batches M must be >= 1, got ",
               micro_batches);
  GC_CHECK_ARG(finite(mu) && mu > 0.0, "AnalyticModel: mu must be finite and > 0, got ", mu);
  GC_CHECK_ARG(finite(sigma) && sigma >= 0.0, "AnalyticModel: sigma must be finite and >= 0, got ",
               sigma);
  GC_CHECK_ARG(finite(serial_time) && serial_time >= 0.0,
               "AnalyticModel: serial_time must be finite and >= 0, got ", serial_time);
}

namespace {

AnalyticPoint point_at(const AnalyticModel& m, double tau, double et) {
  AnalyticPoint p;
  const double md = static_cast<double>(m.micro_batches);
  p.tau = tau;
  p.step_time = et;
  p.completed =
      std::isinf(tau) ? md : expected_completed_microbatches(tau, m.micro_batches, m.mu, m.sigma);
  p.completion_rate = p.completed / md;
  p.drop_rate = 1.0 - p.completion_rate;
  p.step_time_with_tau = std::min(tau, et);
  p.speedup = p.completed * (et + m.serial_time) / (md * (p.step_time_with_tau + m.serial_time));
  p.step_speedup = (et + m.serial_time) / (p.step_time_with_tau + m.serial_time);
  return p;
}

double model_step_time(const AnalyticModel& m) {
  const double md = static_cast<double>(m.micro_batches);
  return expected_max_normal(m.workers, md * m.mu, std::sqrt(md) * m.sigma);
}

}  // namespace

AnalyticPoint analytic_point(const AnalyticModel& model, double tau, double step_time) {
  model.validate();
  GC_CHECK_ARG(!std::isnan(tau) && tau > 0.0, "analytic_point: tau must be > 0, got ", tau);
  GC_CHECK_ARG(finite(step_time) && step_time >= 0.0,
               "analytic_point: step_time must be finite and >= 0 (0 = use Eq. 4), got ",
               step_time);
  const double et = step_time > 0.0 ? step_time : model_step_time(model);
  return point_at(model, tau, et);
}

AnalyticPoint analytic_optimal_tau(const AnalyticModel& model, int64_t grid) {
  model.validate();
  GC_CHECK_ARG(grid >= 2, "analytic_optimal_tau: grid must be >= 2, got ", grid);
  const double et = model_step_time(model);
  // No drop: tau = +Inf, speedup exactly 1.
  AnalyticPoint best = point_at(model, std::numeric_limits<double>::infinity(), et);
  if (et <= 0.0) return best;
  int64_t best_i = -1;
  for (int64_t i = grid; i >= 1; --i) {
    const double tau = et * static_cast<double>(i) / static_cast<double>(grid);
    const AnalyticPoint p = point_at(model, tau, et);
    if (p.speedup > best.speedup) {
      best = p;
      best_i = i;
    }
  }
  if (best_i < 0) return best;
  // Golden-section refinement on the bracket around the best grid point.
  double lo = et * static_cast<double>(best_i - 1) / static_cast<double>(grid);
  double hi = et * static_cast<double>(std::min(best_i + 1, grid)) / static_cast<double>(grid);
  lo = std::max(lo, et * 1e-12);
  const double r = 0.61803398874989484820;
  double x1 = hi - r * (hi - lo), x2 = lo + r * (hi - lo);
  double f1 = point_at(model, x1, et).speedup, f2 = point_at(model, x2, et).speedup;
  for (int it = 0; it < 80; ++it) {
    if (f1 < f2) {
      lo = x1;
      x1 = x2;
      f1 = f2;
      x2 = lo + r * (hi - lo);
      f2 = point_at(model, x2, et).speedup;
    } else {
      hi = x2;
      x2 = x1;
      f2 = f1;
      x1 = hi - r * (hi - lo);
      f1 = point_at(model, x1, et).speedup;
    }
  }
  const AnalyticPoint refined = point_at(model, 0.5 * (lo + hi), et);
  return refined.speedup > best.speedup ? refined : best;
}

}  // namespace gradcomp::straggler

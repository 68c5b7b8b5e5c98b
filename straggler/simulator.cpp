// SPDX-License-Identifier: Apache-2.0
// The delay environment: per-micro-batch latencies drawn from a normal or a normal plus bounded
// log-normal additive noise, and the paper's Fig. 1 / Fig. 3 curves (simulated vs analytic).
#include <algorithm>
#include <cmath>

#include "gradcomp/error.hpp"
#include "gradcomp/rng.hpp"
#include "gradcomp/straggler.hpp"

namespace gradcomp::straggler {

namespace {

constexpr double kTwoPi = 6.28318530717958647692;

// One standard normal from Philox block b (Box-Muller on two 53-bit uniforms).
double normal_draw(const RngKey& key, uint64_t b) {
  const Philox4 w = key.block(b);
  const uint64_t a = (static_cast<uint64_t>(w.v[0]) << 32) | w.v[1];
  const uint64_t c = (static_cast<uint64_t>(w.v[2]) << 32) | w.v[3];
  const double u1 = 1.0 - static_cast<double>(a >> 11) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(c >> 11) * 0x1.0p-53;        // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

}  // namespace

void DelayModel::validate() const {
  GC_CHECK_ARG(kind == DelayKind::kNormal || kind == DelayKind::kBoundedLogNormal,
               "DelayModel: unknown DelayKind ", static_cast<int>(kind));
  GC_CHECK_ARG(std::isfinite(mean) && mean >= 0.0, "DelayModel: mean must be finite and >= 0, got ",
               mean);
  GC_CHECK_ARG(std::isfinite(stddev) && stddev >= 0.0,
               "DelayModel: stddev must be finite and >= 0, got ", stddev);
  if (kind == DelayKind::kBoundedLogNormal) {
    GC_CHECK_ARG(std::isfinite(log_mu), "DelayModel: log_mu must be finite, got ", log_mu);
    GC_CHECK_ARG(std::isfinite(log_sigma) && log_sigma >= 0.0,
                 "DelayModel: log_sigma must be finite and >= 0, got ", log_sigma);
    GC_CHECK_ARG(std::isfinite(cap) && cap >= 0.0, "DelayModel: cap must be finite and >= 0, got ",
                 cap);
  }
}

LatencyStats latency_moments(const DelayModel& model) {
  model.validate();
  double mean = model.mean, var = model.stddev * model.stddev;
  if (model.kind == DelayKind::kBoundedLogNormal) {
    // X = min(exp(Y), c), Y ~ N(mu, s^2):
    //   E[X^k] = exp(k mu + k^2 s^2 / 2) Phi((ln c - mu - k s^2) / s) + c^k (1 - Phi((ln c -
    //   mu)/s))
    const double mu = model.log_mu, s = model.log_sigma, c = model.cap;
    double e1, e2;
    if (c <= 0.0) {
      e1 = e2 = 0.0;
    } else if (s == 0.0) {
      e1 = std::min(std::exp(mu), c);
      e2 = e1 * e1;
    } else {
      const double lc = std::log(c);
      const double tail = 1.0 - normal_cdf((lc - mu) / s);
      e1 = std::exp(mu + 0.5 * s * s) * normal_cdf((lc - mu - s * s) / s) + c * tail;
      e2 =
          std::exp(2.0 * mu + 2.0 * s * s) * normal_cdf((lc - mu - 2.0 * s * s) / s) + c * c * tail;
    }
    mean += e1;
    var += std::max(0.0, e2 - e1 * e1);
  }
  return {mean, std::sqrt(var)};
}

LatencyTrace simulate_latencies(const DelayModel& model, int64_t workers, int64_t steps,
                                int64_t micro_batches, uint64_t seed) {
  model.validate();
  GC_CHECK_ARG(workers >= 1 && steps >= 1 && micro_batches >= 1,
               "simulate_latencies: workers, steps and micro_batches must be >= 1, got ", workers,
               ", ", steps, ", ", micro_batches);
  GC_CHECK_ARG(workers <= (int64_t{1} << 32), "simulate_latencies: at most 2^32 workers, got ",
               workers);
  LatencyTrace t{workers, steps, micro_batches, {}};
  t.latency.resize(static_cast<size_t>(workers * steps * micro_batches));
  const bool lognormal = model.kind == DelayKind::kBoundedLogNormal;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < workers; ++n) {
    for (int64_t s = 0; s < steps; ++s) {
      const RngKey key{seed, static_cast<uint64_t>(s), static_cast<uint32_t>(n)};
      double* out = &t.latency[static_cast<size_t>((n * steps + s) * micro_batches)];
      for (int64_t m = 0; m < micro_batches; ++m) {
        const uint64_t b = 2 * static_cast<uint64_t>(m);
        double v = std::max(0.0, model.mean + model.stddev * normal_draw(key, b));
        if (lognormal)
          v += std::min(std::exp(model.log_mu + model.log_sigma * normal_draw(key, b + 1)),
                        model.cap);
        out[m] = v;
      }
    }
  }
  return t;
}

std::vector<TauCurvePoint> tau_curve(const LatencyTrace& trace, double tau_lo, double tau_hi,
                                     int64_t points, const TauOptions& opt) {
  trace.validate();
  opt.validate();
  GC_CHECK_ARG(std::isfinite(tau_lo) && tau_lo > 0.0 && std::isfinite(tau_hi) && tau_hi >= tau_lo,
               "tau_curve: need 0 < tau_lo <= tau_hi (finite), got [", tau_lo, ", ", tau_hi, "]");
  GC_CHECK_ARG(points >= 1, "tau_curve: points must be >= 1, got ", points);
  const LatencyStats st = latency_stats(trace);
  GC_CHECK_ARG(st.mean > 0.0, "tau_curve: the trace's mean latency must be > 0");
  const AnalyticModel am{trace.workers, trace.micro_batches, st.mean, st.stddev, opt.serial_time};
  std::vector<TauCurvePoint> out;
  out.reserve(static_cast<size_t>(points));
  double sim_t = -1.0;
  for (int64_t i = 0; i < points; ++i) {
    const double tau = points == 1 ? tau_lo
                                   : tau_lo + (tau_hi - tau_lo) * static_cast<double>(i) /
                                                  static_cast<double>(points - 1);
    TauCurvePoint p;
    p.simulated = evaluate_tau(trace, tau, opt);
    if (sim_t < 0.0) sim_t = p.simulated.step_time;
    p.analytic = analytic_point(am, tau);
    p.analytic_given_t = analytic_point(am, tau, sim_t > 0.0 ? sim_t : 0.0);
    out.push_back(p);
  }
  return out;
}

std::vector<ScalePoint> scale_curve(const DelayModel& model, const std::vector<int64_t>& workers,
                                    int64_t steps, int64_t micro_batches, uint64_t seed,
                                    const TauOptions& opt) {
  model.validate();
  opt.validate();
  GC_CHECK_ARG(!workers.empty(), "scale_curve: the list of worker counts is empty");
  for (int64_t n : workers)
    GC_CHECK_ARG(n >= 1, "scale_curve: worker counts must be >= 1, got ", n);
  GC_CHECK_ARG(steps >= 1 && micro_batches >= 1,
               "scale_curve: steps and micro_batches must be >= 1, got ", steps, ", ",
               micro_batches);
  const double md = static_cast<double>(micro_batches);
  const double tc = opt.serial_time;
  const LatencyStats exact = latency_moments(model);
  const double single = md / (md * exact.mean + tc);  // one worker, no variance
  GC_CHECK_ARG(single > 0.0 && std::isfinite(single),
               "scale_curve: the model's mean latency and serial time are both 0");
  std::vector<ScalePoint> out;
  for (size_t i = 0; i < workers.size(); ++i) {
    const int64_t n = workers[i];
    const LatencyTrace tr = simulate_latencies(model, n, steps, micro_batches, seed + i);
    const LatencyStats st = latency_stats(tr);
    ScalePoint p;
    p.workers = n;
    const double nd = static_cast<double>(n);
    p.linear = nd;
    p.simulated = find_optimal_tau(tr, opt);
    p.baseline = nd * md / (p.simulated.step_time + tc) / single;
    p.dropcompute = nd * p.simulated.completed / (p.simulated.step_time_with_tau + tc) / single;
    if (st.mean > 0.0) {
      const AnalyticModel am{n, micro_batches, st.mean, st.stddev, tc};
      p.analytic = analytic_optimal_tau(am);
      p.baseline_analytic = nd * md / (p.analytic.step_time + tc) / single;
      p.dropcompute_analytic =
          nd * p.analytic.completed / (p.analytic.step_time_with_tau + tc) / single;
    }
    out.push_back(p);
  }
  return out;
}

}  // namespace gradcomp::straggler

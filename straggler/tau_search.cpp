// SPDX-License-Identifier: Apache-2.0
// The automatic compute threshold: S_eff(tau) of a gathered latency trace and its maximiser.
// Everything here is sequential and in a fixed order so every rank computes the bitwise same tau.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "gradcomp/error.hpp"
#include "gradcomp/straggler.hpp"

namespace gradcomp::straggler {

void LatencyTrace::validate() const {
  GC_CHECK_ARG(workers >= 1 && steps >= 1 && micro_batches >= 1,
               "LatencyTrace: workers, steps and micro_batches must all be >= 1 (empty latency "
               "samples), got workers = ",
               workers, ", steps = ", steps, ", micro_batches = ", micro_batches);
  const double expect = static_cast<double>(workers) * static_cast<double>(steps) *
                        static_cast<double>(micro_batches);
  GC_CHECK_ARG(static_cast<double>(latency.size()) == expect,
               "LatencyTrace: latency must hold workers * steps * micro_batches = ", workers, " * ",
               steps, " * ", micro_batches, " values, got ", latency.size());
  for (size_t i = 0; i < latency.size(); ++i) {
    const double v = latency[i];
    if (!(std::isfinite(v) && v >= 0.0)) {
      const int64_t m = static_cast<int64_t>(i) % micro_batches;
      const int64_t s = (static_cast<int64_t>(i) / micro_batches) % steps;
      const int64_t n = static_cast<int64_t>(i) / (micro_batches * steps);
      GC_CHECK_ARG(false, "LatencyTrace: latencies must be finite and >= 0, got ", v,
                   " at [worker ", n, ", step ", s, ", micro-batch ", m, "]");
    }
  }
}

void TauOptions::validate() const {
  GC_CHECK_ARG(std::isfinite(serial_time) && serial_time >= 0.0,
               "TauOptions: serial_time must be finite and >= 0, got ", serial_time);
  GC_CHECK_ARG(model == StopModel::kPreemptive || model == StopModel::kMicroBatchBoundary,
               "TauOptions: unknown StopModel ", static_cast<int>(model));
  GC_CHECK_ARG(std::isfinite(min_gain) && min_gain >= 0.0,
               "TauOptions: min_gain must be finite and >= 0, got ", min_gain);
}

namespace {

// Cumulative times T_n^(m) (sequential sums), same layout as the trace.
std::vector<double> cumulative(const LatencyTrace& t) {
  std::vector<double> c(t.latency.size());
  const size_t mb = static_cast<size_t>(t.micro_batches);
  for (size_t row = 0; row < c.size() / mb; ++row) {
    double acc = 0.0;
    for (size_t m = 0; m < mb; ++m) {
      acc += t.latency[row * mb + m];
      c[row * mb + m] = acc;
    }
  }
  return c;
}

// T_s = max over workers of the full step time.
std::vector<double> step_times(const LatencyTrace& t, const std::vector<double>& cum) {
  std::vector<double> ts(static_cast<size_t>(t.steps), 0.0);
  const int64_t mb = t.micro_batches;
  for (int64_t n = 0; n < t.workers; ++n)
    for (int64_t s = 0; s < t.steps; ++s)
      ts[s] = std::max(ts[s], cum[static_cast<size_t>((n * t.steps + s) * mb + mb - 1)]);
  return ts;
}

double fixed_sum(const std::vector<double>& v) {
  double acc = 0.0;
  for (double x : v) acc += x;
  return acc;
}

TauEval make_eval(const LatencyTrace& t, double tau, double total_completed, double sum_t,
                  double sum_t_tau, double tc) {
  TauEval e;
  const double md = static_cast<double>(t.micro_batches);
  const double sd = static_cast<double>(t.steps);
  e.tau = tau;
  e.completed = total_completed / (static_cast<double>(t.workers) * sd);
  e.completion_rate = e.completed / md;
  e.drop_rate = 1.0 - e.completion_rate;
  e.step_time = sum_t / sd;
  e.step_time_with_tau = sum_t_tau / sd;
  const double den = e.step_time_with_tau + tc;
  e.speedup = den > 0.0 ? e.completed * (e.step_time + tc) / (md * den) : 1.0;
  e.step_speedup = den > 0.0 ? (e.step_time + tc) / den : 1.0;
  return e;
}

}  // namespace

TauEval evaluate_tau(const LatencyTrace& trace, double tau, const TauOptions& opt) {
  trace.validate();
  opt.validate();
  GC_CHECK_ARG(!std::isnan(tau) && tau > 0.0, "evaluate_tau: tau must be > 0, got ", tau);
  const std::vector<double> cum = cumulative(trace);
  const std::vector<double> ts = step_times(trace, cum);
  const int64_t mb = trace.micro_batches;
  double total = 0.0;
  std::vector<double> ts_tau(ts.size(), 0.0);
  for (int64_t n = 0; n < trace.workers; ++n) {
    for (int64_t s = 0; s < trace.steps; ++s) {
      const double* c = &cum[static_cast<size_t>((n * trace.steps + s) * mb)];
      int64_t count = 0;
      if (opt.model == StopModel::kPreemptive) {
        while (count < mb && c[count] <= tau) ++count;
        ts_tau[s] = std::min(tau, ts[s]);
      } else {
        // micro-batch j starts iff j == 0 or T^(j) (1-based cumulative of j) <= tau
        count = 1;
        while (count < mb && c[count - 1] <= tau) ++count;
        ts_tau[s] = std::max(ts_tau[s], c[count - 1]);
      }
      total += static_cast<double>(count);
    }
  }
  return make_eval(trace, tau, total, fixed_sum(ts), fixed_sum(ts_tau), opt.serial_time);
}

TauEval find_optimal_tau(const LatencyTrace& trace, const TauOptions& opt) {
  trace.validate();
  opt.validate();
  const std::vector<double> cum = cumulative(trace);
  const std::vector<double> ts = step_times(trace, cum);
  const double sum_t = fixed_sum(ts);
  const double t_max = *std::max_element(ts.begin(), ts.end());
  const int64_t mb = trace.micro_batches;
  const double nd = static_cast<double>(trace.workers), sd = static_cast<double>(trace.steps);
  const double tc = opt.serial_time;

  // speed[k] = S_eff at candidate value cand[k] (distinct, ascending), computed by a sweep.
  std::vector<double> cand;
  std::vector<double> speed;
  if (opt.model == StopModel::kPreemptive) {
    // count(tau) = #{T^(m) <= tau}; sum_s min(tau, T_s) from the sorted T_s and prefix sums.
    std::vector<double> pts(cum);
    std::sort(pts.begin(), pts.end());
    std::vector<double> tsort(ts);
    std::sort(tsort.begin(), tsort.end());
    std::vector<double> prefix(tsort.size() + 1, 0.0);
    for (size_t i = 0; i < tsort.size(); ++i) prefix[i + 1] = prefix[i] + tsort[i];
    size_t k = 0;  // #{T_s <= v}
    for (size_t i = 0; i < pts.size(); ++i) {
      const double v = pts[i];
      if (i + 1 < pts.size() && pts[i + 1] == v) continue;  // last of equal values
      if (v <= 0.0) continue;
      while (k < tsort.size() && tsort[k] <= v) ++k;
      const double sum_tau = prefix[k] + v * static_cast<double>(tsort.size() - k);
      cand.push_back(v);
      speed.push_back(make_eval(trace, v, static_cast<double>(i + 1), sum_t, sum_tau, tc).speedup);
    }
  } else {
    // Event at T_n^(j) (j = 1..M-1): micro-batch j+1 starts, the worker's time moves to
    // T_n^(j+1). Times only grow with tau, so each step's maximum is a running maximum.
    struct Event {
      double v;
      int64_t row;  // n * steps + s
      int64_t j;    // index of the new last micro-batch (0-based)
    };
    std::vector<Event> ev;
    ev.reserve(static_cast<size_t>(trace.workers * trace.steps * (mb - 1)));
    std::vector<double> time_s(ts.size(), 0.0);
    for (int64_t row = 0; row < trace.workers * trace.steps; ++row) {
      const double* c = &cum[static_cast<size_t>(row * mb)];
      const size_t s = static_cast<size_t>(row % trace.steps);
      time_s[s] = std::max(time_s[s], c[0]);
      for (int64_t j = 1; j < mb; ++j) ev.push_back({c[j - 1], row, j});
    }
    std::sort(ev.begin(), ev.end(), [](const Event& a, const Event& b) {
      if (a.v != b.v) return a.v < b.v;
      if (a.row != b.row) return a.row < b.row;
      return a.j < b.j;
    });
    double total = nd * sd;  // one micro-batch per worker and step
    double sum_tau = fixed_sum(time_s);
    for (size_t i = 0; i < ev.size(); ++i) {
      const Event& e = ev[i];
      const size_t s = static_cast<size_t>(e.row % trace.steps);
      const double t_new = cum[static_cast<size_t>(e.row * mb + e.j)];
      if (t_new > time_s[s]) {
        sum_tau += t_new - time_s[s];
        time_s[s] = t_new;
      }
      total += 1.0;
      if (i + 1 < ev.size() && ev[i + 1].v == e.v) continue;
      if (e.v <= 0.0 || e.v >= t_max) continue;
      cand.push_back(e.v);
      speed.push_back(make_eval(trace, e.v, total, sum_t, sum_tau, tc).speedup);
    }
  }

  // No drop (tau = max step time) is the reference; walk down from the largest candidate and
  // accept a smaller tau only for a gain above min_gain over the best so far.
  double best_tau = t_max;
  double best_speed = 1.0;
  for (size_t i = cand.size(); i-- > 0;) {
    if (cand[i] >= t_max) continue;
    if (speed[i] > best_speed * (1.0 + opt.min_gain)) {
      best_speed = speed[i];
      best_tau = cand[i];
    }
  }
  if (!(best_tau > 0.0)) best_tau = t_max > 0.0 ? t_max : 1.0;  // all-zero trace
  return evaluate_tau(trace, best_tau, opt);
}

LatencyStats latency_stats(const LatencyTrace& trace) {
  trace.validate();
  double sum = 0.0;
  for (double v : trace.latency) sum += v;
  const double n = static_cast<double>(trace.latency.size());
  const double mean = sum / n;
  double ss = 0.0;
  for (double v : trace.latency) ss += (v - mean) * (v - mean);
  return {mean, std::sqrt(ss / n)};
}

}  // namespace gradcomp::straggler

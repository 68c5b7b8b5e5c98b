// SPDX-License-Identifier: Apache-2.0
// DropCompute: analytics against numerical integration, the tau* search against a brute-force
// reference, the threshold controller on a manual clock, the gradient normalisation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "gradcomp/gradcomp.hpp"

using namespace gradcomp;
using namespace gradcomp::straggler;

namespace {

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// E[max of N standard normals] = integral of x d/dx Phi(x)^N = integral x N phi Phi^(N-1),
// composite Simpson on [-12, 12].
double emax_integral(int64_t n) {
  const int steps = 48000;
  const double a = -12.0, b = 12.0, h = (b - a) / steps;
  auto f = [n](double x) {
    const double phi = std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    return x * static_cast<double>(n) * phi * std::pow(cdf, static_cast<double>(n - 1));
  };
  double s = f(a) + f(b);
  for (int i = 1; i < steps; ++i) s += f(a + i * h) * (i % 2 ? 4.0 : 2.0);
  return s * h / 3.0;
}

// Brute-force S_eff of a trace at tau, written from the definitions (paper Section 4.3-4.4).
TauEval reference_eval(const LatencyTrace& t, double tau, double tc, StopModel model) {
  const int64_t N = t.workers, S = t.steps, M = t.micro_batches;
  double sum_t = 0, sum_tau = 0, done = 0;
  for (int64_t s = 0; s < S; ++s) {
    double tmax = 0, tmax_tau = 0;
    for (int64_t n = 0; n < N; ++n) {
      double c = 0, end = 0;
      int64_t k = 0;
      for (int64_t m = 0; m < M; ++m) {
        const double start = c;
        c += t.at(n, s, m);
        if (model == StopModel::kPreemptive) {
          if (c <= tau) ++k;
        } else if (m == 0 || start <= tau) {
          ++k;
          end = c;
        }
      }
      tmax = std::max(tmax, c);
      tmax_tau = std::max(tmax_tau, model == StopModel::kPreemptive ? std::min(tau, c) : end);
      done += static_cast<double>(k);
    }
    sum_t += tmax;
    sum_tau += tmax_tau;
  }
  TauEval e;
  e.tau = tau;
  e.completed = done / static_cast<double>(N * S);
  e.step_time = sum_t / static_cast<double>(S);
  e.step_time_with_tau = sum_tau / static_cast<double>(S);
  e.speedup =
      e.completed * (e.step_time + tc) / (static_cast<double>(M) * (e.step_time_with_tau + tc));
  return e;
}

LatencyTrace random_trace(int64_t n, int64_t s, int64_t m, uint64_t seed, bool heavy) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> ln(0.0, heavy ? 1.2 : 0.3);
  LatencyTrace t{n, s, m, std::vector<double>(static_cast<size_t>(n * s * m))};
  for (auto& v : t.latency) v = 0.5 + ln(rng);
  return t;
}

}  // namespace

// ---------------------------------------------------------------------------------- analytics

TEST(Analytics, NormalQuantileInvertsTheCdf) {
  EXPECT_NEAR(normal_quantile(0.975), 1.959963984540054, 1e-13);
  EXPECT_NEAR(normal_quantile(0.5), 0.0, 0.0);
  EXPECT_NEAR(normal_quantile(1e-10), -6.361340902404056, 1e-11);
  for (double x = -8.0; x <= 8.0; x += 0.173) {
    const double p = normal_cdf(x);
    if (p <= 0.0 || p >= 1.0) continue;
    // in the upper tail p is rounded near 1, so compare there with the precision p carries
    const double tol = x > 0 ? 1e-15 / std::max(1e-300, 1.0 - p) * 0.5 + 1e-12 : 1e-12;
    EXPECT_NEAR(normal_quantile(p), x, tol) << x;
  }
  EXPECT_THROW(normal_quantile(0.0), InvalidArgument);
  EXPECT_THROW(normal_quantile(1.0), InvalidArgument);
  EXPECT_THROW(normal_quantile(kNaN), InvalidArgument);
}

TEST(Analytics, ExpectedMaxAgainstNumericalIntegration) {
  // N = 2 has a closed form: 1/sqrt(pi); it checks the integration itself.
  EXPECT_NEAR(emax_integral(2), 1.0 / std::sqrt(M_PI), 1e-10);
  EXPECT_NEAR(emax_integral(1), 0.0, 1e-10);
  for (int64_t n : {2, 16, 64, 200, 1024}) {
    const double exact = emax_integral(n);
    const double approx = expected_max_normal(n, 0.0, 1.0);
    const double rel = std::fabs(approx - exact) / exact;
    if (n >= 16) {
      EXPECT_LT(rel, 0.02) << "N = " << n << " exact " << exact << " approx " << approx;
    } else {
      EXPECT_LT(rel, 0.10) << "N = " << n;  // Eq. 4 is coarse for tiny N
    }
    // location-scale: mu + sigma * E[max of standard normals]
    EXPECT_NEAR(expected_max_normal(n, 3.0, 0.25), 3.0 + 0.25 * approx, 1e-12);
  }
  EXPECT_EQ(expected_max_normal(1, 2.5, 1.0), 2.5);
  EXPECT_EQ(expected_max_normal(1000, 2.5, 0.0), 2.5);
  // increasing in N
  double prev = 0.0;
  for (int64_t n = 2; n <= 4096; n *= 2) {
    const double v = expected_max_normal(n, 0.0, 1.0);
    EXPECT_GT(v, prev);
    prev = v;
  }
  EXPECT_THROW(expected_max_normal(0, 0.0, 1.0), InvalidArgument);
  EXPECT_THROW(expected_max_normal(4, 0.0, -1.0), InvalidArgument);
  EXPECT_THROW(expected_max_normal(4, kNaN, 1.0), InvalidArgument);
}

TEST(Analytics, ExpectedCompletedMicrobatches) {
  // sigma = 0: a staircase (m mu <= tau).
  EXPECT_EQ(expected_completed_microbatches(3.5, 10, 1.0, 0.0), 3.0);
  EXPECT_EQ(expected_completed_microbatches(3.0, 10, 1.0, 0.0), 3.0);
  EXPECT_EQ(expected_completed_microbatches(100.0, 10, 1.0, 0.0), 10.0);
  EXPECT_EQ(expected_completed_microbatches(0.5, 10, 1.0, 0.0), 0.0);
  // Independent sum of the Eq. 5 terms.
  const double tau = 11.3, mu = 1.0, sg = 0.3;
  double ref = 0.0;
  for (int m = 1; m <= 12; ++m)
    ref += 0.5 * std::erfc(-(tau - m * mu) / (std::sqrt(m) * sg) / std::sqrt(2.0));
  EXPECT_NEAR(expected_completed_microbatches(tau, 12, mu, sg), ref, 1e-12);
  // monotone in tau, bounded by M
  double prev = -1.0;
  for (double t = 0.5; t < 30.0; t += 0.5) {
    const double v = expected_completed_microbatches(t, 12, mu, sg);
    EXPECT_GE(v, prev);
    EXPECT_LE(v, 12.0);
    prev = v;
  }
  EXPECT_THROW(expected_completed_microbatches(0.0, 12, 1.0, 0.1), InvalidArgument);
  EXPECT_THROW(expected_completed_microbatches(-1.0, 12, 1.0, 0.1), InvalidArgument);
  EXPECT_THROW(expected_completed_microbatches(kNaN, 12, 1.0, 0.1), InvalidArgument);
  EXPECT_THROW(expected_completed_microbatches(1.0, 0, 1.0, 0.1), InvalidArgument);
  EXPECT_THROW(expected_completed_microbatches(1.0, 12, 0.0, 0.1), InvalidArgument);
  EXPECT_THROW(expected_completed_microbatches(1.0, 12, 1.0, kNaN), InvalidArgument);
}

TEST(Analytics, SpeedupAndCompensation) {
  EXPECT_DOUBLE_EQ(effective_speedup(11.0, 12, 10.0, 12.0, 0.5), 11.0 * 12.5 / (12.0 * 10.5));
  EXPECT_DOUBLE_EQ(effective_speedup(12.0, 12, 20.0, 12.0, 0.5), 1.0);  // tau > T: no change
  EXPECT_DOUBLE_EQ(effective_speedup(6.0, 12, kInf, 12.0, 0.0), 0.5);
  EXPECT_NEAR(compensation_factor(0.9 * 12, 12), 1.0 / 0.9 - 1.0, 1e-15);
  EXPECT_EQ(compensation_factor(12.0, 12), 0.0);
  EXPECT_THROW(effective_speedup(13.0, 12, 1.0, 1.0, 0.0), InvalidArgument);
  EXPECT_THROW(effective_speedup(-1.0, 12, 1.0, 1.0, 0.0), InvalidArgument);
  EXPECT_THROW(effective_speedup(1.0, 0, 1.0, 1.0, 0.0), InvalidArgument);
  EXPECT_THROW(effective_speedup(1.0, 12, 0.0, 1.0, 0.0), InvalidArgument);
  EXPECT_THROW(effective_speedup(1.0, 12, 1.0, 1.0, -0.1), InvalidArgument);
  EXPECT_THROW(effective_speedup(1.0, 12, 1.0, 0.0, 0.0), InvalidArgument);
  EXPECT_THROW(compensation_factor(0.0, 12), InvalidArgument);
  EXPECT_THROW(compensation_factor(kNaN, 12), InvalidArgument);
}

TEST(Analytics, AnalyticPointAndOptimum) {
  const AnalyticModel am{
      .workers = 256, .micro_batches = 12, .mu = 1.0, .sigma = 0.3, .serial_time = 0.5};
  const double et = expected_max_normal(256, 12.0, std::sqrt(12.0) * 0.3);
  const AnalyticPoint p = analytic_point(am, 11.0);
  EXPECT_DOUBLE_EQ(p.step_time, et);
  EXPECT_DOUBLE_EQ(p.completed, expected_completed_microbatches(11.0, 12, 1.0, 0.3));
  EXPECT_DOUBLE_EQ(p.speedup, effective_speedup(p.completed, 12, 11.0, et, 0.5));
  EXPECT_DOUBLE_EQ(analytic_point(am, 11.0, 13.0).step_time, 13.0);
  // The optimum beats an independent fine scan (up to the scan's resolution).
  const AnalyticPoint best = analytic_optimal_tau(am);
  double scan = 1.0;
  for (double t = 0.01; t <= et; t += 0.001) scan = std::max(scan, analytic_point(am, t).speedup);
  EXPECT_GE(best.speedup, scan - 1e-9);
  EXPECT_GT(best.speedup, 1.05);
  EXPECT_LT(best.tau, et);
  // No variance: never drop.
  const AnalyticPoint flat = analytic_optimal_tau(
      {.workers = 256, .micro_batches = 12, .mu = 1.0, .sigma = 0.0, .serial_time = 0.5});
  EXPECT_TRUE(std::isinf(flat.tau));
  EXPECT_EQ(flat.speedup, 1.0);
  EXPECT_EQ(flat.drop_rate, 0.0);
  EXPECT_THROW(analytic_point(am, 0.0), InvalidArgument);
  EXPECT_THROW(analytic_point({.workers = 0}, 1.0), InvalidArgument);
  EXPECT_THROW(analytic_point({.workers = 4, .micro_batches = 4, .mu = 1.0, .sigma = -1.0}, 1.0),
               InvalidArgument);
}

// ------------------------------------------------------------------------------- tau* search

TEST(TauSearch, EvaluateMatchesBruteForce) {
  for (auto model : {StopModel::kPreemptive, StopModel::kMicroBatchBoundary}) {
    for (auto [n, s, m] : std::vector<std::tuple<int, int, int>>{
             {1, 1, 1}, {1, 3, 7}, {5, 1, 1}, {7, 3, 5}, {33, 4, 12}}) {
      const LatencyTrace t = random_trace(n, s, m, 11 + n * s * m, true);
      for (double tau : {0.3, 1.0, 2.7, 5.5, 13.0, 1e9}) {
        const TauEval got = evaluate_tau(t, tau, {.serial_time = 0.4, .model = model});
        const TauEval ref = reference_eval(t, tau, 0.4, model);
        EXPECT_NEAR(got.completed, ref.completed, 1e-12);
        EXPECT_NEAR(got.step_time, ref.step_time, 1e-12);
        EXPECT_NEAR(got.step_time_with_tau, ref.step_time_with_tau, 1e-12);
        EXPECT_NEAR(got.speedup, ref.speedup, 1e-12);
        EXPECT_NEAR(got.drop_rate, 1.0 - ref.completed / m, 1e-12);
      }
    }
  }
}

TEST(TauSearch, OptimumMatchesBruteForceOverAllCandidates) {
  for (auto model : {StopModel::kPreemptive, StopModel::kMicroBatchBoundary}) {
    for (auto [n, s, m] : std::vector<std::tuple<int, int, int>>{
             {1, 1, 1}, {1, 2, 6}, {3, 1, 2}, {9, 3, 5}, {64, 5, 12}}) {
      for (double tc : {0.0, 0.7}) {
        const LatencyTrace t = random_trace(n, s, m, 5 + n + s + m, true);
        const TauEval got = find_optimal_tau(t, {.serial_time = tc, .model = model});
        double best = 1.0;
        double tmax = 0.0;
        for (int64_t w = 0; w < n; ++w)
          for (int64_t st = 0; st < s; ++st) {
            double c = 0.0;
            for (int64_t k = 0; k < m; ++k) {
              c += t.at(w, st, k);
              best = std::max(best, reference_eval(t, c, tc, model).speedup);
            }
            tmax = std::max(tmax, c);
          }
        EXPECT_NEAR(got.speedup, best, 1e-9 * best) << n << " " << s << " " << m;
        EXPECT_GE(got.speedup, 1.0);
        EXPECT_LE(got.tau, tmax);
        EXPECT_NEAR(reference_eval(t, got.tau, tc, model).speedup, got.speedup, 1e-12);
      }
    }
  }
}

TEST(TauSearch, KnownAnswerWithHeavyStragglers) {
  // 16 workers, M = 10 micro-batches of 1.0; in each step two workers are 5x slower (a step of
  // 50 instead of 10), Tc = 2. Dropping at tau = 10 keeps 9 of 10 micro-batches on average:
  //   S(10) = 9 * 52 / (10 * 12) = 3.9;  S(9) = 8 * 52 / (10 * 11) = 3.78;  S(15) = 2.79.
  const int64_t N = 16, S = 4, M = 10;
  LatencyTrace t{N, S, M, std::vector<double>(N * S * M, 1.0)};
  for (int64_t s = 0; s < S; ++s)
    for (int64_t slow : {(3 * s + 1) % N, (5 * s + 7) % N})
      for (int64_t m = 0; m < M; ++m) t.latency[(slow * S + s) * M + m] = 5.0;
  const TauEval r = find_optimal_tau(t, {.serial_time = 2.0});
  EXPECT_EQ(r.tau, 10.0);
  EXPECT_DOUBLE_EQ(r.completed, 9.0);
  EXPECT_DOUBLE_EQ(r.drop_rate, 0.1);
  EXPECT_DOUBLE_EQ(r.step_time, 50.0);
  EXPECT_DOUBLE_EQ(r.speedup, 3.9);
  EXPECT_NEAR(compensation_factor(r.completed, M), 1.0 / 9.0, 1e-15);
  // A check before each micro-batch: at tau = 10 the slow workers start a third micro-batch
  // (they are at 10 <= tau) and finish it at 15, the fast ones are done at 10.
  const TauEval b =
      find_optimal_tau(t, {.serial_time = 2.0, .model = StopModel::kMicroBatchBoundary});
  const TauEval b_ref = reference_eval(t, b.tau, 2.0, StopModel::kMicroBatchBoundary);
  EXPECT_DOUBLE_EQ(b.speedup, b_ref.speedup);
  EXPECT_GT(b.speedup, 3.0);
  EXPECT_GE(b.tau, 9.0);
  EXPECT_LE(b.tau, 10.0);
}

TEST(TauSearch, NoVarianceNeverDrops) {
  for (auto model : {StopModel::kPreemptive, StopModel::kMicroBatchBoundary}) {
    for (double tc : {0.0, 1.0}) {
      for (int64_t M : {1, 2, 12, 37}) {
        LatencyTrace t{8, 3, M, std::vector<double>(8 * 3 * M, 0.37)};
        const TauEval r = find_optimal_tau(t, {.serial_time = tc, .model = model});
        double step = 0.0;
        for (int64_t m = 0; m < M; ++m) step += 0.37;
        EXPECT_GE(r.tau, step) << M;
        EXPECT_EQ(r.drop_rate, 0.0);
        EXPECT_EQ(r.speedup, 1.0);
      }
    }
  }
}

TEST(TauSearch, DeterministicAndIdenticalOnEveryRank) {
  const LatencyTrace t = random_trace(200, 6, 12, 99, true);
  // Eight "ranks", each with its own copy of the gathered trace, running concurrently.
  std::vector<TauEval> res(8);
  std::vector<std::thread> th;
  for (int r = 0; r < 8; ++r)
    th.emplace_back([&, r] {
      LatencyTrace mine = t;  // as received by rank r
      res[r] = find_optimal_tau(mine, {.serial_time = 0.3});
    });
  for (auto& x : th) x.join();
  for (int r = 1; r < 8; ++r) {
    EXPECT_EQ(std::memcmp(&res[r].tau, &res[0].tau, sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(&res[r].speedup, &res[0].speedup, sizeof(double)), 0);
  }
  EXPECT_GT(res[0].speedup, 1.0);
  EXPECT_LT(res[0].tau, evaluate_tau(t, 1e30).step_time);
}

TEST(TauSearch, BadInput) {
  LatencyTrace good = random_trace(2, 2, 3, 1, false);
  EXPECT_NO_THROW(good.validate());
  EXPECT_THROW(find_optimal_tau(LatencyTrace{}), InvalidArgument);             // empty samples
  EXPECT_THROW(find_optimal_tau(LatencyTrace{2, 2, 0, {}}), InvalidArgument);  // M < 1
  LatencyTrace short_trace = good;
  short_trace.latency.pop_back();
  EXPECT_THROW(find_optimal_tau(short_trace), InvalidArgument);
  LatencyTrace nan_trace = good;
  nan_trace.latency[7] = kNaN;  // [worker 1, step 0, micro-batch 1]
  try {
    find_optimal_tau(nan_trace);
    FAIL() << "NaN latency accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("worker 1, step 0, micro-batch 1"), std::string::npos)
        << e.what();
  }
  LatencyTrace neg = good;
  neg.latency[0] = -1.0;
  EXPECT_THROW(find_optimal_tau(neg), InvalidArgument);
  LatencyTrace inf = good;
  inf.latency[3] = kInf;
  EXPECT_THROW(evaluate_tau(inf, 1.0), InvalidArgument);
  EXPECT_THROW(evaluate_tau(good, 0.0), InvalidArgument);
  EXPECT_THROW(evaluate_tau(good, -2.0), InvalidArgument);
  EXPECT_THROW(evaluate_tau(good, kNaN), InvalidArgument);
  EXPECT_THROW(find_optimal_tau(good, {.serial_time = -1.0}), InvalidArgument);
  EXPECT_THROW(find_optimal_tau(good, {.serial_time = kNaN}), InvalidArgument);
  EXPECT_THROW(find_optimal_tau(good, {.min_gain = -1.0}), InvalidArgument);
}

// ---------------------------------------------------------------------------- controller

TEST(Controller, DropPointBeforeForward) {
  ManualClock clk;
  ThresholdController c({.tau = 3.5, .micro_batches = 10}, clk.fn());
  c.begin_step();
  int started = 0;
  while (c.proceed(DropPoint::kBeforeForward)) {
    ++started;
    clk.advance(0.4);                                            // forward
    EXPECT_TRUE(c.proceed(DropPoint::kBetweenForwardBackward));  // not the configured point
    clk.advance(0.6);                                            // backward
    c.micro_batch_done();
    EXPECT_TRUE(c.proceed(DropPoint::kAfterBackward));
  }
  // starts at elapsed 0, 1, 2, 3 (<= 3.5); not at 4
  EXPECT_EQ(started, 4);
  const auto r = c.end_step();
  EXPECT_EQ(r.completed, 4);
  EXPECT_TRUE(r.dropped);
  EXPECT_DOUBLE_EQ(r.elapsed, 4.0);
}

TEST(Controller, DropPointBetweenForwardAndBackward) {
  ManualClock clk;
  ThresholdController c(
      {.tau = 4.0, .micro_batches = 10, .drop_point = DropPoint::kBetweenForwardBackward},
      clk.fn());
  c.begin_step();
  int forwards = 0;
  for (int m = 0; m < 10 && c.proceed(DropPoint::kBeforeForward); ++m) {
    clk.advance(0.4);
    ++forwards;
    if (!c.proceed(DropPoint::kBetweenForwardBackward)) break;  // skip the backward
    clk.advance(0.6);
    c.micro_batch_done();
  }
  // after-forward checks at 0.4, 1.4, 2.4, 3.4, 4.4: the 5th backward is skipped
  EXPECT_EQ(forwards, 5);
  EXPECT_EQ(c.completed(), 4);
  EXPECT_FALSE(c.proceed(DropPoint::kBeforeForward));  // stays stopped
  EXPECT_EQ(c.end_step().completed, 4);
}

TEST(Controller, DropPointAfterBackwardKeepsTheLastMicrobatch) {
  ManualClock clk;
  ThresholdController c({.tau = 3.5, .micro_batches = 10, .drop_point = DropPoint::kAfterBackward},
                        clk.fn());
  c.begin_step();
  do {
    clk.advance(1.0);
    c.micro_batch_done();
  } while (c.proceed(DropPoint::kAfterBackward));
  EXPECT_EQ(c.completed(), 4);  // done at 1, 2, 3, 4; 4 > 3.5 stops after keeping the 4th
  c.end_step();
}

TEST(Controller, InfiniteTauRunsAllAndReadsTheClockOnlyWhenNeeded) {
  int reads = 0;
  double now = 0.0;
  ThresholdController c({.micro_batches = 5}, [&] {
    ++reads;
    return now;
  });
  c.begin_step();
  int m = 0;
  while (c.proceed(DropPoint::kBeforeForward)) {
    now += 100.0;
    c.micro_batch_done();
    ++m;
  }
  EXPECT_EQ(m, 5);
  const auto r = c.end_step();
  EXPECT_FALSE(r.dropped);
  EXPECT_EQ(reads, 2);  // begin and end only: no sync point per micro-batch
  // A finite tau reads the clock only at the configured point.
  reads = 0;
  c.set_tau(1e9);
  c.begin_step();
  for (int k = 0; k < 5; ++k) {
    ASSERT_TRUE(c.proceed(DropPoint::kBeforeForward));
    ASSERT_TRUE(c.proceed(DropPoint::kBetweenForwardBackward));
    c.micro_batch_done();
    ASSERT_TRUE(c.proceed(DropPoint::kAfterBackward) || k == 4);
  }
  c.end_step();
  EXPECT_EQ(reads, 2 + 5);
}

TEST(Controller, HistoryFeedsTheTrace) {
  ManualClock clk;
  ThresholdController c({.micro_batches = 3, .history_steps = 2}, clk.fn());
  for (int s = 0; s < 3; ++s) {
    c.begin_step();
    for (int m = 0; m < 3; ++m) {
      ASSERT_TRUE(c.proceed(DropPoint::kBeforeForward));
      clk.advance(1.0 + s + 0.25 * m);
      c.micro_batch_done();
    }
    c.end_step();
  }
  // a dropped step is not recorded (its latencies are censored)
  c.set_tau(0.5);
  c.begin_step();
  ASSERT_TRUE(c.proceed(DropPoint::kBeforeForward));
  clk.advance(1.0);
  c.micro_batch_done();
  EXPECT_FALSE(c.proceed(DropPoint::kBeforeForward));
  c.end_step();
  EXPECT_EQ(c.history_steps(), 2);
  EXPECT_EQ(c.history(), (std::vector<double>{2.0, 2.25, 2.5, 3.0, 3.25, 3.5}));
  LatencyTrace t{1, c.history_steps(), 3, c.history()};
  EXPECT_NO_THROW(t.validate());
}

TEST(Controller, MatchesTheBoundaryModelOnASimulatedTrace) {
  // Driving the controller (check before forward) with simulated latencies reproduces
  // evaluate_tau's kMicroBatchBoundary counts and step times.
  const LatencyTrace t = random_trace(24, 5, 8, 3, true);
  const double tau = 6.0;
  double done = 0.0, sum_step = 0.0;
  for (int64_t s = 0; s < t.steps; ++s) {
    double step = 0.0;
    for (int64_t n = 0; n < t.workers; ++n) {
      ManualClock clk;
      ThresholdController c({.tau = tau, .micro_batches = t.micro_batches}, clk.fn());
      c.begin_step();
      for (int64_t m = 0; c.proceed(DropPoint::kBeforeForward); ++m) {
        clk.advance(t.at(n, s, m));
        c.micro_batch_done();
      }
      const auto r = c.end_step();
      done += static_cast<double>(r.completed);
      step = std::max(step, r.elapsed);
    }
    sum_step += step;
  }
  const TauEval e = evaluate_tau(t, tau, {.model = StopModel::kMicroBatchBoundary});
  EXPECT_NEAR(e.completed, done / (t.workers * t.steps), 1e-12);
  EXPECT_NEAR(e.step_time_with_tau, sum_step / t.steps, 1e-12);
  EXPECT_GT(e.drop_rate, 0.0);
}

TEST(Controller, MonotonicClockByDefault) {
  ThresholdController c({.tau = 1e6, .micro_batches = 2});
  c.begin_step();
  const double a = c.elapsed();
  const double b = c.elapsed();
  EXPECT_GE(a, 0.0);
  EXPECT_GE(b, a);
  EXPECT_TRUE(c.proceed(DropPoint::kBeforeForward));
  c.end_step();
}

TEST(Controller, BadInputLeavesStateUnchanged) {
  EXPECT_THROW(ThresholdController({.tau = 0.0, .micro_batches = 4}), InvalidArgument);
  EXPECT_THROW(ThresholdController({.tau = -1.0, .micro_batches = 4}), InvalidArgument);
  EXPECT_THROW(ThresholdController({.tau = kNaN, .micro_batches = 4}), InvalidArgument);
  EXPECT_THROW(ThresholdController({.tau = 1.0, .micro_batches = 0}), InvalidArgument);
  EXPECT_THROW(ThresholdController({.tau = 1.0, .micro_batches = 2, .history_steps = -1}),
               InvalidArgument);
  EXPECT_THROW(ThresholdController(
                   {.tau = 1.0, .micro_batches = 2, .drop_point = static_cast<DropPoint>(7)}),
               InvalidArgument);
  ManualClock clk;
  ThresholdController c({.tau = 2.0, .micro_batches = 2}, clk.fn());
  EXPECT_THROW(c.proceed(DropPoint::kBeforeForward), InvalidArgument);  // no step open
  EXPECT_THROW(c.micro_batch_done(), InvalidArgument);
  EXPECT_THROW(c.end_step(), InvalidArgument);
  EXPECT_THROW(c.set_tau(0.0), InvalidArgument);
  EXPECT_THROW(c.set_tau(kNaN), InvalidArgument);
  EXPECT_EQ(c.tau(), 2.0);
  c.begin_step();
  EXPECT_THROW(c.begin_step(), InvalidArgument);
  c.micro_batch_done();
  c.micro_batch_done();
  EXPECT_THROW(c.micro_batch_done(), InvalidArgument);
  EXPECT_EQ(c.completed(), 2);
  EXPECT_THROW(c.proceed_elapsed(DropPoint::kBeforeForward, kNaN), InvalidArgument);
  EXPECT_TRUE(c.in_step());
}

// ------------------------------------------------------------------------------ normalisation

TEST(Normalization, ActualCountGivesTheMeanOfComputedMicrobatchGradients) {
  // Linear model y ~ w.x with loss 0.5 (w.x - y)^2: per-sample gradient (w.x - y) x.
  const int64_t N = 4, M = 6, B = 3, D = 5;
  const std::vector<int64_t> completed = {6, 2, 5, 0};  // drops differ per worker
  std::mt19937_64 rng(7);
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<double> w(D);
  for (auto& v : w) v = g(rng);
  // data[n][m][b] = (x, y)
  std::vector<double> x(N * M * B * D), y(N * M * B);
  for (auto& v : x) v = g(rng);
  for (auto& v : y) v = g(rng);
  auto sample_grad = [&](int64_t i, int64_t d) {
    double p = 0.0;
    for (int64_t k = 0; k < D; ++k) p += w[k] * x[i * D + k];
    return (p - y[i]) * x[i * D + d];
  };
  // Each worker accumulates the sum of its computed micro-batch gradients (each the mean over
  // its B samples); the allreduce sums over workers.
  std::vector<double> summed(D, 0.0);
  int64_t total = 0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m = 0; m < completed[n]; ++m) {
      for (int64_t d = 0; d < D; ++d) {
        double mb = 0.0;
        for (int64_t b = 0; b < B; ++b) mb += sample_grad((n * M + m) * B + b, d);
        summed[d] += mb / B;
      }
    }
    total += completed[n];
  }
  // Reference: the plain mean over all computed samples (= mean of the micro-batch means).
  std::vector<double> mean(D, 0.0);
  for (int64_t d = 0; d < D; ++d) {
    double acc = 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t m = 0; m < completed[n]; ++m)
        for (int64_t b = 0; b < B; ++b) acc += sample_grad((n * M + m) * B + b, d);
    mean[d] = acc / static_cast<double>(total * B);
  }
  const double sa = gradient_scale(Normalization::kActual, N, M, total);
  const double sn = gradient_scale(Normalization::kNominal, N, M, total);
  EXPECT_EQ(sa, 1.0 / 13.0);
  EXPECT_EQ(sn, 1.0 / 24.0);
  for (int64_t d = 0; d < D; ++d) {
    EXPECT_NEAR(summed[d] * sa, mean[d], 1e-14 * (1.0 + std::fabs(mean[d])));
    // nominal: shrunk by the completion rate 13/24
    EXPECT_NEAR(summed[d] * sn, mean[d] * 13.0 / 24.0, 1e-14 * (1.0 + std::fabs(mean[d])));
  }
  // DDP averages over N already: N * scale applies to the averaged gradient.
  EXPECT_DOUBLE_EQ(N * gradient_scale(Normalization::kActual, N, M, total) * (1.0 / N), sa);
}

TEST(Normalization, EdgesAndBadInput) {
  EXPECT_EQ(gradient_scale(Normalization::kActual, 4, 12, 0), 0.0);
  EXPECT_EQ(gradient_scale(Normalization::kActual, 1, 1, 1), 1.0);
  EXPECT_EQ(gradient_scale(Normalization::kNominal, 4, 12, 0), 1.0 / 48.0);
  EXPECT_EQ(gradient_scale(Normalization::kNominal, 4, 12, 48),
            gradient_scale(Normalization::kActual, 4, 12, 48));
  EXPECT_THROW(gradient_scale(Normalization::kActual, 0, 12, 0), InvalidArgument);
  EXPECT_THROW(gradient_scale(Normalization::kActual, 4, 0, 0), InvalidArgument);
  EXPECT_THROW(gradient_scale(Normalization::kActual, 4, 12, 49), InvalidArgument);
  EXPECT_THROW(gradient_scale(Normalization::kActual, 4, 12, -1), InvalidArgument);
  EXPECT_THROW(gradient_scale(static_cast<Normalization>(9), 4, 12, 3), InvalidArgument);
}

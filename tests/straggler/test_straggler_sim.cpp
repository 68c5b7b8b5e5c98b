// SPDX-License-Identifier: Apache-2.0
// The delay simulator: determinism, its moments, and the analytics (Eq. 4-6) against Monte-Carlo.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gradcomp/gradcomp.hpp"

using namespace gradcomp;
using namespace gradcomp::straggler;

namespace {

const DelayModel kNormal{.kind = DelayKind::kNormal, .mean = 1.0, .stddev = 0.3};
const DelayModel kLogNormal{.kind = DelayKind::kBoundedLogNormal,
                            .mean = 1.0,
                            .stddev = 0.05,
                            .log_mu = -2.0,
                            .log_sigma = 1.5,
                            .cap = 3.0};

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST(Simulator, DeterministicGivenTheSeed) {
  for (const DelayModel& dm : {kNormal, kLogNormal}) {
    const LatencyTrace a = simulate_latencies(dm, 8, 3, 5, 42);
    const LatencyTrace b = simulate_latencies(dm, 8, 3, 5, 42);
    EXPECT_TRUE(same_bits(a.latency, b.latency));
    const LatencyTrace c = simulate_latencies(dm, 8, 3, 5, 43);
    EXPECT_FALSE(same_bits(a.latency, c.latency));
    // worker n's latencies do not depend on how many workers there are
    const LatencyTrace d = simulate_latencies(dm, 3, 3, 5, 42);
    EXPECT_TRUE(std::equal(d.latency.begin(), d.latency.end(), a.latency.begin()));
    // nor on the number of threads
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    const LatencyTrace e = simulate_latencies(dm, 8, 3, 5, 42);
    omp_set_num_threads(saved);
    EXPECT_TRUE(same_bits(a.latency, e.latency));
    EXPECT_NO_THROW(a.validate());
  }
}

TEST(Simulator, SampleMomentsMatchTheModel) {
  for (const DelayModel& dm : {kNormal, kLogNormal}) {
    const LatencyTrace t = simulate_latencies(dm, 256, 20, 12, 1);
    const LatencyStats got = latency_stats(t);
    const LatencyStats want = latency_moments(dm);
    const double n = static_cast<double>(t.latency.size());
    EXPECT_NEAR(got.mean, want.mean, 5.0 * want.stddev / std::sqrt(n));
    EXPECT_NEAR(got.stddev, want.stddev, 0.03 * want.stddev);
  }
  // the noise is bounded by the cap
  const LatencyTrace t = simulate_latencies({.kind = DelayKind::kBoundedLogNormal,
                                             .mean = 1.0,
                                             .stddev = 0.0,
                                             .log_mu = 0.0,
                                             .log_sigma = 2.0,
                                             .cap = 0.5},
                                            16, 4, 12, 2);
  for (double v : t.latency) {
    EXPECT_GT(v, 1.0);
    EXPECT_LE(v, 1.5);
  }
  // log_sigma = 0: a constant delay exp(log_mu)
  EXPECT_NEAR(latency_moments({.kind = DelayKind::kBoundedLogNormal,
                               .mean = 1.0,
                               .stddev = 0.0,
                               .log_mu = std::log(0.25),
                               .log_sigma = 0.0,
                               .cap = 1.0})
                  .mean,
              1.25, 1e-15);
}

TEST(Simulator, ExpectedCompletedMatchesMonteCarlo) {
  // Normal micro-batch latencies: Eq. 5 is exact in expectation (sums of normals are normal).
  const int64_t N = 512, S = 20, M = 12;
  const LatencyTrace t = simulate_latencies(kNormal, N, S, M, 5);
  for (double tau : {3.0, 6.0, 10.0, 11.5, 12.0, 13.0, 15.0}) {
    const double sim = evaluate_tau(t, tau).completed;
    const double eq5 = expected_completed_microbatches(tau, M, 1.0, 0.3);
    // the count of one worker-step has a standard deviation below 1.5 here: 4 standard errors
    EXPECT_NEAR(sim, eq5, 4.0 * 1.5 / std::sqrt(static_cast<double>(N * S))) << tau;
  }
  // Bounded log-normal noise: Eq. 5 with the sample mean/variance is a CLT approximation.
  const LatencyTrace u = simulate_latencies(kLogNormal, N, S, M, 6);
  const LatencyStats st = latency_stats(u);
  for (double f : {0.7, 0.9, 1.0, 1.1, 1.3}) {
    const double tau = f * M * st.mean;
    EXPECT_NEAR(evaluate_tau(u, tau).completed,
                expected_completed_microbatches(tau, M, st.mean, st.stddev), 0.02 * M)
        << tau;
  }
}

TEST(Simulator, AnalyticSpeedupMatchesTheMeasuredOne) {
  const int64_t M = 12;
  const double tc = 1.0;
  for (int64_t n : {16, 256, 2048}) {
    const LatencyTrace t = simulate_latencies(kNormal, n, n >= 2048 ? 8 : 40, M, 100 + n);
    const LatencyStats st = latency_stats(t);
    const AnalyticModel am{n, M, st.mean, st.stddev, tc};
    const TauEval best = find_optimal_tau(t, {.serial_time = tc});
    EXPECT_GT(best.speedup, 1.0);
    for (double tau : {best.tau, 0.9 * best.tau, 11.0, 12.5}) {
      const TauEval sim = evaluate_tau(t, tau, {.serial_time = tc});
      const AnalyticPoint an = analytic_point(am, tau);
      EXPECT_NEAR(an.speedup, sim.speedup, 0.03 * sim.speedup) << "N " << n << " tau " << tau;
      EXPECT_NEAR(an.step_time, sim.step_time, 0.02 * sim.step_time) << n;
      // given the measured E[T], only Eq. 5 is approximated
      const AnalyticPoint given = analytic_point(am, tau, sim.step_time);
      EXPECT_NEAR(given.speedup, sim.speedup, 0.02 * sim.speedup) << n;
    }
  }
}

TEST(Simulator, ScaleCurveShape) {
  const std::vector<int64_t> ns = {1, 8, 64, 512, 2048};
  for (const DelayModel& dm : {kNormal, kLogNormal}) {
    const bool normal = dm.kind == DelayKind::kNormal;
    const auto pts = scale_curve(dm, ns, 6, 12, 9, {.serial_time = 0.5});
    ASSERT_EQ(pts.size(), ns.size());
    for (size_t i = 0; i < pts.size(); ++i) {
      const ScalePoint& p = pts[i];
      EXPECT_EQ(p.workers, ns[i]);
      EXPECT_EQ(p.linear, static_cast<double>(ns[i]));
      EXPECT_LE(p.baseline, p.linear * 1.05);
      EXPECT_GE(p.dropcompute, p.baseline * (1.0 - 1e-12));  // tau* never loses on its trace
      EXPECT_GE(p.dropcompute_analytic, p.baseline_analytic * (1.0 - 1e-12));
      EXPECT_NEAR(p.dropcompute / p.baseline, p.simulated.speedup, 1e-12);
      if (p.workers >= 64) {
        if (normal) {
          // Eq. 4 holds for normal step times
          EXPECT_NEAR(p.baseline_analytic, p.baseline, 0.03 * p.baseline) << p.workers;
        } else {
          // a right-skewed step time has a longer max than Eq. 4's normal one (paper Fig. 3b)
          EXPECT_GT(p.baseline_analytic, p.baseline) << p.workers;
          EXPECT_GT(p.simulated.speedup, 1.02) << p.workers;
        }
      }
    }
    // the loss to stragglers grows with N: baseline efficiency falls
    EXPECT_LT(pts.back().baseline / pts.back().linear, pts[1].baseline / pts[1].linear);
  }
}

TEST(Simulator, TauCurve) {
  const LatencyTrace t = simulate_latencies(kLogNormal, 64, 10, 12, 3);
  const auto c = tau_curve(t, 8.0, 20.0, 25, {.serial_time = 0.5});
  ASSERT_EQ(c.size(), 25u);
  EXPECT_EQ(c.front().simulated.tau, 8.0);
  EXPECT_EQ(c.back().simulated.tau, 20.0);
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(c[i].analytic.tau, c[i].simulated.tau);
    EXPECT_EQ(c[i].analytic_given_t.step_time, c[0].simulated.step_time);
    if (i > 0) EXPECT_GE(c[i].simulated.completion_rate, c[i - 1].simulated.completion_rate);
  }
  EXPECT_THROW(tau_curve(t, 0.0, 1.0, 5), InvalidArgument);
  EXPECT_THROW(tau_curve(t, 2.0, 1.0, 5), InvalidArgument);
  EXPECT_THROW(tau_curve(t, 1.0, 2.0, 0), InvalidArgument);
}

TEST(Simulator, BadInput) {
  EXPECT_THROW(simulate_latencies(kNormal, 0, 1, 1, 0), InvalidArgument);
  EXPECT_THROW(simulate_latencies(kNormal, 1, 0, 1, 0), InvalidArgument);
  EXPECT_THROW(simulate_latencies(kNormal, 1, 1, 0, 0), InvalidArgument);
  EXPECT_THROW(simulate_latencies({.mean = -1.0}, 1, 1, 1, 0), InvalidArgument);
  EXPECT_THROW(simulate_latencies({.stddev = std::nan("")}, 1, 1, 1, 0), InvalidArgument);
  EXPECT_THROW(
      simulate_latencies({.kind = DelayKind::kBoundedLogNormal, .log_sigma = -1.0}, 1, 1, 1, 0),
      InvalidArgument);
  EXPECT_THROW(simulate_latencies({.kind = static_cast<DelayKind>(5)}, 1, 1, 1, 0),
               InvalidArgument);
  EXPECT_THROW(scale_curve(kNormal, {}, 1, 1, 0), InvalidArgument);
  EXPECT_THROW(scale_curve(kNormal, {4, 0}, 1, 1, 0), InvalidArgument);
}

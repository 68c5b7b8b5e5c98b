// SPDX-License-Identifier: Apache-2.0
// The Quadratic Synchronization Rule: the period formula and the averaging schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "gradcomp/gradcomp.hpp"

using namespace gradcomp;
using namespace gradcomp::straggler;

TEST(Qsr, PeriodFromThePaper) {
  EXPECT_EQ(qsr_period(0.008, 0.0175, 4), 4);    // (2.1875)^2 = 4.79 -> 4
  EXPECT_EQ(qsr_period(0.001, 0.0175, 4), 306);  // 17.5^2 = 306.25 -> 306
  EXPECT_EQ(qsr_period(0.005, 0.0175, 4), 12);   // 3.5^2 = 12.25
  EXPECT_EQ(qsr_period(0.1, 0.0175, 4), 4);      // large lr: h_base
  EXPECT_EQ(qsr_period(0.001, 0.0, 7), 7);       // alpha = 0: constant period
  EXPECT_EQ(qsr_period(0.5, 1.0, 1), 4);         // exactly representable: (1/0.5)^2 = 4
  // An independent evaluation over a range of learning rates.
  for (double lr = 1e-5; lr < 1.0; lr *= 1.37) {
    const double r = 0.03 / lr;
    const auto expect = std::max<int64_t>(2, static_cast<int64_t>(std::floor(r * r)));
    EXPECT_EQ(qsr_period(lr, 0.03, 2), expect) << lr;
  }
  // Absurdly small lr: no overflow.
  EXPECT_GT(qsr_period(1e-300, 1.0, 4), int64_t{1} << 40);
}

TEST(Qsr, BadInput) {
  EXPECT_THROW(qsr_period(0.0, 0.0175, 4), InvalidArgument);
  EXPECT_THROW(qsr_period(-0.1, 0.0175, 4), InvalidArgument);
  EXPECT_THROW(qsr_period(std::nan(""), 0.0175, 4), InvalidArgument);
  EXPECT_THROW(qsr_period(0.1, -1.0, 4), InvalidArgument);
  EXPECT_THROW(qsr_period(0.1, 0.0175, 0), InvalidArgument);
  EXPECT_THROW(QsrScheduler({.alpha = 0.1, .h_base = 0, .total_steps = 10}, 0.1), InvalidArgument);
  EXPECT_THROW(QsrScheduler({.alpha = 0.1, .h_base = 2, .total_steps = 0}, 0.1), InvalidArgument);
  EXPECT_THROW(QsrScheduler({.alpha = 0.1, .h_base = 2, .total_steps = 10}, 0.0), InvalidArgument);
  QsrScheduler q({.alpha = 0.0175, .h_base = 4, .total_steps = 100}, 0.008);
  EXPECT_EQ(q.next_sync(), 4);
  EXPECT_THROW(q.on_average(3, -1.0), InvalidArgument);
  EXPECT_THROW(q.on_average(100, 0.01), InvalidArgument);
  EXPECT_THROW(q.after_step(0, 0.01), InvalidArgument);
  EXPECT_THROW(q.after_step(101, 0.01), InvalidArgument);
  EXPECT_EQ(q.next_sync(), 4);  // unchanged by the rejected calls
  EXPECT_EQ(q.period(), 4);
  EXPECT_THROW(q.after_step(5, 0.01), InvalidArgument);  // skipped the averaging at 4
}

namespace {

// Linear warm-up then cosine decay to zero at `total`.
double lr_at(int64_t s, int64_t warmup, int64_t total, double peak) {
  if (s < warmup) return peak * static_cast<double>(s + 1) / static_cast<double>(warmup);
  const double p = static_cast<double>(s - warmup) / static_cast<double>(total - warmup);
  return 0.5 * peak * (1.0 + std::cos(M_PI * p)) + 1e-7;
}

}  // namespace

TEST(Qsr, AveragesExactlyAtTheScheduledStepsOverACosineSchedule) {
  const int64_t total = 3000, warmup = 200;
  const double peak = 0.01, alpha = 0.0175;
  const int64_t h_base = 4;
  // Reference schedule, written from the rule directly.
  std::vector<int64_t> expect;
  {
    int64_t t = 0;
    while (t < total) {
      const double lr = lr_at(t, warmup, total, peak);
      int64_t h = t < warmup
                      ? h_base
                      : std::max<int64_t>(
                            h_base, static_cast<int64_t>(std::floor((alpha / lr) * (alpha / lr))));
      h = std::min(h, total - t);
      t += h;
      expect.push_back(t);
    }
  }
  QsrScheduler q({.alpha = alpha, .h_base = h_base, .total_steps = total, .warmup_steps = warmup},
                 lr_at(0, warmup, total, peak));
  std::vector<int64_t> got;
  for (int64_t s = 0; s < total; ++s) {
    if (q.after_step(s + 1, lr_at(s + 1, warmup, total, peak))) got.push_back(s + 1);
  }
  EXPECT_EQ(got, expect);
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.back(), total);  // the last period is capped: the run ends averaged
  // During warm-up the period is h_base.
  for (size_t i = 0; i < got.size() && got[i] <= warmup; ++i)
    EXPECT_EQ(got[i], static_cast<int64_t>(i + 1) * h_base);
  // The period grows as the lr decays: far fewer averagings than steps / h_base.
  EXPECT_LT(got.size(), static_cast<size_t>(total / h_base * 6 / 10));
  // Gaps never shrink after warm-up until the cap (lr decreases monotonically).
  for (size_t i = 2; i + 1 < got.size(); ++i)
    if (got[i - 1] > warmup) EXPECT_GE(got[i] - got[i - 1], got[i - 1] - got[i - 2]) << i;
}

TEST(Qsr, CapAndWarmupBoundary) {
  QsrScheduler q({.alpha = 0.0175, .h_base = 4, .total_steps = 50, .warmup_steps = 10}, 0.001);
  EXPECT_EQ(q.next_sync(), 4);             // warm-up: h_base even though lr is small
  EXPECT_EQ(q.on_average(9, 0.001), 13);   // still warm-up at step 9
  EXPECT_EQ(q.on_average(10, 0.001), 50);  // 306 capped by the 40 remaining steps
  EXPECT_EQ(q.period(), 306);
  EXPECT_TRUE(q.after_step(50, 0.0));  // the end: averaging, no next period (lr ignored)
}

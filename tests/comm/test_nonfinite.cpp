// SPDX-License-Identifier: Apache-2.0
// A step in which some rank's bucket holds NaN or Inf (a loss-scaler overflow): every stateful
// plan built by make_plan skips it on every rank (average NaN everywhere, no exception, state
// bitwise as before) or, with on_nonfinite = "raise", throws on every rank. The strongest check:
// a run with such a step ends bitwise equal, in outputs and state, to a twin run in which that
// step never happened. Every family and its variants, P = 1..3 ranks, sizes 0, 1, odd and large,
// fp32 / fp16 / bf16 gradients, the bad value on the first, a middle and the last rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/powersgd.hpp"
#include "plan_variant.hpp"
#include "plans/powersgd_plan.hpp"
#include "test_util.hpp"

namespace gc = gradcomp;

namespace {

using Variant = gc::test::PlanVariant;
using gc::test::describe;

// Each family with the options that change which buffers carry the signal or the state.
std::vector<Variant> variants() {
  using S = std::string;
  return {
      {"topk", {{"ratio", 0.05}, {"route", S("sparse")}, {"exchange", S("bound")}}},
      {"topk", {{"ratio", 0.05}, {"route", S("sparse")}, {"exchange", S("sizes")}}},
      {"topk", {{"ratio", 0.05}, {"route", S("dense")}, {"momentum", 0.9}}},
      {"topk", {{"ratio", 0.05}, {"momentum", 0.9}, {"value_dtype", S("float16")}}},
      // inside a warm-up (k changes every step, so the collectives are sized from the agreed
      // step): a skipped step must leave that agreement where it was
      {"topk",
       {{"ratio", 0.05},
        {"exchange", S("bound")},
        {"warmup_ratios", std::vector<double>{0.3, 0.2, 0.1}},
        {"warmup_steps", int64_t{1}}}},
      {"topk",
       {{"ratio", 0.05},
        {"route", S("dense")},
        {"warmup_ratios", std::vector<double>{0.3, 0.2, 0.1}},
        {"warmup_steps", int64_t{1}}}},
      {"randomk",
       {{"ratio", 0.1},
        {"dense_below", int64_t{0}},
        {"warmup_ratios", std::vector<double>{0.3, 0.2}},
        {"warmup_steps", int64_t{1}}}},
      {"randomk", {{"ratio", 0.1}, {"dense_below", int64_t{0}}}},
      {"randomk", {{"ratio", 0.1}, {"momentum", 0.9}, {"dense_below", int64_t{0}}}},
      {"randomk", {{"ratio", 0.1}, {"value_dtype", S("bfloat16")}, {"dense_below", int64_t{0}}}},
      {"onebit", {}},
      {"onebit", {{"momentum", 0.9}}},
      {"onebit", {{"rotate", false}, {"scaling", S("sign_l1")}}},
      {"onebit", {{"rotate", false}, {"block_size", int64_t{0}}, {"error_feedback", false}}},
      {"powersgd", {{"rank", int64_t{2}}}},
      {"powersgd", {{"rank", int64_t{1}}, {"warm_start", false}}},
  };
}

// The bucket's tensor shapes for n elements: a matrix and a vector when n allows (PowerSGD then
// compresses one tensor and packs the other).
std::vector<std::vector<int64_t>> shapes_for(int64_t n) {
  if (n >= 40 && n % 8 == 0) return {{8, (n - 8) / 8}, {8}};
  return {{n}};
}

// One rank's gradient at a step, as bytes of `dt` (deterministic).
std::vector<uint8_t> gradient(int64_t n, gc::DType dt, int rank, int step) {
  const std::vector<float> f = gc::test::normal(n, 1000 * step + 17 * rank + 3);
  std::vector<uint8_t> b(static_cast<size_t>(n) * gc::dtype_size(dt));
  for (int64_t i = 0; i < n; ++i) {
    if (dt == gc::DType::kFloat32) {
      std::memcpy(b.data() + 4 * i, &f[i], 4);
    } else {
      const uint16_t h =
          dt == gc::DType::kFloat16 ? gc::float_to_half(f[i]) : gc::float_to_bf16(f[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

// Puts a NaN or an Inf (by `kind`) at element i of a gradient of dtype dt.
void poison(std::vector<uint8_t>& b, gc::DType dt, int64_t i, int kind) {
  const float v =
      kind == 0 ? std::numeric_limits<float>::quiet_NaN() : (kind == 1 ? INFINITY : -INFINITY);
  if (dt == gc::DType::kFloat32) {
    std::memcpy(b.data() + 4 * i, &v, 4);
  } else {
    const uint16_t h = dt == gc::DType::kFloat16 ? gc::float_to_half(v) : gc::float_to_bf16(v);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
}

bool all_nan(const std::vector<uint8_t>& b, gc::DType dt) {
  const size_t es = gc::dtype_size(dt), n = b.size() / es;
  for (size_t i = 0; i < n; ++i) {
    float x;
    if (dt == gc::DType::kFloat32) {
      std::memcpy(&x, b.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      x = dt == gc::DType::kFloat16 ? gc::half_to_float(h) : gc::bf16_to_float(h);
    }
    if (!std::isnan(x)) return false;
  }
  return true;
}

struct Ranks {
  std::vector<std::unique_ptr<gc::BucketPlan>> plans;
  Ranks(const Variant& v, int P, int64_t n, gc::DType dt, gc::OnNonFinite policy) {
    for (int r = 0; r < P; ++r) {
      gc::PlanOptions o = v.options;
      o["on_nonfinite"] = std::string(policy == gc::OnNonFinite::kSkip ? "skip" : "raise");
      plans.push_back(
          gc::make_plan(v.family, gc::test::rank_bucket(n, dt, P, r, shapes_for(n)), o));
    }
  }
  // One step over the given gradients (averaged in place).
  void step(std::vector<std::vector<uint8_t>>& g, gc::DType dt) {
    std::vector<gc::Plan*> raw;
    for (size_t r = 0; r < plans.size(); ++r) {
      const int64_t n = plans[r]->numel();
      plans[r]->begin(gc::TensorView(g[r].data(), {n}, dt, gc::Device::kCPU));
      raw.push_back(plans[r].get());
    }
    gc::run_plans_in_process(raw);
  }
  std::vector<std::vector<uint8_t>> states() const {
    std::vector<std::vector<uint8_t>> s;
    for (const auto& p : plans) s.push_back(p->state_dict());
    return s;
  }
};

}  // namespace

TEST(NonFinite, SkippedStepLeavesEveryPlanAsIfItNeverHappened) {
  const int steps = 5, bad_step = 2;
  int checked = 0;
  for (const Variant& v : variants())
    for (int P : {1, 2, 3})
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{20008}})
        for (gc::DType dt : {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16}) {
          if (n == 20008 && (P == 2 || dt == gc::DType::kBFloat16)) continue;  // (time)
          const int bad_rank = (n + P) % P;  // first, middle or last rank across cases
          const int64_t bad_index = n > 0 ? (n * 7 / 11) : 0;
          const int kind = static_cast<int>(n % 3);
          SCOPED_TRACE(describe(v) + " P=" + std::to_string(P) + " n=" + std::to_string(n) +
                       " dtype " + gc::dtype_name(dt) + " bad rank " + std::to_string(bad_rank));
          Ranks with(v, P, n, dt, gc::OnNonFinite::kSkip);
          Ranks twin(v, P, n, dt, gc::OnNonFinite::kSkip);
          for (int s = 0; s < steps; ++s) {
            std::vector<std::vector<uint8_t>> g, h;
            for (int r = 0; r < P; ++r) g.push_back(gradient(n, dt, r, s));
            h = g;
            if (s == bad_step && n > 0) {
              poison(g[bad_rank], dt, bad_index, kind);
              const auto before = with.states();
              with.step(g, dt);
              for (int r = 0; r < P; ++r) {
                ASSERT_TRUE(with.plans[r]->skipped()) << "rank " << r;
                ASSERT_TRUE(all_nan(g[r], dt)) << "rank " << r << ": the average is not NaN";
              }
              ASSERT_EQ(with.states(), before) << "a skipped step changed a state";
              continue;  // the twin never sees this step
            }
            with.step(g, dt);
            twin.step(h, dt);
            for (int r = 0; r < P; ++r) {
              ASSERT_FALSE(with.plans[r]->skipped());
              ASSERT_EQ(g[r], h[r]) << "step " << s << " rank " << r << ": outputs differ";
            }
          }
          ASSERT_EQ(with.states(), twin.states());
          if (n > 0) {
            for (const auto& p : with.plans) EXPECT_EQ(p->skipped_steps(), 1);
            ++checked;
          }
        }
  EXPECT_GT(checked, 300);
}

TEST(NonFinite, RaisePolicyThrowsOnEveryRankAndChangesNothing) {
  for (const Variant& v : variants()) {
    const int P = 3;
    const int64_t n = 1000;
    const gc::DType dt = gc::DType::kFloat32;
    SCOPED_TRACE(describe(v));
    Ranks ranks(v, P, n, dt, gc::OnNonFinite::kRaise);
    std::vector<std::vector<uint8_t>> g;
    for (int r = 0; r < P; ++r) g.push_back(gradient(n, dt, r, 0));
    ranks.step(g, dt);
    const auto before = ranks.states();
    g.clear();
    for (int r = 0; r < P; ++r) g.push_back(gradient(n, dt, r, 1));
    poison(g[1], dt, 321, 1);
    // every rank's step ends in InvalidArgument (run_plans_in_process runs each rank's last
    // phase before rethrowing the first): the bad rank names the index, the others say "another"
    std::vector<gc::Plan*> raw;
    for (int r = 0; r < P; ++r) {
      ranks.plans[r]->begin(gc::TensorView(g[r].data(), {n}, dt, gc::Device::kCPU));
      raw.push_back(ranks.plans[r].get());
    }
    try {
      gc::run_plans_in_process(raw);
      ADD_FAILURE() << "no exception";
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("another rank"), std::string::npos) << e.what();
    }
    for (int r = 0; r < P; ++r) EXPECT_TRUE(ranks.plans[r]->skipped()) << r;
    EXPECT_EQ(ranks.states(), before);
    // the bad rank's own message names the index
    Ranks solo(v, 1, n, dt, gc::OnNonFinite::kRaise);
    std::vector<std::vector<uint8_t>> one{gradient(n, dt, 0, 0)};
    poison(one[0], dt, 321, 0);
    try {
      solo.step(one, dt);
      ADD_FAILURE() << "no exception";
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("321"), std::string::npos) << e.what();
    }
    // and the plans go on afterwards
    g.clear();
    for (int r = 0; r < P; ++r) g.push_back(gradient(n, dt, r, 2));
    EXPECT_NO_THROW(ranks.step(g, dt));
    for (int r = 0; r < P; ++r) EXPECT_FALSE(ranks.plans[r]->skipped());
  }
}

TEST(NonFinite, OptionIsCheckedAndRefusedByTheCodecs) {
  gc::BucketSpec b;
  b.numel = 16;
  for (const char* f : {"topk", "randomk", "onebit", "powersgd"}) {
    EXPECT_EQ(std::get<std::string>(gc::plan_defaults(f).at("on_nonfinite")), "skip") << f;
    EXPECT_THROW(gc::make_plan(f, b, {{"on_nonfinite", std::string("ignore")}}),
                 gc::InvalidArgument)
        << f;
    EXPECT_THROW(gc::make_plan(f, b, {{"on_nonfinite", true}}), gc::InvalidArgument) << f;
    auto p = gc::make_plan(f, b, {{"on_nonfinite", std::string("raise")}});
    EXPECT_EQ(p->on_nonfinite(), gc::OnNonFinite::kRaise);
  }
  // stateless plans have nothing to protect and take no such option
  EXPECT_THROW(gc::make_plan("allreduce", b, {{"on_nonfinite", std::string("skip")}}),
               gc::InvalidArgument);
  EXPECT_THROW(gc::topk_config({{"on_nonfinite", std::string("skip")}}), gc::InvalidArgument);
}

// A training step over two buckets in which only the second holds a NaN/Inf on one rank: the
// first bucket's plans keep their step, the second's skip it, and settle_step() takes the first
// bucket's step back, so that both buckets end bitwise as in a twin run without that step (the
// optimizer skips the whole step, as a GradScaler does when any gradient is non-finite).
TEST(NonFinite, SettleStepTakesBackTheBucketsThatWereKept) {
  const int steps = 5, bad_step = 2;
  int checked = 0;
  for (const Variant& v : variants())
    for (int P : {1, 2, 3})
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}})
        for (gc::DType dt : {gc::DType::kFloat32, gc::DType::kFloat16}) {
          const int64_t n2 = n + 5;
          const int bad_rank = static_cast<int>(n % P);
          SCOPED_TRACE(describe(v) + " P=" + std::to_string(P) + " n=" + std::to_string(n) +
                       " dtype " + gc::dtype_name(dt));
          Ranks a(v, P, n, dt, gc::OnNonFinite::kSkip), b(v, P, n2, dt, gc::OnNonFinite::kSkip);
          Ranks ta(v, P, n, dt, gc::OnNonFinite::kSkip), tb(v, P, n2, dt, gc::OnNonFinite::kSkip);
          for (int s = 0; s < steps; ++s) {
            std::vector<std::vector<uint8_t>> ga, gb;
            for (int r = 0; r < P; ++r) {
              ga.push_back(gradient(n, dt, r, s));
              gb.push_back(gradient(n2, dt, r + 7, s));
            }
            auto ha = ga, hb = gb;
            if (s == bad_step) {
              poison(gb[bad_rank], dt, n2 / 2, static_cast<int>(n % 3));
              const auto before = a.states();
              a.step(ga, dt);
              b.step(gb, dt);
              for (int r = 0; r < P; ++r) {
                ASSERT_FALSE(a.plans[r]->skipped());
                ASSERT_TRUE(b.plans[r]->skipped());
                ASSERT_TRUE(a.plans[r]->can_undo());
              }
              ASSERT_NE(a.states(), before) << "the kept bucket did not step";
              for (int r = 0; r < P; ++r)  // each rank settles its own buckets
                ASSERT_TRUE(gc::settle_step({a.plans[r].get(), b.plans[r].get()}));
              ASSERT_EQ(a.states(), before) << "settle_step did not take the kept step back";
              for (int r = 0; r < P; ++r) {
                ASSERT_FALSE(a.plans[r]->can_undo());
                ASSERT_THROW(a.plans[r]->undo_step(), gc::InvalidArgument);  // once only
                ASSERT_THROW(b.plans[r]->undo_step(), gc::InvalidArgument);  // nothing kept
              }
              continue;
            }
            a.step(ga, dt);
            b.step(gb, dt);
            ta.step(ha, dt);
            tb.step(hb, dt);
            for (int r = 0; r < P; ++r) {
              ASSERT_FALSE(gc::settle_step({a.plans[r].get(), b.plans[r].get()}));
              ASSERT_EQ(ga[r], ha[r]) << "step " << s << " rank " << r;
              ASSERT_EQ(gb[r], hb[r]) << "step " << s << " rank " << r;
            }
          }
          ASSERT_EQ(a.states(), ta.states());
          ASSERT_EQ(b.states(), tb.states());
          ++checked;
        }
  EXPECT_GT(checked, 200);
}

TEST(NonFinite, UndoStepIsRefusedWhereItCannotBeExact) {
  gc::BucketSpec b;
  b.numel = 64;
  std::vector<float> g = gc::test::normal(64, 5);
  for (const char* f : {"topk", "randomk", "onebit", "powersgd"}) {
    SCOPED_TRACE(f);
    // check_finite off: no copy of the state before the step is kept
    auto off = gc::make_plan(f, b, {{"check_finite", false}});
    auto on = gc::make_plan(f, b, {});
    for (auto* p : {off.get(), on.get()}) {
      std::vector<float> x = g;
      p->begin(gc::TensorView(x.data(), {64}, gc::DType::kFloat32, gc::Device::kCPU));
      gc::run_plans_in_process({p});
    }
    EXPECT_FALSE(off->can_undo());
    EXPECT_THROW(off->undo_step(), gc::InvalidArgument);
    ASSERT_TRUE(on->can_undo());
    // a bucket of the same step skipped: settle_step refuses before changing anything
    gc::BucketSpec nb = b;
    auto bad = gc::make_plan(f, nb, {});
    std::vector<float> y = g;
    y[3] = NAN;
    bad->begin(gc::TensorView(y.data(), {64}, gc::DType::kFloat32, gc::Device::kCPU));
    gc::run_plans_in_process({bad.get()});
    ASSERT_TRUE(bad->skipped());
    const auto on_state = on->state_dict();
    EXPECT_THROW(gc::settle_step({on.get(), off.get(), bad.get()}), gc::InvalidArgument);
    EXPECT_TRUE(on->can_undo());
    EXPECT_EQ(on->state_dict(), on_state);
    // a load_state_dict() or a begin() since the step ends the chance to undo it
    on->load_state_dict(on_state.data(), on_state.size());
    EXPECT_FALSE(on->can_undo());
    EXPECT_THROW(on->undo_step(), gc::InvalidArgument);
    EXPECT_THROW(gc::settle_step({on.get(), nullptr}), gc::InvalidArgument);
  }
  {  // PowerSGD: the state loaded directly since the step (same step count): refused
    gc::BucketSpec pb = b;
    pb.shapes = {{8, 8}};
    auto p = gc::make_plan("powersgd", pb, {{"rank", int64_t{1}}});
    std::vector<float> x = g;
    p->begin(gc::TensorView(x.data(), {64}, gc::DType::kFloat32, gc::Device::kCPU));
    gc::run_plans_in_process({p.get()});
    ASSERT_TRUE(p->can_undo());
    auto* ps = dynamic_cast<gc::PowerSGDPlan*>(p.get());
    ASSERT_NE(ps, nullptr);
    const auto st = ps->state().state_dict();
    ps->state().load_state_dict(st.data(), st.size());
    EXPECT_THROW(p->undo_step(), gc::InvalidArgument);
  }
  // a stateless plan has nothing to take back
  auto plain = gc::make_plan("allreduce", b, {});
  std::vector<float> x = g;
  plain->begin(gc::TensorView(x.data(), {64}, gc::DType::kFloat32, gc::Device::kCPU));
  gc::run_plans_in_process({plain.get()});
  EXPECT_NO_THROW(plain->undo_step());
}

// Finite gradients whose compressed state would overflow fp32 (1-bit's momentum sum, PowerSGD's
// P summed over ranks) skip the step on every rank instead of poisoning the state.
TEST(NonFinite, StateThatWouldOverflowSkipsTheStep) {
  const int P = 3;
  const int64_t n = 1000;
  for (const Variant& v :
       {Variant{"onebit", {{"momentum", 0.9}}}, Variant{"powersgd", {{"rank", int64_t{2}}}}}) {
    SCOPED_TRACE(describe(v));
    Ranks ranks(v, P, n, gc::DType::kFloat32, gc::OnNonFinite::kSkip);
    int skipped = 0;
    for (int s = 0; s < 4; ++s) {
      std::vector<std::vector<uint8_t>> g;
      for (int r = 0; r < P; ++r) {
        std::vector<float> f(static_cast<size_t>(n), 3.0e38f);  // finite, near FLT_MAX
        std::vector<uint8_t> bytes(4 * n);
        std::memcpy(bytes.data(), f.data(), bytes.size());
        g.push_back(bytes);
      }
      const auto before = ranks.states();
      ranks.step(g, gc::DType::kFloat32);
      const bool sk = ranks.plans[0]->skipped();
      for (int r = 0; r < P; ++r) ASSERT_EQ(ranks.plans[r]->skipped(), sk) << "rank " << r;
      if (sk) {
        ++skipped;
        ASSERT_EQ(ranks.states(), before);
        for (int r = 0; r < P; ++r) ASSERT_TRUE(all_nan(g[r], gc::DType::kFloat32));
      } else {
        for (int r = 0; r < P; ++r) {
          float x;
          for (int64_t i = 0; i < n; ++i) {
            std::memcpy(&x, g[r].data() + 4 * i, 4);
            ASSERT_TRUE(std::isfinite(x)) << "rank " << r << " index " << i;
          }
        }
      }
    }
    EXPECT_GT(skipped, 0) << "nothing overflowed: the test does not test";
    const auto states = ranks.states();  // every state reloads (it holds no NaN/Inf)
    Ranks fresh(v, P, n, gc::DType::kFloat32, gc::OnNonFinite::kSkip);
    for (int r = 0; r < P; ++r)
      EXPECT_NO_THROW(fresh.plans[r]->load_state_dict(states[r].data(), states[r].size()));
  }
}

// Top-k averages by summing over ranks values each scaled by 1/P: the exact average of finite
// values is finite, but at the top of fp32's range the rounded sum passes FLT_MAX (ten ranks each
// sending FLT_MAX: ten times FLT_MAX * 0.1f is Inf) at whichever element every rank sends there.
// On either route that is an overflow step on every rank wherever the element lies (the first, a
// middle, the last): average NaN, state as before, and the plans go on.
TEST(NonFinite, TopKSumThatOverflowsAnywhereIsAnOverflowStep) {
  using S = std::string;
  const int P = 10;
  const int64_t n = 200;
  const gc::DType dt = gc::DType::kFloat32;
  // (coded values, value_bits: the sparse route reads a bound from the blocks' scales instead of
  // the values' sums of squares)
  for (const int64_t bits : {int64_t{0}, int64_t{2}})
    for (const char* route : {"dense", "sparse"})
      for (int64_t at : {int64_t{0}, int64_t{77}, n - 1}) {
        const Variant v{"topk", {{"ratio", 0.05}, {"route", S(route)}, {"value_bits", bits}}};
        SCOPED_TRACE(describe(v) + " element " + std::to_string(at));
        Ranks ranks(v, P, n, dt, gc::OnNonFinite::kSkip);
        auto grads = [&](int step) {
          std::vector<std::vector<uint8_t>> g;
          for (int r = 0; r < P; ++r) g.push_back(gradient(n, dt, r, step));
          return g;
        };
        auto g = grads(0);
        ranks.step(g, dt);
        const auto before = ranks.states();
        g = grads(1);
        const float big = std::numeric_limits<float>::max();
        for (auto& b : g) std::memcpy(b.data() + 4 * at, &big, 4);
        ranks.step(g, dt);
        for (int r = 0; r < P; ++r) {
          ASSERT_TRUE(ranks.plans[r]->skipped()) << "rank " << r;
          ASSERT_TRUE(all_nan(g[r], dt)) << "rank " << r << ": the average is not NaN";
        }
        ASSERT_EQ(ranks.states(), before) << "a skipped step changed a state";
        g = grads(2);
        ranks.step(g, dt);
        for (int r = 0; r < P; ++r) {
          ASSERT_FALSE(ranks.plans[r]->skipped()) << "rank " << r;
          for (int64_t i = 0; i < n; ++i) {
            float x;
            std::memcpy(&x, g[r].data() + 4 * i, 4);
            ASSERT_TRUE(std::isfinite(x)) << "rank " << r << " index " << i;
          }
        }
      }
}

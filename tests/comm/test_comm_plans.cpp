// SPDX-License-Identifier: Apache-2.0
// The comm plans and kernels in one process: every plan run for P = 1..4 simulated ranks by
// run_plans_in_process and compared bitwise with an independent scalar reference; the
// rank-ordered reduction and cast kernels against scalar loops; the cost model's choice; bad
// input rejected before any state changes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <vector>

#include "comm_reference.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/runtime.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/reduce_kernels.hpp"
#include "kernels/reduce_math.h"
#include "plans/cast_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gc = gradcomp;
using gc::test::rank_input;

namespace {

template <class MakePlan, class Reference>
void check_plan(int P, int64_t n, int steps, MakePlan make, Reference&& ref) {
  std::vector<std::unique_ptr<gc::GradientPlan>> plans;
  for (int r = 0; r < P; ++r) plans.push_back(make(r));
  std::vector<gc::Plan*> raw;
  for (auto& p : plans) raw.push_back(p.get());
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> in, work;
    for (int r = 0; r < P; ++r) in.push_back(rank_input(n, r, s));
    work = in;
    for (int r = 0; r < P; ++r) plans[r]->begin(gc::TensorView::cpu(work[r].data(), n));
    gc::run_plans_in_process(raw);
    const std::vector<float> want = ref(in);
    for (int r = 0; r < P; ++r) {
      ASSERT_TRUE(gc::test::same_bits(want, work[r].data()))
          << plans[0]->name() << " P=" << P << " n=" << n << " step " << s << " rank " << r
          << " first differs at " << gc::test::first_diff(want, work[r].data());
    }
  }
}

const int64_t kSizes[] = {0, 1, 7, 1000, 65537};

}  // namespace

TEST(CommKernels, ReduceBlocksMatchesScalarLoop) {
  for (int64_t n : kSizes) {
    for (size_t P : {1, 2, 3, 4}) {
      std::vector<float> blocks;
      for (size_t r = 0; r < P; ++r) {
        auto v = gc::test::normal(n, 5 + r);
        blocks.insert(blocks.end(), v.begin(), v.end());
      }
      std::vector<float> out(static_cast<size_t>(n)), want(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        float a = blocks[i];
        for (size_t r = 1; r < P; ++r) a += blocks[r * n + i];
        want[i] = a;
      }
      gc::kernels::cpu::reduce_blocks(blocks.data(), P, n, n, gc::ElemType::kF32, out.data());
      EXPECT_TRUE(gc::test::same_bits(want, out.data())) << "n=" << n << " P=" << P;
      // fp16: rounding after every addition
      std::vector<uint16_t> h(blocks.size()), ho(static_cast<size_t>(n));
      for (size_t i = 0; i < h.size(); ++i) h[i] = gc::float_to_half(blocks[i]);
      gc::kernels::cpu::reduce_blocks(h.data(), P, n, n, gc::ElemType::kF16, ho.data());
      for (int64_t i = 0; i < n; ++i) {
        uint16_t a = h[i];
        for (size_t r = 1; r < P; ++r)
          a = gc::float_to_half(gc::half_to_float(a) + gc::half_to_float(h[r * n + i]));
        ASSERT_EQ(a, ho[i]) << "fp16 n=" << n << " P=" << P << " i=" << i;
      }
    }
  }
}

TEST(CommKernels, ConvertDividesThenRounds) {
  for (int64_t n : kSizes) {
    auto x = gc::test::normal(n, 3, 100.0f);
    std::vector<uint16_t> b(static_cast<size_t>(n));
    gc::kernels::cpu::convert(x.data(), gc::DType::kFloat32, b.data(), gc::DType::kBFloat16, n,
                              3.0f);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(b[i], gc::float_to_bf16(x[i] / 3.0f)) << i;
    std::vector<float> y(static_cast<size_t>(n));
    gc::kernels::cpu::convert(b.data(), gc::DType::kBFloat16, y.data(), gc::DType::kFloat32, n,
                              1.0f);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], gc::bf16_to_float(b[i]));
  }
}

/// Every fp16 bit pattern (NaNs, infinities, subnormals, both zeros) plus fp32 values around
/// the fp16 rounding boundaries: the conversions and the fp16 sum (the F16C fast paths where the
/// CPU has them) must give the bits of the scalar twins.
TEST(CommKernels, HalfConversionsAndSumBitwiseEqualScalarTwins) {
  std::vector<uint16_t> all(65536 + 5);  // + 5: a tail shorter than one vector of 8
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i * 40503u);
  const auto n = static_cast<int64_t>(all.size());
  std::vector<float> f(all.size());
  for (float div : {1.0f, 3.0f}) {
    gc::kernels::cpu::convert(all.data(), gc::DType::kFloat16, f.data(), gc::DType::kFloat32, n,
                              div);
    for (int64_t i = 0; i < n; ++i) {
      const float want = div == 1.0f ? gc::half_to_float(all[i]) : gc::half_to_float(all[i]) / div;
      ASSERT_EQ(std::memcmp(&want, &f[i], 4), 0) << "half " << all[i] << " / " << div;
    }
  }
  // fp32 -> fp16: exact halves, midpoints between neighbours (ties to even), just off them,
  // overflow, subnormal range, NaNs with payloads, infinities
  std::vector<float> x;
  for (uint32_t h = 0; h < 0x7c00u; h += 7) {
    const float a = gc::half_to_float(static_cast<uint16_t>(h));
    const float b = gc::half_to_float(static_cast<uint16_t>(h + 1));
    const float mid = a + (b - a) / 2;
    for (float v : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  for (uint32_t u : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x477ff000u,
                     0x477fefffu, 0x33000000u, 0x33000001u, 0x00000001u})
    for (int k = 0; k < 9; ++k) {
      float v;
      std::memcpy(&v, &u, 4);
      x.push_back(v);
    }
  std::vector<uint16_t> h(x.size()), back(x.size());
  for (float div : {1.0f, 3.0f}) {
    gc::kernels::cpu::convert(x.data(), gc::DType::kFloat32, h.data(), gc::DType::kFloat16,
                              static_cast<int64_t>(x.size()), div);
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(h[i], gc::float_to_half(div == 1.0f ? x[i] : x[i] / div))
          << "float " << x[i] << " / " << div << " at " << i;
    // fp16 -> fp16 with a divisor (the cast plan's re-averaging)
    gc::kernels::cpu::convert(all.data(), gc::DType::kFloat16, back.data(), gc::DType::kFloat16,
                              std::min<int64_t>(n, static_cast<int64_t>(back.size())), div);
    for (size_t i = 0; i < std::min(all.size(), back.size()); ++i)
      ASSERT_EQ(back[i], div == 1.0f ? all[i]  // same type, no division: a plain copy
                                     : gc::float_to_half(gc::half_to_float(all[i]) / div))
          << i;
  }
  // rank-ordered fp16 sum of 3 blocks over every bit pattern (NaN + x, Inf - Inf, overflow)
  const size_t P = 3;
  std::vector<uint16_t> blocks(all.size() * P), out(all.size());
  for (size_t r = 0; r < P; ++r)
    for (size_t i = 0; i < all.size(); ++i)
      blocks[r * all.size() + i] = static_cast<uint16_t>(all[i] + r * 977u);
  gc::kernels::cpu::reduce_blocks(blocks.data(), P, all.size(), all.size(), gc::ElemType::kF16,
                                  out.data());
  for (size_t i = 0; i < all.size(); ++i) {
    uint16_t a = blocks[i];
    for (size_t r = 1; r < P; ++r) a = gc::kernels::add_f16(a, blocks[r * all.size() + i]);
    ASSERT_EQ(a, out[i]) << "i=" << i;
  }
}

TEST(CommPlans, DenseMatchesReference) {
  for (int P = 1; P <= 4; ++P)
    for (int64_t n : kSizes)
      check_plan(
          P, n, 2,
          [&](int) { return std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P); },
          gc::test::ref_dense);
}

TEST(CommPlans, CastMatchesReference) {
  for (auto wire : {gc::DType::kFloat16, gc::DType::kBFloat16})
    for (int P = 1; P <= 4; ++P)
      for (int64_t n : kSizes)
        check_plan(
            P, n, 2,
            [&](int) {
              return std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, wire, P);
            },
            [&](const auto& in) { return gc::test::ref_cast(in, wire); });
}

TEST(CommPlans, CastReduceScatterAndGatherMatchReference) {
  // sizes that do not divide by P (zero-padded last chunk), smaller than P (empty chunks), 0;
  // the gather route (one allgather of the whole wire buffer, then the same ordered fp32 sum)
  // gives bitwise the reduce-scatter route's result
  for (auto route : {gc::CastRoute::kReduceScatter, gc::CastRoute::kGather})
    for (auto wire : {gc::DType::kFloat16, gc::DType::kBFloat16})
      for (int P = 1; P <= 4; ++P)
        for (int64_t n :
             {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{7}, int64_t{1000}, int64_t{65537}})
          check_plan(
              P, n, 2,
              [&](int) {
                return std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, wire, P,
                                                               gc::Device::kCPU, 0, nullptr, route);
              },
              [&](const auto& in) { return gc::test::ref_cast_rs(in, wire); });
}

TEST(CommPlans, CastReduceScatterAsksForAllToAllThenAllgather) {
  const int P = 3;
  const int64_t n = 10;  // chunks of 4, the last padded by 2
  std::vector<std::unique_ptr<gc::CastAllreducePlan>> plans;
  std::vector<gc::Plan*> raw;
  std::vector<std::vector<float>> g(P, std::vector<float>(n, 1.0f));
  for (int r = 0; r < P; ++r) {
    plans.push_back(std::make_unique<gc::CastAllreducePlan>(
        n, gc::DType::kFloat32, gc::DType::kFloat16, P, gc::Device::kCPU, 0, nullptr,
        gc::CastRoute::kReduceScatter));
    plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
    raw.push_back(plans[r].get());
  }
  auto cs = gc::run_plans_in_process(raw);
  ASSERT_EQ(cs.size(), 2u);
  EXPECT_EQ(cs[0].kind, gc::CollectiveKind::kAllToAll);
  EXPECT_EQ(cs[1].kind, gc::CollectiveKind::kAllgather);
  EXPECT_EQ(cs[0].count, 4u);
  EXPECT_EQ(cs[1].count, 4u);
  // handed to collectives: the whole padded fp16 buffer (3 x 4 x 2 B), then one 4-element chunk
  EXPECT_EQ(cs[0].send_bytes(), size_t{3 * 4 * 2});
  EXPECT_EQ(cs[1].send_bytes(), size_t{4 * 2});
  EXPECT_EQ(plans[0]->name(), "cast_fp16_rs");
  for (int r = 0; r < P; ++r)
    for (float v : g[r]) ASSERT_EQ(v, 1.0f);
}

namespace {

/// Top-k plans of `cfg` against the scalar reference for every exchange and route given, P = 1-4
/// and every size of kSizes, 3 steps each.
void check_topk_plans(const gc::TopKConfig& cfg, std::initializer_list<gc::TopKExchange> exchanges,
                      std::initializer_list<gc::TopKRoute> routes) {
  for (auto exchange : exchanges)
    for (auto route : routes)
      for (int P = 1; P <= 4; ++P)
        for (int64_t n : kSizes) {
          gc::test::TopKReference ref(cfg, n, P);
          gc::TopKPlanOptions opt;
          opt.route = route;
          opt.exchange = exchange;
          check_plan(
              P, n, 3, [&](int) { return std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, opt); },
              [&](const auto& in) {
                auto v = ref.step(in);
                if (n == 0) v.clear();
                return v;
              });
        }
}

}  // namespace

TEST(CommPlans, TopKBothRoutesMatchReference) {
  gc::TopKConfig cfg;
  cfg.ratio = 0.01;
  check_topk_plans(cfg,
                   {gc::TopKExchange::kAuto, gc::TopKExchange::kBound, gc::TopKExchange::kSizes},
                   {gc::TopKRoute::kSparse, gc::TopKRoute::kDense, gc::TopKRoute::kAuto});
}

namespace {

/// Runs P top-k plans for `steps` steps on rank_input; returns every rank's averaged gradient per
/// step and the collectives of each step.
struct TopKRun {
  std::vector<std::vector<std::vector<float>>> out;  // [step][rank]
  std::vector<std::vector<gc::Collective>> log;      // [step]
  std::vector<std::unique_ptr<gc::TopKAllreducePlan>> plans;
};
TopKRun run_topk(const gc::TopKConfig& cfg, const gc::TopKPlanOptions& opt, int P, int64_t n,
                 int steps) {
  TopKRun run;
  std::vector<gc::Plan*> raw;
  for (int r = 0; r < P; ++r) {
    run.plans.push_back(std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, opt));
    raw.push_back(run.plans.back().get());
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> g;
    for (int r = 0; r < P; ++r) g.push_back(rank_input(n, r, s));
    for (int r = 0; r < P; ++r) run.plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
    run.log.push_back(gc::run_plans_in_process(raw));
    run.out.push_back(g);
  }
  return run;
}

}  // namespace

TEST(CommPlans, TopKCodedValuesMatchTheCodecsOnEveryRouteAndRank) {
  // value_bits: each rank's payload carries its coded values; both routes, every exchange and
  // P = 1-4 give every rank the bits of the codecs' decodes summed in rank order (the codec
  // itself is checked against the grid's definition in tests/topk).
  gc::TopKConfig cfg;
  cfg.ratio = 0.03;
  cfg.value_bits = 2;
  cfg.value_block = 32;
  check_topk_plans(cfg, {gc::TopKExchange::kBound, gc::TopKExchange::kSizes},
                   {gc::TopKRoute::kSparse, gc::TopKRoute::kDense});
  // a rank coding at another width (or not at all) is told at the first step, on every rank
  for (int other : {0, 4}) {
    gc::TopKConfig a, b;
    a.ratio = b.ratio = 0.03;
    a.value_bits = 2;
    b.value_bits = other;
    const int64_t n = 1000;
    gc::TopKAllreducePlan pa(a, n, 2), pb(b, n, 2);
    std::vector<float> ga = rank_input(n, 0, 0), gb = rank_input(n, 1, 0);
    pa.begin(gc::TensorView::cpu(ga.data(), n));
    pb.begin(gc::TensorView::cpu(gb.data(), n));
    std::vector<gc::Plan*> raw{&pa, &pb};
    try {
      gc::run_plans_in_process(raw);
      ADD_FAILURE() << "value_bits 2 and " << other << " were not refused";
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("value_bits"), std::string::npos) << e.what();
    }
  }
}

TEST(CommPlans, TopKBoundExchangeIsOneCollectiveWithTheSameBits) {
  // A warm-up schedule, so that k (and with it the bound) changes from step to step; fp16 values
  // and a momentum, so that payloads are not trivially alike; n odd and large enough for the
  // delta coding (shorter than the bound) to be chosen.
  for (int P : {1, 2, 3, 4})
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{20011}}) {
      gc::TopKConfig cfg;
      cfg.ratio = 0.001;
      cfg.warmup_ratios = {0.25, 0.02};
      cfg.warmup_steps = 1;
      cfg.momentum = 0.9;
      cfg.value_dtype = gc::DType::kFloat16;
      gc::TopKPlanOptions bound, sizes;
      bound.exchange = gc::TopKExchange::kBound;
      sizes.exchange = gc::TopKExchange::kSizes;
      bound.route = sizes.route = gc::TopKRoute::kSparse;
      const int steps = 5;
      const TopKRun a = run_topk(cfg, bound, P, n, steps);
      const TopKRun b = run_topk(cfg, sizes, P, n, steps);
      for (int s = 0; s < steps; ++s) {
        for (int r = 0; r < P; ++r)
          ASSERT_TRUE(gc::test::same_bits(b.out[s][r], a.out[s][r].data()))
              << "P=" << P << " n=" << n << " step " << s << " rank " << r << " first differs at "
              << gc::test::first_diff(b.out[s][r], a.out[s][r].data());
        // the first step exchanges sizes either way (it checks the bucket sizes across ranks)
        ASSERT_EQ(b.log[s].size(), 2u);
        ASSERT_EQ(a.log[s].size(), s == 0 ? 2u : 1u) << "step " << s;
        const gc::Collective& c = a.log[s].back();
        EXPECT_EQ(c.kind, gc::CollectiveKind::kAllgather);
        if (s > 0) {
          EXPECT_EQ(c.tag, "topk payloads (bound)");
          // the stride is the bound of the step's k, the same on every rank
          const uint64_t want =
              gc::sparse_payload_bound(gc::topk_count(cfg.ratio_at(s), n), n, cfg.value_dtype);
          EXPECT_EQ(c.count, want) << "step " << s;
          EXPECT_GE(c.count, b.log[s].back().count);
        }
      }
      for (int r = 0; r < P; ++r) {
        const gc::TopKPlanStats& st = a.plans[r]->stats();
        EXPECT_EQ(st.steps, steps);
        EXPECT_EQ(st.bound_steps, steps - 1);
        EXPECT_EQ(st.last_exchange, gc::TopKExchange::kBound);
        // the real sizes, read from the gathered headers, are the ones the size exchange gives
        EXPECT_EQ(st.last_max_payload, b.plans[r]->stats().last_max_payload);
        EXPECT_EQ(st.last_total_payload, b.plans[r]->stats().last_total_payload);
        EXPECT_EQ(b.plans[r]->stats().bound_steps, 0);
      }
    }
}

TEST(CommPlans, TopKPayloadBoundHoldsForEveryCoding) {
  // Independent of the plan: encode with every density where each index coding wins and check
  // that the payload never exceeds the bound (which the bound exchange pads to).
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{9}, int64_t{1000}, int64_t{65537}})
    for (double ratio : {1e-4, 0.01, 0.1, 0.3, 1.0})
      for (auto vt : {gc::DType::kFloat32, gc::DType::kFloat16}) {
        gc::TopKConfig cfg;
        cfg.ratio = ratio;
        cfg.value_dtype = vt;
        gc::TopKCompressor c(cfg, n);
        gc::Payload p;
        std::vector<float> g = rank_input(n, 0, 0);
        c.encode(gc::TensorView::cpu(g.data(), n), p);
        const uint64_t bound = c.payload_bound(0);
        EXPECT_LE(p.size(), bound) << "n=" << n << " ratio " << ratio;
        EXPECT_EQ(bound % 8, 0u);
        // and the bound is tight for raw indices: 64 + 8-aligned 4k + 8-aligned k * value size
        const auto k = static_cast<uint64_t>(gc::topk_count(ratio, n));
        if (4 * k <= (static_cast<uint64_t>(n) + 7) / 8)
          EXPECT_EQ(bound, 64 + (4 * k + 7) / 8 * 8 + (k * gc::dtype_size(vt) + 7) / 8 * 8);
      }
  EXPECT_THROW(gc::sparse_payload_bound(5, 4, gc::DType::kFloat32), gc::InvalidArgument);
}

TEST(CommPlans, TopKAutoExchangeFollowsTheCostModel) {
  // Latency-bound link: skipping a round is worth the padding; bandwidth-bound (no latency):
  // the padding is not, and the size exchange is kept.
  const int P = 3;
  const int64_t n = 20011;
  gc::TopKConfig cfg;
  cfg.ratio = 0.01;
  for (double latency : {1e-3, 0.0}) {
    gc::TopKPlanOptions opt;
    opt.cost.latency_s = latency;
    opt.cost.bandwidth_Bps = 1e8;
    const TopKRun run = run_topk(cfg, opt, P, n, 3);
    for (int r = 0; r < P; ++r) {
      const gc::TopKPlanStats& st = run.plans[r]->stats();
      EXPECT_EQ(st.bound_steps, latency > 0 ? 2 : 0) << "latency " << latency;
      EXPECT_EQ(run.plans[r]->next_exchange(),
                latency > 0 ? gc::TopKExchange::kBound : gc::TopKExchange::kSizes);
    }
    EXPECT_EQ(run.log[2].size(), latency > 0 ? 1u : 2u);
  }
  // a fresh plan always starts with the size exchange
  gc::TopKAllreducePlan fresh(cfg, n, P);
  EXPECT_EQ(fresh.next_exchange(), gc::TopKExchange::kSizes);
}

TEST(CommPlans, TopKBucketSizesThatDifferAcrossRanksThrowOnTheFirstStep) {
  // Bound exchange asked for, but the first step exchanges sizes: a mismatch is a clear error.
  gc::TopKConfig cfg;
  cfg.ratio = 0.1;
  gc::TopKPlanOptions opt;
  opt.exchange = gc::TopKExchange::kBound;
  gc::TopKAllreducePlan a(cfg, 100, 2, opt), b(cfg, 101, 2, opt);
  std::vector<float> ga(100, 1.0f), gb(101, 1.0f);
  a.begin(gc::TensorView::cpu(ga.data(), 100));
  b.begin(gc::TensorView::cpu(gb.data(), 101));
  std::vector<gc::Plan*> raw{&a, &b};
  try {
    gc::run_plans_in_process(raw);
    FAIL() << "expected InvalidArgument";
  } catch (const gc::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bucket sizes differ across ranks"), std::string::npos)
        << e.what();
  }
}

TEST(CommPlans, TopKRanksThatWouldPadDifferentlyThrowOnTheFirstStep) {
  // What a later bound step relies on is checked in the first step's size exchange, by the step
  // envelope it carries: the step (one rank restored from a checkpoint, the other not) and the
  // options (a different density on one rank); both throw on every rank.
  const int64_t n = 1000;
  gc::TopKConfig cfg;
  cfg.ratio = 0.01;
  cfg.warmup_ratios = {0.1};
  cfg.warmup_steps = 2;
  auto expect_throw = [&](gc::TopKAllreducePlan& a, gc::TopKAllreducePlan& b, const char* what) {
    std::vector<float> ga = rank_input(n, 0, 0), gb = rank_input(n, 1, 0);
    a.begin(gc::TensorView::cpu(ga.data(), n));
    b.begin(gc::TensorView::cpu(gb.data(), n));
    std::vector<gc::Plan*> raw{&a, &b};
    try {
      gc::run_plans_in_process(raw);
      ADD_FAILURE() << "expected InvalidArgument: " << what;
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  {
    gc::TopKAllreducePlan ran(cfg, n, 1);  // three steps alone, then its state goes to rank 0
    for (int s = 0; s < 3; ++s) {
      std::vector<float> g = rank_input(n, 0, s);
      ran.begin(gc::TensorView::cpu(g.data(), n));
      std::vector<gc::Plan*> one{&ran};
      gc::run_plans_in_process(one);
    }
    gc::TopKAllreducePlan a(cfg, n, 2), b(cfg, n, 2);
    const auto st = ran.state_dict();
    a.load_state_dict(st.data(), st.size());
    expect_throw(a, b, "ranks are at different steps (this rank at 3)");
  }
  {
    gc::TopKConfig other = cfg;
    other.warmup_ratios = {0.2};
    gc::TopKAllreducePlan a(cfg, n, 2), b(other, n, 2);
    expect_throw(a, b, "the options differ across ranks");
  }
  {  // schedules that agree at step 0 and differ later: found at step 0 all the same
    gc::TopKConfig c1 = cfg, c2 = cfg;
    c1.warmup_ratios = {0.1, 0.1};
    c2.warmup_ratios = {0.1, 0.2};
    gc::TopKAllreducePlan a(c1, n, 2), b(c2, n, 2);
    expect_throw(a, b, "the options differ across ranks");
  }
  {  // the exchange differs (one rank would gather payloads while the other gathers sizes)
    gc::TopKPlanOptions bound, sizes;
    bound.exchange = gc::TopKExchange::kBound;
    sizes.exchange = gc::TopKExchange::kSizes;
    gc::TopKAllreducePlan a(cfg, n, 2, bound), b(cfg, n, 2, sizes);
    expect_throw(a, b, "the options differ across ranks");
  }
  {  // live plans on the one-collective exchange (after any warm-up: the same padding on both
     // ranks); one rank loads an older state: the gathered headers' steps tell both ranks
    gc::TopKConfig plain;
    plain.ratio = 0.01;
    gc::TopKPlanOptions bound;
    bound.exchange = gc::TopKExchange::kBound;
    gc::TopKAllreducePlan a(plain, n, 2, bound), b(plain, n, 2, bound);
    std::vector<uint8_t> old;
    for (int s = 0; s < 4; ++s) {
      if (s == 1) old = a.state_dict();
      std::vector<float> ga = rank_input(n, 0, s), gb = rank_input(n, 1, s);
      a.begin(gc::TensorView::cpu(ga.data(), n));
      b.begin(gc::TensorView::cpu(gb.data(), n));
      std::vector<gc::Plan*> raw{&a, &b};
      gc::run_plans_in_process(raw);
    }
    EXPECT_GE(a.stats().bound_steps, 2);
    a.load_state_dict(old.data(), old.size());
    expect_throw(a, b, "ranks are at different steps: rank 0 at 1, rank 1 at 4");
  }
}

TEST(CommPlans, TopKAndRandomKRefuseLoadStateDictDuringAStep) {
  const int64_t n = 1000;
  gc::TopKConfig cfg;
  cfg.ratio = 0.05;
  gc::TopKAllreducePlan t(cfg, n, 2);
  gc::RandomKConfig rc;
  rc.ratio = 0.05;
  gc::RandomKAllreducePlan r(rc, n, 2);
  for (gc::BucketPlan* p : std::vector<gc::BucketPlan*>{&t, &r}) {
    const auto st = p->state_dict();
    std::vector<float> g = rank_input(n, 0, 0);
    p->begin(gc::TensorView::cpu(g.data(), n));
    ASSERT_TRUE(p->next().has_value());  // the step is under way
    EXPECT_THROW(p->load_state_dict(st.data(), st.size()), gc::InvalidArgument) << p->name();
  }
}

TEST(CommPlans, TopKDenseRouteNeedsNoSizes) {
  // route forced dense: after the first step, auto exchanges no sizes (they would go unused)
  gc::TopKConfig cfg;
  cfg.ratio = 0.01;
  gc::TopKPlanOptions opt;
  opt.route = gc::TopKRoute::kDense;
  opt.cost.latency_s = 0;  // the cost model alone would keep the size exchange
  const TopKRun run = run_topk(cfg, opt, 3, 5000, 3);
  EXPECT_EQ(run.log[0].size(), 2u);
  EXPECT_EQ(run.log[2].size(), 1u);
  EXPECT_EQ(run.log[2][0].kind, gc::CollectiveKind::kAllreduceSum);
  EXPECT_EQ(run.plans[0]->stats().bound_steps, 2);
}

TEST(CommPlans, TopKBoundExchangeRefusesAHeaderThatOverrunsTheStride) {
  // Two ranks driven by hand: after a normal first step, the second (bound) step's gathered
  // payload of rank 1 is altered to declare more bytes than its stride: CorruptPayload, and the
  // gradient is not written.
  const int P = 2;
  const int64_t n = 1000;
  gc::TopKConfig cfg;
  cfg.ratio = 0.01;
  gc::TopKPlanOptions opt;
  opt.exchange = gc::TopKExchange::kBound;
  opt.route = gc::TopKRoute::kSparse;
  std::vector<std::unique_ptr<gc::TopKAllreducePlan>> plans;
  std::vector<gc::Plan*> raw;
  for (int r = 0; r < P; ++r) {
    plans.push_back(std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, opt));
    raw.push_back(plans.back().get());
  }
  std::vector<std::vector<float>> g;
  for (int r = 0; r < P; ++r) g.push_back(rank_input(n, r, 0));
  for (int r = 0; r < P; ++r) plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
  gc::run_plans_in_process(raw);
  for (int field : {0, 1}) {  // 0: a section longer than the stride; 1: the sum of sections
    SCOPED_TRACE(field);
    for (int r = 0; r < P; ++r) g[r] = rank_input(n, r, 1);
    std::vector<std::vector<float>> before = g;
    for (int r = 0; r < P; ++r) plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
    std::vector<gc::Collective> cs;
    for (int r = 0; r < P; ++r) cs.push_back(*plans[r]->next());
    ASSERT_EQ(cs[0].tag, "topk payloads (bound)");
    const size_t stride = cs[0].count;
    for (int r = 0; r < P; ++r)  // the allgather, by hand
      for (int q = 0; q < P; ++q)
        std::memcpy(static_cast<uint8_t*>(cs[r].recv) + q * stride, cs[q].send, stride);
    auto* h = reinterpret_cast<gc::PayloadHeader*>(static_cast<uint8_t*>(cs[0].recv) + stride);
    if (field == 0)
      h->section_bytes[1] = stride + 1;
    else
      h->section_bytes[1] = stride - 64 - h->section_bytes[0] + 8;  // each fits, the sum does not
    try {
      plans[0]->next();
      FAIL() << "expected CorruptPayload";
    } catch (const gc::CorruptPayload& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(gc::test::same_bits(before[0], g[0].data()));
    // rank 1 (untouched copy) finishes; rebuild the pair for the next case
    plans.clear();
    raw.clear();
    for (int r = 0; r < P; ++r) {
      plans.push_back(std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, opt));
      raw.push_back(plans.back().get());
      g[r] = rank_input(n, r, 0);
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
    }
    gc::run_plans_in_process(raw);
  }
}

TEST(CommPlans, RandomKMatchesReference) {
  for (int P = 1; P <= 4; ++P)
    for (int64_t n : kSizes) {
      gc::RandomKConfig cfg;
      cfg.ratio = 0.05;
      cfg.seed = 11;
      gc::test::RandomKReference ref(cfg, n, P);
      check_plan(
          P, n, 3, [&](int) { return std::make_unique<gc::RandomKAllreducePlan>(cfg, n, P); },
          [&](const auto& in) { return ref.step(in); });
    }
}

// Random-k sums values of the indices its RNG draws for the step: ranks at different steps (one
// restored alone, an older state loaded into a live plan) or with other options would average
// values of different elements without any error. The consensus slots after the values tell
// every rank, with the step left undone; every value dtype.
TEST(CommPlans, RandomKRanksAtDifferentStepsOrOptionsFailOnEveryRank) {
  const int P = 3;
  const int64_t n = 4000;
  auto run_step = [&](std::vector<std::unique_ptr<gc::RandomKAllreducePlan>>& plans, int step) {
    std::vector<gc::Plan*> raw;
    std::vector<std::vector<float>> g(P);
    for (int r = 0; r < P; ++r) {
      g[r] = rank_input(n, r, step);
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      raw.push_back(plans[r].get());
    }
    gc::run_plans_in_process(raw);
  };
  for (gc::DType vt : {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16}) {
    SCOPED_TRACE(gc::dtype_name(vt));
    gc::RandomKConfig cfg;
    cfg.ratio = 0.05;
    cfg.value_dtype = vt;
    cfg.dense_below = 0;
    std::vector<std::unique_ptr<gc::RandomKAllreducePlan>> plans;
    for (int r = 0; r < P; ++r)
      plans.push_back(std::make_unique<gc::RandomKAllreducePlan>(cfg, n, P));
    run_step(plans, 0);
    const auto older = plans[1]->state_dict();
    run_step(plans, 1);
    plans[1]->load_state_dict(older.data(), older.size());  // rank 1 one step behind
    std::vector<std::vector<uint8_t>> before;
    for (auto& p : plans) before.push_back(p->state_dict());
    // every rank is driven by hand: one allreduce (summed here in rank order), then each rank's
    // next() must raise, and no state may change
    std::vector<std::vector<float>> g(P);
    std::vector<gc::Collective> cs;
    for (int r = 0; r < P; ++r) {
      g[r] = rank_input(n, r, 2);
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      auto c = plans[r]->next();
      ASSERT_TRUE(c.has_value());
      ASSERT_EQ(c->kind, gc::CollectiveKind::kAllreduceSum);
      cs.push_back(*c);
    }
    const size_t m = cs[0].count, es = gc::elem_size(cs[0].type);
    for (const auto& c : cs) ASSERT_EQ(c.count, m);
    std::vector<float> sum(m, 0.0f);
    auto get = [&](const void* p, size_t i) {
      const auto* b = static_cast<const uint8_t*>(p) + i * es;
      if (vt == gc::DType::kFloat32) {
        float f;
        std::memcpy(&f, b, 4);
        return f;
      }
      uint16_t h;
      std::memcpy(&h, b, 2);
      return vt == gc::DType::kFloat16 ? gc::half_to_float(h) : gc::bf16_to_float(h);
    };
    for (int r = 0; r < P; ++r)
      for (size_t i = 0; i < m; ++i) sum[i] += get(cs[r].send, i);
    for (int r = 0; r < P; ++r)
      for (size_t i = 0; i < m; ++i) {
        auto* b = static_cast<uint8_t*>(cs[r].recv) + i * es;
        if (vt == gc::DType::kFloat32) {
          std::memcpy(b, &sum[i], 4);
        } else {
          const uint16_t h =
              vt == gc::DType::kFloat16 ? gc::float_to_half(sum[i]) : gc::float_to_bf16(sum[i]);
          std::memcpy(b, &h, 2);
        }
      }
    for (int r = 0; r < P; ++r) {
      try {
        plans[r]->next();
        ADD_FAILURE() << "rank " << r << " accepted a step of ranks at different steps";
      } catch (const gc::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("ranks are at different steps"), std::string::npos)
            << e.what();
      }
      EXPECT_EQ(plans[r]->state_dict(), before[r]) << "rank " << r;
    }
    // the same states again on every rank: the next step runs
    for (auto& p : plans) p->load_state_dict(before[0].data(), before[0].size());
    run_step(plans, 3);
    // another seed on one rank: other indices, told as an option mismatch
    gc::RandomKConfig other = cfg;
    other.seed = 5;
    plans[2] = std::make_unique<gc::RandomKAllreducePlan>(other, n, P);
    const auto same = plans[0]->state_dict();
    plans[2]->load_state_dict(same.data(), same.size());
    std::vector<gc::Plan*> raw;
    std::vector<std::vector<float>> h(P);
    for (int r = 0; r < P; ++r) {
      h[r] = rank_input(n, r, 4);
      plans[r]->begin(gc::TensorView::cpu(h[r].data(), n));
      raw.push_back(plans[r].get());
    }
    try {
      gc::run_plans_in_process(raw);
      ADD_FAILURE() << "another seed accepted";
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("the options differ across ranks"), std::string::npos)
          << e.what();
    }
  }
}

TEST(CommPlans, CostModelChoosesDenseWhenDensityIsHigh) {
  gc::TopKConfig cfg;
  gc::TopKPlanOptions opt;
  opt.cost.latency_s = 0;
  opt.cost.bandwidth_Bps = 1e9;
  const int64_t n = 1 << 20;
  gc::TopKAllreducePlan plan(cfg, n, 4, opt);
  // sparse sends max_payload * (P-1); dense 2 n 4 (P-1)/P: break-even at max_payload = 2 n
  EXPECT_EQ(plan.choose(uint64_t(n)), gc::TopKRoute::kSparse);
  EXPECT_EQ(plan.choose(uint64_t(3 * n)), gc::TopKRoute::kDense);
  // latency favours the route with fewer rounds (sparse: P-1, dense: 2 (P-1))
  opt.cost.latency_s = 1.0;
  gc::TopKAllreducePlan slow(cfg, n, 4, opt);
  EXPECT_EQ(slow.choose(uint64_t(3 * n)), gc::TopKRoute::kSparse);
  gc::TopKAllreducePlan one(cfg, n, 1, opt);
  EXPECT_EQ(one.choose(uint64_t(100 * n)), gc::TopKRoute::kSparse);
}

TEST(CommPlans, TopKStatisticsRecordRoute) {
  const int P = 3;
  const int64_t n = 5000;
  gc::TopKConfig cfg;
  cfg.ratio = 0.9;  // dense enough that densify wins on a bandwidth-bound model
  gc::TopKPlanOptions opt;
  opt.cost.latency_s = 0;
  std::vector<std::unique_ptr<gc::TopKAllreducePlan>> plans;
  std::vector<gc::Plan*> raw;
  std::vector<std::vector<float>> g;
  for (int r = 0; r < P; ++r) {
    plans.push_back(std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, opt));
    raw.push_back(plans.back().get());
    g.push_back(rank_input(n, r, 0));
    plans.back()->begin(gc::TensorView::cpu(g.back().data(), n));
  }
  auto log = gc::run_plans_in_process(raw);
  ASSERT_EQ(log.size(), 2u);
  EXPECT_EQ(log[1].kind, gc::CollectiveKind::kAllreduceSum) << log[1].tag;
  EXPECT_EQ(plans[0]->stats().last_route, gc::TopKRoute::kDense);
  EXPECT_EQ(plans[0]->stats().dense_steps, 1);
  EXPECT_GT(plans[0]->stats().last_sparse_cost_s, plans[0]->stats().last_dense_cost_s);
}

TEST(CommPlans, BadInputRejectedBeforeStateChanges) {
  gc::TopKConfig cfg;
  cfg.ratio = 0.1;
  gc::TopKAllreducePlan plan(cfg, 100, 2);
  std::vector<float> g(101, 1.0f);
  const auto before = plan.compressor().state_dict();
  EXPECT_THROW(plan.begin(gc::TensorView::cpu(g.data(), 101)), gc::InvalidArgument);
  EXPECT_THROW(plan.next(), gc::InvalidArgument);  // never begun
  EXPECT_EQ(plan.compressor().state_dict(), before);
  std::vector<uint16_t> h(100);
  EXPECT_THROW(plan.begin(gc::TensorView(h.data(), {100}, gc::DType::kFloat16, gc::Device::kCPU)),
               gc::InvalidArgument);
  EXPECT_THROW(gc::CastAllreducePlan(10, gc::DType::kFloat32, gc::DType::kFloat16, 2,
                                     gc::Device::kCPU, 0, nullptr, static_cast<gc::CastRoute>(7)),
               gc::InvalidArgument);
  EXPECT_THROW(gc::CastAllreducePlan(10, gc::DType::kFloat32, gc::DType::kFloat32, 2),
               gc::InvalidArgument);
  EXPECT_THROW(gc::DenseAllreducePlan(-1, gc::DType::kFloat32, 2), gc::InvalidArgument);
  EXPECT_THROW(gc::DenseAllreducePlan(5, gc::DType::kFloat32, 0), gc::InvalidArgument);
}

TEST(CommPlans, DenseHalfGradientsSumInHalf) {
  const int P = 3;
  const int64_t n = 333;
  std::vector<std::vector<uint16_t>> g(P);
  std::vector<std::unique_ptr<gc::DenseAllreducePlan>> plans;
  std::vector<gc::Plan*> raw;
  for (int r = 0; r < P; ++r) {
    auto v = rank_input(n, r, 0);
    for (float x : v) g[r].push_back(gc::float_to_half(x));
    plans.push_back(std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat16, P));
    raw.push_back(plans.back().get());
  }
  auto orig = g;
  for (int r = 0; r < P; ++r)
    plans[r]->begin(gc::TensorView(g[r].data(), {n}, gc::DType::kFloat16, gc::Device::kCPU));
  gc::run_plans_in_process(raw);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t a = orig[0][i];
    for (int r = 1; r < P; ++r)
      a = gc::float_to_half(gc::half_to_float(a) + gc::half_to_float(orig[r][i]));
    const uint16_t want = gc::float_to_half(gc::half_to_float(a) / float(P));
    for (int r = 0; r < P; ++r) ASSERT_EQ(g[r][i], want) << "i=" << i << " rank " << r;
  }
}

TEST(CommPlans, SparsifyPlansClipEachRankAtNormOverSqrtWorld) {
  // DGC (Lin et al. 2018, Sec. 3.2): each of N ranks clips at clip_norm N^-1/2 by default;
  // ClipScaling::kNone clips at clip_norm. Gradients of all ones (norm sqrt(n) = 10) with
  // clip_norm 2 on 4 ranks: the local threshold 1 scales them by 0.1 (kNone: 2, by 0.2), and
  // with density 1 the average is that scale everywhere.
  const int P = 4;
  const int64_t n = 100;
  for (auto scaling :
       {gc::SparsifyConfig::ClipScaling::kSqrtWorld, gc::SparsifyConfig::ClipScaling::kNone}) {
    const float want = scaling == gc::SparsifyConfig::ClipScaling::kNone ? 0.2f : 0.1f;
    for (int family = 0; family < 2; ++family) {
      std::vector<std::unique_ptr<gc::Plan>> plans;
      std::vector<gc::Plan*> raw;
      std::vector<std::vector<float>> g(P, std::vector<float>(n, 1.0f));
      for (int r = 0; r < P; ++r) {
        if (family == 0) {
          gc::TopKConfig cfg;
          cfg.ratio = 1.0;
          cfg.clip_norm = 2.0;
          cfg.clip_scaling = scaling;
          plans.push_back(std::make_unique<gc::TopKAllreducePlan>(cfg, n, P));
        } else {
          gc::RandomKConfig cfg;
          cfg.ratio = 1.0;
          cfg.clip_norm = 2.0;
          cfg.clip_scaling = scaling;
          plans.push_back(std::make_unique<gc::RandomKAllreducePlan>(cfg, n, P));
        }
        static_cast<gc::GradientPlan*>(plans[r].get())->begin(gc::TensorView::cpu(g[r].data(), n));
        raw.push_back(plans[r].get());
      }
      gc::run_plans_in_process(raw);
      for (int r = 0; r < P; ++r)
        for (int64_t i = 0; i < n; ++i)
          ASSERT_NEAR(g[r][i], want, 1e-6f) << "family " << family << " rank " << r << " i " << i;
    }
  }
  gc::SparsifyConfig c;
  c.clip_norm = 3.0;
  EXPECT_DOUBLE_EQ(c.local_clip_norm(9), 1.0);
  EXPECT_DOUBLE_EQ(c.local_clip_norm(1), 3.0);
  EXPECT_THROW(c.local_clip_norm(0), gc::InvalidArgument);
  EXPECT_EQ(gc::parse_enum<gc::SparsifyConfig::ClipScaling>("none"),
            gc::SparsifyConfig::ClipScaling::kNone);
  EXPECT_THROW(gc::parse_enum<gc::SparsifyConfig::ClipScaling>("sqrt"), gc::InvalidArgument);
}

// A rank whose state is replaced in a live plan (an older checkpoint loaded on one rank) within a
// warm-up, where k and with it every step's collective sizes change from step to step: every
// rank must be told by a clear error, on every exchange and route, and never by collectives of
// different sizes (gloo aborts the process on those). Afterwards the job goes on: the rank loads
// the right state and the next steps are bitwise those of an uninterrupted pair. When every rank
// loads the same older state, the step runs (top-k gathers again at the real sizes, random-k
// sums again at the real count) and equals new plans given that state.
namespace {

struct Pair {
  std::vector<std::unique_ptr<gc::BucketPlan>> plans;
  std::vector<gc::Collective> log;  // of the last step
  // one step on rank_input(n, r, s); returns every rank's output
  std::vector<std::vector<float>> step(int64_t n, int s) {
    std::vector<std::vector<float>> g;
    std::vector<gc::Plan*> raw;
    for (size_t r = 0; r < plans.size(); ++r) g.push_back(rank_input(n, static_cast<int>(r), s));
    for (size_t r = 0; r < plans.size(); ++r) {
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      raw.push_back(plans[r].get());
    }
    log = gc::run_plans_in_process(raw);
    return g;
  }
  std::vector<std::vector<uint8_t>> states() const {
    std::vector<std::vector<uint8_t>> s;
    for (const auto& p : plans) s.push_back(p->state_dict());
    return s;
  }
};

template <class Make>
Pair make_pair_of(int P, Make make) {
  Pair p;
  for (int r = 0; r < P; ++r) p.plans.push_back(make());
  return p;
}

void expect_steps_differ(Pair& p, int64_t n, int s) {
  const auto before = p.states();
  try {
    p.step(n, s);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const gc::InvalidArgument& e) {
    // the plans' own check, not the engine's refusal of collectives of different sizes
    EXPECT_NE(std::string(e.what()).find("ranks are at different steps"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(p.states(), before) << "a failed step changed a state";
}

}  // namespace

TEST(CommPlans, ALiveRankLoadingAnotherStepInTheWarmUpFailsCleanlyAndTheJobGoesOn) {
  const int64_t n = 1000;
  gc::TopKConfig tk;
  tk.ratio = 0.01;
  tk.warmup_ratios = {0.3, 0.2, 0.1, 0.05};
  tk.warmup_steps = 1;  // k changes at every step of the warm-up
  gc::RandomKConfig rk;
  rk.ratio = 0.01;
  rk.warmup_ratios = tk.warmup_ratios;
  rk.warmup_steps = 1;
  rk.dense_below = 0;
  struct Case {
    const char* what;
    std::function<std::unique_ptr<gc::BucketPlan>()> make;
  };
  gc::TopKPlanOptions bound, sizes, dense;
  bound.exchange = gc::TopKExchange::kBound;
  sizes.exchange = gc::TopKExchange::kSizes;
  dense.route = gc::TopKRoute::kDense;
  const std::vector<Case> cases = {
      {"topk bound", [&] { return std::make_unique<gc::TopKAllreducePlan>(tk, n, 2, bound); }},
      {"topk sizes", [&] { return std::make_unique<gc::TopKAllreducePlan>(tk, n, 2, sizes); }},
      {"topk dense", [&] { return std::make_unique<gc::TopKAllreducePlan>(tk, n, 2, dense); }},
      {"randomk", [&] { return std::make_unique<gc::RandomKAllreducePlan>(rk, n, 2); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Pair ref = make_pair_of(2, c.make), run = make_pair_of(2, c.make);
    std::vector<std::vector<std::vector<float>>> want;
    for (int s = 0; s < 6; ++s) want.push_back(ref.step(n, s));
    std::vector<uint8_t> older;
    for (int s = 0; s < 3; ++s) {
      if (s == 1) older = run.plans[0]->state_dict();
      run.step(n, s);
    }
    // rank 0 goes back to step 1, twice in a row (the step after a failed one is checked too)
    const auto mine = run.plans[0]->state_dict();
    run.plans[0]->load_state_dict(older.data(), older.size());
    expect_steps_differ(run, n, 3);
    expect_steps_differ(run, n, 3);
    run.plans[0]->load_state_dict(mine.data(), mine.size());
    for (int s = 3; s < 6; ++s) EXPECT_EQ(run.step(n, s), want[s]) << "step " << s;
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.what) + ": every rank loads the same older state");
    Pair run = make_pair_of(2, c.make);
    std::vector<std::vector<uint8_t>> older;
    for (int s = 0; s < 4; ++s) {
      if (s == 1) older = run.states();
      run.step(n, s);
    }
    Pair fresh = make_pair_of(2, c.make);
    for (int r = 0; r < 2; ++r) {
      run.plans[r]->load_state_dict(older[r].data(), older[r].size());
      fresh.plans[r]->load_state_dict(older[r].data(), older[r].size());
    }
    for (int s = 4; s < 7; ++s) {
      EXPECT_EQ(run.step(n, s), fresh.step(n, s)) << "step " << s;
      EXPECT_EQ(run.states(), fresh.states()) << "step " << s;
    }
  }
}

TEST(CommPlans, TheAgreedStepSizesTheCollectives) {
  const int64_t n = 1000;
  {  // top-k bound: every rank loaded step 1 (k = 20% of n) where the agreed step is 4 (5%):
     // the headers fit the bound and are flagged; the payloads are gathered again
    gc::TopKConfig tk;
    tk.ratio = 0.01;
    tk.warmup_ratios = {0.3, 0.2, 0.1, 0.05};
    tk.warmup_steps = 1;
    gc::TopKPlanOptions bound;
    bound.exchange = gc::TopKExchange::kBound;
    Pair run =
        make_pair_of(2, [&] { return std::make_unique<gc::TopKAllreducePlan>(tk, n, 2, bound); });
    std::vector<std::vector<uint8_t>> older;
    for (int s = 0; s < 4; ++s) {
      if (s == 1) older = run.states();
      run.step(n, s);
    }
    EXPECT_EQ(run.log.size(), 1u);
    for (int r = 0; r < 2; ++r) run.plans[r]->load_state_dict(older[r].data(), older[r].size());
    run.step(n, 4);
    ASSERT_EQ(run.log.size(), 2u);
    EXPECT_EQ(std::string(run.log[1].tag), "topk payloads (past the bound)");
    EXPECT_GT(run.log[1].count, run.log[0].count);
    run.step(n, 5);  // agreed again: one collective
    EXPECT_EQ(run.log.size(), 1u);
  }
  {  // random-k: a new plan sums the schedule's largest count once (its step is not known to
     // agree with the others'), then the count of each step
    gc::RandomKConfig rk;
    rk.ratio = 0.01;
    rk.warmup_ratios = {0.05, 0.3};  // the largest is not the first
    rk.warmup_steps = 2;
    rk.dense_below = 0;
    Pair run =
        make_pair_of(3, [&] { return std::make_unique<gc::RandomKAllreducePlan>(rk, n, 3); });
    const size_t slots = 65;
    run.step(n, 0);
    ASSERT_EQ(run.log.size(), 1u);
    EXPECT_EQ(run.log[0].count, gc::topk_count(0.3, n) + slots);
    run.step(n, 1);
    EXPECT_EQ(run.log[0].count, gc::topk_count(0.05, n) + slots);
    run.step(n, 2);
    EXPECT_EQ(run.log[0].count, gc::topk_count(0.3, n) + slots);
    for (int s = 3; s < 6; ++s) run.step(n, s);
    EXPECT_EQ(run.log[0].count, gc::topk_count(0.01, n) + slots);
  }
}

// The cast plans' one-pass sum of what every rank sent (kernels::cpu::sum_widened): bitwise the
// composition it replaced (widen every block to fp32, reduce_blocks in rank order, round to the
// wire type, cast to the gradient's dtype) and a scalar reference written here, for fp16 and bf16
// wires, fp32/fp16/bf16 outputs, 1-5 blocks and sizes 0, 1, odd, around the 8-lane groups and
// large; values that are normal, subnormal, signed zeros, large enough that the sum overflows
// the wire type, Inf and NaN.
TEST(SumWidened, MatchesTheWidenSumNarrowCompositionBitwise) {
  namespace k = gc::kernels;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const gc::DType wire : {gc::DType::kFloat16, gc::DType::kBFloat16}) {
    const bool bf = wire == gc::DType::kBFloat16;
    auto narrow = [&](float v) { return bf ? gc::float_to_bf16(v) : gc::float_to_half(v); };
    auto widen = [&](uint16_t h) { return bf ? gc::bf16_to_float(h) : gc::half_to_float(h); };
    for (const size_t P : {size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}})
      for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9},
                              int64_t{1000}, int64_t{100003}}) {
        SCOPED_TRACE(::testing::Message() << (bf ? "bf16" : "fp16") << " P " << P << " n " << n);
        const size_t stride = static_cast<size_t>(n) + 3;  // blocks not back to back
        std::vector<uint16_t> blocks(P * stride + 1, 0);
        for (size_t r = 0; r < P; ++r)
          for (int64_t i = 0; i < n; ++i) {
            float v = nd(rng);
            switch (i % 11) {
              case 3:
                v *= 60000.0f;
                break;  // sums past fp16's 65504
              case 5:
                v = (r % 2) ? -0.0f : 0.0f;
                break;
              case 7:
                v *= 1e-6f;
                break;  // fp16 subnormals
              case 9:
                if (r == P - 1 && i % 3 == 0) v = INFINITY;
                break;
              case 10:
                if (r == 0 && i % 4 == 0) v = NAN;
                break;
              default:
                break;
            }
            blocks[r * stride + static_cast<size_t>(i)] = narrow(v);
            if (i % 13 == 12 && r == (static_cast<size_t>(i) / 13) % P) {
              // NaNs with payloads, signed, and signalling ones, written as raw bits: the F16C
              // path hands any group with a NaN to the scalar twin, whose payloads must be the
              // composition's
              static const uint16_t f16[] = {0x7e01, 0xfe55, 0x7c01, 0xfc3f};
              static const uint16_t b16[] = {0x7fc1, 0xff81, 0x7f81, 0xffa5};
              blocks[r * stride + static_cast<size_t>(i)] = (bf ? b16 : f16)[(i / 13) % 4];
            }
          }
        // the scalar reference and the composition the plans used before
        std::vector<uint16_t> ref(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          float acc = widen(blocks[static_cast<size_t>(i)]);
          for (size_t r = 1; r < P; ++r) acc += widen(blocks[r * stride + static_cast<size_t>(i)]);
          ref[static_cast<size_t>(i)] = narrow(acc);
        }
        std::vector<float> wide(P * stride);
        k::cpu::convert(blocks.data(), wire, wide.data(), gc::DType::kFloat32,
                        static_cast<int64_t>(P * stride), 1.0f);
        k::cpu::reduce_blocks(wide.data(), P, static_cast<size_t>(n), stride, gc::ElemType::kF32,
                              wide.data());
        std::vector<uint16_t> old_wire(static_cast<size_t>(n));
        k::cpu::convert(wide.data(), gc::DType::kFloat32, old_wire.data(), wire, n, 1.0f);
        ASSERT_EQ(ref, old_wire);

        std::vector<uint16_t> got_wire(static_cast<size_t>(n), 0xdead);
        for (const gc::DType out_t :
             {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16}) {
          std::vector<uint8_t> got(static_cast<size_t>(n) * gc::dtype_size(out_t) + 1, 0xab);
          std::vector<uint8_t> old(got.size(), 0xab);
          k::cpu::sum_widened(blocks.data(), wire, P, static_cast<size_t>(n), stride,
                              got_wire.data(), got.data(), out_t);
          EXPECT_EQ(got_wire, ref);
          k::cpu::convert(old_wire.data(), wire, old.data(), out_t, n, 1.0f);
          EXPECT_EQ(got, old) << gc::dtype_name(out_t);
        }
        // in place: the sum over block 0 itself, as the reduce-scatter route does (wire_out), and
        // the output in either 2-byte type over block 0 (out)
        auto in_place = blocks;
        k::cpu::sum_widened(in_place.data(), wire, P, static_cast<size_t>(n), stride,
                            in_place.data(), nullptr, wire);
        EXPECT_TRUE(std::equal(ref.begin(), ref.end(), in_place.begin()));
        EXPECT_TRUE(std::equal(in_place.begin() + static_cast<long>(stride), in_place.end(),
                               blocks.begin() + static_cast<long>(stride)));
        for (const gc::DType out_t : {gc::DType::kFloat16, gc::DType::kBFloat16}) {
          auto over = blocks;
          std::vector<uint16_t> want(static_cast<size_t>(n));
          k::cpu::convert(old_wire.data(), wire, want.data(), out_t, n, 1.0f);
          k::cpu::sum_widened(over.data(), wire, P, static_cast<size_t>(n), stride, nullptr,
                              over.data(), out_t);
          EXPECT_TRUE(std::equal(want.begin(), want.end(), over.begin()))
              << "out over block 0, " << gc::dtype_name(out_t);
        }
      }
  }
}

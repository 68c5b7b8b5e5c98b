// SPDX-License-Identifier: Apache-2.0
// Multi-rank tests (run by ctest under mpirun -np 1, 2, 3, 4). Bodies use the Communicator
// interface: each plan's result equals the single-process reference (run_plans_in_process on
// all ranks' inputs, and the independent scalar reference), bitwise and on every rank; the
// primitives; uneven and empty payloads; buckets of 0 and 1 elements; no memory growth over 200
// steps; mismatched bucket sizes reported with both sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "comm_reference.hpp"
#include "gradcomp/comm.hpp"
#include "gradcomp/make_plan.hpp"
#include "mpi_main.hpp"
#include "plans/cast_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gc = gradcomp;
using gc::test::rank_input;

namespace {

using gc::test::world;

/// Every rank holds the same bytes as rank 0.
bool consensus(gc::Communicator& comm, const void* data, size_t bytes) {
  std::vector<uint8_t> r0(static_cast<const uint8_t*>(data),
                          static_cast<const uint8_t*>(data) + bytes);
  comm.broadcast(r0.data(), r0.data(), bytes, gc::ElemType::kU8, 0);
  int64_t same = bytes == 0 || std::memcmp(r0.data(), data, bytes) == 0, all = 0;
  comm.allreduce(&same, &all, 1, gc::ElemType::kI64, gc::ReduceOp::kSum);
  return all == comm.size();
}

// Under AddressSanitizer freed memory stays resident in its quarantine (256 MiB by default), so
// resident memory says nothing about growth there: that build checks for leaks at exit instead,
// the others check RSS.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeasurable = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssMeasurable = false;
#else
constexpr bool kRssMeasurable = true;
#endif
#else
constexpr bool kRssMeasurable = true;
#endif

long rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return 0;
}

using RankFactory = std::function<std::unique_ptr<gc::test::RankPlan>(int rank)>;
/// Extra per-step check: (step, every rank's input, this rank's result).
using StepCheck =
    std::function<void(int step, const std::vector<std::vector<float>>& in, const float* got)>;

/// Runs `steps` steps of this rank's plan over MPI (PlanRunner: the size handshake on the first
/// step) and, in process, of P simulated ranks on all ranks' inputs; checks bitwise equality with
/// the simulation, the extra check, and consensus across ranks.
void check_rank_plans(const RankFactory& make, int steps, const StepCheck& check) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  auto mine = make(me);
  const int64_t n = mine->numel();
  std::vector<std::unique_ptr<gc::test::RankPlan>> sims;
  std::vector<gc::Plan*> raw;
  for (int r = 0; r < P; ++r) {
    sims.push_back(make(r));
    raw.push_back(&sims.back()->plan());
  }
  gc::PlanRunner runner(comm);
  const std::string name = mine->plan().name();
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> in;
    for (int r = 0; r < P; ++r) in.push_back(rank_input(n, r, s));
    auto g = in[me];
    mine->begin(g.data());
    runner.run(mine->plan(), 0);
    const float* got = mine->result(g.data());
    auto sim = in;
    for (int r = 0; r < P; ++r) sims[r]->begin(sim[r].data());
    gc::run_plans_in_process(raw);
    std::vector<float> want(sims[me]->result(sim[me].data()), sims[me]->result(sim[me].data()) + n);
    ASSERT_TRUE(gc::test::same_bits(want, got))
        << name << " n=" << n << " step " << s << ": MPI result differs from the "
        << "in-process simulation at " << gc::test::first_diff(want, got);
    if (check) check(s, in, got);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(consensus(comm, got, static_cast<size_t>(n) * sizeof(float)))
        << name << " step " << s;
  }
}

using Factory = std::function<std::unique_ptr<gc::GradientPlan>(int rank)>;

/// check_rank_plans for a bucket plan with an independent reference `ref` (all ranks'
/// inputs -> expected average), compared bitwise.
template <class Ref>
void check_against_reference(const Factory& make, int64_t n, int steps, Ref&& ref) {
  check_rank_plans([&](int r) { return std::make_unique<gc::test::GradientRankPlan>(make(r)); },
                   steps,
                   [&](int s, const std::vector<std::vector<float>>& in, const float* got) {
                     const std::vector<float> want = ref(in);
                     ASSERT_TRUE(gc::test::same_bits(want, got))
                         << "n=" << n << " step " << s << ": differs from the reference at "
                         << gc::test::first_diff(want, got);
                   });
}

const int64_t kSizes[] = {0, 1, 5, 1000, 100003};

}  // namespace

TEST(MpiComm, PrimitivesMatchOrderedReference) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{1000}, int64_t{300007}}) {
    std::vector<std::vector<float>> in;
    for (int r = 0; r < P; ++r) in.push_back(gc::test::normal(n, 99 + r));
    std::vector<float> out(static_cast<size_t>(n));
    comm.allreduce(in[me].data(), out.data(), n, gc::ElemType::kF32, gc::ReduceOp::kSum);
    std::vector<float> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      float a = in[0][i];
      for (int r = 1; r < P; ++r) a += in[r][i];
      want[i] = a;
    }
    EXPECT_TRUE(gc::test::same_bits(want, out.data())) << "allreduce n=" << n;
    auto inplace = in[me];
    comm.allreduce(inplace.data(), inplace.data(), n, gc::ElemType::kF32, gc::ReduceOp::kMean);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(inplace[i], want[i] / float(P)) << "mean i=" << i;
    // reduce-scatter: block b of every rank summed into rank b
    std::vector<float> blocks(static_cast<size_t>(n * P)), rs(static_cast<size_t>(n));
    for (int b = 0; b < P; ++b)
      for (int64_t i = 0; i < n; ++i) blocks[b * n + i] = in[me][i] * float(b + 1);
    comm.reduce_scatter(blocks.data(), rs.data(), n, gc::ElemType::kF32, gc::ReduceOp::kSum);
    for (int64_t i = 0; i < n; ++i) {
      float a = in[0][i] * float(me + 1);
      for (int r = 1; r < P; ++r) a += in[r][i] * float(me + 1);
      ASSERT_EQ(rs[i], a) << "reduce_scatter i=" << i;
    }
    // alltoall: block b from rank r carries r * 1000 + b
    std::vector<uint32_t> a2a(static_cast<size_t>(P) * 3), got(static_cast<size_t>(P) * 3);
    for (int b = 0; b < P; ++b)
      for (int j = 0; j < 3; ++j) a2a[b * 3 + j] = me * 1000 + b * 10 + j;
    comm.alltoall(a2a.data(), got.data(), 3, gc::ElemType::kU32);
    for (int r = 0; r < P; ++r)
      for (int j = 0; j < 3; ++j) ASSERT_EQ(got[r * 3 + j], uint32_t(r * 1000 + me * 10 + j));
  }
  // broadcast from the last rank, allgather
  int64_t v = 42 + me, all[8] = {};
  comm.broadcast(&v, &v, 1, gc::ElemType::kI64, P - 1);
  EXPECT_EQ(v, 42 + P - 1);
  int64_t mine = me * 7;
  comm.allgather(&mine, all, 1, gc::ElemType::kI64);
  for (int r = 0; r < P; ++r) EXPECT_EQ(all[r], r * 7);
  comm.barrier();
  EXPECT_THROW(comm.broadcast(&v, &v, 1, gc::ElemType::kI64, P), gc::InvalidArgument);
}

TEST(MpiComm, AllgatherVaryingUnevenAndEmpty) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  std::vector<uint8_t> mine(static_cast<size_t>(me) * 37);  // rank 0 sends nothing
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = uint8_t(me * 31 + i);
  gc::Buffer all(gc::Device::kCPU);
  std::vector<uint64_t> sizes;
  const size_t stride = comm.allgather_varying(mine.data(), mine.size(), all, sizes);
  EXPECT_EQ(stride % 8, 0u);
  EXPECT_GE(stride, size_t(P - 1) * 37);
  for (int r = 0; r < P; ++r) {
    ASSERT_EQ(sizes[r], uint64_t(r) * 37);
    const auto* p = static_cast<const uint8_t*>(all.data()) + r * stride;
    for (size_t i = 0; i < sizes[r]; ++i) ASSERT_EQ(p[i], uint8_t(r * 31 + i)) << r << " " << i;
  }
}

TEST(MpiPlans, DenseEqualsReference) {
  const int P = world().size();
  for (int64_t n : kSizes)
    check_against_reference(
        [&](int) { return std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P); }, n,
        2, gc::test::ref_dense);
}

TEST(MpiPlans, CastEqualsReference) {
  const int P = world().size();
  for (auto wire : {gc::DType::kFloat16, gc::DType::kBFloat16})
    for (int64_t n : kSizes)
      check_against_reference(
          [&](int) {
            return std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, wire, P);
          },
          n, 2, [&](const auto& in) { return gc::test::ref_cast(in, wire); });
}

TEST(MpiPlans, CastReduceScatterEqualsReference) {
  const int P = world().size();
  for (auto wire : {gc::DType::kFloat16, gc::DType::kBFloat16})
    for (int64_t n : kSizes)
      check_against_reference(
          [&](int) {
            return std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, wire, P,
                                                           gc::Device::kCPU, 0, nullptr,
                                                           gc::CastRoute::kReduceScatter);
          },
          n, 2, [&](const auto& in) { return gc::test::ref_cast_rs(in, wire); });
}

TEST(MpiPlans, TopKEqualsReferenceOnBothRoutes) {
  const int P = world().size();
  for (auto route : {gc::TopKRoute::kSparse, gc::TopKRoute::kDense})
    for (int64_t n : kSizes) {
      gc::TopKConfig cfg;
      cfg.ratio = 0.001;
      cfg.momentum = 0.9;
      gc::test::TopKReference ref(cfg, n, P);
      gc::TopKPlanOptions opt;
      opt.route = route;
      check_against_reference(
          [&](int) { return std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, opt); }, n, 3,
          [&](const auto& in) { return ref.step(in); });
      if (P > 1 && n >= 100000) {  // the ranks' payloads really had different lengths
        size_t lo = SIZE_MAX, hi = 0;
        for (size_t i = ref.sizes.size() - P; i < ref.sizes.size(); ++i) {
          lo = std::min(lo, ref.sizes[i]);
          hi = std::max(hi, ref.sizes[i]);
        }
        EXPECT_LT(lo, hi) << "n=" << n;
      }
    }
}

TEST(MpiPlans, TopKAutoRouteUsesMeasuredCostModel) {
  gc::Communicator& comm = world();
  const int P = comm.size();
  const gc::CostModel cm = gc::measure_cost_model(comm, 1 << 20);
  EXPECT_GT(cm.bandwidth_Bps, 0);
  EXPECT_GE(cm.latency_s, 0);
  const int64_t n = 20000;
  for (double ratio : {0.001, 0.9}) {
    gc::TopKConfig cfg;
    cfg.ratio = ratio;
    gc::test::TopKReference ref(cfg, n, P);
    check_against_reference(
        [&](int) {
          return std::make_unique<gc::TopKAllreducePlan>(cfg, n, P,
                                                         gc::TopKPlanOptions{.cost = cm});
        },
        n, 2, [&](const auto& in) { return ref.step(in); });
  }
  // a dense-enough bucket over a bandwidth-bound model goes dense
  gc::TopKConfig cfg;
  cfg.ratio = 0.9;
  gc::TopKAllreducePlan plan(cfg, n, P, {.cost = {.latency_s = 0, .bandwidth_Bps = 1e9}});
  auto g = rank_input(n, comm.rank(), 0);
  plan.begin(gc::TensorView::cpu(g.data(), n));
  gc::run_plan(plan, comm);
  // (P = 2: the ring sends n values either way, and the sparse route needs fewer rounds)
  EXPECT_EQ(plan.stats().last_route, P > 2 ? gc::TopKRoute::kDense : gc::TopKRoute::kSparse);
}

TEST(MpiPlans, RandomKEqualsReference) {
  const int P = world().size();
  for (int64_t n : kSizes) {
    gc::RandomKConfig cfg;
    cfg.ratio = 0.02;
    cfg.seed = 5;
    gc::test::RandomKReference ref(cfg, n, P);
    check_against_reference(
        [&](int) { return std::make_unique<gc::RandomKAllreducePlan>(cfg, n, P); }, n, 3,
        [&](const auto& in) { return ref.step(in); });
  }
}

TEST(MpiPlans, HierarchicalEqualsSimulationOnEveryLayout) {
  // every node size that divides the world: node and cross communicators from MPI_Comm_split,
  // each rank's plan driven by run_plan(plan, node, cross), against all ranks simulated here
  gc::MpiCommunicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  for (int L = 1; L <= P; ++L) {
    if (P % L) continue;
    auto node = comm.split(me / L, me);
    auto cross = comm.split(me % L, me);
    ASSERT_EQ(node->size(), L);
    ASSERT_EQ(cross->size(), P / L);
    for (const char* name : {"allreduce", "topk", "onebit", "quant"}) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}}) {
        SCOPED_TRACE(std::string(name) + " L=" + std::to_string(L) + " n=" + std::to_string(n));
        const gc::PlanOptions o =
            std::string(name) == "topk" ? gc::PlanOptions{{"ratio", 0.05}} : gc::PlanOptions{};
        auto spec = [&](int r) {
          gc::BucketSpec b;
          b.numel = n;
          b.world = P;
          b.rank = r;
          return b;
        };
        std::vector<std::unique_ptr<gc::BucketPlan>> sim;
        for (int r = 0; r < P; ++r) sim.push_back(gc::make_hierarchical_plan(name, spec(r), L, o));
        auto mine = gc::make_hierarchical_plan(name, spec(me), L, o);
        for (int64_t step = 0; step < 3; ++step) {
          std::vector<std::vector<float>> in;
          std::vector<gc::Plan*> ps;
          for (int r = 0; r < P; ++r) in.push_back(rank_input(n, r, step));
          for (int r = 0; r < P; ++r) {
            sim[r]->begin(gc::TensorView::cpu(in[r].data(), n));
            ps.push_back(sim[r].get());
          }
          gc::run_plans_in_process(ps, L);
          std::vector<float> g = rank_input(n, me, step);
          mine->begin(gc::TensorView::cpu(g.data(), n));
          gc::run_plan(*mine, *node, *cross);
          ASSERT_TRUE(g.empty() || std::memcmp(g.data(), in[me].data(), g.size() * 4) == 0)
              << "step " << step;
          ASSERT_TRUE(consensus(comm, g.data(), g.size() * 4));
        }
      }
    }
  }
}

gc::OneBitConfig onebit_cfg(gc::OneBitScaling s = gc::OneBitScaling::kSignL2) {
  gc::OneBitConfig cfg;
  cfg.scaling = s;
  return cfg;
}

TEST(MpiPlans, OneBitEqualsSimulationAndScalarReference) {
  const int P = world().size();
  for (auto sc : {gc::OneBitScaling::kSignL2, gc::OneBitScaling::kSignL1})
    for (int64_t n : kSizes) {
      SCOPED_TRACE("onebit n=" + std::to_string(n));
      check_rank_plans(
          [&](int r) {
            return std::make_unique<gc::test::OneBitRankPlan>(onebit_cfg(sc), n, P, r);
          },
          3,
          [&](int s, const std::vector<std::vector<float>>& in, const float* got) {
            if (s != 0 || sc != gc::OneBitScaling::kSignL2) return;
            // first step (no error carried in): the scalar reference, up to rounding; an average
            // within rounding of zero may take either sign
            const auto want = gc::test::ref_onebit_first_step(in);
            int64_t flips = 0;
            for (int64_t i = 0; i < n; ++i) {
              if (std::signbit(want[i]) != std::signbit(got[i])) {
                ++flips;
                continue;
              }
              ASSERT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i]) + 1e-7) << "i=" << i;
            }
            EXPECT_LE(flips, n / 1000) << "sign flips";
          });
    }
}

TEST(MpiPlans, PowerSGDEqualsSimulationAndExactForUncompressedTensors) {
  const int P = world().size();
  for (int64_t start_iter : {0, 1})
    for (const auto& shapes : gc::test::powersgd_layouts()) {
      const int64_t n = gc::test::bucket_numel(shapes);
      SCOPED_TRACE("powersgd n=" + std::to_string(n) + " start_iter " + std::to_string(start_iter));
      gc::PowerSGDConfig cfg;
      cfg.rank = 4;
      cfg.start_iter = start_iter;
      cfg.seed = 11;
      // which elements of the bucket are sent uncompressed (averaged exactly)
      gc::PowerSGDState probe(cfg, shapes);
      std::vector<char> exact(static_cast<size_t>(n), 0);
      int64_t off = 0;
      for (size_t t = 0; t < shapes.size(); ++t) {
        const int64_t len = gc::test::bucket_numel({shapes[t]});
        if (probe.tensor(t).rank == 0) std::fill(exact.begin() + off, exact.begin() + off + len, 1);
        off += len;
      }
      int compressed_steps = 0;
      check_rank_plans(
          [&](int) { return std::make_unique<gc::test::PowerSGDRankPlan>(cfg, shapes, P); }, 3,
          [&](int s, const std::vector<std::vector<float>>& in, const float* got) {
            const auto dense = gc::test::ref_dense(in);
            const bool plain = s < start_iter;
            compressed_steps += !plain;
            for (int64_t i = 0; i < n; ++i)
              if (plain || exact[i])
                ASSERT_EQ(std::memcmp(&dense[i], &got[i], 4), 0)
                    << "step " << s << " i=" << i << ": want the exact average " << dense[i]
                    << ", got " << got[i];
          });
      EXPECT_EQ(compressed_steps, 3 - start_iter);
    }
}

TEST(MpiPlans, OneBitAndPowerSGDTwoHundredStepsWithoutMemoryGrowth) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  gc::PowerSGDConfig pcfg;
  pcfg.rank = 4;
  std::vector<std::unique_ptr<gc::test::RankPlan>> plans;
  plans.push_back(std::make_unique<gc::test::OneBitRankPlan>(onebit_cfg(), 4099, P, me));
  plans.push_back(std::make_unique<gc::test::PowerSGDRankPlan>(
      pcfg, std::vector<std::vector<int64_t>>{{64, 3, 3, 3}, {64}, {48, 64}, {48, 64}, {7}}, P));
  gc::PlanRunner runner(comm);
  long rss0 = 0;
  std::vector<std::vector<float>> g(plans.size());
  for (int s = 0; s < 200; ++s) {
    for (size_t p = 0; p < plans.size(); ++p) {
      g[p] = rank_input(plans[p]->numel(), me, s % 7);
      plans[p]->begin(g[p].data());
      runner.run(plans[p]->plan(), p);
    }
    if (s == 20) rss0 = rss_kib();
  }
  if (kRssMeasurable) EXPECT_LT(rss_kib() - rss0, 1024) << "resident memory grew over 180 steps";
  // still consistent after 200 steps of error feedback
  for (size_t p = 0; p < plans.size(); ++p)
    EXPECT_TRUE(consensus(comm, plans[p]->result(g[p].data()), g[p].size() * sizeof(float)))
        << plans[p]->plan().name();
}

TEST(MpiPlans, TwoHundredStepsWithoutMemoryGrowth) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  const int64_t n = 4099;
  gc::TopKConfig tcfg;
  tcfg.ratio = 0.01;
  tcfg.select.method = gc::SelectMethod::kExact;
  gc::RandomKConfig rcfg;
  std::vector<std::unique_ptr<gc::GradientPlan>> plans;
  plans.push_back(std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P));
  plans.push_back(
      std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, gc::DType::kFloat16, P));
  plans.push_back(std::make_unique<gc::TopKAllreducePlan>(tcfg, n, P));
  plans.push_back(std::make_unique<gc::RandomKAllreducePlan>(rcfg, n, P));
  gc::PlanRunner runner(comm);
  std::vector<size_t> ws(plans.size());
  long rss0 = 0;
  for (int s = 0; s < 200; ++s) {
    auto g = rank_input(n, me, s % 7);
    for (size_t p = 0; p < plans.size(); ++p) {
      plans[p]->begin(gc::TensorView::cpu(g.data(), n));
      runner.run(*plans[p], p);
    }
    if (s == 20) {
      for (size_t p = 0; p < plans.size(); ++p) ws[p] = plans[p]->workspace_bytes();
      rss0 = rss_kib();
    }
  }
  for (size_t p = 0; p < plans.size(); ++p)
    EXPECT_EQ(plans[p]->workspace_bytes(), ws[p]) << plans[p]->name();
  if (kRssMeasurable) EXPECT_LT(rss_kib() - rss0, 1024) << "resident memory grew over 180 steps";
}

TEST(MpiPlans, MismatchedBucketSizesReportedWithBothSizes) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  const int64_t n = me == 1 ? 101 : 100;
  std::vector<float> g(static_cast<size_t>(n), 1.0f);
  gc::DenseAllreducePlan plan(n, gc::DType::kFloat32, P);
  plan.begin(gc::TensorView::cpu(g.data(), n));
  try {
    gc::run_plan(plan, comm);
    FAIL() << "mismatch not detected";
  } catch (const gc::InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("100"), std::string::npos) << msg;
    EXPECT_NE(msg.find("101"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  }
  // the gradient was not touched, and the communicator still works
  for (float x : g) ASSERT_EQ(x, 1.0f);
  // top-k without the driver's handshake: the plan's own size exchange catches it
  gc::TopKConfig cfg;
  cfg.ratio = 0.1;
  gc::TopKAllreducePlan tplan(cfg, n, P);
  tplan.begin(gc::TensorView::cpu(g.data(), n));
  try {
    gc::run_plan(tplan, comm, gc::Handshake::kNone);
    FAIL() << "top-k mismatch not detected";
  } catch (const gc::InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("100"), std::string::npos) << msg;
    EXPECT_NE(msg.find("101"), std::string::npos) << msg;
  }
  comm.barrier();
}

TEST(MpiPlans, OneBitAndPowerSGDMismatchedBucketsReportedWithBothSizes) {
  gc::Communicator& comm = world();
  const int P = comm.size(), me = comm.rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  auto expect_sizes = [&](gc::test::RankPlan& rp, std::vector<float>& g, const char* a,
                          const char* b) {
    const auto before = g;
    rp.begin(g.data());
    try {
      gc::run_plan(rp.plan(), comm);
      ADD_FAILURE() << rp.plan().name() << ": mismatch not detected";
    } catch (const gc::InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(a), std::string::npos) << msg;
      EXPECT_NE(msg.find(b), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    }
    EXPECT_EQ(g, before) << rp.plan().name() << ": the gradient was changed";
  };
  // 100 and 101 elements make 1-bit blocks of the same byte count: only the handshake sees it
  const int64_t n = me == 1 ? 101 : 100;
  std::vector<float> g(static_cast<size_t>(n), 1.0f);
  gc::test::OneBitRankPlan ob(onebit_cfg(), n, P, me);
  expect_sizes(ob, g, "100", "101");
  EXPECT_EQ(ob.p_.step(), 0);
  gc::PowerSGDConfig cfg;
  cfg.rank = 2;
  gc::test::PowerSGDRankPlan ps(cfg, {{10, me == 1 ? int64_t{11} : int64_t{10}}}, P);
  std::vector<float> h(static_cast<size_t>(ps.numel()), 1.0f);
  expect_sizes(ps, h, "100", "110");
  EXPECT_EQ(ps.st_.step(), 0);
  comm.barrier();
}

TEST(MpiPlans, PlanForOtherWorldSizeRejected) {
  gc::Communicator& comm = world();
  std::vector<float> g(4, 1.0f);
  gc::DenseAllreducePlan plan(4, gc::DType::kFloat32, comm.size() + 1);
  plan.begin(gc::TensorView::cpu(g.data(), 4));
  EXPECT_THROW(gc::run_plan(plan, comm, gc::Handshake::kNone), gc::InvalidArgument);
}

GC_MPI_TEST_MAIN()

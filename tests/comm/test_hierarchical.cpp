// SPDX-License-Identifier: Apache-2.0
// The two-level plan (HierarchicalPlan): against a reference built from its definition (the
// node means of each shard, in rank order in fp32, averaged across nodes by the family's flat
// plan), on several layouts and sizes; agreement between ranks; NaN steps; checkpoints; ranks on
// threads over real communicators.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/comm.hpp"
#include "gradcomp/make_plan.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/hierarchical_plan.hpp"
#include "test_util.hpp"

namespace gradcomp {
namespace {

using test::normal;

struct Layout {
  int nodes, per_node;
};

BucketSpec spec(int64_t n, int world, int rank, DType dt = DType::kFloat32) {
  BucketSpec b;
  b.numel = n;
  b.world = world;
  b.rank = rank;
  b.dtype = dt;
  b.bucket_id = 3;
  return b;
}

/// Options per family that compress hard enough to differ from plain averaging.
PlanOptions options_of(const std::string& name) {
  if (name == "topk") return {{"ratio", 0.05}};
  if (name == "randomk") return {{"ratio", 0.1}, {"dense_below", int64_t{0}}};
  if (name == "quant") return {{"bits", int64_t{4}}};
  if (name == "powersgd") return {{"rank", int64_t{2}}, {"min_compression_rate", 1.0}};
  return {};
}

/// Gradients of one step, rank by rank (a fixed pattern per rank and step).
std::vector<std::vector<float>> gradients(int P, int64_t n, int step) {
  std::vector<std::vector<float>> g;
  for (int r = 0; r < P; ++r) g.push_back(normal(n, 1000 * step + r + 1));
  return g;
}

std::vector<std::unique_ptr<BucketPlan>> hierarchical(
    const std::string& name, int64_t n, Layout l, const PlanOptions& o,
    const std::vector<std::vector<int64_t>>& shapes = {}) {
  std::vector<std::unique_ptr<BucketPlan>> plans;
  const int P = l.nodes * l.per_node;
  for (int r = 0; r < P; ++r) {
    BucketSpec b = spec(n, P, r);
    b.shapes = shapes;
    plans.push_back(make_hierarchical_plan(name, b, l.per_node, o));
  }
  return plans;
}

/// Begins every rank's plan on its gradient (in place); returns the ranks for the simulator.
std::vector<Plan*> begin_all(std::vector<std::unique_ptr<BucketPlan>>& plans,
                             std::vector<std::vector<float>>& g) {
  std::vector<Plan*> ps;
  for (size_t r = 0; r < plans.size(); ++r) {
    plans[r]->begin(TensorView::cpu(g[r].data(), static_cast<int64_t>(g[r].size())));
    ps.push_back(plans[r].get());
  }
  return ps;
}

/// One step of P ranks' plans over the lockstep simulator; returns every rank's output.
std::vector<std::vector<float>> step_all(std::vector<std::unique_ptr<BucketPlan>>& plans,
                                         std::vector<std::vector<float>> g, int per_node) {
  run_plans_in_process(begin_all(plans, g), per_node);
  return g;
}

/// The reference: for each local rank i, the node means of shard i (fp32, rank order, / L), zero
/// padded, averaged across the nodes by the family's flat plan built as the hierarchical plan
/// builds it; the shards back to back, cut to n.
class Reference {
 public:
  Reference(const std::string& name, int64_t n, Layout l, const PlanOptions& o,
            const std::vector<std::vector<int64_t>>& shapes = {})
      : n_(n), l_(l), c_(HierarchicalPlan::shard_elems(n, l.per_node)) {
    for (int i = 0; i < l.per_node; ++i) {
      std::vector<std::unique_ptr<BucketPlan>> row;
      for (int node = 0; node < l.nodes; ++node) {
        BucketSpec b = spec(c_, l.nodes, node);
        if (!shapes.empty() || l.per_node > 1)
          b.shapes = HierarchicalPlan::shard_shapes(shapes, n, l.per_node, i);
        b.bucket_id = 3u * static_cast<uint32_t>(l.per_node) + static_cast<uint32_t>(i);
        row.push_back(make_plan(name, b, o));
      }
      inner_.push_back(std::move(row));
    }
  }
  std::vector<float> step(const std::vector<std::vector<float>>& g) {
    std::vector<float> out(static_cast<size_t>(n_));
    for (int i = 0; i < l_.per_node; ++i) {
      std::vector<std::vector<float>> means;
      for (int node = 0; node < l_.nodes; ++node) {
        std::vector<float> m(static_cast<size_t>(c_), 0.0f);
        for (int64_t e = 0; e < c_; ++e) {
          const int64_t at = i * c_ + e;
          if (at >= n_) break;
          float acc = 0.0f;
          for (int q = 0; q < l_.per_node; ++q)
            acc += g[static_cast<size_t>(node * l_.per_node + q)][static_cast<size_t>(at)];
          m[static_cast<size_t>(e)] = acc / float(l_.per_node);
        }
        means.push_back(std::move(m));
      }
      if (l_.nodes > 1) {
        std::vector<Plan*> ps;
        for (int node = 0; node < l_.nodes; ++node) {
          inner_[i][node]->begin(TensorView::cpu(means[node].data(), c_));
          ps.push_back(inner_[i][node].get());
        }
        run_plans_in_process(ps);
      }
      for (int64_t e = 0; e < c_ && i * c_ + e < n_; ++e)
        out[static_cast<size_t>(i * c_ + e)] = means[0][static_cast<size_t>(e)];
    }
    return out;
  }

 private:
  int64_t n_;
  Layout l_;
  int64_t c_;
  std::vector<std::vector<std::unique_ptr<BucketPlan>>> inner_;
};

TEST(Hierarchical, ShardShapesCutRowsAndPad) {
  // a 5 x 3 matrix and a vector of 4: 19 elements in 2 shards of 10
  const std::vector<std::vector<int64_t>> s{{5, 3}, {4}};
  EXPECT_EQ(HierarchicalPlan::shard_shapes(s, 19, 2, 0),
            (std::vector<std::vector<int64_t>>{{3, 3}, {1}}));
  EXPECT_EQ(HierarchicalPlan::shard_shapes(s, 19, 2, 1),
            (std::vector<std::vector<int64_t>>{{2}, {1, 3}, {4}, {1}}));
  // more shards than elements: the empty shards are padding alone
  EXPECT_EQ(HierarchicalPlan::shard_shapes({}, 1, 3, 2), (std::vector<std::vector<int64_t>>{{1}}));
  EXPECT_EQ(HierarchicalPlan::shard_shapes({}, 0, 2, 1), (std::vector<std::vector<int64_t>>{}));
  EXPECT_THROW(HierarchicalPlan::shard_shapes({{4}}, 5, 2, 0), InvalidArgument);
}

TEST(Hierarchical, EveryFamilyMatchesItsDefinitionOnEveryLayout) {
  for (const std::string name : plan_names()) {
    for (const Layout l : {Layout{2, 2}, Layout{3, 1}, Layout{1, 4}, Layout{2, 3}}) {
      for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{40003}}) {
        if (name == "powersgd" && n < 7) continue;  // (covered by the shaped case below)
        SCOPED_TRACE(name + " " + std::to_string(l.nodes) + "x" + std::to_string(l.per_node) +
                     " n=" + std::to_string(n));
        const PlanOptions o = options_of(name);
        std::vector<std::vector<int64_t>> shapes;
        if (name == "powersgd" && n == 40003) shapes = {{200, 200}, {3}};
        auto plans = hierarchical(name, n, l, o, shapes);
        Reference ref(name, n, l, o, shapes);
        const int P = l.nodes * l.per_node;
        for (int step = 0; step < 3; ++step) {
          const auto g = gradients(P, n, step);
          const auto out = step_all(plans, g, l.per_node);
          const auto want = ref.step(g);
          for (int r = 0; r < P; ++r)
            ASSERT_TRUE(test::same_bytes(out[r].data(), want.data(), want.size() * 4))
                << "rank " << r << " step " << step;
        }
      }
    }
  }
}

TEST(Hierarchical, PlainAveragesEqualTheMeanOnHalfPrecisionBuckets) {
  // allreduce in the bucket's dtype: the node mean rounded once, then the flat average
  for (const DType dt : {DType::kFloat16, DType::kBFloat16}) {
    const int64_t n = 777;
    const Layout l{2, 2};
    std::vector<std::vector<uint16_t>> g(4, std::vector<uint16_t>(n));
    std::vector<std::vector<float>> gf(4);
    for (int r = 0; r < 4; ++r) {
      gf[r] = normal(n, 50 + r);
      kernels::cpu::convert(gf[r].data(), DType::kFloat32, g[r].data(), dt, n, 1.0f);
      kernels::cpu::convert(g[r].data(), dt, gf[r].data(), DType::kFloat32, n, 1.0f);
    }
    std::vector<std::unique_ptr<BucketPlan>> plans;
    std::vector<Plan*> ps;
    for (int r = 0; r < 4; ++r) {
      plans.push_back(make_hierarchical_plan("allreduce", spec(n, 4, r, dt), 2));
      const int64_t dims[1] = {n};
      plans[r]->begin(TensorView(g[r].data(), dims, 1, dt, Device::kCPU));
      ps.push_back(plans[r].get());
    }
    run_plans_in_process(ps, 2);
    for (int64_t e = 0; e < n; ++e) {
      const float exact = (gf[0][e] + gf[1][e] + gf[2][e] + gf[3][e]) / 4;
      float got;
      kernels::cpu::convert(&g[3][e], dt, &got, DType::kFloat32, 1, 1.0f);
      ASSERT_NEAR(got, exact, (dt == DType::kFloat16 ? 2e-3f : 2e-2f) * (1 + std::abs(exact)));
      for (int r = 0; r < 3; ++r) ASSERT_EQ(g[r][e], g[3][e]);
    }
  }
}

std::vector<std::vector<uint8_t>> states(const std::vector<std::unique_ptr<BucketPlan>>& plans) {
  std::vector<std::vector<uint8_t>> s;
  for (const auto& p : plans) s.push_back(p->state_dict());
  return s;
}

// An independent check of the definition on the one family where the two levels must agree with
// the flat plan: random-k draws the same indices on every rank and sums the values alone, so it
// is linear in the gradients (residual, momentum correction and masking included), and the
// average of the node means is the average. At full density every element is sent, so the
// two-level and the flat plan give the same average, step after step with momentum, to fp32
// rounding (the node mean adds one rounding).
TEST(Hierarchical, RandomKAtFullDensityEqualsTheFlatPlanStepAfterStep) {
  const Layout l{2, 2};
  const int P = l.nodes * l.per_node;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{40003}}) {
    SCOPED_TRACE(n);
    const PlanOptions o{{"ratio", 1.0}, {"momentum", 0.9}, {"dense_below", int64_t{0}}};
    auto two = hierarchical("randomk", n, l, o);
    std::vector<std::unique_ptr<BucketPlan>> flat;
    for (int r = 0; r < P; ++r) flat.push_back(make_plan("randomk", spec(n, P, r), o));
    for (int s = 0; s < 5; ++s) {
      const auto g = gradients(P, n, s);
      const auto a = step_all(two, g, l.per_node);
      const auto b = step_all(flat, g, 1);
      for (int r = 0; r < P; ++r)
        for (int64_t i = 0; i < n; ++i)
          ASSERT_NEAR(a[r][i], b[r][i], 1e-5f * (1.0f + std::abs(b[r][i])))
              << "step " << s << " rank " << r << " element " << i;
    }
  }
}

TEST(Hierarchical, CheckpointResumesBitwise) {
  for (const std::string name : {"topk", "randomk", "onebit", "quant", "powersgd"}) {
    SCOPED_TRACE(name);
    const int64_t n = 3001;
    const Layout l{2, 2};
    const PlanOptions o = options_of(name);
    const std::vector<std::vector<int64_t>> shapes{{30, 100}, {1}};
    auto a = hierarchical(name, n, l, o, shapes);
    for (int s = 0; s < 3; ++s) step_all(a, gradients(4, n, s), 2);
    const auto saved = states(a);
    auto b = hierarchical(name, n, l, o, shapes);
    for (int r = 0; r < 4; ++r) b[r]->load_state_dict(saved[r].data(), saved[r].size());
    for (int s = 3; s < 5; ++s) {
      const auto x = step_all(a, gradients(4, n, s), 2);
      const auto y = step_all(b, gradients(4, n, s), 2);
      for (int r = 0; r < 4; ++r) ASSERT_TRUE(test::same_bytes(x[r].data(), y[r].data(), n * 4));
    }
    // another layout's or another local rank's state is refused whole
    auto other = hierarchical(name, n, Layout{1, 4}, o, shapes);
    if (other[0]->stateful())
      EXPECT_THROW(other[0]->load_state_dict(saved[0].data(), saved[0].size()), InvalidArgument);
    const auto before = b[1]->state_dict();
    EXPECT_THROW(b[1]->load_state_dict(saved[0].data(), saved[0].size()), InvalidArgument);
    EXPECT_EQ(b[1]->state_dict(), before);
    auto flipped = saved[0];
    flipped[flipped.size() / 2] ^= 1;
    EXPECT_THROW(b[0]->load_state_dict(flipped.data(), flipped.size()), InvalidArgument);
    // a gathered checkpoint: each rank's own state on as many ranks; another world size, states
    // out of rank order or of another step are refused
    for (int r = 0; r < 4; ++r) EXPECT_EQ(reshard_state(saved, 4, r), saved[r]);
    EXPECT_THROW(reshard_state(saved, 2, 0), InvalidArgument);
    EXPECT_THROW(reshard_state({saved[1], saved[0], saved[2], saved[3]}, 4, 0), InvalidArgument);
    const auto later = states(a);
    EXPECT_THROW(reshard_state({saved[0], saved[1], saved[2], later[3]}, 4, 0), InvalidArgument);
  }
}

TEST(Hierarchical, ANonFiniteGradientSkipsTheStepOnEveryRankAndChangesNoState) {
  for (const std::string name : {"topk", "randomk", "onebit", "quant", "powersgd"}) {
    for (const OnNonFinite policy : {OnNonFinite::kSkip, OnNonFinite::kRaise}) {
      SCOPED_TRACE(name + (policy == OnNonFinite::kSkip ? " skip" : " raise"));
      const int64_t n = 2000;
      auto plans = hierarchical(name, n, Layout{2, 2}, options_of(name), {{20, 100}});
      for (auto& p : plans) p->set_on_nonfinite(policy);
      step_all(plans, gradients(4, n, 0), 2);
      const auto before = states(plans);
      auto g = gradients(4, n, 1);
      g[2][1500] = INFINITY;  // node 1, in local rank 1's shard
      const std::vector<Plan*> ps = begin_all(plans, g);
      if (policy == OnNonFinite::kRaise) {
        // every rank raises at the end of its step (the simulator rethrows the first)
        try {
          run_plans_in_process(ps, 2);
          FAIL() << "no exception";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
        }
      } else {
        run_plans_in_process(ps, 2);
      }
      for (int r = 0; r < 4; ++r) {
        EXPECT_TRUE(plans[r]->skipped()) << "rank " << r;
        for (int64_t e = 0; e < n; e += 97) ASSERT_TRUE(std::isnan(g[r][e]));
      }
      EXPECT_EQ(states(plans), before);
      // and the job goes on
      const auto next = step_all(plans, gradients(4, n, 2), 2);
      for (int r = 0; r < 4; ++r) EXPECT_FALSE(plans[r]->skipped());
      EXPECT_TRUE(std::isfinite(next[0][0]));
    }
  }
}

TEST(Hierarchical, RanksOfANodeAtDifferentStepsFailAndChangeNothing) {
  const int64_t n = 1000;
  const PlanOptions o = options_of("topk");
  auto plans = hierarchical("topk", n, Layout{2, 2}, o);
  step_all(plans, gradients(4, n, 0), 2);
  const auto at1 = states(plans);
  step_all(plans, gradients(4, n, 1), 2);
  // rank 1 alone goes back one step (an older checkpoint loaded into it)
  plans[1]->load_state_dict(at1[1].data(), at1[1].size());
  const auto before = states(plans);
  auto g = gradients(4, n, 2);
  const std::vector<Plan*> ps = begin_all(plans, g);
  try {
    run_plans_in_process(ps, 2);
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("different steps"), std::string::npos) << e.what();
  }
  EXPECT_EQ(states(plans), before);  // nothing committed anywhere
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(std::isnan(g[r][0])) << r;
  // once the states agree again the job goes on
  plans[0]->load_state_dict(at1[0].data(), at1[0].size());
  plans[2]->load_state_dict(at1[2].data(), at1[2].size());
  plans[3]->load_state_dict(at1[3].data(), at1[3].size());
  const auto out = step_all(plans, gradients(4, n, 2), 2);
  for (int r = 0; r < 4; ++r) EXPECT_FALSE(plans[r]->skipped());
  EXPECT_TRUE(std::isfinite(out[0][0]));
}

TEST(Hierarchical, OptionsThatDifferAcrossNodesFailOnEveryRank) {
  const int64_t n = 1000;
  std::vector<std::unique_ptr<BucketPlan>> plans;
  for (int r = 0; r < 4; ++r)
    plans.push_back(
        make_hierarchical_plan("topk", spec(n, 4, r), 2, {{"ratio", r < 2 ? 0.05 : 0.1}}));
  const auto before = states(plans);
  auto g = gradients(4, n, 0);
  const std::vector<Plan*> ps = begin_all(plans, g);
  EXPECT_THROW(run_plans_in_process(ps, 2), InvalidArgument);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(plans[r]->skipped()) << r;
  EXPECT_EQ(states(plans), before);
}

TEST(Hierarchical, ShardsWhosePlansAskForDifferentCollectivesProceedApart) {
  // PowerSGD on a bucket of a vector of 1000 and a 10 x 10 matrix in nodes of 2: shard 0 holds
  // only vector elements (one allreduce across nodes), shard 1 the matrix too (P and Q): the two
  // cross groups ask for different collectives while the node groups wait for both
  const int64_t n = 1100;
  const std::vector<std::vector<int64_t>> shapes{{1000}, {10, 10}};
  const PlanOptions o = options_of("powersgd");
  auto sim = hierarchical("powersgd", n, Layout{2, 2}, o, shapes);
  auto thr = hierarchical("powersgd", n, Layout{2, 2}, o, shapes);
  Reference ref("powersgd", n, Layout{2, 2}, o, shapes);
  InProcessGroup node0(2), node1(2), cross0(2), cross1(2);
  InProcessGroup* nodes[2] = {&node0, &node1};
  InProcessGroup* cross[2] = {&cross0, &cross1};
  for (int s = 0; s < 3; ++s) {
    const auto g = gradients(4, n, s);
    const auto want = ref.step(g);
    const auto out = step_all(sim, g, 2);
    auto t = g;
    std::vector<std::thread> ts;
    for (int r = 0; r < 4; ++r)
      ts.emplace_back([&, r] {
        thr[r]->begin(TensorView::cpu(t[r].data(), n));
        run_plan(*thr[r], nodes[r / 2]->comm(r % 2), cross[r % 2]->comm(r / 2));
      });
    for (auto& th : ts) th.join();
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(test::same_bytes(out[r].data(), want.data(), n * 4)) << r;
      ASSERT_TRUE(test::same_bytes(t[r].data(), want.data(), n * 4)) << r;
    }
  }
}

TEST(Hierarchical, OneRankPerNodeRaisesAsItsFamilyAndRecordsTheSkip) {
  // nodes of one rank: the family's plan runs on the bucket and applies the policy itself
  const int64_t n = 500;
  auto plans = hierarchical("topk", n, Layout{3, 1}, options_of("topk"));
  for (auto& p : plans) p->set_on_nonfinite(OnNonFinite::kRaise);
  auto g = gradients(3, n, 0);
  g[1][7] = NAN;
  const std::vector<Plan*> ps = begin_all(plans, g);
  EXPECT_THROW(run_plans_in_process(ps, 1), InvalidArgument);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(plans[r]->skipped()) << r;
    EXPECT_EQ(plans[r]->skipped_steps(), 1) << r;
  }
}

TEST(Hierarchical, RanksOfANodeWithOtherTensorShapesFail) {
  // the same bucket size cut into other tensors on one rank (another model, or buckets in
  // another order): the node's header hash differs, so the node's ranks raise instead of summing
  // unrelated shards (top-k: a family whose collectives do not depend on the shapes, so only the
  // header can tell)
  const int64_t n = 2000;
  std::vector<std::unique_ptr<BucketPlan>> plans;
  for (int r = 0; r < 4; ++r) {
    BucketSpec b = spec(n, 4, r);
    b.shapes = r == 1 ? std::vector<std::vector<int64_t>>{{40, 50}}
                      : std::vector<std::vector<int64_t>>{{50, 40}};
    plans.push_back(make_hierarchical_plan("topk", b, 2, options_of("topk")));
  }
  auto g = gradients(4, n, 0);
  const std::vector<Plan*> ps = begin_all(plans, g);
  try {
    run_plans_in_process(ps, 2);
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("options differ"), std::string::npos) << e.what();
  }
}

TEST(Hierarchical, BadLayoutsAreRefused) {
  EXPECT_THROW(make_hierarchical_plan("topk", spec(10, 4, 0), 3), InvalidArgument);
  EXPECT_THROW(make_hierarchical_plan("topk", spec(10, 4, 0), 0), InvalidArgument);
  EXPECT_THROW(make_hierarchical_plan("topk", spec(10, 4, 4), 2), InvalidArgument);
  EXPECT_THROW(make_hierarchical_plan("topk", spec(10, 4, 0), 2, {{"ratio", 2.0}}),
               InvalidArgument);
  EXPECT_THROW(make_hierarchical_plan("nope", spec(10, 4, 0), 2), InvalidArgument);
  // a hierarchical plan run as a flat one is refused before any collective moves
  auto p = make_hierarchical_plan("allreduce", spec(10, 2, 0), 2);
  std::vector<float> g(10, 1.0f);
  p->begin(TensorView::cpu(g.data(), 10));
  EXPECT_THROW(run_plans_in_process({p.get()}), InvalidArgument);
}

TEST(Hierarchical, RanksOnThreadsOverCommunicatorsMatchTheSimulator) {
  // 2 nodes x 2 ranks: a node group per node and a cross group per local rank, each its own
  // InProcessGroup, driven by run_plan(plan, node, cross) on one thread per rank
  for (const std::string name : {"topk", "onebit", "allreduce"}) {
    SCOPED_TRACE(name);
    const int64_t n = 5003;
    const PlanOptions o = options_of(name);
    auto sim = hierarchical(name, n, Layout{2, 2}, o);
    auto thr = hierarchical(name, n, Layout{2, 2}, o);
    InProcessGroup node0(2), node1(2), cross0(2), cross1(2);
    InProcessGroup* nodes[2] = {&node0, &node1};
    InProcessGroup* cross[2] = {&cross0, &cross1};
    for (int s = 0; s < 3; ++s) {
      const auto want = step_all(sim, gradients(4, n, s), 2);
      auto g = gradients(4, n, s);
      std::vector<std::thread> ts;
      for (int r = 0; r < 4; ++r)
        ts.emplace_back([&, r] {
          thr[r]->begin(TensorView::cpu(g[r].data(), n));
          run_plan(*thr[r], nodes[r / 2]->comm(r % 2), cross[r % 2]->comm(r / 2));
        });
      for (auto& t : ts) t.join();
      for (int r = 0; r < 4; ++r)
        ASSERT_TRUE(test::same_bytes(g[r].data(), want[r].data(), n * 4)) << r;
    }
  }
}

}  // namespace
}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// reshard_state(): a checkpoint of P ranks resumed on P' ranks, for every stateful family. What
// must hold (gradcomp/make_plan.hpp): the error-feedback mass, the sum over ranks of residuals /
// worker errors / errors divided by the world size, is the same before and after (to the one
// fp32 rounding of the mean), the momenta's the same, 1-bit's server errors laid end to end are
// the same vector exactly, PowerSGD's Q and every step counter are kept; P -> P gives each rank
// its own bytes back; the resharded states load into plans of P' ranks, which then train on in
// consensus. Bad inputs are refused with an error naming what is wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/error.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/powersgd.hpp"
#include "plan_variant.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/powersgd_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gc = gradcomp;

namespace {

using Variant = gc::test::PlanVariant;

std::vector<Variant> variants() {
  using S = std::string;
  return {
      {"topk", {{"ratio", 0.1}}},
      {"topk", {{"ratio", 0.1}, {"momentum", 0.9}}},
      {"randomk", {{"ratio", 0.1}, {"momentum", 0.9}, {"dense_below", int64_t{0}}}},
      {"randomk", {{"ratio", 0.1}, {"momentum", 0.9}, {"dense_below", int64_t{100}}}},
      {"onebit", {}},  // rotated blocks of 128
      {"onebit", {{"momentum", 0.9}}},
      {"onebit", {{"rotate", false}, {"block_size", int64_t{0}}}},  // one scale per chunk
      {"powersgd", {{"rank", int64_t{2}}}},
  };
}

// a matrix PowerSGD compresses and a vector it sends whole, when n allows
std::vector<std::vector<int64_t>> shapes_for(int64_t n) {
  if (n >= 200 && (n - 40) % 8 == 0) return {{8, (n - 40) / 8}, {40}};
  return {{n}};
}

std::unique_ptr<gc::BucketPlan> plan_for(const Variant& v, int64_t n, int P, int r) {
  gc::BucketSpec b = gc::test::rank_bucket(n, gc::DType::kFloat32, P, r, shapes_for(n));
  b.bucket_id = 3;
  return gc::make_plan(v.family, b, v.options);
}

using Plans = std::vector<std::unique_ptr<gc::BucketPlan>>;

// `steps` steps of random gradients on every rank; returns rank 0's averages of the last step
std::vector<float> train(Plans& plans, int64_t n, int steps, uint64_t seed) {
  std::vector<std::vector<float>> g(plans.size(), std::vector<float>(static_cast<size_t>(n)));
  for (int s = 0; s < steps; ++s) {
    std::vector<gc::Plan*> raw;
    for (size_t r = 0; r < plans.size(); ++r) {
      std::mt19937_64 rng(seed + 1000 * s + 7 * r);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (auto& x : g[r]) x = d(rng);
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      raw.push_back(plans[r].get());
    }
    gc::run_plans_in_process(raw);
    for (size_t r = 1; r < plans.size(); ++r)
      for (int64_t i = 0; i < n; ++i)  // consensus: every rank holds the same average
        EXPECT_EQ(std::memcmp(&g[r][i], &g[0][i], 4), 0) << "step " << s << " rank " << r;
  }
  return g[0];
}

std::vector<float> copy(const float* p, int64_t n) {
  return p ? std::vector<float>(p, p + n) : std::vector<float>();
}

// The arrays of one rank's state that resharding must conserve, read through the plans' own
// accessors (not by parsing the bytes): `mean` arrays add to the average with weight 1/P;
// `server` is 1-bit's server error of this rank's chunk; `q` is PowerSGD's Q.
struct Arrays {
  std::vector<std::vector<float>> mean;
  std::vector<float> server, q;
  int64_t chunk = 0, step = 0;
};

Arrays arrays_of(gc::BucketPlan& plan, int64_t n) {
  Arrays a;
  if (auto* t = dynamic_cast<gc::TopKAllreducePlan*>(&plan)) {
    a.mean = {copy(t->compressor().residual(), n), copy(t->compressor().momentum_buffer(), n)};
    a.step = t->compressor().step();
  } else if (auto* rk = dynamic_cast<gc::RandomKAllreducePlan*>(&plan)) {
    a.mean = {copy(rk->compressor().residual(), n), copy(rk->compressor().momentum_buffer(), n)};
    a.step = rk->compressor().step();
  } else if (auto* o = dynamic_cast<gc::OneBitAllreducePlan*>(&plan)) {
    a.mean = {copy(o->worker_error(), n), copy(o->momentum_buffer(), n)};
    a.chunk = o->chunk_elems();
    a.server = copy(o->server_error(), a.chunk);
    a.step = o->step();
  } else {
    auto& st = dynamic_cast<gc::PowerSGDPlan&>(plan).state();
    std::vector<float> e;
    for (size_t i = 0; i < st.num_tensors(); ++i) {
      const auto ei = st.error(i), qi = st.q(i);
      e.insert(e.end(), ei.begin(), ei.end());
      a.q.insert(a.q.end(), qi.begin(), qi.end());
    }
    a.mean = {e};
    a.step = st.step();
  }
  return a;
}

// element-wise mean over ranks of arrays[k], in double
std::vector<double> rank_mean(const std::vector<Arrays>& ranks, size_t k) {
  std::vector<double> m(ranks[0].mean[k].size(), 0.0);
  for (const auto& a : ranks)
    for (size_t i = 0; i < m.size(); ++i) m[i] += a.mean[k][i];
  for (double& x : m) x /= static_cast<double>(ranks.size());
  return m;
}

// 1-bit's server errors laid end to end over the bucket
std::vector<float> server_vector(const std::vector<Arrays>& ranks, int64_t n) {
  std::vector<float> s;
  for (const auto& a : ranks) s.insert(s.end(), a.server.begin(), a.server.end());
  s.resize(static_cast<size_t>(n));
  return s;
}

std::vector<std::vector<uint8_t>> states_of(const Plans& plans) {
  std::vector<std::vector<uint8_t>> s;
  for (const auto& p : plans) s.push_back(p->state_dict());
  return s;
}

// P ranks of plans trained `steps` steps, with their states and conserved arrays
struct Job {
  Plans plans;
  std::vector<std::vector<uint8_t>> states;
  std::vector<Arrays> arrays;
};

Job trained(const Variant& v, int64_t n, int P, int steps, uint64_t seed) {
  Job j;
  for (int r = 0; r < P; ++r) j.plans.push_back(plan_for(v, n, P, r));
  train(j.plans, n, steps, seed);
  j.states = states_of(j.plans);
  for (auto& p : j.plans) j.arrays.push_back(arrays_of(*p, n));
  return j;
}

// the P2 ranks of a new job, each loading its reshard_state() of `states`
Plans resharded(const Variant& v, const std::vector<std::vector<uint8_t>>& states, int64_t n,
                int P2) {
  Plans fresh;
  for (int r = 0; r < P2; ++r) {
    const auto st = gc::reshard_state(states, P2, r);
    fresh.push_back(plan_for(v, n, P2, r));
    fresh.back()->load_state_dict(st.data(), st.size());
  }
  return fresh;
}

// `steps` steps of zero gradients on every rank: what rank 0's averages add up to (the residual
// the job still sends)
std::vector<double> drain(Plans& plans, int64_t n, int steps) {
  std::vector<double> sent(static_cast<size_t>(n), 0.0);
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> g(plans.size(), std::vector<float>(n, 0.0f));
    std::vector<gc::Plan*> raw;
    for (size_t r = 0; r < plans.size(); ++r) {
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      raw.push_back(plans[r].get());
    }
    gc::run_plans_in_process(raw);
    for (int64_t i = 0; i < n; ++i) sent[i] += g[0][i];
  }
  return sent;
}

}  // namespace

TEST(Reshard, ConservesErrorFeedbackMassAndTrainsOnInEveryFamily) {
  int checked = 0;
  for (const Variant& v : variants())
    for (auto [P, P2] : {std::pair{4, 2}, std::pair{2, 3}, std::pair{3, 1}, std::pair{1, 4}})
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4137}}) {
        SCOPED_TRACE(gc::test::describe(v) + " P=" + std::to_string(P) + " -> " +
                     std::to_string(P2) + " n=" + std::to_string(n));
        const Job old = trained(v, n, P, 5, 11);
        const auto& states = old.states;
        const auto& before = old.arrays;

        Plans fresh;
        std::vector<Arrays> after;
        for (int r = 0; r < P2; ++r) {
          const auto st = gc::reshard_state(states, P2, r);
          fresh.push_back(plan_for(v, n, P2, r));
          ASSERT_NO_THROW(fresh.back()->load_state_dict(st.data(), st.size()));
          after.push_back(arrays_of(*fresh.back(), n));
          EXPECT_EQ(after.back().step, before[0].step);
        }
        // the mass of every additive array: the new mean is the old one rounded once to fp32
        for (size_t k = 0; k < before[0].mean.size(); ++k) {
          const auto m0 = rank_mean(before, k), m1 = rank_mean(after, k);
          ASSERT_EQ(m0.size(), m1.size());
          double worst = 0.0, mass = 0.0;
          for (size_t i = 0; i < m0.size(); ++i) {
            EXPECT_LE(std::fabs(m1[i] - m0[i]), std::fabs(m0[i]) * 0x1p-24 + 1e-300)
                << "array " << k << " element " << i;
            worst = std::max(worst, std::fabs(m1[i] - m0[i]));
            mass += std::fabs(m0[i]);
          }
          // the test must see some mass: at n = 1000 every family keeps some (a matrix for
          // PowerSGD, sampled elements for random-k; momentum off: the array is empty)
          if (n == 1000 && !m0.empty())
            EXPECT_GT(mass, 0.0) << "array " << k << " is zero: nothing was tested";
        }
        if (!before[0].server.empty()) {  // 1-bit: the server errors, exactly
          const auto s0 = server_vector(before, n), s1 = server_vector(after, n);
          EXPECT_EQ(std::memcmp(s0.data(), s1.data(), 4 * s0.size()), 0);
        }
        for (const auto& a : after)  // PowerSGD's Q, exactly
          EXPECT_EQ(a.q, before[0].q);
        train(fresh, n, 3, 99);  // the new job trains on, in consensus
        ++checked;
      }
  EXPECT_EQ(checked, 8 * 4 * 4);
}

TEST(Reshard, SameWorldSizeGivesEachRankItsOwnBytes) {
  for (const Variant& v : variants()) {
    SCOPED_TRACE(gc::test::describe(v));
    const int P = 3;
    const int64_t n = 1000;
    const auto states = trained(v, n, P, 4, 5).states;
    for (int r = 0; r < P; ++r) EXPECT_EQ(gc::reshard_state(states, P, r), states[r]);
  }
}

// The residual that resharding conserves is what the ranks will still send: with zero gradients
// from then on, top-k drains every residual, and the averages it sends add up to the old job's
// mean residual, on the old world size and on the new one alike.
TEST(Reshard, TopKResidualIsWhatTheNewJobStillSends) {
  const Variant v{"topk", {{"ratio", 0.25}}};
  const int64_t n = 1000;
  const int P = 4, P2 = 3;
  Job old = trained(v, n, P, 4, 21);
  const auto& states = old.states;
  const auto mass = rank_mean(old.arrays, 0);

  Plans fresh = resharded(v, states, n, P2);
  // ratio 0.25: four steps empty each residual
  const auto sent_old = drain(old.plans, n, 12), sent_new = drain(fresh, n, 12);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(sent_old[i], mass[i], 1e-5 * (1 + std::fabs(mass[i]))) << i;
    EXPECT_NEAR(sent_new[i], mass[i], 1e-5 * (1 + std::fabs(mass[i]))) << i;
    total += std::fabs(mass[i]);
  }
  EXPECT_GT(total, 1.0);
}

// Random-k's resharded residual is, as top-k's, what the new job still sends, at random-k's pace:
// with zero gradients from then on an element's residual goes out whole at the first step that
// samples it, and each step samples each element with probability `ratio` (one element of each
// stratum of 1 / ratio elements, drawn afresh at every step), so after T steps the expected share
// of the residual not sent yet is (1 - ratio)^T (0.95^40 = 0.129 here; at 1% after 80 steps
// 0.45), where top-k, sending the largest first, empties it in 1 / ratio steps. That share is
// random-k's, not the resharding's: the resharded job sends what the old one would have, element
// by element (the indices depend on the seed, the step and the bucket, all kept), and what was
// sent plus what is left is the old mean residual. With momentum (and DGC's masking) an element's
// momentum keeps adding to its residual until the element is sent and is then dropped, so what is
// sent is not the residual alone; the resharded job still sends what the old one would have.
TEST(Reshard, RandomKResidualDrainsAtItsDensity) {
  const int64_t n = 4000;
  const int P = 4, P2 = 3, T = 40;
  const double ratio = 0.05;
  for (double momentum : {0.0, 0.9}) {
    const Variant v{"randomk",
                    {{"ratio", ratio}, {"momentum", momentum}, {"dense_below", int64_t{0}}}};
    SCOPED_TRACE(gc::test::describe(v));
    Job old = trained(v, n, P, 4, 21);
    const auto mass = rank_mean(old.arrays, 0);
    Plans fresh = resharded(v, old.states, n, P2);
    // T steps of zero gradients: what rank 0's averages add up to, and the mean residual left
    auto left_after = [&](Plans& plans) {
      std::vector<Arrays> after;
      for (auto& p : plans) after.push_back(arrays_of(*p, n));
      return rank_mean(after, 0);
    };
    const auto sent_old = drain(old.plans, n, T);
    const auto left_old = left_after(old.plans);
    const auto sent_new = drain(fresh, n, T);
    const auto left_new = left_after(fresh);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(sent_new[i], sent_old[i], 1e-5 * (1 + std::fabs(sent_old[i]))) << i;
      ASSERT_NEAR(left_new[i], left_old[i], 1e-5 * (1 + std::fabs(left_old[i]))) << i;
    }
    if (momentum > 0.0) continue;
    int64_t left_whole = 0, sent_whole = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double tol = 1e-5 * (1 + std::fabs(mass[i]));
      ASSERT_NEAR(sent_new[i] + left_new[i], mass[i], tol) << i;
      if (mass[i] == 0.0) continue;
      const bool left = left_new[i] != 0.0;  // never sampled: its residual whole, nothing sent
      ASSERT_NEAR(left ? left_new[i] : sent_new[i], mass[i], tol) << i;
      ++(left ? left_whole : sent_whole);
    }
    ASSERT_GT(left_whole + sent_whole, n / 2) << "little residual: the test does not test";
    const double share =
        static_cast<double>(left_whole) / static_cast<double>(left_whole + sent_whole);
    // (binomial: the standard deviation of the share is 0.005 here)
    EXPECT_NEAR(share, std::pow(1.0 - ratio, T), 0.03);
  }
}

// A resharded state is a state like any other: a step where one rank's gradient overflows (an
// fp16 run's NaN/Inf) is skipped on every rank of the new job and leaves the state as loaded.
TEST(Reshard, AnOverflowStepAfterResumingLeavesTheStateAsLoaded) {
  const int64_t n = 1000;
  const int P = 4, P2 = 3;
  for (const Variant& v : variants()) {
    SCOPED_TRACE(gc::test::describe(v));
    const auto states = trained(v, n, P, 3, 7).states;
    Plans fresh;
    std::vector<std::vector<uint8_t>> loaded;
    for (int r = 0; r < P2; ++r) {
      loaded.push_back(gc::reshard_state(states, P2, r));
      fresh.push_back(plan_for(v, n, P2, r));
      fresh.back()->load_state_dict(loaded.back().data(), loaded.back().size());
    }
    std::vector<std::vector<float>> g(P2, std::vector<float>(n, 0.5f));
    g[1][17] = std::numeric_limits<float>::infinity();
    std::vector<gc::Plan*> raw;
    for (int r = 0; r < P2; ++r) {
      fresh[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      raw.push_back(fresh[r].get());
    }
    gc::run_plans_in_process(raw);
    for (int r = 0; r < P2; ++r) {
      EXPECT_TRUE(fresh[r]->skipped()) << "rank " << r;
      EXPECT_EQ(fresh[r]->state_dict(), loaded[r]) << "rank " << r << ": state changed";
    }
    train(fresh, n, 2, 3);  // and the next steps run, in consensus
  }
}

TEST(Reshard, RefusesStatesThatAreNotOneJobsStep) {
  const int64_t n = 500;
  auto job = [&](const Variant& v, int P, int steps) { return trained(v, n, P, steps, 3).states; };
  auto refused = [](const std::vector<std::vector<uint8_t>>& s, int world, int rank,
                    const std::string& says) {
    try {
      gc::reshard_state(s, world, rank);
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "accepted; expected an error saying '" << says << "'";
  };
  const Variant tk{"topk", {{"ratio", 0.1}}}, ob{"onebit", {}},
      ps{"powersgd", {{"rank", int64_t{2}}}};
  const auto a = job(tk, 2, 3), b = job(tk, 2, 4);
  refused({}, 2, 0, "no states");
  refused(a, 2, 2, "not a rank");
  refused(a, 0, 0, "not a rank");
  refused(a, 2, -1, "not a rank");
  refused({a[0], b[1]}, 3, 0, "step");  // ranks saved after different steps
  refused({a[0], b[1]}, 2, 0, "step");  // also on as many ranks
  auto flipped = a;
  flipped[1][40] ^= 1;
  refused(flipped, 3, 0, "rank 1's state_dict: checksum");
  const auto o = job(ob, 3, 2);
  refused({o[1], o[0], o[2]}, 2, 0, "saved by rank");  // out of rank order
  refused({o[0], o[1]}, 2, 0, "3 ranks, 2 were given");
  refused({a[0], o[1]}, 2, 0, "rank 1's state_dict: saved by a 'onebit-allreduce'");
  const auto q = job(ps, 2, 3), q4 = job(ps, 2, 4);
  refused({q[0], q4[1]}, 3, 0, "step");
  // a per-tensor codec's state is not a plan's
  gc::OneBitConfig cfg;
  gc::OneBitCompressor codec(cfg, 4, 8);
  const auto cs = codec.state_dict();
  refused({cs}, 2, 0, "not a bucket plan's");
}

// SPDX-License-Identifier: Apache-2.0
// PowerSGD on the CPU: against an independent double-precision reference of Algorithm 1, an SVD
// (LAPACKE), simulated ranks, the collectives of the plan, bad input and state round trips.
#include <lapacke.h>
#include <omp.h>

#include <algorithm>
#include <memory>

#include "gradcomp/detail/numeric.hpp"
#include "kernels/powersgd_kernels.hpp"
#include "plans/powersgd_plan.hpp"
#include "psgd_test_util.hpp"

namespace gradcomp::test {
namespace {

PowerSGDConfig cfg_rank(int r) {
  PowerSGDConfig c;
  c.rank = r;
  return c;
}

std::vector<float> to_f(const std::vector<double>& v) { return {v.begin(), v.end()}; }

// ---------------------------------------------------------------- orthogonalization kernels

struct OrthCase {
  int64_t n;
  int r;
};

std::vector<float> gram_defect(const std::vector<float>& p, int64_t n, int r,
                               std::vector<bool>* zero_cols) {
  zero_cols->assign(r, false);
  for (int c = 0; c < r; ++c) {
    bool z = true;
    for (int64_t i = 0; i < n; ++i) z = z && p[i * r + c] == 0.0f;
    (*zero_cols)[c] = z;
  }
  std::vector<float> d;
  for (int a = 0; a < r; ++a)
    for (int b = 0; b < r; ++b) {
      if ((*zero_cols)[a] || (*zero_cols)[b]) continue;
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += double(p[i * r + a]) * p[i * r + b];
      d.push_back(static_cast<float>(std::fabs(s - (a == b ? 1.0 : 0.0))));
    }
  return d;
}

TEST(PowerSGDOrth, FusedMatchesScalarReferenceOnManySizes) {
  kernels::PsgdContext ctx(Device::kCPU);
  for (OrthCase oc : {OrthCase{1, 1}, OrthCase{7, 3}, OrthCase{100, 4}, OrthCase{33, 8},
                      OrthCase{20000, 4}, OrthCase{9000, 8}, OrthCase{64, 32}, OrthCase{5, 5}}) {
    for (int batch : {1, 3}) {
      std::vector<float> p = normal(oc.n * oc.r * batch, 11 + oc.n + oc.r);
      for (Orthogonalization how :
           {Orthogonalization::kGramSchmidt, Orthogonalization::kGramSchmidtUnfused,
            Orthogonalization::kHouseholder}) {
        std::vector<float> q = p;
        kernels::cpu::orthogonalize(q.data(), batch, oc.n, oc.r, 0.0f, how, ctx);
        for (int b = 0; b < batch; ++b) {
          std::vector<double> ref(p.begin() + b * oc.n * oc.r, p.begin() + (b + 1) * oc.n * oc.r);
          ref_orth(ref, oc.n, oc.r);
          std::vector<float> got(q.begin() + b * oc.n * oc.r, q.begin() + (b + 1) * oc.n * oc.r);
          std::vector<bool> zc;
          for (float d : gram_defect(got, oc.n, oc.r, &zc))
            ASSERT_LT(d, 2e-5) << oc.n << "x" << oc.r;
          for (bool z : zc) EXPECT_FALSE(z);
          if (how == Orthogonalization::kHouseholder) {
            // Householder columns may differ in sign: compare |<q_c, ref_c>| = 1.
            for (int c = 0; c < oc.r; ++c) {
              double d = 0;
              for (int64_t i = 0; i < oc.n; ++i) d += got[i * oc.r + c] * ref[i * oc.r + c];
              EXPECT_NEAR(std::fabs(d), 1.0, 1e-3) << oc.n << "x" << oc.r << " col " << c;
            }
          } else {
            EXPECT_LT(rel_err(got, ref), 1e-3) << oc.n << "x" << oc.r << " how " << int(how);
          }
        }
      }
    }
  }
}

TEST(PowerSGDOrth, ZeroAndDuplicateColumnsNeverNaN) {
  kernels::PsgdContext ctx(Device::kCPU);
  for (int64_t n : {6, 50, 20000}) {
    const int r = 5;
    std::vector<float> p = normal(n * r, 3 + n);
    for (int64_t i = 0; i < n; ++i) {
      p[i * r + 1] = 0.0f;                 // zero column
      p[i * r + 3] = p[i * r + 0];         // duplicate of column 0
      p[i * r + 4] = 2.0f * p[i * r + 2];  // parallel to column 2
    }
    for (float eps : {0.0f, 1e-8f}) {
      for (Orthogonalization how :
           {Orthogonalization::kGramSchmidt, Orthogonalization::kHouseholder}) {
        std::vector<float> q = p;
        kernels::cpu::orthogonalize(q.data(), 1, n, r, eps, how, ctx);
        for (float x : q) ASSERT_TRUE(std::isfinite(x));
        std::vector<bool> zc;
        for (float d : gram_defect(q, n, r, &zc)) EXPECT_LT(d, 2e-5) << "n " << n;
        if (how == Orthogonalization::kGramSchmidt) {
          EXPECT_FALSE(zc[0]);
          EXPECT_TRUE(zc[1]);
          EXPECT_FALSE(zc[2]);
          EXPECT_TRUE(zc[3]);
          EXPECT_TRUE(zc[4]);
        } else {
          for (bool z : zc) EXPECT_FALSE(z);  // Householder: always r orthonormal columns
        }
      }
    }
  }
}

TEST(PowerSGDOrth, EpsilonFollowsPyTorchFormula) {
  kernels::PsgdContext ctx(Device::kCPU);
  std::vector<float> p = {3.0f, 4.0f};  // n = 2, r = 1: norm 5
  kernels::cpu::orthogonalize(p.data(), 1, 2, 1, 1.0f, Orthogonalization::kGramSchmidt, ctx);
  EXPECT_FLOAT_EQ(p[0], 0.5f);  // 3 / (5 + 1)
  EXPECT_FLOAT_EQ(p[1], 4.0f / 6.0f);
}

// ---------------------------------------------------------------- algorithm

TEST(PowerSGD, RankRMatrixReproducedAfterOneStep) {
  for (int true_rank : {1, 3}) {
    for (int r : {true_rank, true_rank + 2}) {
      const int64_t n = 40, m = 30;
      auto a = normal(n * true_rank, 1), b = normal(m * true_rank, 2);
      Bucket bk({{n, m}}, 0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < m; ++j) {
          float s = 0;
          for (int c = 0; c < true_rank; ++c) s += a[i * true_rank + c] * b[j * true_rank + c];
          bk.data[0][i * m + j] = s;
        }
      const auto M = bk.data[0];
      PowerSGDState st(cfg_rank(r), bk.shapes);
      step_ranks({&st}, {&bk});
      std::vector<double> Md(M.begin(), M.end());
      EXPECT_LT(rel_err(bk.data[0], Md), 2e-5) << "true rank " << true_rank << " r " << r;
      EXPECT_EQ(st.last_stats().rank_used[0], r);
    }
  }
}

TEST(PowerSGD, PowerIterationApproachesBestRankRError) {
  const int64_t n = 48, m = 36;
  const int r = 4;
  // M = A diag(0.8^i) B: a decaying spectrum, as gradients have.
  auto A = normal(n * m, 5), B = normal(m * m, 6);
  std::vector<float> M(n * m, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < m; ++k) {
      const float s = A[i * m + k] * std::pow(0.8f, static_cast<float>(k));
      for (int64_t j = 0; j < m; ++j) M[i * m + j] += s * B[k * m + j];
    }
  std::vector<double> Md(M.begin(), M.end());
  // Best rank-r error from the singular values (LAPACKE dgesdd).
  std::vector<double> a = Md, sv(m);
  // (row-major n x m is column-major m x n: the same singular values)
  ASSERT_EQ(
      LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'N', m, n, a.data(), m, sv.data(), nullptr, 1, nullptr, 1),
      0);
  double best = 0, total = 0;
  for (int64_t i = 0; i < m; ++i) total += sv[i] * sv[i];
  for (int64_t i = r; i < m; ++i) best += sv[i] * sv[i];
  best = std::sqrt(best);
  PowerSGDConfig c = cfg_rank(r);
  c.error_feedback = false;  // the same matrix every step: plain power iteration
  PowerSGDState st(c, {{n, m}});
  std::vector<double> errs;
  for (int k = 0; k < 30; ++k) {
    Bucket bk({{n, m}}, 0);
    bk.data[0] = M;
    step_ranks({&st}, {&bk});
    double e = 0;
    for (int64_t i = 0; i < n * m; ++i) e += (bk.data[0][i] - Md[i]) * (bk.data[0][i] - Md[i]);
    errs.push_back(std::sqrt(e));
  }
  EXPECT_GT(errs[0], 1.02 * best);  // one iteration from a random Q is not optimal ...
  EXPECT_LT(errs.back(), 1.001 * best + 1e-4 * std::sqrt(total));  // ... k iterations are
  EXPECT_GE(errs.back(), best * (1 - 1e-4));                       // and nothing beats the SVD
  EXPECT_LT(errs[5], errs[0]);
}

TEST(PowerSGD, ErrorFeedbackInvariantOver50Steps) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Shapes shapes = {{24, 18}, {24}, {10, 3, 3}, {24, 18}};
    const int P = 2;
    PowerSGDConfig c = cfg_rank(2);
    std::vector<std::unique_ptr<PowerSGDState>> st;
    for (int p = 0; p < P; ++p) st.push_back(std::make_unique<PowerSGDState>(c, shapes, dt));
    std::vector<std::vector<double>> in_sum(shapes.size()), out_sum(shapes.size());
    for (size_t i = 0; i < shapes.size(); ++i) {
      in_sum[i].assign(numel_of(shapes[i]), 0.0);
      out_sum[i].assign(numel_of(shapes[i]), 0.0);
    }
    for (int t = 0; t < 50; ++t) {
      std::vector<std::vector<std::vector<uint16_t>>> half(P);
      std::vector<Bucket> bk;
      for (int p = 0; p < P; ++p) bk.emplace_back(shapes, 1000 + t * 7 + p);
      std::vector<std::unique_ptr<PowerSGDPlan>> plans;
      std::vector<Plan*> raw;
      for (int p = 0; p < P; ++p) {
        std::vector<TensorView> v;
        half[p].resize(shapes.size());
        for (size_t i = 0; i < shapes.size(); ++i) {
          half[p][i].resize(bk[p].data[i].size());
          for (size_t e = 0; e < bk[p].data[i].size(); ++e) {
            half[p][i][e] = float_to_bf16(bk[p].data[i][e]);
            const double x =
                dt == DType::kFloat32 ? bk[p].data[i][e] : bf16_to_float(half[p][i][e]);
            in_sum[i][e] += x / P;
          }
          v.push_back(dt == DType::kFloat32
                          ? bk[p].views()[i]
                          : TensorView(half[p][i].data(), shapes[i].data(),
                                       static_cast<int>(shapes[i].size()), dt, Device::kCPU));
        }
        plans.push_back(std::make_unique<PowerSGDPlan>(*st[p], P));
        plans.back()->begin(v);
        raw.push_back(plans.back().get());
      }
      run_plans_in_process(raw);
      for (size_t i = 0; i < shapes.size(); ++i)
        for (size_t e = 0; e < out_sum[i].size(); ++e)
          out_sum[i][e] += dt == DType::kFloat32 ? bk[0].data[i][e] : bf16_to_float(half[0][i][e]);
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto e0 = st[0]->error(i), e1 = st[1]->error(i);
      double worst = 0, scale = 0;
      for (size_t e = 0; e < in_sum[i].size(); ++e) {
        const double lhs = in_sum[i][e], rhs = out_sum[i][e] + (double(e0[e]) + e1[e]) / P;
        worst = std::max(worst, std::fabs(lhs - rhs));
        scale = std::max(scale, std::fabs(lhs));
      }
      // Uncompressed tensors keep no error: their only loss is the rounding of the stored mean
      // (exact in fp32 up to summation, up to 2^-8 per step in bf16).
      const bool exact = st[0]->tensor(i).rank > 0 || dt == DType::kFloat32;
      const double tol = exact ? 1e-4 * std::max(1.0, scale) : 50 * std::ldexp(2.0, -8) * 4.0;
      EXPECT_LT(worst, tol) << "tensor " << i << " dtype " << int(dt);
      if (st[0]->tensor(i).rank > 0) {
        double en = 0;
        for (float x : e0) en += x * x;
        EXPECT_GT(en, 0.0) << "compressed tensor " << i << " keeps an error";
      }
    }
  }
}

TEST(PowerSGD, SimulatedRanksBitwiseIdenticalAndEqualReferenceOnMean) {
  const Shapes shapes = {{16, 12}, {16}, {8, 4, 3, 3}, {16, 12}, {2, 2}, {30, 20}};
  for (int P : {1, 2, 4}) {
    for (bool fuse : {true, false}) {
      PowerSGDConfig c = cfg_rank(3);
      c.seed = 77;
      c.fuse_uncompressed_with_p = fuse;
      std::vector<std::unique_ptr<PowerSGDState>> st;
      std::vector<std::unique_ptr<Bucket>> bk;
      std::vector<PowerSGDState*> sp;
      std::vector<Bucket*> bp;
      for (int p = 0; p < P; ++p) {
        st.push_back(std::make_unique<PowerSGDState>(c, shapes));
        bk.push_back(std::make_unique<Bucket>(shapes, 40 + p));
        sp.push_back(st.back().get());
        bp.push_back(bk.back().get());
      }
      // mean of the inputs, before the step overwrites them
      std::vector<std::vector<double>> mean(shapes.size());
      for (size_t i = 0; i < shapes.size(); ++i) {
        mean[i].assign(numel_of(shapes[i]), 0.0);
        for (int p = 0; p < P; ++p)
          for (size_t e = 0; e < mean[i].size(); ++e) mean[i][e] += bk[p]->data[i][e] / P;
      }
      step_ranks(sp, bp);
      for (int p = 1; p < P; ++p)
        for (size_t i = 0; i < shapes.size(); ++i)
          ASSERT_EQ(0, std::memcmp(bk[p]->data[i].data(), bk[0]->data[i].data(),
                                   bk[0]->data[i].size() * 4))
              << "rank " << p << " tensor " << i << " differs from rank 0";
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto& t = st[0]->tensor(i);
        if (t.rank == 0) {
          EXPECT_LT(rel_err(bk[0]->data[i], mean[i]), 1e-6) << "uncompressed tensor " << i;
          continue;
        }
        auto q = initial_q(77, 0, static_cast<uint32_t>(i), t.m, t.rank);
        const auto ref = ref_step(mean[i], t.n, t.m, q, t.rank);
        EXPECT_LT(rel_err(bk[0]->data[i], ref), 1e-4) << "P " << P << " tensor " << i;
        EXPECT_LT(rel_err(st[0]->q(i), q), 1e-4) << "Q of tensor " << i;
      }
    }
  }
}

TEST(PowerSGD, WarmStartOffRedrawsQEachStep) {
  const Shapes shapes = {{20, 15}};
  PowerSGDConfig c = cfg_rank(2);
  c.warm_start = false;
  c.error_feedback = false;
  PowerSGDState st(c, shapes);
  Bucket b0(shapes, 1);
  const std::vector<double> M(b0.data[0].begin(), b0.data[0].end());
  for (int step = 0; step < 3; ++step) {
    Bucket b(shapes, 1);
    step_ranks({&st}, {&b});
    auto q = initial_q(0, step, 0, 15, 2);
    EXPECT_LT(rel_err(b.data[0], ref_step(M, 20, 15, q, 2)), 1e-4) << "step " << step;
  }
}

// Shapes large enough for the CPU's fused tiles: several row tiles per member, one-row tiles
// (m larger than a tile), a batch group, a member of more than one Q chunk (partial sums added
// in chunk order), and an uneven thread count; two steps so that the error path runs too.
TEST(PowerSGD, FusedTilesMatchReferenceOnLargeShapes) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(3);
  const Shapes shapes = {{600, 500}, {16, 40000}, {300, 400}, {7}, {300, 400}, {1100, 1000}};
  for (bool ef : {true, false}) {
    PowerSGDConfig c = cfg_rank(4);
    c.error_feedback = ef;
    PowerSGDState st(c, shapes);
    std::vector<std::vector<double>> err(shapes.size()), q(shapes.size());
    for (int step = 0; step < 2; ++step) {
      Bucket b(shapes, 5 + step);
      std::vector<std::vector<double>> M(shapes.size());
      for (size_t i = 0; i < shapes.size(); ++i) {
        M[i].assign(b.data[i].begin(), b.data[i].end());
        if (step > 0 && ef && st.tensor(i).rank > 0)
          for (size_t e = 0; e < M[i].size(); ++e) M[i][e] += err[i][e];
      }
      step_ranks({&st}, {&b});
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto& t = st.tensor(i);
        if (t.rank == 0) {
          EXPECT_LT(rel_err(b.data[i], M[i]), 1e-7) << "uncompressed tensor " << i;
          continue;
        }
        if (step == 0) q[i] = initial_q(0, 0, static_cast<uint32_t>(i), t.m, t.rank);
        const auto ref = ref_step(M[i], t.n, t.m, q[i], t.rank);
        EXPECT_LT(rel_err(b.data[i], ref), 1e-4) << "step " << step << " tensor " << i;
        EXPECT_LT(rel_err(st.q(i), q[i]), 1e-4) << "step " << step << " Q of tensor " << i;
        err[i].assign(M[i].size(), 0.0);
        for (size_t e = 0; e < M[i].size(); ++e) err[i][e] = M[i][e] - ref[e];
        if (ef) {  // the error is M minus exactly what was written to the gradient
          const auto e_got = st.error(i);
          double worst = 0;
          for (size_t e = 0; e < M[i].size(); ++e)
            worst = std::max(worst, std::fabs(e_got[e] - (M[i][e] - b.data[i][e])));
          EXPECT_LT(worst, 1e-4) << "step " << step << " error of tensor " << i;
        }
      }
    }
  }
  omp_set_num_threads(saved);
}

TEST(PowerSGD, HouseholderForLargeRank) {
  const Shapes shapes = {{100, 80}};
  PowerSGDConfig c = cfg_rank(40);
  c.min_compression_rate = 0.5;
  PowerSGDState st(c, shapes);
  Bucket b(shapes, 3);
  const std::vector<double> M(b.data[0].begin(), b.data[0].end());
  step_ranks({&st}, {&b});
  auto q = initial_q(0, 0, 0, 80, 40);
  EXPECT_LT(rel_err(b.data[0], ref_step(M, 100, 80, q, 40)), 1e-3);
}

// ---------------------------------------------------------------- collectives

TEST(PowerSGDPlan, CollectivesCountAndSize) {
  // (16,12) x2 batched, (12,16), bias (16), (3,3) fails the rate test at r = 2.
  const Shapes shapes = {{16, 12}, {16, 12}, {12, 16}, {16}, {3, 3}};
  for (bool fuse : {true, false}) {
    PowerSGDConfig c = cfg_rank(2);
    c.fuse_uncompressed_with_p = fuse;
    PowerSGDState st(c, shapes);
    EXPECT_EQ(st.num_groups(), 2u);
    EXPECT_EQ(st.tensor(0).group, st.tensor(1).group);
    EXPECT_NE(st.tensor(0).group, st.tensor(2).group);
    EXPECT_EQ(st.tensor(4).rank, 0);
    const size_t np = 2 * 16 * 2 + 12 * 2, nq = 2 * 12 * 2 + 16 * 2, nu = 16 + 9;
    Bucket b(shapes, 9);
    const auto log = step_ranks({&st}, {&b});
    if (fuse) {
      ASSERT_EQ(log.size(), 2u);
      EXPECT_EQ(log[0].count, np + nu);
      EXPECT_EQ(log[1].count, nq);
    } else {
      ASSERT_EQ(log.size(), 3u);
      EXPECT_EQ(log[0].count, nu);
      EXPECT_EQ(log[1].count, np);
      EXPECT_EQ(log[2].count, nq);
    }
    for (const auto& col : log) {
      EXPECT_EQ(col.kind, CollectiveKind::kAllreduceSum);
      EXPECT_EQ(col.type, ElemType::kF32);
    }
    const auto& s = st.last_stats();
    EXPECT_TRUE(s.compressed);
    EXPECT_EQ(s.dense_bytes, (2 * 192 + 192 + 16 + 9) * 4u);
    EXPECT_EQ(s.sent_bytes, (np + nq + nu) * 4);
    EXPECT_EQ(s.collectives, fuse ? 2 : 3);
    EXPECT_EQ(s.rank_used, (std::vector<int>{2, 2, 2, 0, 0}));
    EXPECT_NEAR(s.compression_ratio(), double(s.dense_bytes) / s.sent_bytes, 1e-12);
  }
}

TEST(PowerSGDPlan, OnlyCompressedOrOnlyUncompressed) {
  {
    PowerSGDState st(cfg_rank(1), {{10, 10}, {12, 10}});
    Bucket b({{10, 10}, {12, 10}}, 1);
    const auto log = step_ranks({&st}, {&b});
    ASSERT_EQ(log.size(), 2u);
    EXPECT_EQ(log[0].count, 22u);
    EXPECT_EQ(log[1].count, 20u);
  }
  {
    PowerSGDState st(cfg_rank(1), {{10}, {}, {7}});
    Bucket b({{10}, {}, {7}}, 1);
    const auto ref = b.data;
    const auto log = step_ranks({&st}, {&b});
    ASSERT_EQ(log.size(), 1u);
    EXPECT_EQ(log[0].count, 18u);
    EXPECT_EQ(b.data, ref);  // world 1: the mean is the input
  }
}

TEST(PowerSGDPlan, MinCompressionRate) {
  // 10 x 10 at r = 2: (10 + 10) * 2 * rate < 100 <=> rate < 2.5
  for (double rate : {2.0, 2.5, 3.0}) {
    PowerSGDConfig c = cfg_rank(2);
    c.min_compression_rate = rate;
    PowerSGDState st(c, {{10, 10}});
    Bucket b({{10, 10}}, 2);
    const auto log = step_ranks({&st}, {&b});
    if (rate < 2.5) {
      ASSERT_EQ(log.size(), 2u);
      EXPECT_EQ(log[0].count, 20u);
    } else {
      ASSERT_EQ(log.size(), 1u);
      EXPECT_EQ(log[0].count, 100u);
      EXPECT_EQ(log[0].tag, "powersgd uncompressed");
    }
  }
}

TEST(PowerSGDPlan, RankIsClampedToMinDimension) {
  PowerSGDConfig c = cfg_rank(8);
  c.min_compression_rate = 0.1;
  PowerSGDState st(c, {{3, 50}, {40, 5, 1, 1}});
  EXPECT_EQ(st.tensor(0).rank, 3);
  EXPECT_EQ(st.tensor(1).rank, 5);
  Bucket b({{3, 50}, {40, 5, 1, 1}}, 4);
  const std::vector<double> M0(b.data[0].begin(), b.data[0].end());
  const std::vector<double> M1(b.data[1].begin(), b.data[1].end());
  const auto log = step_ranks({&st}, {&b});
  EXPECT_EQ(log[0].count, 3u * 3 + 40 * 5);
  // full rank: exact
  EXPECT_LT(rel_err(b.data[0], M0), 1e-5);
  EXPECT_LT(rel_err(b.data[1], M1), 1e-5);
}

TEST(PowerSGDPlan, StartIterDoesPlainAllreduce) {
  const Shapes shapes = {{16, 12}, {16}};
  PowerSGDConfig c = cfg_rank(1);
  c.start_iter = 2;
  const int P = 2;
  PowerSGDState s0(c, shapes), s1(c, shapes);
  for (int step = 0; step < 3; ++step) {
    Bucket b0(shapes, 10 + step), b1(shapes, 20 + step);
    std::vector<double> mean(192);
    for (int e = 0; e < 192; ++e) mean[e] = (double(b0.data[0][e]) + b1.data[0][e]) / P;
    const auto log = step_ranks({&s0, &s1}, {&b0, &b1});
    if (step < 2) {
      ASSERT_EQ(log.size(), 1u);
      EXPECT_EQ(log[0].count, 208u + 65);  // (+ the step envelope's 65 slots)
      EXPECT_FALSE(s0.last_stats().compressed);
      EXPECT_EQ(s0.last_stats().rank_used, (std::vector<int>{0, 0}));
      EXPECT_LT(rel_err(b0.data[0], mean), 1e-6);
      for (float x : s0.error(0)) ASSERT_EQ(x, 0.0f);  // no error feedback before start_iter
      EXPECT_TRUE(s0.q(0).empty());
    } else {
      ASSERT_EQ(log.size(), 2u);
      EXPECT_EQ(log[0].count, 16u + 16 + 65);
      EXPECT_TRUE(s0.last_stats().compressed);
      auto q = initial_q(0, 2, 0, 12, 1);  // Q is drawn at the first compressed step
      EXPECT_LT(rel_err(b0.data[0], ref_step(mean, 16, 12, q, 1)), 1e-4);
    }
  }
  EXPECT_EQ(s0.step(), 3);
}

// ---------------------------------------------------------------- bad input, state

TEST(PowerSGDBad, RejectsBadConfigAndInputLeavingStateUnchanged) {
  EXPECT_THROW(PowerSGDState(cfg_rank(0), {{4, 4}}), InvalidArgument);
  EXPECT_THROW(PowerSGDState(cfg_rank(-1), {{4, 4}}), InvalidArgument);
  {
    PowerSGDConfig c = cfg_rank(64);
    c.orthogonalization = Orthogonalization::kGramSchmidt;
    EXPECT_THROW(PowerSGDState(c, {{4, 4}}), InvalidArgument);
    c.orthogonalization = Orthogonalization::kAuto;
    c.min_compression_rate = std::nan("");
    EXPECT_THROW(PowerSGDState(c, {{4, 4}}), InvalidArgument);
  }
  EXPECT_THROW(PowerSGDState(cfg_rank(1), {{4, -1}}), InvalidArgument);
  EXPECT_THROW(PowerSGDPlan(*std::make_unique<PowerSGDState>(cfg_rank(1), Shapes{{4, 4}}), 0),
               InvalidArgument);

  const Shapes shapes = {{16, 12}, {16}};
  PowerSGDState st(cfg_rank(2), shapes);
  for (int i = 0; i < 3; ++i) {
    Bucket b(shapes, 50 + i);
    step_ranks({&st}, {&b});
  }
  const auto before = st.state_dict();
  PowerSGDPlan plan(st, 1);
  Bucket b(shapes, 99);
  auto v = b.views();
  auto expect_rejected = [&](std::vector<TensorView> bad, const char* what) {
    try {
      plan.begin(bad);
      ADD_FAILURE() << what << ": no exception";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("tensor"), std::string::npos) << e.what();
    }
    EXPECT_EQ(st.state_dict(), before) << what;
    EXPECT_THROW(plan.next(), InvalidArgument) << what << ": no step may start";
  };
  expect_rejected({v[0]}, "wrong count");
  {
    auto w = v;
    w[0] = TensorView(b.data[0].data(), {12, 16}, DType::kFloat32, Device::kCPU);
    expect_rejected(w, "shape");
    w[0] = TensorView(b.data[0].data(), {16, 12}, DType::kFloat16, Device::kCPU);
    expect_rejected(w, "dtype");
    w[0] = TensorView(b.data[0].data(), {16, 12}, DType::kFloat32, Device::kCUDA);
    expect_rejected(w, "device");
  }
  // The finiteness check runs in the first next() phase on the CPU (see check_finite); with the
  // raise policy the step raises at its end, state unchanged.
  plan.set_on_nonfinite(OnNonFinite::kRaise);
  auto start_step = [](PowerSGDPlan& p, std::vector<TensorView> g) {
    p.begin(g);
    return run_plans_in_process({&p});
  };
  b.data[1][7] = std::nanf("");
  try {
    start_step(plan, b.views());
    ADD_FAILURE() << "NaN accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("index 7"), std::string::npos) << e.what();
  }
  EXPECT_EQ(st.state_dict(), before);
  EXPECT_FALSE(plan.next().has_value()) << "a rejected step is over";
  b.data[1][7] = 0.0f;
  b.data[0][100] = INFINITY;
  EXPECT_THROW(start_step(plan, b.views()), InvalidArgument);
  EXPECT_EQ(st.state_dict(), before);
  // check_finite off: accepted (the NaN policy is the caller's).
  PowerSGDConfig c = cfg_rank(2);
  c.check_finite = false;
  PowerSGDState st2(c, shapes);
  PowerSGDPlan plan2(st2, 1);
  EXPECT_NO_THROW(start_step(plan2, b.views()));
  // next() before begin(); begin() while a step is in progress.
  PowerSGDPlan idle(st, 1);
  EXPECT_THROW(idle.next(), InvalidArgument);
  Bucket ok(shapes, 5);
  idle.begin(ok.views());
  ASSERT_TRUE(idle.next().has_value());
  EXPECT_THROW(idle.begin(ok.views()), InvalidArgument);
}

TEST(PowerSGDState, StateDictRoundTrip) {
  const Shapes shapes = {{16, 12}, {16}, {8, 2, 3}};
  PowerSGDConfig c = cfg_rank(2);
  PowerSGDState a(c, shapes), b(c, shapes);
  for (int i = 0; i < 3; ++i) {
    Bucket x(shapes, 70 + i);
    step_ranks({&a}, {&x});
  }
  const auto bytes = a.state_dict();
  b.load_state_dict(bytes.data(), bytes.size());
  EXPECT_EQ(b.step(), 3);
  EXPECT_EQ(b.state_dict(), bytes);
  EXPECT_EQ(b.error(0), a.error(0));
  EXPECT_EQ(b.q(0), a.q(0));
  Bucket x1(shapes, 80), x2(shapes, 80);
  step_ranks({&a}, {&x1});
  step_ranks({&b}, {&x2});
  EXPECT_EQ(x1.data, x2.data);
  EXPECT_EQ(a.state_dict(), b.state_dict());
  // mismatched layout / truncated / garbage: rejected, unchanged
  PowerSGDState other(cfg_rank(3), shapes);
  const auto other_before = other.state_dict();
  EXPECT_THROW(other.load_state_dict(bytes.data(), bytes.size()), InvalidArgument);
  EXPECT_EQ(other.state_dict(), other_before);
  const auto b_before = b.state_dict();
  EXPECT_THROW(b.load_state_dict(bytes.data(), bytes.size() - 1), InvalidArgument);
  std::vector<uint8_t> junk(bytes.size(), 0xAB);
  EXPECT_THROW(b.load_state_dict(junk.data(), junk.size()), InvalidArgument);
  EXPECT_EQ(b.state_dict(), b_before);
}

}  // namespace
}  // namespace gradcomp::test

namespace gradcomp::test {
namespace {

// Runs one single-rank step to completion; throws what the plan throws.
void run_step(PowerSGDPlan& p, std::vector<TensorView> g) {
  p.begin(g);
  while (p.next()) {
  }
}

// A NaN/Inf in an uncompressed tensor, in a compressed tensor, and in a compressed tensor at a
// column whose row of Q is exactly zero (P gets NaN * 0 = NaN there), for every gradient dtype and
// with/without error feedback: rejected with the tensor and the first bad index, error, Q, step
// and stats as they were, and the plan usable again afterwards.
TEST(PowerSGDPlan, NonFiniteRejectedInFirstPhaseStateUnchanged) {
  const Shapes shapes = {{16, 12}, {16}, {24, 10}};
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (int mode = 0; mode < 3; ++mode) {
      const bool ef = mode != 1;
      PowerSGDConfig c = cfg_rank(2);
      c.error_feedback = ef;
      c.warm_start = mode != 2;  // mode 2: Q re-drawn every step (a rejection must restore it)
      PowerSGDState st(c, shapes, dt);
      PowerSGDPlan plan(st, 1);
      plan.set_on_nonfinite(OnNonFinite::kRaise);  // (the skip policy: test_nonfinite_skip.cpp)
      ASSERT_EQ(st.tensor(0).rank, 2);
      ASSERT_EQ(st.tensor(1).rank, 0);
      // Gradients in dtype dt; column 5 of tensor 2 is zero in the first step, so Q's row 5 is 0.
      std::vector<std::vector<uint16_t>> half(shapes.size());
      std::vector<std::vector<float>> f32(shapes.size());
      auto views = [&](const std::vector<std::vector<float>>& src) {
        std::vector<TensorView> v;
        for (size_t i = 0; i < shapes.size(); ++i) {
          f32[i] = src[i];
          void* p = f32[i].data();
          if (dt != DType::kFloat32) {
            half[i].resize(src[i].size());
            for (size_t j = 0; j < src[i].size(); ++j)
              half[i][j] =
                  dt == DType::kFloat16 ? float_to_half(src[i][j]) : float_to_bf16(src[i][j]);
            p = half[i].data();
          }
          v.emplace_back(p, shapes[i].data(), static_cast<int>(shapes[i].size()), dt, Device::kCPU);
        }
        return v;
      };
      Bucket b(shapes, 7);
      for (int64_t i = 0; i < 24; ++i) b.data[2][i * 10 + 5] = 0.0f;
      run_step(plan, views(b.data));
      const std::vector<float> q2 = st.q(2);
      ASSERT_EQ(q2.size(), 20u);
      ASSERT_EQ(q2[5 * 2], 0.0f);
      ASSERT_EQ(q2[5 * 2 + 1], 0.0f);
      const auto before = st.state_dict();
      const int64_t step_before = st.step();
      const int64_t stats_step = st.last_stats().step;
      struct Case {
        size_t tensor;
        int64_t index;
        float value;
        const char* what;
      };
      const Case cases[] = {{1, 9, std::nanf(""), "uncompressed NaN"},
                            {1, 0, -INFINITY, "uncompressed -Inf"},
                            {0, 37, std::nanf(""), "compressed NaN"},
                            {2, 3 * 10 + 5, std::nanf(""), "NaN under a zero Q row"},
                            {2, 17 * 10 + 5, INFINITY, "Inf under a zero Q row"}};
      for (const Case& k : cases) {
        SCOPED_TRACE(std::string(k.what) + " dtype " + dtype_name(dt) + " mode " +
                     std::to_string(mode));
        Bucket g(shapes, 11);
        for (int64_t i = 0; i < 24; ++i) g.data[2][i * 10 + 5] = 0.0f;
        g.data[k.tensor][k.index] = k.value;
        g.data[k.tensor][k.index + 1] = std::nanf("");  // a later one: the first is named
        try {
          run_step(plan, views(g.data));
          ADD_FAILURE() << "accepted";
        } catch (const InvalidArgument& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("tensor " + std::to_string(k.tensor)), std::string::npos) << msg;
          EXPECT_NE(msg.find("index " + std::to_string(k.index) + " "), std::string::npos) << msg;
        }
        EXPECT_EQ(st.state_dict(), before);
        EXPECT_EQ(st.step(), step_before);
        EXPECT_EQ(st.last_stats().step, stats_step);
        EXPECT_EQ(st.q(2), q2);
        EXPECT_FALSE(plan.next().has_value()) << "the step is over after a rejection";
        EXPECT_TRUE(plan.skipped());
      }
      // The last element of a compressed tensor alone.
      {
        Bucket g(shapes, 11);
        g.data[0][191] = INFINITY;
        try {
          run_step(plan, views(g.data));
          ADD_FAILURE() << "accepted";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("index 191 "), std::string::npos) << e.what();
        }
        EXPECT_EQ(st.state_dict(), before);
      }
      // Still usable, and a rejected step changed nothing: the next good step equals the one of
      // a twin state that never saw the bad gradients.
      PowerSGDState twin(c, shapes, dt);
      PowerSGDPlan tplan(twin, 1);
      run_step(tplan, views(b.data));
      Bucket ok(shapes, 12);
      run_step(plan, views(ok.data));
      const auto out = f32;
      const auto outh = half;
      run_step(tplan, views(ok.data));
      EXPECT_EQ(st.state_dict(), twin.state_dict());
      if (dt == DType::kFloat32)
        EXPECT_EQ(out, f32);
      else
        EXPECT_EQ(outh, half);
    }
}

// Steps before start_iter (plain allreduce) reject a NaN/Inf too, changing nothing.
TEST(PowerSGDPlan, NonFiniteRejectedInPlainSteps) {
  const Shapes shapes = {{16, 12}, {16}};
  PowerSGDConfig c = cfg_rank(2);
  c.start_iter = 2;
  PowerSGDState st(c, shapes);
  PowerSGDPlan plan(st, 1);
  plan.set_on_nonfinite(OnNonFinite::kRaise);
  Bucket b(shapes, 3);
  run_step(plan, b.views());
  const auto before = st.state_dict();
  b.data[1][4] = INFINITY;
  try {
    run_step(plan, b.views());
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("index 4 "), std::string::npos) << e.what();
  }
  EXPECT_EQ(st.state_dict(), before);
  EXPECT_EQ(st.step(), 1);
}

// In the plain steps before start_iter a finite gradient whose sum over ranks overflows fp32 (2e38
// on every rank) makes an overflow step wherever the element lies: the first of the bucket, one
// inside the matrix, the matrix's last, the bucket's last. Every rank skips (its average NaN, no
// exception), the state is as before, and the next step is kept.
TEST(PowerSGDPlan, PlainStepSumOverflowingAnywhereIsSkippedOnEveryRank) {
  const Shapes shapes = {{16, 12}, {16}};  // 192 + 16 elements
  PowerSGDConfig c = cfg_rank(2);
  c.start_iter = 3;
  for (int P : {2, 3})
    for (int64_t at : {int64_t{0}, int64_t{100}, int64_t{191}, int64_t{207}}) {
      SCOPED_TRACE("P=" + std::to_string(P) + " element " + std::to_string(at));
      std::vector<std::unique_ptr<PowerSGDState>> st;
      std::vector<std::unique_ptr<PowerSGDPlan>> plans;
      std::vector<Plan*> raw;
      for (int r = 0; r < P; ++r) {
        st.push_back(std::make_unique<PowerSGDState>(c, shapes));
        plans.push_back(std::make_unique<PowerSGDPlan>(*st.back(), P));
        plans.back()->set_on_nonfinite(OnNonFinite::kSkip);
        raw.push_back(plans.back().get());
      }
      auto step = [&](uint64_t seed, bool overflow) {
        std::vector<Bucket> b;
        for (int r = 0; r < P; ++r) {
          b.emplace_back(shapes, seed + r);
          if (overflow) (at < 192 ? b[r].data[0][at] : b[r].data[1][at - 192]) = 2e38f;
        }
        for (int r = 0; r < P; ++r) plans[r]->begin(b[r].views());
        run_plans_in_process(raw);
        return b;
      };
      step(10, false);
      std::vector<std::vector<uint8_t>> before;
      for (const auto& s : st) before.push_back(s->state_dict());
      const auto out = step(20, true);
      for (int r = 0; r < P; ++r) {
        EXPECT_TRUE(plans[r]->skipped()) << "rank " << r;
        for (const auto& t : out[r].data)
          for (float x : t)
            ASSERT_TRUE(std::isnan(x)) << "rank " << r << ": the average is not NaN";
        EXPECT_EQ(st[r]->state_dict(), before[r]) << "rank " << r;
        EXPECT_EQ(st[r]->step(), 1);
      }
      const auto next = step(30, false);
      for (int r = 0; r < P; ++r) {
        EXPECT_FALSE(plans[r]->skipped()) << "rank " << r;
        for (const auto& t : next[r].data)
          for (float x : t) ASSERT_TRUE(std::isfinite(x));
        EXPECT_EQ(st[r]->step(), 2);
      }
    }
}

}  // namespace
}  // namespace gradcomp::test

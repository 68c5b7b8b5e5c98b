// SPDX-License-Identifier: Apache-2.0
// 1-bit Adam's two-phase compressed allreduce, simulated in one process for P ranks: the
// collectives asked for, a scalar reference of one step, bitwise consensus, convergence of the
// running average under error feedback, bad input and state round trips.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"
#include "plans/onebit_plan.hpp"
#include "test_util.hpp"

using namespace gradcomp;
using namespace gradcomp::test;

namespace {

OneBitConfig plan_cfg(OneBitScaling s = OneBitScaling::kSignL2, bool ef = true, int64_t block = 0) {
  OneBitConfig c;
  c.scaling = s;
  c.error_feedback = ef;
  c.block_size = block;
  return c;
}

struct Sim {
  int P;
  int64_t n;
  std::vector<std::unique_ptr<OneBitAllreducePlan>> plans;
  std::vector<std::vector<float>> out;
  Sim(const OneBitConfig& cfg, int P_, int64_t n_) : P(P_), n(n_), out(P_) {
    for (int r = 0; r < P; ++r) {
      plans.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r));
      out[r].assign(static_cast<size_t>(n), -1.0f);
    }
  }
  std::vector<Collective> step(std::vector<std::vector<float>>& g) {
    std::vector<Plan*> ps;
    for (int r = 0; r < P; ++r) {
      plans[r]->begin(TensorView::cpu(g[r].data(), n), TensorView::cpu(out[r].data(), n));
      ps.push_back(plans[r].get());
    }
    return run_plans_in_process(ps);
  }
};

double norm_scale(const std::vector<float>& x, int64_t b, int64_t e, OneBitScaling s) {
  double acc = 0;
  for (int64_t i = b; i < e; ++i)
    acc += s == OneBitScaling::kSignL1 ? std::fabs(x[i]) : double(x[i]) * x[i];
  const double len = double(e - b);
  return s == OneBitScaling::kSignL1 ? acc / len : std::sqrt(acc / len);
}

/// One step of the algorithm written from its description, no error feedback state carried in:
/// one scale per block of `block` elements (0: per server chunk of 32 ceil(ceil(n/32) / P)).
/// Server chunks hold whole blocks, so blocks start at multiples of `block` everywhere.
std::vector<float> reference_step(const std::vector<std::vector<float>>& g, int64_t n,
                                  OneBitScaling s, int64_t block = 0) {
  const int P = static_cast<int>(g.size());
  const int64_t CE = block > 0 ? block : 32 * (((n + 31) / 32 + P - 1) / P);
  std::vector<std::vector<float>> d(P, std::vector<float>(n));
  for (int p = 0; p < P; ++p)
    for (int64_t b = 0; b < n; b += CE) {
      const int64_t e = std::min(n, b + CE);
      const float sc = static_cast<float>(norm_scale(g[p], b, e, s));
      for (int64_t i = b; i < e; ++i) d[p][i] = g[p][i] >= 0 ? sc : -sc;
    }
  std::vector<float> avg(n), out(n);
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.0f;
    for (int p = 0; p < P; ++p) acc += d[p][i];
    avg[i] = acc * (1.0f / P);
  }
  for (int64_t b = 0; b < n; b += CE) {
    const int64_t e = std::min(n, b + CE);
    const float sc = static_cast<float>(norm_scale(avg, b, e, s));
    for (int64_t i = b; i < e; ++i) out[i] = avg[i] >= 0 ? sc : -sc;
  }
  return out;
}

/// The plan's rotation written from its definition, in double: z = H D x / sqrt(S) with
/// H_ij = (-1)^popcount(i & j) (no fast transform), or its inverse x = D H z / sqrt(S), over every
/// full block of S elements of x (global block b uses D's signs of elements b S .. b S + S - 1);
/// the trailing partial block is left as it is.
std::vector<float> rotate_ref(const std::vector<float>& x, int64_t S, bool inverse) {
  std::vector<float> y = x;
  const int64_t n = static_cast<int64_t>(x.size());
  for (int64_t b = 0; b + S <= n; b += S)
    for (int64_t i = 0; i < S; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < S; ++j) {
        const double h = (__builtin_popcountll(static_cast<uint64_t>(i & j)) & 1) ? -1.0 : 1.0;
        acc += h * (inverse ? 1.0 : kernels::onebit::rotation_sign(b + j)) * x[b + j];
      }
      acc /= std::sqrt(double(S));
      y[b + i] = static_cast<float>(inverse ? acc * kernels::onebit::rotation_sign(b + i) : acc);
    }
  return y;
}

}  // namespace

/// The rotation as its defining sequence of fp32 operations, stage by stage (what the CUDA kernel
/// does): the CPU twin's vectorized form must give the same bits.
std::vector<float> rotate_stagewise(std::vector<float> v, int64_t S, int64_t first_block,
                                    bool inverse) {
  namespace ob = kernels::onebit;
  const float r = ob::rotation_norm(S);
  for (int64_t b = 0; b + S <= static_cast<int64_t>(v.size()); b += S) {
    const int64_t base = first_block * S + b;
    if (!inverse)
      for (int64_t j = 0; j < S; ++j) v[b + j] = ob::mul_rn(v[b + j], ob::rotation_sign(base + j));
    for (int64_t h = 1; h < S; h <<= 1)
      for (int64_t i = 0; i < S; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) ob::butterfly(v[b + j], v[b + j + h]);
    for (int64_t j = 0; j < S; ++j) {
      v[b + j] = ob::mul_rn(v[b + j], r);
      if (inverse) v[b + j] = ob::mul_rn(v[b + j], ob::rotation_sign(base + j));
    }
  }
  return v;
}

TEST(OneBitPlan, HadamardRotationIsTheStagewiseSequenceBitwise) {
  for (int64_t S : {2, 4, 8, 16, 32, 64, 128, 256, 8192})
    for (int64_t nb : {1, 3, 40})
      for (bool inverse : {false, true}) {
        SCOPED_TRACE("S " + std::to_string(S) + " blocks " + std::to_string(nb) + " inverse " +
                     std::to_string(inverse));
        std::vector<float> x = normal(S * nb, 11, 5.0f);
        x[0] = 0.0f;
        if (S >= 2) x[1] = -0.0f;
        const auto want = rotate_stagewise(x, S, 5, inverse);
        // the dispatched form (AVX2 where the CPU has it) and the baseline build
        std::vector<float> base = x;
        kernels::cpu::hadamard_rotate(x.data(), nb, S, 5, inverse);
        kernels::cpu::hadamard_rotate_baseline(base.data(), nb, S, 5, inverse);
        ASSERT_TRUE(same_bytes(x.data(), want.data(), 4 * x.size()));
        ASSERT_TRUE(same_bytes(base.data(), want.data(), 4 * x.size()));
      }
  // more blocks than one thread's run of 64, with a block offset: both builds, every block
  for (bool inverse : {false, true}) {
    const int64_t S = 128, nb = 1000;
    std::vector<float> x = normal(S * nb, 21, 3.0f), base = x;
    const auto want = rotate_stagewise(x, S, 5, inverse);
    kernels::cpu::hadamard_rotate(x.data(), nb, S, 5, inverse);
    kernels::cpu::hadamard_rotate_baseline(base.data(), nb, S, 5, inverse);
    ASSERT_TRUE(same_bytes(x.data(), want.data(), 4 * x.size()));
    ASSERT_TRUE(same_bytes(base.data(), want.data(), 4 * x.size()));
  }
  std::printf("hadamard_rotate runs the %s build on this CPU\n",
              kernels::cpu::hadamard_rotate_uses_avx2() ? "AVX2" : "baseline");
}

TEST(OneBitPlan, HadamardRotationMatchesMatrixReferenceAndInverts) {
  for (int64_t S : {2, 8, 16, 32, 128, 1024})
    for (int64_t n : {int64_t{0}, int64_t{1}, S - 1, S, 3 * S + 5}) {
      SCOPED_TRACE("S " + std::to_string(S) + " n " + std::to_string(n));
      const std::vector<float> x = normal(n, 3, 2.0f);
      std::vector<float> z = x;
      kernels::cpu::hadamard_rotate(z.data(), n / S, S, 0, false);
      const auto want = rotate_ref(x, S, false);
      double norm = 0;
      for (float v : x) norm += double(v) * v;
      const double tol =
          1e-6 * std::sqrt(norm / std::max<int64_t>(1, n)) * std::log2(double(S) + 1);
      for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(z[i], want[i], tol + 1e-7) << i;
      for (int64_t i = n / S * S; i < n; ++i) ASSERT_EQ(z[i], x[i]) << "tail changed at " << i;
      std::vector<float> back = z;
      kernels::cpu::hadamard_rotate(back.data(), n / S, S, 0, true);
      const auto back_ref = rotate_ref(z, S, true);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(back[i], back_ref[i], tol + 1e-7) << i;
        ASSERT_NEAR(back[i], x[i], 2 * tol + 1e-7) << i;
      }
    }
  // D follows the global element index: blocks rotated with an offset equal the same blocks
  // rotated in place within the whole vector, and differ from rotating them as block 0
  const int64_t S = 64;
  const std::vector<float> x = normal(4 * S, 9);
  std::vector<float> whole = x, tail(x.begin() + 2 * S, x.end()), as0 = tail;
  kernels::cpu::hadamard_rotate(whole.data(), 4, S, 0, false);
  kernels::cpu::hadamard_rotate(tail.data(), 2, S, 2, false);
  kernels::cpu::hadamard_rotate(as0.data(), 2, S, 0, false);
  EXPECT_TRUE(same_bytes(whole.data() + 2 * S, tail.data(), 4 * 2 * S));
  EXPECT_FALSE(same_bytes(tail.data(), as0.data(), 4 * 2 * S));
  // the signs are balanced (a fixed pattern, not a constant)
  int64_t neg = 0;
  for (int64_t i = 0; i < 100000; ++i) neg += kernels::onebit::rotation_sign(i) < 0;
  EXPECT_NEAR(double(neg), 50000.0, 1000.0);
}

TEST(OneBitPlan, RotatedStepMatchesScalarReference) {
  // rotate every full block of the gradient, run the reference step there, rotate back: the
  // plan's output, rotated forward again, must be the reference's rotated-domain result
  for (auto sc : {OneBitScaling::kSignL1, OneBitScaling::kSignL2})
    for (int64_t block : {32, 128, 256})
      for (int P : {1, 2, 3, 8})
        for (int64_t n :
             {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1000}, int64_t{20011}}) {
          SCOPED_TRACE("P " + std::to_string(P) + " n " + std::to_string(n) + " block " +
                       std::to_string(block));
          OneBitConfig cfg = plan_cfg(sc, true, block);
          cfg.rotate = true;
          Sim sim(cfg, P, n);
          std::vector<std::vector<float>> g(P), gz(P);
          for (int r = 0; r < P; ++r) {
            g[r] = normal(n, 10 * r + 1);
            for (int64_t i = 0; i < n; i += 17) g[r][i] *= 30.0f;  // heavy tails
            gz[r] = rotate_ref(g[r], block, false);
          }
          const auto g_copy = g;
          sim.step(g);
          EXPECT_EQ(g, g_copy);  // the separate-output form leaves the gradient as it was
          for (int r = 1; r < P; ++r)
            ASSERT_TRUE(same_bytes(sim.out[0].data(), sim.out[r].data(), 4 * n)) << "rank " << r;
          const auto want = reference_step(gz, n, sc, block);
          const auto got = rotate_ref(sim.out[0], block, false);
          int64_t sign_flips = 0;
          for (int64_t i = 0; i < n; ++i) {
            if (std::signbit(want[i]) != std::signbit(got[i])) {
              ++sign_flips;
              continue;
            }
            ASSERT_NEAR(got[i], want[i], 2e-4 * std::fabs(want[i]) + 1e-6) << i;
          }
          EXPECT_LE(sign_flips, n / 1000 + 1);
        }
}

TEST(OneBitPlan, RotationLosesLessOfAHeavyTailedGradient) {
  // One step, no error feedback carried: the relative error of the average for a gradient whose
  // blocks hold a few large entries (as a ReLU network's weight gradients do). Without rotation
  // the sign and one scale lose most of it; rotated blocks are near-Gaussian, where sign + L1
  // scale loses 1 - 2/pi = 36% of the energy per phase.
  const int P = 4;
  const int64_t n = 128 * 200;
  std::vector<std::vector<float>> g(P);
  std::vector<double> truth(n, 0.0);
  for (int r = 0; r < P; ++r) {
    g[r] = normal(n, 40 + r, 0.01f);
    for (int64_t i = r; i < n; i += 23) g[r][i] = (i % 2 ? 1.0f : -1.0f) * (1.0f + 0.1f * r);
    for (int64_t i = 0; i < n; ++i) truth[i] += double(g[r][i]) / P;
  }
  auto rel_err = [&](bool rotate) {
    OneBitConfig cfg = plan_cfg(OneBitScaling::kSignL1, true, 128);
    cfg.rotate = rotate;
    Sim sim(cfg, P, n);
    auto gg = g;
    sim.step(gg);
    double e = 0, t = 0;
    for (int64_t i = 0; i < n; ++i) {
      e += (sim.out[0][i] - truth[i]) * (sim.out[0][i] - truth[i]);
      t += truth[i] * truth[i];
    }
    return std::sqrt(e / t);
  };
  const double plain = rel_err(false), rotated = rel_err(true);
  EXPECT_GT(plain, 0.9) << plain;
  EXPECT_LT(rotated, 0.85) << rotated;
  EXPECT_LT(rotated, 0.8 * plain) << plain << " vs " << rotated;
}

TEST(OneBitPlan, AsksForAllToAllThenAllgatherOfEqualBlocks) {
  for (int P : {1, 2, 3, 8}) {
    const int64_t n = 1000;
    Sim sim(plan_cfg(), P, n);
    std::vector<std::vector<float>> g(P);
    for (int r = 0; r < P; ++r) g[r] = normal(n, r);
    const auto log = sim.step(g);
    ASSERT_EQ(log.size(), 2u);
    const int64_t W = (32 + P - 1) / P;  // ceil(1000 / 32) = 32 words
    EXPECT_EQ(log[0].kind, CollectiveKind::kAllToAll);
    EXPECT_EQ(log[0].type, ElemType::kU8);
    // the all-to-all's blocks end with the step envelope (16 bytes) when there are peers
    EXPECT_EQ(log[0].count, size_t(4 * (W + 1) + (P > 1 ? 16 : 0)));
    EXPECT_EQ(log[1].kind, CollectiveKind::kAllgather);
    EXPECT_EQ(log[1].count, size_t(4 * (W + 1)));
    EXPECT_EQ(sim.plans[0]->block_bytes(), size_t(4 * (W + 1)));
    EXPECT_EQ(sim.plans[0]->chunk_elems(), 32 * W);
  }
}

TEST(OneBitPlan, BlockScalesRoundChunksToWholeBlocks) {
  // n = 1000 -> 32 words; blocks of 256 elements = 8 words. P = 3: 11 words per chunk rounded up
  // to 16 (two blocks), so B = 4 (2 + 16). A state made with another block size is rejected.
  Sim sim(plan_cfg(OneBitScaling::kSignL1, true, 256), 3, 1000);
  EXPECT_EQ(sim.plans[0]->chunk_elems(), 512);
  EXPECT_EQ(sim.plans[0]->scales_per_chunk(), 2);
  EXPECT_EQ(sim.plans[0]->scale_block(), 256);
  std::vector<std::vector<float>> g(3);
  for (int r = 0; r < 3; ++r) g[r] = normal(1000, r + 5);
  const auto log = sim.step(g);
  ASSERT_EQ(log.size(), 2u);
  EXPECT_EQ(log[0].count, size_t(4 * (2 + 16) + 16));  // (+ the step envelope)
  EXPECT_EQ(log[1].count, size_t(4 * (2 + 16)));
  OneBitAllreducePlan other(plan_cfg(OneBitScaling::kSignL1, true, 128), 1000, 3, 0);
  const auto st = sim.plans[0]->state_dict();
  const auto before = other.state_dict();
  EXPECT_THROW(other.load_state_dict(st.data(), st.size()), InvalidArgument);
  EXPECT_EQ(other.state_dict(), before);
}

TEST(OneBitPlan, FirstStepMatchesScalarReferenceAndRanksAgreeBitwise) {
  for (auto sc : {OneBitScaling::kSignL1, OneBitScaling::kSignL2})
    for (int64_t block : {0, 32, 256, 4096})
      for (int P : {1, 2, 3, 8})
        for (int64_t n :
             {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1000}, int64_t{100003}}) {
          SCOPED_TRACE("P " + std::to_string(P) + " n " + std::to_string(n) + " block " +
                       std::to_string(block));
          Sim sim(plan_cfg(sc, true, block), P, n);
          std::vector<std::vector<float>> g(P);
          for (int r = 0; r < P; ++r) g[r] = normal(n, 10 * r + 1);
          sim.step(g);
          for (int r = 1; r < P; ++r)
            ASSERT_TRUE(same_bytes(sim.out[0].data(), sim.out[r].data(), 4 * n)) << "rank " << r;
          const auto want = reference_step(g, n, sc, block);
          int64_t sign_flips = 0;
          for (int64_t i = 0; i < n; ++i) {
            if (std::signbit(want[i]) != std::signbit(sim.out[0][i])) {
              ++sign_flips;  // an average within rounding of 0 may fall either way
              continue;
            }
            ASSERT_NEAR(sim.out[0][i], want[i], 1e-5 * std::fabs(want[i]) + 1e-7) << i;
          }
          EXPECT_LE(sign_flips, n / 1000);
        }
}

TEST(OneBitPlan, ErrorFeedbackMakesRunningAverageConverge) {
  const int64_t n = 5000;
  for (int P : {1, 2, 3, 8}) {
    SCOPED_TRACE("P " + std::to_string(P));
    std::vector<std::vector<float>> g(P);
    for (int r = 0; r < P; ++r) g[r] = normal(n, 100 + r);
    std::vector<double> truth(n, 0.0);
    for (int r = 0; r < P; ++r)
      for (int64_t i = 0; i < n; ++i) truth[i] += double(g[r][i]) / P;
    double tnorm = 0;
    for (double v : truth) tnorm += v * v;
    tnorm = std::sqrt(tnorm);
    auto run = [&](bool ef, int steps, std::vector<double>& errs, bool rotate = false) {
      OneBitConfig cfg = plan_cfg(OneBitScaling::kSignL2, ef, rotate ? 128 : 0);
      cfg.rotate = rotate;
      Sim sim(cfg, P, n);
      std::vector<double> sum(n, 0.0);
      for (int t = 1; t <= steps; ++t) {
        sim.step(g);
        for (int r = 1; r < P; ++r)
          ASSERT_TRUE(same_bytes(sim.out[0].data(), sim.out[r].data(), 4 * n));
        double err = 0;
        for (int64_t i = 0; i < n; ++i) {
          sum[i] += sim.out[0][i];
          const double dlt = sum[i] / t - truth[i];
          err += dlt * dlt;
        }
        errs.push_back(std::sqrt(err) / tnorm);
      }
    };
    std::vector<double> ef, noef, rot;
    run(true, 200, ef);
    run(false, 200, noef);
    run(true, 200, rot, true);
    EXPECT_LT(rot[199], rot[9] / 5) << rot[9] << " -> " << rot[199];
    EXPECT_LT(rot[199], 0.05);
    // with error feedback the error of the running mean decays like 1/t
    EXPECT_LT(ef[199], ef[9] / 5) << ef[9] << " -> " << ef[199];
    EXPECT_LT(ef[199], 0.05);
    // without it the bias of 1-bit quantization stays
    EXPECT_GT(noef[199], 0.3);
    EXPECT_GT(noef[199], 10 * ef[199]);
  }
}

TEST(OneBitPlan, HalfGradientsAndStateRoundTrip) {
  const int P = 3;
  const int64_t n = 4099;
  auto make = [&] {
    std::vector<std::unique_ptr<OneBitAllreducePlan>> v;
    for (int r = 0; r < P; ++r)
      v.push_back(std::make_unique<OneBitAllreducePlan>(plan_cfg(), n, P, r));
    return v;
  };
  auto a = make(), b = make();
  std::vector<std::vector<uint16_t>> g(P, std::vector<uint16_t>(n));
  std::vector<std::vector<float>> oa(P, std::vector<float>(n)), ob(P, std::vector<float>(n));
  auto step = [&](std::vector<std::unique_ptr<OneBitAllreducePlan>>& pl,
                  std::vector<std::vector<float>>& out, int seed) {
    std::vector<Plan*> ps;
    for (int r = 0; r < P; ++r) {
      const auto x = normal(n, seed * 10 + r);
      for (int64_t i = 0; i < n; ++i) g[r][i] = float_to_bf16(x[i]);
      pl[r]->begin(TensorView(g[r].data(), {n}, DType::kBFloat16, Device::kCPU),
                   TensorView::cpu(out[r].data(), n));
      ps.push_back(pl[r].get());
    }
    run_plans_in_process(ps);
  };
  for (int t = 0; t < 3; ++t) step(a, oa, t);
  for (int r = 0; r < P; ++r) {
    const auto st = a[r]->state_dict();
    b[r]->load_state_dict(st.data(), st.size());
    EXPECT_EQ(b[r]->step(), 3);
  }
  step(a, oa, 7);
  step(b, ob, 7);
  for (int r = 0; r < P; ++r) {
    EXPECT_TRUE(same_bytes(oa[r].data(), ob[r].data(), 4 * n));
    EXPECT_TRUE(same_bytes(oa[0].data(), oa[r].data(), 4 * n));
  }
  // a state of another rank is rejected and changes nothing
  const auto s0 = b[0]->state_dict(), s1 = b[1]->state_dict();
  EXPECT_THROW(b[0]->load_state_dict(s1.data(), s1.size()), InvalidArgument);
  EXPECT_EQ(b[0]->state_dict(), s0);
}

TEST(OneBitPlan, InPlaceEqualsSeparateOutputInEveryDtype) {
  // begin(grad) writes the average over the gradient (rounded to its dtype); it must be the
  // separate-output result bitwise (fp32) or that result rounded once (fp16/bf16), step after
  // step (the state evolves the same), for sizes 0, 1, odd, several chunks, with and without
  // momentum.
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{4099}, int64_t{100003}})
      for (double momentum : {0.0, 0.9})
        for (bool rotate : {false, true}) {
          SCOPED_TRACE("dtype " + std::to_string(int(t)) + " n=" + std::to_string(n) +
                       " momentum " + std::to_string(momentum) + " rotate " +
                       std::to_string(rotate));
          const int P = 3;
          OneBitConfig cfg = plan_cfg(OneBitScaling::kSignL2, true, 128);
          cfg.momentum = momentum;
          cfg.rotate = rotate;
          std::vector<std::unique_ptr<OneBitAllreducePlan>> sep, inp;
          for (int r = 0; r < P; ++r) {
            sep.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r));
            inp.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r));
          }
          const size_t es = dtype_size(t);
          for (int step = 0; step < 3; ++step) {
            std::vector<std::vector<uint8_t>> ga(P), gb(P);
            std::vector<std::vector<float>> out(P, std::vector<float>(static_cast<size_t>(n)));
            std::vector<Plan*> pa, pb;
            for (int r = 0; r < P; ++r) {
              const auto x = normal(n, 1000 * step + r, 1.0f + r);
              ga[r].resize(static_cast<size_t>(n) * es);
              for (int64_t i = 0; i < n; ++i) {
                if (t == DType::kFloat32) {
                  std::memcpy(ga[r].data() + 4 * i, &x[i], 4);
                } else {
                  const uint16_t h =
                      t == DType::kFloat16 ? float_to_half(x[i]) : float_to_bf16(x[i]);
                  std::memcpy(ga[r].data() + 2 * i, &h, 2);
                }
              }
              gb[r] = ga[r];
              sep[r]->begin(TensorView(ga[r].data(), {n}, t, Device::kCPU),
                            TensorView::cpu(out[r].data(), n));
              inp[r]->begin(TensorView(gb[r].data(), {n}, t, Device::kCPU));
              pa.push_back(sep[r].get());
              pb.push_back(inp[r].get());
            }
            run_plans_in_process(pa);
            run_plans_in_process(pb);
            for (int r = 0; r < P; ++r) {
              std::vector<uint8_t> want(static_cast<size_t>(n) * es);
              for (int64_t i = 0; i < n; ++i) {
                if (t == DType::kFloat32) {
                  std::memcpy(want.data() + 4 * i, &out[r][i], 4);
                } else {
                  const uint16_t h =
                      t == DType::kFloat16 ? float_to_half(out[r][i]) : float_to_bf16(out[r][i]);
                  std::memcpy(want.data() + 2 * i, &h, 2);
                }
              }
              ASSERT_EQ(gb[r], want) << "step " << step << " rank " << r;
              ASSERT_EQ(sep[r]->state_dict(), inp[r]->state_dict()) << "step " << step;
            }
          }
        }
}

TEST(OneBitPlan, BadInputRejectedBeforeStateChanges) {
  const int64_t n = 300;
  EXPECT_THROW(OneBitAllreducePlan(plan_cfg(OneBitScaling::kColumnMeans), n, 2, 0),
               InvalidArgument);
  OneBitConfig chunked = plan_cfg();
  chunked.block_size = 48;  // blocks of scales are whole words of bits
  EXPECT_THROW(OneBitAllreducePlan(chunked, n, 2, 0), InvalidArgument);
  chunked.block_size = -32;
  EXPECT_THROW(OneBitAllreducePlan(chunked, n, 2, 0), InvalidArgument);
  EXPECT_THROW(OneBitAllreducePlan(plan_cfg(), n, 2, 2), InvalidArgument);
  EXPECT_THROW(OneBitAllreducePlan(plan_cfg(), n, 0, 0), InvalidArgument);
  // rotate: blocks of a power of two in [32, 8192], a sign scaling, the plan only
  for (int64_t block : {0, 96, 16384}) {
    OneBitConfig rc = plan_cfg(OneBitScaling::kSignL2, true, block);
    rc.rotate = true;
    EXPECT_THROW(OneBitAllreducePlan(rc, n, 2, 0), InvalidArgument) << block;
  }
  OneBitConfig rc = plan_cfg(OneBitScaling::kSignL2, true, 8192);
  rc.rotate = true;
  EXPECT_NO_THROW(OneBitAllreducePlan(rc, n, 2, 0));
  EXPECT_THROW(OneBitCompressor(rc, n), InvalidArgument);

  OneBitAllreducePlan plan(plan_cfg(), n, 1, 0);
  std::vector<float> g = normal(n, 1), out(n);
  EXPECT_THROW(plan.next(), InvalidArgument);  // no step begun
  plan.begin(TensorView::cpu(g.data(), n), TensorView::cpu(out.data(), n));
  run_plans_in_process({&plan});
  const auto st = plan.state_dict();
  g[123] = std::numeric_limits<float>::quiet_NaN();
  // a NaN gradient: raised at the end of the step (on every rank), naming the index
  plan.set_on_nonfinite(OnNonFinite::kRaise);
  try {
    plan.begin(TensorView::cpu(g.data(), n), TensorView::cpu(out.data(), n));
    run_plans_in_process({&plan});
    ADD_FAILURE() << "NaN accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("index 123"), std::string::npos) << e.what();
  }
  EXPECT_EQ(plan.state_dict(), st);
  EXPECT_TRUE(plan.skipped());
  plan.set_on_nonfinite(OnNonFinite::kSkip);
  g[123] = 0.5f;
  std::vector<float> small(n - 1);
  EXPECT_THROW(plan.begin(TensorView::cpu(small.data(), n - 1), TensorView::cpu(out.data(), n)),
               InvalidArgument);
  EXPECT_THROW(plan.begin(TensorView::cpu(g.data(), n), TensorView::cpu(g.data(), n)),
               InvalidArgument);  // alias
  std::vector<uint16_t> half(n);
  EXPECT_THROW(plan.begin(TensorView::cpu(g.data(), n),
                          TensorView(half.data(), {n}, DType::kFloat16, Device::kCPU)),
               InvalidArgument);  // fp16 output
  EXPECT_EQ(plan.state_dict(), st);
  // a begun step cannot be begun again, nor its state replaced
  plan.begin(TensorView::cpu(g.data(), n), TensorView::cpu(out.data(), n));
  EXPECT_THROW(plan.begin(TensorView::cpu(g.data(), n), TensorView::cpu(out.data(), n)),
               InvalidArgument);
  EXPECT_THROW(plan.load_state_dict(st.data(), st.size()), InvalidArgument);
  run_plans_in_process({&plan});
  EXPECT_EQ(plan.step(), 2);
}

// C++ code written when the field was called chunk_size keeps working: the old name sets
// block_size (same plans, bits and state), and the two names with different values are refused.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(OneBitPlan, ChunkSizeIsBlockSizesEarlierName) {
  const int64_t n = 1000;
  const int P = 3;
  OneBitConfig old_name = plan_cfg();
  old_name.chunk_size = 64;
  const OneBitConfig r = old_name.resolved();
  EXPECT_EQ(r.block_size, 64);
  EXPECT_EQ(r.chunk_size, -1);
  EXPECT_EQ(onebit_effective_chunk(old_name, n), 64);
  EXPECT_EQ(onebit_payload_bytes(old_name, n, 1),
            onebit_payload_bytes(plan_cfg(OneBitScaling::kSignL2, true, 64), n, 1));
  Sim a(old_name, P, n), b(plan_cfg(OneBitScaling::kSignL2, true, 64), P, n),
      other(plan_cfg(OneBitScaling::kSignL2, true, 0), P, n);
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> g(P);
    for (int q = 0; q < P; ++q) g[q] = normal(n, 100 * step + q);
    auto g2 = g, g3 = g;
    a.step(g);
    b.step(g2);
    other.step(g3);
    for (int q = 0; q < P; ++q) {
      ASSERT_TRUE(same_bytes(a.out[q].data(), b.out[q].data(), 4 * n)) << step << " " << q;
      ASSERT_EQ(a.plans[q]->state_dict(), b.plans[q]->state_dict());
    }
    // (the blocks matter: one scale per chunk gives other bits)
    EXPECT_FALSE(same_bytes(a.out[0].data(), other.out[0].data(), 4 * n));
  }
  EXPECT_EQ(a.plans[0]->config().block_size, 64);
  // the same value under both names is that value; different values are refused everywhere
  OneBitConfig both = plan_cfg(OneBitScaling::kSignL2, true, 64);
  both.chunk_size = 64;
  EXPECT_EQ(both.resolved().block_size, 64);
  EXPECT_NO_THROW(both.validate());
  both.chunk_size = 128;
  EXPECT_THROW(both.validate(), InvalidArgument);
  EXPECT_THROW(both.resolved(), InvalidArgument);
  EXPECT_THROW(OneBitAllreducePlan(both, n, 2, 0), InvalidArgument);
  EXPECT_THROW(OneBitCompressor(both, n), InvalidArgument);
  try {
    both.validate();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("earlier name"), std::string::npos) << e.what();
  }
  OneBitConfig bad = plan_cfg();
  bad.chunk_size = -32;
  EXPECT_THROW(bad.validate(), InvalidArgument);
  bad.chunk_size = 48;  // not whole words: refused as block_size 48 is
  EXPECT_THROW(OneBitAllreducePlan(bad, n, 2, 0), InvalidArgument);
  // the codec reads the old name too: its payload is the block_size one's, byte for byte
  OneBitConfig codec_old = plan_cfg();
  codec_old.chunk_size = 128;
  OneBitCompressor c_old(codec_old, n), c_new(plan_cfg(OneBitScaling::kSignL2, true, 128), n);
  auto g = normal(n, 7);
  Payload p_old, p_new;
  c_old.encode(TensorView::cpu(g.data(), n), p_old);
  c_new.encode(TensorView::cpu(g.data(), n), p_new);
  ASSERT_EQ(p_old.size(), p_new.size());
  EXPECT_TRUE(same_bytes(p_old.data(), p_new.data(), p_old.size()));
}
#pragma GCC diagnostic pop

TEST(OneBitPlan, MomentumCompressesTheVelocityAndKeepsItInTheState) {
  // With momentum m the plan must behave as a plan without momentum fed u_t = m u_{t-1} + g_t
  // (computed here in double), on every rank, over several steps and sizes.
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{33}, int64_t{1000}, int64_t{100003}}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const int P = 3;
    OneBitConfig mc = plan_cfg(OneBitScaling::kSignL1, true, 256);
    mc.momentum = 0.9;
    Sim with(mc, P, n), without(plan_cfg(OneBitScaling::kSignL1, true, 256), P, n);
    std::vector<std::vector<double>> u(P, std::vector<double>(n, 0.0));
    for (int t = 0; t < 6; ++t) {
      std::vector<std::vector<float>> g(P), uf(P);
      for (int r = 0; r < P; ++r) {
        g[r] = normal(n, 50 * t + r);
        uf[r].resize(n);
        for (int64_t i = 0; i < n; ++i) {
          u[r][i] = 0.9 * u[r][i] + g[r][i];
          uf[r][i] = static_cast<float>(u[r][i]);
        }
      }
      with.step(g);
      without.step(uf);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(with.out[0][i], without.out[0][i], 1e-4 * (1 + std::fabs(without.out[0][i])))
            << "step " << t << " i " << i;
      for (int r = 1; r < P; ++r)
        ASSERT_TRUE(same_bytes(with.out[0].data(), with.out[r].data(), 4 * n));
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(with.plans[1]->momentum_buffer()[i], u[1][i], 1e-4 * (1 + std::fabs(u[1][i])));
    }
    // NaN: rejected in begin(), momentum and errors untouched
    if (n > 0) {
      std::vector<float> g = normal(n, 7), out(n);
      g[n / 2] = std::numeric_limits<float>::infinity();
      std::vector<std::vector<uint8_t>> st;
      std::vector<std::vector<float>> gs;
      for (int r = 0; r < P; ++r) {
        st.push_back(with.plans[r]->state_dict());
        gs.push_back(r == 0 ? g : normal(n, 8 + r));
      }
      with.step(gs);  // skipped on every rank: momenta and errors untouched, the average NaN
      for (int r = 0; r < P; ++r) {
        EXPECT_TRUE(with.plans[r]->skipped());
        EXPECT_EQ(with.plans[r]->state_dict(), st[r]);
        EXPECT_TRUE(std::isnan(with.out[r][0]) && std::isnan(with.out[r][n - 1]));
      }
    }
    // the momentum travels with the state; a state without it is rejected
    OneBitAllreducePlan back(mc, n, P, 0);
    const auto st = with.plans[0]->state_dict();
    back.load_state_dict(st.data(), st.size());
    EXPECT_EQ(back.state_dict(), st);
    const auto plain = without.plans[0]->state_dict();
    EXPECT_THROW(back.load_state_dict(plain.data(), plain.size()), InvalidArgument);
    EXPECT_EQ(back.state_dict(), st);
  }
  OneBitConfig bad = plan_cfg();
  bad.momentum = 1.0;
  EXPECT_THROW(OneBitAllreducePlan(bad, 10, 1, 0), InvalidArgument);
  OneBitConfig comp_cfg;
  comp_cfg.momentum = 0.5;
  EXPECT_THROW(OneBitCompressor(comp_cfg, 10), InvalidArgument);  // plan-only option
}

TEST(OneBitPlan, RotatedPlanRejectsNaNLeavingGradientAndStateAndKeepsRotateInTheState) {
  const int64_t n = 1000;
  for (double momentum : {0.0, 0.9}) {
    OneBitConfig cfg = plan_cfg(OneBitScaling::kSignL2, true, 128);
    cfg.rotate = true;
    cfg.momentum = momentum;
    OneBitAllreducePlan plan(cfg, n, 2, 0), peer(cfg, n, 2, 1);
    std::vector<float> g0 = normal(n, 1), g1 = normal(n, 2);
    plan.begin(TensorView::cpu(g0.data(), n));
    peer.begin(TensorView::cpu(g1.data(), n));
    run_plans_in_process({&plan, &peer});
    const auto st = plan.state_dict();
    // in place on fp32: a NaN found before the gradient is rotated leaves it and the state
    const auto peer_st = peer.state_dict();
    // a NaN found before the gradient is rotated: raised on both ranks (raise policy), the
    // index named where it was found, both states unchanged
    plan.set_on_nonfinite(OnNonFinite::kRaise);
    peer.set_on_nonfinite(OnNonFinite::kRaise);
    std::vector<float> g = normal(n, 3), gp = normal(n, 5);
    g[700] = std::numeric_limits<float>::quiet_NaN();
    auto run_both = [&](std::vector<float>& a, std::vector<float>* out_a) {
      if (out_a)
        plan.begin(TensorView::cpu(a.data(), n), TensorView::cpu(out_a->data(), n));
      else
        plan.begin(TensorView::cpu(a.data(), n));
      peer.begin(TensorView::cpu(gp.data(), n));
      run_plans_in_process({&plan, &peer});
    };
    try {
      run_both(g, nullptr);
      ADD_FAILURE() << "NaN accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("index 700"), std::string::npos) << e.what();
    }
    EXPECT_EQ(plan.state_dict(), st);
    EXPECT_EQ(peer.state_dict(), peer_st);
    // finite but too large to rotate (the butterflies overflow): treated as a bad gradient,
    // state unchanged, the gradient too when the plan rotates a copy (separate output)
    std::vector<float> huge = normal(n, 4), out(n);
    for (int64_t i = 256; i < 384; ++i) huge[i] = 3.0e38f;
    const auto huge_before = huge;
    try {
      run_both(huge, &out);
      ADD_FAILURE() << "overflow accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("block 2 overflows"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(same_bytes(huge.data(), huge_before.data(), 4 * n));
    EXPECT_EQ(plan.state_dict(), st);
    // the skip policy: no exception, the average NaN on both ranks, states unchanged
    plan.set_on_nonfinite(OnNonFinite::kSkip);
    peer.set_on_nonfinite(OnNonFinite::kSkip);
    run_both(huge, nullptr);  // in place
    EXPECT_TRUE(plan.skipped() && peer.skipped());
    EXPECT_TRUE(std::isnan(huge[0]) && std::isnan(gp[n - 1]));
    EXPECT_EQ(plan.state_dict(), st);
    EXPECT_EQ(peer.state_dict(), peer_st);
    // the state records rotate: an unrotated plan of the same shape refuses it
    OneBitConfig plain = cfg;
    plain.rotate = false;
    OneBitAllreducePlan other(plain, n, 2, 0);
    const auto other_st = other.state_dict();
    EXPECT_THROW(other.load_state_dict(st.data(), st.size()), InvalidArgument);
    EXPECT_EQ(other.state_dict(), other_st);
    OneBitAllreducePlan same(cfg, n, 2, 0);
    same.load_state_dict(st.data(), st.size());
    EXPECT_EQ(same.state_dict(), st);
  }
}

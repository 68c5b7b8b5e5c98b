// SPDX-License-Identifier: Apache-2.0
// The 1-bit family over the whole finite range of its gradient dtypes (fp32, fp16, bf16): the
// largest finite value, random values of 1e18 to 4e18, the smallest normal, denormals and mixed
// magnitudes in one block, for sign_l1 and sign_l2, with and without error feedback, through the
// per-tensor OneBitCompressor and the OneBitAllreducePlan over 1, 2 and 3 ranks. Every decode
// must be finite, nonzero wherever its block is nonzero, and every scale must match a reference
// computed in long double from the definitions (x = g + e in fp32, saturated to +-FLT_MAX; scale
// = mean |x| or RMS of x over the block, rounded once to fp32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/gradcomp.hpp"
#include "onebit/onebit_ref.hpp"
#include "plans/onebit_plan.hpp"
#include "test_util.hpp"

using namespace gradcomp;
using namespace gradcomp::test;

namespace {

/// Tolerance of a scale against the long double reference: rounding of the double sum and of
/// the final fp32 (a few ulps) plus one denormal ulp for scales in the denormal range. The plan
/// averages in fp32 before its server scale, hence the wider relative bound there.
constexpr double kRelTolScale = 1e-6;
constexpr double kRelTolPlan = 1e-5;
constexpr double kAbsTol = 8 * 1.4012984643e-45;  // 8 fp32 denormal ulps

enum class Mag { kMax, kHuge, kMinNormal, kDenormal, kMixed };
const char* mag_name(Mag m) {
  switch (m) {
    case Mag::kMax:
      return "max";
    case Mag::kHuge:
      return "huge";
    case Mag::kMinNormal:
      return "min_normal";
    case Mag::kDenormal:
      return "denormal";
    case Mag::kMixed:
      return "mixed";
  }
  return "?";
}
constexpr Mag kMags[] = {Mag::kMax, Mag::kHuge, Mag::kMinNormal, Mag::kDenormal, Mag::kMixed};
constexpr DType kTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr OneBitScaling kScalings[] = {OneBitScaling::kSignL1, OneBitScaling::kSignL2};

/// Largest finite value, smallest normal and smallest denormal of a dtype (as floats).
float max_of(DType t) {
  if (t == DType::kFloat16) return 65504.0f;
  if (t == DType::kBFloat16) return bf16_to_float(0x7f7f);
  return FLT_MAX;
}
float min_normal_of(DType t) {
  if (t == DType::kFloat16) return half_to_float(0x0400);
  return FLT_MIN;  // bf16 shares fp32's exponent range
}
float min_denormal_of(DType t) {
  if (t == DType::kFloat16) return half_to_float(0x0001);
  if (t == DType::kBFloat16) return bf16_to_float(0x0001);
  return std::nextafter(0.0f, 1.0f);
}
/// v rounded to the dtype (round to nearest even, as the library's conversions).
float to_type(float v, DType t) {
  if (t == DType::kFloat16) return half_to_float(float_to_half(v));
  if (t == DType::kBFloat16) return bf16_to_float(float_to_bf16(v));
  return v;
}

/// A gradient of one dtype: its values as floats (exact) and its storage.
struct Grad {
  DType t;
  std::vector<float> f;
  std::vector<uint16_t> h;
  TensorView view() {
    const int64_t n = static_cast<int64_t>(f.size());
    if (t == DType::kFloat32) return TensorView::cpu(f.data(), n);
    return TensorView(h.data(), {n}, t, Device::kCPU);
  }
};

/// Random magnitude in [lo, hi] (log-uniform), random sign, rounded to the dtype, never zero.
float draw(std::mt19937_64& rng, float lo, float hi, DType t) {
  std::uniform_real_distribution<double> u(std::log(double(lo)), std::log(double(hi)));
  float v = to_type(static_cast<float>(std::exp(u(rng))), t);
  v = std::min(std::max(v, lo), hi);
  return (rng() & 1) ? -v : v;
}

Grad draw_grad(DType t, Mag m, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Grad g{t, std::vector<float>(static_cast<size_t>(n)), {}};
  const float mx = max_of(t), mn = min_normal_of(t), md = min_denormal_of(t);
  // "huge": 1e18 .. 4e18 where the dtype holds it; fp16 (max 65504): its top octave
  const float hlo = t == DType::kFloat16 ? 32768.0f : 1e18f;
  const float hhi = t == DType::kFloat16 ? mx : 4e18f;
  for (int64_t i = 0; i < n; ++i) {
    float v = 0.0f;
    switch (m) {
      case Mag::kMax:
        v = (rng() & 1) ? -mx : mx;
        break;
      case Mag::kHuge:
        v = draw(rng, hlo, hhi, t);
        break;
      case Mag::kMinNormal:
        v = (rng() & 1) ? -mn : mn;
        break;
      case Mag::kDenormal:
        v = draw(rng, md, std::nextafter(mn, 0.0f), t);
        break;
      case Mag::kMixed:
        switch (i % 7) {
          case 0:
            v = (rng() & 1) ? -mx : mx;
            break;
          case 1:
            v = draw(rng, hlo, hhi, t);
            break;
          case 2:
            v = draw(rng, 0.5f, 2.0f, t);
            break;
          case 3:
            v = (rng() & 1) ? -mn : mn;
            break;
          case 4:
            v = draw(rng, md, std::nextafter(mn, 0.0f), t);
            break;
          case 5:
            v = 0.0f;
            break;
          default:
            v = draw(rng, mn, std::max(4 * mn, 1e-20f), t);
            break;
        }
        break;
    }
    g.f[i] = v;
  }
  if (t != DType::kFloat32) {
    g.h.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      g.h[i] = t == DType::kFloat16 ? float_to_half(g.f[i]) : float_to_bf16(g.f[i]);
      g.f[i] = t == DType::kFloat16 ? half_to_float(g.h[i]) : bf16_to_float(g.h[i]);  // exact
    }
  }
  return g;
}

/// draw_grad, remembered (gradcomp::test::remembered): the sweeps below draw the same gradient
/// for every setting of the codec (scaling, error feedback, chunk).
Grad make_grad(DType t, Mag m, int64_t n, uint64_t seed) {
  return gradcomp::test::remembered(
      std::tuple{static_cast<int>(t), static_cast<int>(m), n, seed},
      [&] { return draw_grad(t, m, n, seed); },
      [](const Grad& g) { return 4 * g.f.size() + 2 * g.h.size(); });
}

/// The compensated value of the definition: g + e in fp32, saturated to +-FLT_MAX.
float comp_x(float g, float e) {
  const float r = g + e;
  return std::isinf(r) ? std::copysign(FLT_MAX, r) : r;
}

/// Mean |x| or RMS of x[b, e) in long double.
long double ref_norm(const std::vector<float>& x, int64_t b, int64_t e, OneBitScaling s) {
  long double acc = 0;
  for (int64_t i = b; i < e; ++i) {
    const long double v = x[i];
    acc += s == OneBitScaling::kSignL1 ? std::fabs(v) : v * v;
  }
  const long double len = static_cast<long double>(e - b);
  return s == OneBitScaling::kSignL1 ? acc / len : std::sqrt(acc / len);
}
long double ref_norm_ld(const std::vector<long double>& x, int64_t b, int64_t e, OneBitScaling s) {
  long double acc = 0;
  for (int64_t i = b; i < e; ++i)
    acc += s == OneBitScaling::kSignL1 ? std::fabs(x[i]) : x[i] * x[i];
  const long double len = static_cast<long double>(e - b);
  return s == OneBitScaling::kSignL1 ? acc / len : std::sqrt(acc / len);
}

bool all_finite(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}
int64_t first_nonfinite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) return static_cast<int64_t>(i);
  return -1;
}

std::string trace(DType t, OneBitScaling s, bool ef, Mag m, int64_t n) {
  return std::string(dtype_name(t)) + " " + enum_name(s) + (ef ? " ef" : " no-ef") + " " +
         mag_name(m) + " n " + std::to_string(n);
}

}  // namespace

// The per-tensor compressor: payload scales against the reference of x = g + e (e read from the
// compressor before each step), decodes (one payload, the average of three copies, and
// accumulated onto a decode) finite and nonzero, the error state finite.
TEST(OneBitRange, CompressorScalesAndDecodesOverTheWholeRange) {
  for (DType t : kTypes)
    for (OneBitScaling sc : kScalings)
      for (bool ef : {true, false})
        for (Mag m : kMags)
          for (int64_t chunk : {int64_t{0}, int64_t{64}})
            for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{33}, int64_t{1001}, int64_t{70001}}) {
              SCOPED_TRACE(trace(t, sc, ef, m, n) + " chunk " + std::to_string(chunk));
              OneBitConfig cfg;
              cfg.scaling = sc;
              cfg.error_feedback = ef;
              cfg.block_size = chunk;
              OneBitCompressor comp(cfg, n, 1, t);
              const int64_t S = onebit_effective_chunk(cfg, n);
              for (int step = 0; step < 3; ++step) {
                SCOPED_TRACE("step " + std::to_string(step));
                Grad g = make_grad(t, m, n, 1000 * step + 17 + n);
                std::vector<float> e(static_cast<size_t>(n), 0.0f);
                if (ef && n > 0) std::memcpy(e.data(), comp.error(), 4 * n);
                std::vector<float> x(static_cast<size_t>(n));
                for (int64_t i = 0; i < n; ++i) x[i] = ef ? comp_x(g.f[i], e[i]) : g.f[i];
                Payload p;
                comp.encode(g.view(), p);
                const View v = view_of(p.data());
                std::vector<char> block_nonzero;  // per block of S: does x have a nonzero?
                for (int64_t b = 0, k = 0; b < n; b += S, ++k) {
                  const int64_t end = std::min(n, b + S);
                  const long double want = ref_norm(x, b, end, sc);
                  const float got = v.scales[k];
                  ASSERT_TRUE(std::isfinite(got)) << "block " << k;
                  ASSERT_NEAR(double(got), double(want), kRelTolScale * double(want) + kAbsTol)
                      << "block " << k;
                  bool nonzero = false;
                  for (int64_t i = b; i < end; ++i) nonzero = nonzero || x[i] != 0.0f;
                  if (nonzero) ASSERT_GT(got, 0.0f) << "block " << k << " of a nonzero x";
                  block_nonzero.push_back(nonzero);
                }
                std::vector<float> d(static_cast<size_t>(n), 0.0f);
                comp.decode_add(p.data(), p.size(), TensorView::cpu(d.data(), n), 1.0f);
                ASSERT_EQ(first_nonfinite(d), -1);
                for (int64_t i = 0; i < n; ++i) {
                  if (block_nonzero[static_cast<size_t>(i / S)]) ASSERT_NE(d[i], 0.0f) << i;
                  ASSERT_EQ(std::signbit(d[i]), !(x[i] >= 0.0f)) << i;
                }
                // dense += decode (twice the decode: saturates at FLT_MAX) and the average of
                // three copies (the fp32 sum of three FLT_MAX would overflow)
                comp.decode_add(p.data(), p.size(), TensorView::cpu(d.data(), n), 1.0f);
                ASSERT_EQ(first_nonfinite(d), -1);
                const void* ptrs[3] = {p.data(), p.data(), p.data()};
                const size_t sizes[3] = {p.size(), p.size(), p.size()};
                std::vector<float> a(static_cast<size_t>(n), 0.0f);
                comp.decode_average(ptrs, sizes, 3, TensorView::cpu(a.data(), n), 1.0f / 3.0f);
                ASSERT_EQ(first_nonfinite(a), -1);
                for (int64_t i = 0; i < n; ++i) {
                  const float one = std::fabs(v.scales[i / S]);
                  ASSERT_NEAR(std::fabs(a[i]), one, 1e-6 * one + kAbsTol) << i;
                }
                if (ef && n > 0) {
                  std::vector<float> e2(static_cast<size_t>(n));
                  std::memcpy(e2.data(), comp.error(), 4 * n);
                  ASSERT_EQ(first_nonfinite(e2), -1);
                }
              }
            }
}

namespace {

/// Runs the plan over P ranks for `steps` steps of fresh gradients (dtype t, magnitude m) with
/// fp32 outputs, and checks every step against the reference of one step written from the
/// plan's definition (gradcomp/onebit.hpp), given the error states read before the step:
/// worker x_r = g_r + we_r (saturated), worker scales per block, avg = (1/P) sum_r +-s_r, server
/// x = avg + se, server scale per block = |out| of every element of the block.
void check_plan(DType t, OneBitScaling sc, bool ef, Mag m, int P, int64_t n, int64_t chunk,
                int steps) {
  OneBitConfig cfg;
  cfg.scaling = sc;
  cfg.error_feedback = ef;
  cfg.block_size = chunk;
  std::vector<std::unique_ptr<OneBitAllreducePlan>> plans;
  for (int r = 0; r < P; ++r) plans.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r));
  const int64_t CE = plans[0]->chunk_elems(), S = plans[0]->scale_block();
  std::vector<std::vector<float>> out(P, std::vector<float>(static_cast<size_t>(n)));
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<Grad> g;
    std::vector<std::vector<float>> x(P);
    std::vector<std::vector<float>> se(P);
    std::vector<Plan*> ps;
    for (int r = 0; r < P; ++r) {
      g.push_back(make_grad(t, m, n, 7919 * step + 31 * r + n + 5));
      std::vector<float> we(static_cast<size_t>(n), 0.0f);
      se[r].assign(static_cast<size_t>(CE), 0.0f);
      if (ef) {
        if (n > 0) std::memcpy(we.data(), plans[r]->worker_error(), 4 * n);
        if (CE > 0) std::memcpy(se[r].data(), plans[r]->server_error(), 4 * CE);
      }
      x[r].resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) x[r][i] = ef ? comp_x(g[r].f[i], we[i]) : g[r].f[i];
    }
    for (int r = 0; r < P; ++r) {
      plans[r]->begin(g[r].view(), TensorView::cpu(out[r].data(), n));
      ps.push_back(plans[r].get());
    }
    run_plans_in_process(ps);
    // reference: worker scales, the average, the server's x and its block scales
    std::vector<long double> avg(static_cast<size_t>(n), 0.0L);
    for (int r = 0; r < P; ++r)
      for (int64_t b = 0; b < n; b += S) {
        const int64_t end = std::min(n, b + S);
        const float s = static_cast<float>(ref_norm(x[r], b, end, sc));
        for (int64_t i = b; i < end; ++i) avg[i] += x[r][i] >= 0.0f ? s : -s;
      }
    std::vector<long double> xs(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      avg[i] /= P;
      xs[i] = avg[i] + (ef ? se[i / CE][i % CE] : 0.0f);
      xs[i] = std::min<long double>(std::max<long double>(xs[i], -FLT_MAX), FLT_MAX);
    }
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(first_nonfinite(out[r]), -1) << "rank " << r;
      ASSERT_TRUE(same_bytes(out[0].data(), out[r].data(), 4 * n)) << "rank " << r;
      if (ef) {
        ASSERT_TRUE(all_finite(plans[r]->worker_error(), n)) << "rank " << r;
        ASSERT_TRUE(all_finite(plans[r]->server_error(), CE)) << "rank " << r;
      }
    }
    for (int64_t b = 0; b < n; b += S) {
      const int64_t end = std::min(n, b + S);
      const long double want = ref_norm_ld(xs, b, end, sc);
      for (int64_t i = b; i < end; ++i) {
        const double got = std::fabs(double(out[0][i]));
        ASSERT_NEAR(got, double(want), kRelTolPlan * double(want) + kAbsTol) << i;
        if (static_cast<float>(want) > 0.0f) ASSERT_GT(got, 0.0) << i;
      }
    }
  }
}

}  // namespace

// The plan over 1, 2 and 3 ranks, every dtype, scaling, error feedback on and off, sizes 0, 1,
// odd and large (past the CPU's 65536-element reduction groups), one scale per chunk or per 64.
TEST(OneBitRange, AllreducePlanOverTheWholeRange) {
  for (DType t : kTypes)
    for (OneBitScaling sc : kScalings)
      for (bool ef : {true, false})
        for (Mag m : kMags)
          for (int P : {1, 2, 3})
            for (int64_t chunk : {int64_t{0}, int64_t{64}})
              for (int64_t n :
                   {int64_t{0}, int64_t{1}, int64_t{33}, int64_t{1001}, int64_t{140001}}) {
                if (n == 140001 && (P == 2 || (ef && m != Mag::kMixed))) continue;  // run time
                SCOPED_TRACE(trace(t, sc, ef, m, n) + " P " + std::to_string(P) + " chunk " +
                             std::to_string(chunk));
                check_plan(t, sc, ef, m, P, n, chunk, ef ? 3 : 1);
                if (HasFatalFailure()) return;
              }
}

// Many steps at the extremes with error feedback: the averaged gradient stays finite and
// nonzero on every step (the errors carried from step to step stay in range too).
TEST(OneBitRange, PlanStaysFiniteAndNonzeroOver20Steps) {
  for (DType t : kTypes)
    for (OneBitScaling sc : kScalings)
      for (Mag m : {Mag::kMax, Mag::kHuge, Mag::kMinNormal, Mag::kDenormal, Mag::kMixed}) {
        SCOPED_TRACE(trace(t, sc, true, m, 1000));
        check_plan(t, sc, true, m, 2, 1000, 128, 20);
        if (HasFatalFailure()) return;
      }
}

// In place (begin(grad)) on an fp32 gradient: the average written over the gradient is finite.
TEST(OneBitRange, InPlaceFp32AverageIsFinite) {
  for (OneBitScaling sc : kScalings)
    for (Mag m : kMags)
      for (int P : {1, 2, 3}) {
        SCOPED_TRACE(trace(DType::kFloat32, sc, true, m, 1001) + " P " + std::to_string(P));
        OneBitConfig cfg;
        cfg.scaling = sc;
        cfg.block_size = 64;
        std::vector<std::unique_ptr<OneBitAllreducePlan>> plans;
        for (int r = 0; r < P; ++r)
          plans.push_back(std::make_unique<OneBitAllreducePlan>(cfg, 1001, P, r));
        for (int step = 0; step < 5; ++step) {
          std::vector<Grad> g;
          std::vector<Plan*> ps;
          for (int r = 0; r < P; ++r)
            g.push_back(make_grad(DType::kFloat32, m, 1001, 97 * step + r));
          for (int r = 0; r < P; ++r) {
            plans[r]->begin(g[r].view());
            ps.push_back(plans[r].get());
          }
          run_plans_in_process(ps);
          for (int r = 0; r < P; ++r) ASSERT_EQ(first_nonfinite(g[r].f), -1) << "rank " << r;
        }
      }
}

// In place on fp16 / bf16 gradients: the average is rounded to the gradient's dtype. The
// decoded fp32 value can exceed the dtype's largest finite value (error feedback adds to the
// gradient), so the rounding must saturate rather than give Inf.
TEST(OneBitRange, InPlaceHalfAverageIsFinite) {
  for (DType t : {DType::kFloat16, DType::kBFloat16})
    for (OneBitScaling sc : kScalings)
      for (Mag m : {Mag::kMax, Mag::kHuge, Mag::kMixed})
        for (int P : {1, 2, 3}) {
          SCOPED_TRACE(trace(t, sc, true, m, 1000) + " P " + std::to_string(P));
          OneBitConfig cfg;
          cfg.scaling = sc;
          cfg.block_size = 128;
          std::vector<std::unique_ptr<OneBitAllreducePlan>> plans;
          for (int r = 0; r < P; ++r)
            plans.push_back(std::make_unique<OneBitAllreducePlan>(cfg, 1000, P, r));
          for (int step = 0; step < 20; ++step) {
            std::vector<Grad> g;
            std::vector<Plan*> ps;
            for (int r = 0; r < P; ++r) g.push_back(make_grad(t, m, 1000, 97 * step + r));
            for (int r = 0; r < P; ++r) {
              plans[r]->begin(g[r].view());
              ps.push_back(plans[r].get());
            }
            run_plans_in_process(ps);
            for (int r = 0; r < P; ++r) {
              int64_t bad = 0;
              for (uint16_t h : g[r].h)
                bad += std::isfinite(t == DType::kFloat16 ? half_to_float(h) : bf16_to_float(h))
                           ? 0
                           : 1;
              ASSERT_EQ(bad, 0) << "rank " << r << " step " << step;
            }
          }
        }
}

// SPDX-License-Identifier: Apache-2.0
// Finite gradients anywhere in their dtype's range, through every stateful family's bucket plan
// (make_plan): the largest finite values, the smallest normals, denormals and magnitudes mixed
// over the whole range, for fp32, fp16 and bf16 gradients, P = 1 and 3 ranks, several steps so
// that residuals and errors accumulate. No finite input may give a non-finite average or state,
// nor lose everything to underflow where the exact average is representable. The only steps
// allowed to be skipped (average NaN on every rank, state untouched, as an overflow step) are
// those whose fp32 state or wire sum would overflow by construction: 1-bit's momentum and
// rotation and PowerSGD's projection at the largest fp32/bf16 values, random-k's sum over ranks of
// fp32 or bf16 values at the largest values (its fp16 values are each rank's share of the average,
// whose sum cannot overflow fp16). fp16 values (value_dtype) of fp32/bf16 gradients below fp16's
// range are not sent but kept in the residual (where they accumulate): only that case may average
// to zero.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/plan.hpp"
#include "kernels/topk_math.h"
#include "plan_variant.hpp"

namespace gc = gradcomp;

namespace {

struct Variant {
  const char* label;
  const char* family;
  gc::PlanOptions options;
  bool may_skip_at_max;  // its state or wire sum overflows by construction at the largest values
};

std::vector<Variant> variants() {
  using S = std::string;
  return {
      {"topk", "topk", {{"ratio", 0.2}}, false},
      {"topk fp16 values", "topk", {{"ratio", 0.2}, {"value_dtype", S("float16")}}, false},
      {"topk momentum", "topk", {{"ratio", 0.2}, {"momentum", 0.9}}, false},
      {"topk dense", "topk", {{"ratio", 0.2}, {"route", S("dense")}}, false},
      {"randomk", "randomk", {{"ratio", 0.2}, {"dense_below", int64_t{0}}}, true},
      {"randomk fp16 values",
       "randomk",
       {{"ratio", 0.2}, {"dense_below", int64_t{0}}, {"value_dtype", S("float16")}},
       false},                         // shares of the average: their fp16 sum cannot overflow
      {"onebit", "onebit", {}, true},  // the rotation's sums of S values overflow at the top
      {"onebit sign_l1", "onebit", {{"scaling", S("sign_l1")}, {"rotate", false}}, false},
      {"onebit momentum", "onebit", {{"momentum", 0.9}}, true},
      {"powersgd", "powersgd", {{"rank", int64_t{2}}}, true},
  };
}

enum class Pattern { kMax, kMinNormal, kDenormal, kMixed };
const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::kMax:
      return "largest finite";
    case Pattern::kMinNormal:
      return "smallest normal";
    case Pattern::kDenormal:
      return "denormal";
    case Pattern::kMixed:
      return "mixed magnitudes";
  }
  return "";
}

float to_f(const uint8_t* b, gc::DType dt, int64_t i) {
  if (dt == gc::DType::kFloat32) {
    float x;
    std::memcpy(&x, b + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, b + 2 * i, 2);
  return dt == gc::DType::kFloat16 ? gc::half_to_float(h) : gc::bf16_to_float(h);
}

void put(uint8_t* b, gc::DType dt, int64_t i, float x) {
  if (dt == gc::DType::kFloat32) {
    std::memcpy(b + 4 * i, &x, 4);
  } else {
    const uint16_t h = dt == gc::DType::kFloat16 ? gc::float_to_half(x) : gc::float_to_bf16(x);
    std::memcpy(b + 2 * i, &h, 2);
  }
}

// The dtype's largest finite, smallest normal and smallest denormal magnitudes.
void limits(gc::DType dt, float& mx, float& mn, float& dn) {
  if (dt == gc::DType::kFloat32) {
    mx = 0x1.fffffep127f, mn = 0x1p-126f, dn = 0x1p-149f;
  } else if (dt == gc::DType::kFloat16) {
    mx = 65504.0f, mn = 0x1p-14f, dn = 0x1p-24f;
  } else {
    mx = 0x1.fep127f, mn = 0x1p-126f, dn = 0x1p-133f;
  }
}

std::vector<uint8_t> gradient(int64_t n, gc::DType dt, Pattern p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  float mx, mn, dn;
  limits(dt, mx, mn, dn);
  std::vector<uint8_t> b(static_cast<size_t>(n) * gc::dtype_size(dt));
  for (int64_t i = 0; i < n; ++i) {
    const float sign = u(rng) < 0.5 ? -1.0f : 1.0f;
    float x = 0.0f;
    switch (p) {
      case Pattern::kMax:
        x = mx;
        break;
      case Pattern::kMinNormal:
        x = mn * static_cast<float>(1.0 + u(rng));
        break;
      case Pattern::kDenormal:
        x = dn * static_cast<float>(1 + static_cast<int>(8 * u(rng)));
        break;
      case Pattern::kMixed: {  // log-uniform over the dtype's normal range, but its top, which
        // kMax covers: sums over ranks, steps and rotation blocks stay below the largest value
        const double top = dt == gc::DType::kFloat16 ? 0x1p-4 : 0x1p-20;
        const double lo = std::log(static_cast<double>(mn));
        const double hi = std::log(static_cast<double>(mx) * top);
        x = static_cast<float>(std::exp(lo + (hi - lo) * u(rng)));
        break;
      }
    }
    put(b.data(), dt, i, sign * x);
  }
  return b;
}

// bucket shapes: a matrix (compressed by PowerSGD) when n allows
std::vector<std::vector<int64_t>> shapes_for(int64_t n) {
  if (n >= 40 && n % 8 == 0) return {{8, n / 8}};
  return {{n}};
}

// rank r's plan of `family` for a bucket of n elements of dt on P ranks
std::unique_ptr<gc::BucketPlan> plan_for(const Variant& v, int64_t n, gc::DType dt, int P, int r) {
  return gc::make_plan(v.family, gc::test::rank_bucket(n, dt, P, r, shapes_for(n)), v.options);
}

}  // namespace

TEST(Range, FiniteGradientsGiveFiniteAveragesAndStateInEveryFamily) {
  const int steps = 6;
  int cases = 0, skipped_cases = 0;
  for (const Variant& v : variants())
    for (gc::DType dt : {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16})
      for (Pattern pat : {Pattern::kMax, Pattern::kMinNormal, Pattern::kDenormal, Pattern::kMixed})
        for (int P : {1, 3})
          for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}}) {
            SCOPED_TRACE(std::string(v.label) + " " + gc::dtype_name(dt) + " " + pattern_name(pat) +
                         " P=" + std::to_string(P) + " n=" + std::to_string(n));
            std::vector<std::unique_ptr<gc::BucketPlan>> plans;
            for (int r = 0; r < P; ++r) plans.push_back(plan_for(v, n, dt, P, r));
            const bool max_fp32_range = pat == Pattern::kMax && dt != gc::DType::kFloat16;
            // random-k sums its fp32 or bf16 values over ranks as they are: at the top of fp32's
            // range the sum overflows, as plain DDP's allreduce of such values would
            const bool fp16_values = std::string(v.label).find("fp16 values") != std::string::npos;
            const bool may_skip = v.may_skip_at_max && max_fp32_range;
            double out_abs = 0.0, exact_abs = 0.0;
            int skips = 0;
            for (int s = 0; s < steps; ++s) {
              std::vector<std::vector<uint8_t>> g;
              std::vector<double> exact(static_cast<size_t>(n), 0.0);
              for (int r = 0; r < P; ++r) {
                g.push_back(gradient(n, dt, pat, 1000 * s + 17 * r + 5));
                for (int64_t i = 0; i < n; ++i) exact[i] += to_f(g[r].data(), dt, i) / P;
              }
              std::vector<gc::Plan*> raw;
              for (int r = 0; r < P; ++r) {
                plans[r]->begin(gc::TensorView(g[r].data(), {n}, dt, gc::Device::kCPU));
                raw.push_back(plans[r].get());
              }
              gc::run_plans_in_process(raw);
              const bool sk = plans[0]->skipped();
              for (int r = 1; r < P; ++r) ASSERT_EQ(plans[r]->skipped(), sk) << "rank " << r;
              if (sk) {
                ASSERT_TRUE(may_skip) << "step " << s << " was skipped";
                ++skips;
                continue;
              }
              for (int r = 0; r < P; ++r)
                for (int64_t i = 0; i < n; ++i) {
                  const float x = to_f(g[r].data(), dt, i);
                  ASSERT_TRUE(std::isfinite(x))
                      << "step " << s << " rank " << r << " index " << i << ": " << x;
                  if (r == 0) out_abs += std::fabs(x);
                }
              for (double e : exact) exact_abs += std::fabs(e);
            }
            // the state stays finite: it reloads (load_state_dict refuses NaN/Inf)
            for (int r = 0; r < P; ++r) {
              const auto st = plans[r]->state_dict();
              auto fresh = plan_for(v, n, dt, P, r);
              ASSERT_NO_THROW(fresh->load_state_dict(st.data(), st.size())) << "rank " << r;
            }
            // not silently zeroed: what the kept steps averaged is not all lost (the exact
            // average of a step is at least the smallest denormal of the output dtype here)
            float mx, mn, dn;
            limits(dt, mx, mn, dn);
            const bool below_values =
                fp16_values && dt != gc::DType::kFloat16 && pat != Pattern::kMax;
            if (skips < steps && exact_abs >= dn && !below_values)
              EXPECT_GT(out_abs, 0.0) << "every output was 0";
            skipped_cases += skips > 0;
            ++cases;
          }
  EXPECT_EQ(cases, 10 * 3 * 4 * 2 * 3);
  EXPECT_GT(skipped_cases, 0);  // the allowed overflow steps do occur (the test tests them)
}

// Random-k's fp16 values are summed over ranks in fp16. Each rank sends its share of the average
// (v / P, saturated so that P shares cannot sum past 65504), so values near and past 65504 / P on
// every rank, whose plain sum passes 65504, average right and finite instead of making every such
// step an overflow step (which, without a loss scaler, skipped every step for good). A value
// beyond what one step can carry (a rank's 1e5 of an fp32 gradient) is delivered over the
// following steps from the residual: what the steps deliver adds up to the average.
TEST(Range, RandomKFp16ValuesAverageRightWhereTheirSumPasses65504) {
  const Variant v{
      "randomk fp16 values",
      "randomk",
      {{"ratio", 1.0}, {"dense_below", int64_t{0}}, {"value_dtype", std::string("float16")}},
      false};
  const int64_t n = 64;
  for (int P : {2, 3, 4})
    for (gc::DType dt : {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16}) {
      SCOPED_TRACE(std::string(gc::dtype_name(dt)) + " P=" + std::to_string(P));
      std::vector<std::unique_ptr<gc::BucketPlan>> plans;
      for (int r = 0; r < P; ++r) plans.push_back(plan_for(v, n, dt, P, r));
      // element i of rank r: 65504 / P times a factor in [0.9, 1.5] (every sum over ranks but
      // the smallest passes 65504); fp32 gradients also carry 1e5 at element 0 on every rank
      const bool beyond = dt == gc::DType::kFloat32;
      std::vector<double> exact(static_cast<size_t>(n), 0.0), sent(static_cast<size_t>(n), 0.0);
      const int steps = beyond ? 4 : 1;  // (then zero gradients: the residual drains)
      for (int s = 0; s < steps; ++s) {
        std::vector<std::vector<uint8_t>> g;
        for (int r = 0; r < P; ++r) {
          g.emplace_back(static_cast<size_t>(n) * gc::dtype_size(dt), 0);
          for (int64_t i = 0; s == 0 && i < n; ++i) {
            const double f = 0.9 + 0.6 * static_cast<double>((i * 7 + r * 3) % 13) / 12.0;
            const float x = (beyond && i == 0) ? 1e5f : static_cast<float>(65504.0 / P * f);
            put(g[r].data(), dt, i, (i % 2 ? -1.0f : 1.0f) * x);
            exact[i] += to_f(g[r].data(), dt, i) / P;
          }
        }
        std::vector<gc::Plan*> raw;
        for (int r = 0; r < P; ++r) {
          plans[r]->begin(gc::TensorView(g[r].data(), {n}, dt, gc::Device::kCPU));
          raw.push_back(plans[r].get());
        }
        gc::run_plans_in_process(raw);
        for (int r = 0; r < P; ++r) {
          ASSERT_FALSE(plans[r]->skipped()) << "step " << s << " rank " << r;
          for (int64_t i = 0; i < n; ++i) {
            const float x = to_f(g[r].data(), dt, i);
            ASSERT_TRUE(std::isfinite(x)) << "step " << s << " rank " << r << " index " << i;
            ASSERT_EQ(x, to_f(g[0].data(), dt, i)) << "ranks disagree at " << i;
          }
        }
        for (int64_t i = 0; i < n; ++i) sent[i] += to_f(g[0].data(), dt, i);
        if (beyond && s == 0)  // one step carries at most 65504: the rest waits
          EXPECT_LE(std::fabs(to_f(g[0].data(), dt, 0)), 65504.0f);
      }
      // each value carries fp16's rounding (2^-11 relative) as a share and at each addition of
      // the sum (the residual keeps the share's, to send it later), then the output dtype's
      const double out_eps = dt == gc::DType::kBFloat16  ? 0x1p-8
                             : dt == gc::DType::kFloat16 ? 0x1p-11
                                                         : 0.0;
      for (int64_t i = 0; i < n; ++i)
        EXPECT_NEAR(sent[i], exact[i], std::fabs(exact[i]) * ((P + 1) * 0x1p-11 + out_eps))
            << "index " << i;
    }
}

// share_limit: an fp16 value m whose sum over P ranks cannot pass 65504 with the rounding of the
// P - 2 intermediate partial sums: P copies of m summed in fp16, one rounding per addition, stay
// finite, P m <= 65504, and m keeps most of the range where the bound allows (within 1% of
// 65504 / P for a few ranks, a quarter of it at 2048).
TEST(Range, ShareLimitKeepsTheFp16SumOfSharesFinite) {
  namespace k = gc::kernels;
  EXPECT_EQ(k::share_limit(gc::DType::kFloat16, 1), 65504.0f);
  for (int P = 2; P <= 8192; P += (P < 64 ? 1 : 37)) {
    const float m = k::share_limit(gc::DType::kFloat16, P);
    ASSERT_EQ(gc::half_to_float(gc::float_to_half(m)), m) << "P=" << P;  // an fp16 value
    ASSERT_LE(static_cast<double>(m) * P, 65504.0) << "P=" << P;
    if (P <= 16) ASSERT_GE(static_cast<double>(m) * P, 0.99 * 65504.0) << "P=" << P;
    if (P <= 2048) ASSERT_GE(static_cast<double>(m) * P, 0.25 * 65504.0) << "P=" << P;
    ASSERT_GT(m, 0.0f) << "P=" << P;
    const uint16_t h = gc::float_to_half(m);
    uint16_t sum = h;
    for (int r = 1; r < P; ++r)
      sum = gc::float_to_half(gc::half_to_float(sum) + gc::half_to_float(h));
    ASSERT_TRUE(std::isfinite(gc::half_to_float(sum))) << "P=" << P;
  }
}

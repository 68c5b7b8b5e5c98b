// SPDX-License-Identifier: Apache-2.0
// The element-wise math of the top-k family, written once for the CPU loops and the CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "gradcomp/detail/macros.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/rng.hpp"
#include "kernels/reduce_math.h"

namespace gradcomp::kernels {

/// DGC momentum correction (Lin et al. 2018, Alg. 1/2) for one element, on the clipped gradient g.
/// Plain:     u <- m u + g;        v <- v + u
/// Nesterov:  u <- m (u + g);      v <- v + u + g
/// With m = 0 both reduce to residual accumulation v <- v + g (u is then not stored).
/// With a finite g, u and v saturate at +-FLT_MAX (numeric.hpp) instead of overflowing, so a
/// finite gradient anywhere in the fp32 range never makes the state infinite; a non-finite g
/// (check_finite off) passes through as before.
GC_HD void dgc_update(float g, float m, bool nesterov, float& u, float& v) {
  if (nesterov) {
    u = m * (u + g);
    v = v + u + g;
  } else {
    u = m * u + g;
    v = v + u;
  }
  if (is_finite_bits(g)) {
    u = saturate_f32(u);
    v = saturate_f32(v);
  }
}

/// Residual accumulation without momentum, v + g, saturating as dgc_update does.
GC_HD float dgc_residual(float v, float g) {
  const float r = v + g;
  return is_finite_bits(g) ? saturate_f32(r) : r;
}

/// The value sent for an accumulated v in a value dtype of narrower range (fp16): v saturated to
/// the dtype's largest finite value (reduce_math.h), so that the receiver never decodes Inf from
/// a finite residual; what does not fit stays in the residual (residual_after_send).
GC_HD float value_to_send(float v, DType vt) { return saturate_for(v, vt); }

/// x with -0 made +0: the value 0 + x that the residual accumulation forms from a zero residual,
/// for the gather that reads the gradient itself (the same bits as that path sends).
GC_HD float plus_zero(float x) { return (float_bits(x) & 0x7fffffffu) == 0u ? 0.0f : x; }

/// What stays in the residual of an element whose accumulated value v was sent as `sent` (v
/// rounded to the value dtype, as the receiver decodes it): the rounding error v - sent, so
/// that fp16/bf16 values lose nothing over steps; 0 for fp32 values (sent == v). A `sent` that
/// overflowed the value dtype (infinite) leaves 0. A share (value_share) stands for `divisor`
/// times itself: v - divisor * sent stays (divisor 1: v - sent, bit for bit).
GC_HD float residual_after_send(float v, float sent, float divisor = 1.0f) {
  return is_finite_bits(sent) ? v - divisor * sent : 0.0f;
}

/// One rank's share of a sum over `divisor` ranks that is summed in the value dtype itself (the
/// random-k plan, whose indices are shared, allreduces the values): v / divisor, saturated to
/// `limit` (share_limit), so that the sum of the ranks' shares, which is the average, stays in
/// the dtype's range however large the residuals grow; what does not fit stays in the residual
/// (residual_after_send with the same divisor). NaN and Inf pass unchanged.
GC_HD float value_share(float v, float divisor, float limit) {
  const float x = divisor == 1.0f ? v : v / divisor;
  const float a = x < 0.0f ? -x : x;
  if (!(a > limit) || !is_finite_bits(x)) return x;
  return x < 0.0f ? -limit : limit;
}

/// The largest value of vt that value_share may send so that a sum over `ranks` such values
/// cannot overflow vt however the sum is ordered. Each rounded partial sum is off by at most half
/// an ulp of vt's largest value, and by at most u = 2^-(mantissa bits + 1) of itself: with
/// either bound, ranks * limit plus the error of the ranks - 2 intermediate roundings stays at
/// or below vt's largest finite value, and the last rounding of a sum that does not pass it
/// gives no Inf. The larger of the two limits is taken (the first is tighter for few ranks, the
/// second for thousands). ranks <= 1: vt's largest finite value (value_to_send). Host only.
inline float share_limit(DType vt, int ranks) {
  const bool f16 = vt == DType::kFloat16, b16 = vt == DType::kBFloat16;
  const double top = f16 ? 65504.0 : b16 ? 0x1.fep127 : 0x1.fffffep127;
  if (ranks <= 1) return static_cast<float>(top);
  const double half_ulp = f16 ? 16.0 : b16 ? 0x1p119 : 0x1p103;
  const double u = f16 ? 0x1p-11 : b16 ? 0x1p-8 : 0x1p-24;
  const double p = static_cast<double>(ranks);
  const double by_ulp = (top - half_ulp * (p - 2.0)) / p;
  const double by_rel = top / (p * std::pow(1.0 + u, p - 2.0));
  const double x = by_ulp > by_rel ? by_ulp : by_rel;
  float f = static_cast<float>(x);  // the largest value of vt at or below x
  if (static_cast<double>(f) > x) f = std::nextafter(f, 0.0f);
  if (vt == DType::kFloat32) return f;
  auto back = [&](uint16_t b) { return f16 ? half_to_float(b) : bf16_to_float(b); };
  uint16_t h = f16 ? float_to_half(f) : float_to_bf16(f);
  while (h > 0 && static_cast<double>(back(h)) > x) --h;  // (positive: the bits order values)
  return back(h);
}

/// Local gradient clipping coefficient: min(1, max_norm / ||g||); 1 when clipping is off (<= 0).
GC_HD float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0 || norm <= max_norm) return 1.0f;
  return static_cast<float>(max_norm / norm);
}

/// The threshold test of the selection: keep x when |x| >= threshold (on ordered bits).
GC_HD bool passes_threshold(float x, uint32_t threshold_bits) {
  return abs_bits(x) >= threshold_bits;
}

/// Random-k index j of k in [0, n): stratified, one uniform draw in each of k equal strata
/// [floor(j n / k), floor((j + 1) n / k)). Distinct, ascending, identical on every rank and device.
GC_HD uint32_t randomk_index(uint64_t j, uint64_t k, uint64_t n, const RngKey& key) {
  const uint64_t lo = j * n / k, hi = (j + 1) * n / k;
  return static_cast<uint32_t>(lo + key.below(j, hi - lo));
}

/// Position in the tensor of element r of the concatenation of nr > 0 ranges of it. `ranges`
/// holds 2 nr entries: the ranges' starts in the concatenation (ascending, the first 0, no empty
/// range), then their starts in the tensor. Random-k draws over the concatenation of the
/// tensors it samples and maps the draws here, skipping the ones sent whole (dense_below).
GC_HD uint32_t range_position(uint32_t r, const uint32_t* ranges, int64_t nr) {
  int64_t lo = 0, hi = nr - 1;  // the last range starting at or before r
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (ranges[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return ranges[nr + lo] + (r - ranges[lo]);
}

/// Random-k index j of k over n elements, mapped through `ranges` when nr > 0.
GC_HD uint32_t randomk_position(uint64_t j, uint64_t k, uint64_t n, const RngKey& key,
                                const uint32_t* ranges, int64_t nr) {
  const uint32_t r = randomk_index(j, k, n, key);
  return nr > 0 ? range_position(r, ranges, nr) : r;
}

}  // namespace gradcomp::kernels

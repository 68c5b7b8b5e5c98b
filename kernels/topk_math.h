// SPDX-License-Identifier: Apache-2.0
// The element-wise math of the top-k family, written once for the CPU loops and the CUDA kernels.
#pragma once

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

/// Local gradient clipping coefficient: min(1, max_norm / ||g||); 1 when clipping is off (<= 0).
/// What stays in the residual of an element whose accumulated value v was sent as `sent` (v
/// rounded to the value dtype, as the receiver decodes it): the rounding error v - sent, so
/// that fp16/bf16 values lose nothing over steps; 0 for fp32 values (sent == v). A `sent` that
/// overflowed the value dtype (infinite) leaves 0.
GC_HD float residual_after_send(float v, float sent) {
  return is_finite_bits(sent) ? v - sent : 0.0f;
}

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

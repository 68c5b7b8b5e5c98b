// SPDX-License-Identifier: Apache-2.0
// The math of PowerSGD written once for the CPU loops and the CUDA kernels: the initial Q, the
// fused modified Gram-Schmidt (coefficients and the per-row update), element-wise load / store.
//
// Fused MGS on a row-major n x r block A (rows are r contiguous floats): pass j = 0..r reads every
// row once and
//   1. (j >= 1) finishes column j-1:   old = a[j-1];  a[j-1] = old * inv;  a[k] -= coef[k] * old
//      for k >= j, where inv = 1 / (||a_{j-1}|| + eps) and coef[k] = <a_{j-1}, a_k> inv^2 (this is
//      a_k -= <q, a_k> q with q = a_{j-1} inv, PyTorch's formula, on the unnormalized column);
//   2. (j < r) accumulates s[k] = <a_j, a_k> for k >= j on the updated row (pass 0 also the
//      original squared norms of every column, for the degenerate-column test).
// So r + 1 passes instead of PyTorch's O(r^2) separate norm / dot / axpy passes over strided
// columns, with the same arithmetic as textbook MGS (up to the order of the sums).
#pragma once

#include <cmath>
#include <cstdint>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/rng.hpp"
#include "gradcomp/tensor.hpp"
#include "kernels/reduce_math.h"

#if defined(__CUDACC__)
#define PSGD_UNROLL _Pragma("unroll")
#else
#define PSGD_UNROLL _Pragma("GCC unroll 32")
#endif

namespace gradcomp::kernels {

/// A column whose norm after projection is <= kPsgdDegenerate x its norm before projection is
/// numerically dependent (or zero) and is set to zero, never divided: no NaN, whatever epsilon.
inline constexpr float kPsgdDegenerate = 1e-4f;

/// Element i of a freshly drawn Q (row-major m x r): uniform in [-1, 1) with 24 random bits from
/// the counter-based RNG keyed by (seed, step, tensor id). Exact integer arithmetic, so the CPU and
/// the GPU draw bitwise the same Q (a Gaussian would need log/cos, which differ in the last ulp).
GC_HD float psgd_q_value(const RngKey& key, uint64_t i) {
  return static_cast<float>(static_cast<int32_t>(key.word(i) >> 8) - 8388608) * (1.0f / 8388608.0f);
}

/// The power of two 2^k (k returned) that brings a P block whose largest |value| is maxabs to
/// about 1 before Gram-Schmidt, or 0 (nothing done) when maxabs is within 2^-20..2^20, zero or
/// not finite, or eps > 0. The column norms are formed from squares, which overflow fp32 above
/// about 1e19 and underflow below about 1e-19: such a block's columns would come out as zero (the
/// gradient lost, silently). Orthonormalization is scale-free and a power of two scales every
/// rounding exactly, so a scaled block gives the same bits as an unscaled one wherever that one
/// neither overflowed nor underflowed: this only adds range. (With eps > 0, PyTorch's epsilon,
/// the result depends on the scale, so it is left as PyTorch computes it.)
GC_HD int psgd_prescale_exponent(float maxabs, float eps) {
  if (eps > 0.0f || !(maxabs > 0.0f) || !is_finite_bits(maxabs)) return 0;
  int e = 0;
  frexpf(maxabs, &e);  // maxabs = f 2^e, f in [0.5, 1)
  return e >= -20 && e <= 20 ? 0 : -e;
}

/// 1 / (norm + eps) for a column with squared norm s after projection and orig before it, or 0
/// when the column is numerically zero.
GC_HD float psgd_mgs_inv(float s, float orig, float eps) {
  const float norm = sqrtf(s > 0.0f ? s : 0.0f);
  const float norm0 = sqrtf(orig > 0.0f ? orig : 0.0f);
  if (!(norm > 0.0f) || !(norm > kPsgdDegenerate * norm0)) return 0.0f;
  return 1.0f / (norm + eps);
}

/// Step 1 of a fused MGS pass on one row held in v[0..R): finish column jp = j - 1. Branch-free
/// (vectorizes over k): v[k] = v[k] * scale[k] - coef[k] * v[jp], with scale[jp] = inv and 1
/// elsewhere, coef[k] = <a_jp, a_k> inv^2 for k > jp and 0 elsewhere (see
/// psgd_mgs_coefficients): exactly old * inv for k = jp and v[k] for k < jp.
template <int R>
GC_HD void psgd_mgs_update_row(float (&v)[R], int jp, const float* scale, const float* coef) {
  float old = 0.0f;
  PSGD_UNROLL
  for (int k = 0; k < R; ++k)
    if (k == jp) old = v[k];
  PSGD_UNROLL
  for (int k = 0; k < R; ++k) v[k] = v[k] * scale[k] - coef[k] * old;
}

/// Step 2 of a fused MGS pass: acc[k] += a_j * a_k for every k (the caller reads k >= j); with
/// First (pass 0) also acc[R + k] += a_k^2. Padding columns (k >= r) hold 0.
template <int R, bool First>
GC_HD void psgd_mgs_accumulate_row(const float (&v)[R], int j, float (&acc)[2 * R]) {
  float xj = 0.0f;
  PSGD_UNROLL
  for (int k = 0; k < R; ++k)
    if (k == j) xj = v[k];
  PSGD_UNROLL
  for (int k = 0; k < R; ++k) acc[k] += xj * v[k];
  if (First) {
    PSGD_UNROLL
    for (int k = 0; k < R; ++k) acc[R + k] += v[k] * v[k];
  }
}

/// After pass j's sums s[k] (k >= j): scale[] and coef[] of the update that finishes column j in
/// the next pass. orig[] holds the original squared norms (from pass 0's sums).
template <int R>
GC_HD void psgd_mgs_coefficients(const float* s, const float* orig, int r, int j, float eps,
                                 float* scale, float* coef) {
  const float inv = psgd_mgs_inv(s[j], orig[j], eps);
  for (int k = 0; k < R; ++k) {
    scale[k] = k == j ? inv : 1.0f;
    coef[k] = k > j && k < r ? s[k] * inv * inv : 0.0f;
  }
}

/// Stores x into element i of an fp32/fp16/bf16 array (round to nearest even; a finite x beyond
/// fp16's / bf16's range saturates to its largest finite value, reduce_math.h, so that a finite
/// average never turns into Inf; the error then keeps the excess).
GC_HD void psgd_store(void* p, int64_t i, DType t, float x) {
  store_float(p, t, i, saturate_for(x, t));
}

/// Loads element i of an fp32/fp16/bf16 array as float.
GC_HD float psgd_load(const void* p, int64_t i, DType t) {
  if (t == DType::kFloat32) return static_cast<const float*>(p)[i];
  if (t == DType::kFloat16) return half_to_float(static_cast<const uint16_t*>(p)[i]);
  return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

/// What every rank writes back for a summed value: sum / world (IEEE division).
GC_HD float psgd_mean(float sum, float world) { return sum / world; }

}  // namespace gradcomp::kernels

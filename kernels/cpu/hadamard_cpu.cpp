// SPDX-License-Identifier: Apache-2.0
// CPU backend of the 1-bit plan's fixed randomized Hadamard rotation (kernels/onebit_kernels.hpp,
// hadamard_rotate): each block of S elements becomes H D x / sqrt(S), D's signs a fixed pattern
// of the global element index (kernels/onebit_math.h, rotation_sign), so every rank and device
// rotates alike. Blocks are independent: threads take contiguous runs of them. An AVX2 build of
// the butterflies is chosen at run time; the baseline build is x86-64-v2 (SSE).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/threads.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gradcomp::kernels {
namespace cpu {
namespace {

using namespace onebit;

}  // namespace

// AVX2 build of the rotation, chosen at run time (the library's baseline is x86-64-v2)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GC_ROTATE_AVX2 1
#define GC_ALWAYS_INLINE_ROTATE __attribute__((always_inline))
#else
#define GC_ROTATE_AVX2 0
#define GC_ALWAYS_INLINE_ROTATE
#endif

namespace {
/// kSignNibbles[m][k]: -1 where bit k of m is set, else 1 (four of D's signs from four bits).
constexpr float kSignNibbles[16][4] = {
    {1, 1, 1, 1},   {-1, 1, 1, 1},   {1, -1, 1, 1},   {-1, -1, 1, 1},
    {1, 1, -1, 1},  {-1, 1, -1, 1},  {1, -1, -1, 1},  {-1, -1, -1, 1},
    {1, 1, 1, -1},  {-1, 1, 1, -1},  {1, -1, 1, -1},  {-1, -1, 1, -1},
    {1, 1, -1, -1}, {-1, 1, -1, -1}, {1, -1, -1, -1}, {-1, -1, -1, -1}};

/// The first three stages (h = 1, 2, 4) of the transform of one group of 8 at v, after
/// multiplying it by d (D's signs, or nullptr): the same butterflies as the general stages. With
/// SSE a - b is computed as a + (-b) (the sign flipped by xor), which IEEE defines to be the same
/// value, so both forms give the CUDA kernel's bits.
GC_ALWAYS_INLINE_ROTATE inline void signed_wht8(float* v, const float* d) {
#if defined(__SSE2__)
  const __m128 odd = _mm_castsi128_ps(_mm_set_epi32(INT32_MIN, 0, INT32_MIN, 0));   // lanes 1, 3
  const __m128 high = _mm_castsi128_ps(_mm_set_epi32(INT32_MIN, INT32_MIN, 0, 0));  // lanes 2, 3
  __m128 a = _mm_loadu_ps(v), b = _mm_loadu_ps(v + 4);
  if (d) {
    a = _mm_mul_ps(a, _mm_loadu_ps(d));
    b = _mm_mul_ps(b, _mm_loadu_ps(d + 4));
  }
  // h = 1: [x0 + x1, x0 - x1, x2 + x3, x2 - x3]
  a = _mm_add_ps(_mm_shuffle_ps(a, a, _MM_SHUFFLE(2, 2, 0, 0)),
                 _mm_xor_ps(_mm_shuffle_ps(a, a, _MM_SHUFFLE(3, 3, 1, 1)), odd));
  b = _mm_add_ps(_mm_shuffle_ps(b, b, _MM_SHUFFLE(2, 2, 0, 0)),
                 _mm_xor_ps(_mm_shuffle_ps(b, b, _MM_SHUFFLE(3, 3, 1, 1)), odd));
  // h = 2: [y0 + y2, y1 + y3, y0 - y2, y1 - y3]
  a = _mm_add_ps(_mm_shuffle_ps(a, a, _MM_SHUFFLE(1, 0, 1, 0)),
                 _mm_xor_ps(_mm_shuffle_ps(a, a, _MM_SHUFFLE(3, 2, 3, 2)), high));
  b = _mm_add_ps(_mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 1, 0)),
                 _mm_xor_ps(_mm_shuffle_ps(b, b, _MM_SHUFFLE(3, 2, 3, 2)), high));
  _mm_storeu_ps(v, _mm_add_ps(a, b));  // h = 4
  _mm_storeu_ps(v + 4, _mm_sub_ps(a, b));
#else
  if (d)
    for (int j = 0; j < 8; ++j) v[j] = mul_rn(v[j], d[j]);
  for (int h = 1; h < 8; h <<= 1)
    for (int i = 0; i < 8; i += 2 * h)
      for (int j = i; j < i + h; ++j) butterfly(v[j], v[j + h]);
#endif
}

/// Stage h of the transform of one block of S elements (h >= 8: contiguous runs that vectorize).
/// With r (the last stage) each output is then multiplied by r and, with d, by D's sign.
GC_ALWAYS_INLINE_ROTATE inline void wht_stage(float* v, int64_t S, int64_t h, const float* r,
                                              const float* d) {
  for (int64_t i = 0; i < S; i += 2 * h) {
    float* __restrict p = v + i;
    float* __restrict q = v + i + h;
    if (!r) {
      for (int64_t j = 0; j < h; ++j) {
        const float s = add_rn(p[j], q[j]), t = sub_rn(p[j], q[j]);
        p[j] = s;
        q[j] = t;
      }
    } else if (!d) {
      for (int64_t j = 0; j < h; ++j) {
        const float s = mul_rn(add_rn(p[j], q[j]), *r), t = mul_rn(sub_rn(p[j], q[j]), *r);
        p[j] = s;
        q[j] = t;
      }
    } else {
      const float* __restrict dp = d + i;
      const float* __restrict dq = d + i + h;
      for (int64_t j = 0; j < h; ++j) {
        const float s = mul_rn(mul_rn(add_rn(p[j], q[j]), *r), dp[j]);
        const float t = mul_rn(mul_rn(sub_rn(p[j], q[j]), *r), dq[j]);
        p[j] = s;
        q[j] = t;
      }
    }
  }
}
}  // namespace

namespace {
/// Blocks [b0, b1) of the rotation (d: S floats of scratch for D's signs). Compiled twice below:
/// for the build's baseline ISA and for AVX2 (the same fp32 adds, subtracts and multiplies in the
/// same order, only wider vectors: bitwise equal; FMA is not enabled, so nothing is contracted).
GC_ALWAYS_INLINE_ROTATE inline void rotate_range(float* x, int64_t b0, int64_t b1, int64_t S,
                                                 int64_t first_block, bool inverse,
                                                 float* __restrict d) {
  const float r = rotation_norm(S);
  for (int64_t b = b0; b < b1; ++b) {
    float* v = x + b * S;
    // D's signs: one hash per 32 elements, expanded 4 at a time from a nibble table
    const int64_t base = (first_block + b) * S;
    if (S >= 32) {
      for (int64_t w = 0; w < S / 32; ++w) {
        const uint32_t bits = rotation_word(base / 32 + w);
        for (int k = 0; k < 8; ++k)
          std::memcpy(d + 32 * w + 4 * k, kSignNibbles[(bits >> (4 * k)) & 15u], 16);
      }
    } else {
      for (int64_t j = 0; j < S; ++j) d[j] = rotation_sign(base + j);
    }
    if (S < 16) {  // small blocks: the stages one by one (the plan's blocks are >= 32)
      if (!inverse)
        for (int64_t j = 0; j < S; ++j) v[j] = mul_rn(v[j], d[j]);
      for (int64_t h = 1; h < S; h <<= 1)
        for (int64_t i = 0; i < S; i += 2 * h)
          for (int64_t j = i; j < i + h; ++j) butterfly(v[j], v[j + h]);
      for (int64_t j = 0; j < S; ++j)
        v[j] = inverse ? mul_rn(mul_rn(v[j], r), d[j]) : mul_rn(v[j], r);
      continue;
    }
    for (int64_t i = 0; i < S; i += 8) signed_wht8(v + i, inverse ? nullptr : d + i);
    for (int64_t h = 8; h < S / 2; h <<= 1) wht_stage(v, S, h, nullptr, nullptr);
    wht_stage(v, S, S / 2, &r, inverse ? d : nullptr);  // the last stage, scaled (and signed)
  }
}

void rotate_range_baseline(float* x, int64_t b0, int64_t b1, int64_t S, int64_t first_block,
                           bool inverse, float* d) {
  rotate_range(x, b0, b1, S, first_block, inverse, d);
}

#if GC_ROTATE_AVX2
__attribute__((target("avx2"))) void rotate_range_avx2(float* x, int64_t b0, int64_t b1, int64_t S,
                                                       int64_t first_block, bool inverse,
                                                       float* d) {
  rotate_range(x, b0, b1, S, first_block, inverse, d);
}
#endif

using RotateRange = void (*)(float*, int64_t, int64_t, int64_t, int64_t, bool, float*);

/// The blocks split over the threads in runs of 64 (one ISA build's range function per run).
void rotate_blocks(RotateRange fn, float* x, int64_t nblocks, int64_t S, int64_t first_block,
                   bool inverse) {
  constexpr int64_t kRun = 64;
  const int64_t runs = (nblocks + kRun - 1) / kRun;
#pragma omp parallel num_threads(threads_for(nblocks* S))
  {
    std::vector<float> sg(static_cast<size_t>(S));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < runs; ++c)
      fn(x, c * kRun, std::min(nblocks, (c + 1) * kRun), S, first_block, inverse, sg.data());
  }
}
}  // namespace

void hadamard_rotate_baseline(float* x, int64_t nblocks, int64_t S, int64_t first_block,
                              bool inverse) {
  if (nblocks > 0) rotate_blocks(rotate_range_baseline, x, nblocks, S, first_block, inverse);
}

bool hadamard_rotate_uses_avx2() {
#if GC_ROTATE_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}

void hadamard_rotate(float* x, int64_t nblocks, int64_t S, int64_t first_block, bool inverse) {
  if (nblocks <= 0) return;
#if GC_ROTATE_AVX2
  if (hadamard_rotate_uses_avx2())
    return rotate_blocks(rotate_range_avx2, x, nblocks, S, first_block, inverse);
#endif
  rotate_blocks(rotate_range_baseline, x, nblocks, S, first_block, inverse);
}

}  // namespace cpu
}  // namespace gradcomp::kernels

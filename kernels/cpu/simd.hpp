// SPDX-License-Identifier: Apache-2.0
// SSE helpers the CPU kernels share (the library's baseline is x86-64-v2: SSE4.2): lane-wise
// forms of the scalar math in kernels/onebit_math.h, with the same results lane by lane.
#pragma once

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif

#include "kernels/onebit_math.h"

namespace gradcomp::kernels::cpu {

#if defined(__SSE2__)
/// m ? a : b per lane (m all-ones or all-zeros lanes).
inline __m128 select_ps(__m128 m, __m128 a, __m128 b) {
#if defined(__SSE4_1__)
  return _mm_blendv_ps(b, a, m);
#else
  return _mm_or_ps(_mm_and_ps(m, a), _mm_andnot_ps(m, b));
#endif
}
/// onebit::compensate on 4 lanes: g + e, saturated to +-FLT_MAX where g is finite (min / max in
/// this operand order return a NaN sum unchanged, as saturate does).
inline __m128 compensate_ps(__m128 g, __m128 e) {
  const __m128 big = _mm_set1_ps(onebit::kMaxFinite), nbig = _mm_set1_ps(-onebit::kMaxFinite);
  const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  const __m128 r = _mm_add_ps(g, e);
  const __m128 sat = _mm_min_ps(big, _mm_max_ps(nbig, r));
  return select_ps(_mm_cmple_ps(_mm_and_ps(g, absmask), big), sat, r);
}
/// saturate_f32 on 4 lanes (a NaN stays NaN).
inline __m128 saturate_ps(__m128 r) {
  const __m128 big = _mm_set1_ps(onebit::kMaxFinite), nbig = _mm_set1_ps(-onebit::kMaxFinite);
  return _mm_min_ps(big, _mm_max_ps(nbig, r));
}
#endif

}  // namespace gradcomp::kernels::cpu

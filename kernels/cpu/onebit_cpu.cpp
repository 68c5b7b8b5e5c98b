// SPDX-License-Identifier: Apache-2.0
// CPU backend of the 1-bit family.
//  - onebit_compress (the compressor's path): one pass reads g and the lazy error state, writes
//    the packed bits and x into the state and sums the scale terms (see
//    kernels/onebit_kernels.hpp), so a step moves read g + read e + write e + write bits and
//    nothing else. Work items are fixed element groups (flat) or (32-row slab, column tile) blocks
//    whose partial sums are combined in a fixed order, so scales do not depend on the thread count.
//    Full 32-element words go through SSE (compare + movemask packs 4 bits per instruction),
//    partial or column-wrapping words through the same scalar math from kernels/onebit_math.h. A
//    state written to another buffer goes out through non-temporal stores (no read-for-ownership of
//    the target).
//  - onebit_scales + onebit_quantize: the two-pass form (scale pass, then fused quantize pass that
//    writes e itself), used by the allreduce plan's worker and server steps.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/simd.hpp"
#include "kernels/cpu/threads.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"
#include "kernels/pinned.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#define GC_ONEBIT_SSE 1
#endif
#if defined(__SSE4_1__)
#include <smmintrin.h>
#endif

namespace gradcomp::kernels {

OneBitWorkspace::~OneBitWorkspace() { free_pinned_slot(pinned); }

namespace cpu {
namespace {

using namespace onebit;

constexpr int64_t kGroup = int64_t{1} << 16;  // elements per partial sum of the flat reductions
constexpr int64_t kLaneBlock = 1024;          // fp32 lane sums are folded into double this often
constexpr int64_t kTile = 1024;               // columns per work item of the column reduction

template <class Load>
inline float xval(const void* g, const float* e, int64_t i) {
  const float gv = Load::load(g, i);
  return e ? compensate(gv, e[i]) : gv;
}

template <class Load>
int64_t first_nonfinite(const void* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!is_finite_bits(Load::load(g, i))) return i;
  return -1;
}

/// Sum over [b, end) of onebit::norm_term_wide(x(i)) in double (4 lanes, i - b mod 4, added in
/// order): the redo of a slice whose fp32 sum needs_wide_sum flags. Rare: scalar.
template <int N, class X>
double wide_sum(int64_t b, int64_t end, X x) {
  double lane[4] = {0, 0, 0, 0};
  int64_t j = b;
  for (; j + 4 <= end; j += 4)
    for (int l = 0; l < 4; ++l) lane[l] = add_rn_d(lane[l], norm_term_wide<N>(x(j + l)));
  for (; j < end; ++j) lane[0] = add_rn_d(lane[0], norm_term_wide<N>(x(j)));
  return (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

#if GC_ONEBIT_SSE
/// The 8 fp32 lanes of the flat reductions (a: |x|, x^2 or the non-negative sum; n, c: the
/// negative sum and the non-negative count of kColumnMeans).
template <int M>
struct FlatLanes {
  __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
  __m128 n0 = _mm_setzero_ps(), n1 = _mm_setzero_ps();
  __m128 c0 = _mm_setzero_ps(), c1 = _mm_setzero_ps();
  inline void add(__m128 x0, __m128 x1, __m128 m0, __m128 m1) {
    if constexpr (M == kL1) {
      const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
      a0 = _mm_add_ps(a0, _mm_and_ps(x0, absmask));
      a1 = _mm_add_ps(a1, _mm_and_ps(x1, absmask));
    } else if constexpr (M == kL2) {
      a0 = _mm_add_ps(a0, _mm_mul_ps(x0, x0));
      a1 = _mm_add_ps(a1, _mm_mul_ps(x1, x1));
    } else {
      const __m128 one = _mm_set1_ps(1.0f);
      a0 = _mm_add_ps(a0, _mm_and_ps(m0, x0));
      a1 = _mm_add_ps(a1, _mm_and_ps(m1, x1));
      n0 = _mm_add_ps(n0, _mm_andnot_ps(m0, x0));
      n1 = _mm_add_ps(n1, _mm_andnot_ps(m1, x1));
      c0 = _mm_add_ps(c0, _mm_and_ps(m0, one));
      c1 = _mm_add_ps(c1, _mm_and_ps(m1, one));
    }
  }
  void store(float* a, float* an, float* ac) const {
    _mm_storeu_ps(a, a0);
    _mm_storeu_ps(a + 4, a1);
    if constexpr (M == kColumnMeans) {
      _mm_storeu_ps(an, n0);
      _mm_storeu_ps(an + 4, n1);
      _mm_storeu_ps(ac, c0);
      _mm_storeu_ps(ac + 4, c1);
    }
  }
};
#endif

// ---- pass 1 -----------------------------------------------------------------------------------

/// Sum over [b, end) of norm_term(x): fp32 lanes over blocks of kLaneBlock, folded into double;
/// a block whose total needs_wide_sum is summed again in double (wide_sum).
template <class Load, int N, bool HasE>
double flat_sum(const void* g, const float* e, int64_t b, int64_t end) {
  const auto x = [g, e](int64_t i) { return xval<Load>(g, HasE ? e : nullptr, i); };
  double total = 0.0;
#if GC_ONEBIT_SSE
  if constexpr (std::is_same_v<Load, F32Load>) {  // same lanes as below, explicit SSE
    const float* gf = static_cast<const float*>(g);
    const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    for (int64_t i = b; i < end; i += kLaneBlock) {
      const int64_t stop = std::min(end, i + kLaneBlock);
      __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
      int64_t j = i;
      for (; j + 8 <= stop; j += 8) {
        __m128 x0 = _mm_loadu_ps(gf + j), x1 = _mm_loadu_ps(gf + j + 4);
        if (HasE) {  // plain g + e: an overflow makes the block's sum Inf, redone saturated
          x0 = _mm_add_ps(x0, _mm_loadu_ps(e + j));
          x1 = _mm_add_ps(x1, _mm_loadu_ps(e + j + 4));
        }
        if (N == kL1) {
          x0 = _mm_and_ps(x0, absmask);
          x1 = _mm_and_ps(x1, absmask);
        } else {
          x0 = _mm_mul_ps(x0, x0);
          x1 = _mm_mul_ps(x1, x1);
        }
        a0 = _mm_add_ps(a0, x0);
        a1 = _mm_add_ps(a1, x1);
      }
      float lane[8];
      _mm_storeu_ps(lane, a0);
      _mm_storeu_ps(lane + 4, a1);
      for (; j < stop; ++j) lane[0] += norm_term<N>(x(j));
      double s = 0.0;
      for (int l = 0; l < 8; ++l) s += lane[l];
      total += needs_wide_sum<N>(s) ? wide_sum<N>(i, stop, x) : s;
    }
    return total;
  }
#endif
  for (int64_t i = b; i < end; i += kLaneBlock) {
    const int64_t stop = std::min(end, i + kLaneBlock);
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = i;
    for (; j + 8 <= stop; j += 8)
      for (int l = 0; l < 8; ++l) lane[l] += norm_term<N>(x(j + l));
    for (; j < stop; ++j) lane[0] += norm_term<N>(x(j));
    double s = 0.0;
    for (int l = 0; l < 8; ++l) s += lane[l];
    total += needs_wide_sum<N>(s) ? wide_sum<N>(i, stop, x) : s;
  }
  return total;
}

/// Sums of the non-negative entries, their count, and of the negative entries over [b, end).
template <class Load, bool HasE>
void flat_split_sum(const void* g, const float* e, int64_t b, int64_t end, double out[3]) {
  double sp = 0, sn = 0, cp = 0;
  for (int64_t i = b; i < end; i += kLaneBlock) {
    const int64_t stop = std::min(end, i + kLaneBlock);
    float lp[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ln[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int32_t lc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = i;
#if GC_ONEBIT_SSE
    if constexpr (std::is_same_v<Load, F32Load>) {
      const float* gf = static_cast<const float*>(g);
      const __m128 zero = _mm_setzero_ps();
      FlatLanes<kColumnMeans> lanes;
      for (; j + 8 <= stop; j += 8) {
        __m128 x0 = _mm_loadu_ps(gf + j), x1 = _mm_loadu_ps(gf + j + 4);
        if (HasE) {
          x0 = compensate_ps(x0, _mm_loadu_ps(e + j));
          x1 = compensate_ps(x1, _mm_loadu_ps(e + j + 4));
        }
        lanes.add(x0, x1, _mm_cmpge_ps(x0, zero), _mm_cmpge_ps(x1, zero));
      }
      float cf[8];
      lanes.store(lp, ln, cf);
      for (int l = 0; l < 8; ++l) lc[l] = static_cast<int32_t>(cf[l]);  // <= 128: exact
    }
#endif
    for (; j + 8 <= stop; j += 8)
      for (int l = 0; l < 8; ++l) {
        const float x = xval<Load>(g, HasE ? e : nullptr, j + l);
        const bool p = sign_bit(x);
        lp[l] += p ? x : 0.0f;
        ln[l] += p ? 0.0f : x;
        lc[l] += p ? 1 : 0;
      }
    for (; j < stop; ++j) {
      const float x = xval<Load>(g, HasE ? e : nullptr, j);
      const bool p = sign_bit(x);
      lp[0] += p ? x : 0.0f;
      ln[0] += p ? 0.0f : x;
      lc[0] += p ? 1 : 0;
    }
    for (int l = 0; l < 8; ++l) {
      sp += lp[l];
      sn += ln[l];
      cp += lc[l];
    }
  }
  out[0] = sp;
  out[1] = cp;
  out[2] = sn;
}

/// Flat finish (one column): the items' partials (sum of non-negatives, their count, sum of
/// negatives) added in item order, then hi = mean of the non-negatives, lo = mean of the
/// negatives. Shared by the scale pass and the fused encode so that both add in the same order.
void finish_flat_means(const double* part, int64_t items, int64_t R, float* hi, float* lo) {
  double sp = 0, cp = 0, sn = 0;
  for (int64_t it = 0; it < items; ++it) {
    sp += part[3 * it];
    cp += part[3 * it + 1];
    sn += part[3 * it + 2];
  }
  *hi = mean_or_zero(sp, cp);
  *lo = mean_or_zero(sn, static_cast<double>(R) - cp);
}

/// Sign-scale finish: per chunk k, its `spc` group sums added in group order, then its L1 or L2
/// scale over the chunk's length. Shared by the scale pass and the fused encode.
void finish_sign_scales(const double* part, int64_t K, int64_t spc, int64_t n, int64_t S, int norm,
                        float* scales) {
  for (int64_t k = 0; k < K; ++k) {
    double sum = 0.0;
    for (int64_t s = 0; s < spc; ++s) sum += part[k * spc + s];
    const int64_t len = std::min(n, (k + 1) * S) - k * S;
    scales[k] = norm == kL1 ? l1_scale(sum, len) : l2_scale(sum, len);
  }
}

/// Column-means finish: per column, the slab partials (sum of non-negatives, their count, sum of
/// negatives) added in slab order, then hi = mean of the non-negatives, lo = mean of the negatives.
void finish_column_means(const double* part, int64_t nslab, int64_t C, int64_t R, float* hi,
                         float* lo) {
#pragma omp parallel for num_threads(threads_for(C* nslab * 8)) schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    double sp = 0, cp = 0, sn = 0;
    for (int64_t s = 0; s < nslab; ++s) {
      const double* p = part + 3 * s * C;
      sp += p[c];
      cp += p[C + c];
      sn += p[2 * C + c];
    }
    hi[c] = mean_or_zero(sp, cp);
    lo[c] = mean_or_zero(sn, static_cast<double>(R) - cp);
  }
}

template <class Load, bool HasE>
void sign_scales(const void* g, const float* e, const OneBitGeom& geo, int norm, float* scales,
                 OneBitWorkspace& ws) {
  const int64_t n = geo.n, S = geo.chunk, K = geo.num_scales();
  const int64_t spc = (std::min(S, n) + kGroup - 1) / kGroup;  // groups per chunk
  const int64_t items = K * spc;
  ws.host.resize(static_cast<size_t>(items));
  double* part = ws.host.data();
  const int T = threads_for(n);
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t k = it / spc, s = it % spc;
    const int64_t ce = std::min(n, (k + 1) * S);
    const int64_t b = k * S + s * kGroup, end = std::min(ce, b + kGroup);
    double v = 0.0;
    if (b < end)
      v = norm == kL1 ? flat_sum<Load, kL1, HasE>(g, e, b, end)
                      : flat_sum<Load, kL2, HasE>(g, e, b, end);
    part[it] = v;
  }
  finish_sign_scales(part, K, spc, n, S, norm, scales);
}

template <class Load, bool HasE>
void column_scales(const void* g, const float* e, const OneBitGeom& geo, float* scales,
                   OneBitWorkspace& ws) {
  const int64_t n = geo.n, C = geo.cols, R = n / C;
  float* hi = scales;
  float* lo = scales + C;
  if (C == 1) {  // one column: a flat reduction over fixed groups
    const int64_t items = (n + kGroup - 1) / kGroup;
    ws.host.resize(static_cast<size_t>(3 * items));
    double* part = ws.host.data();
    const int T = threads_for(n);
#pragma omp parallel for num_threads(T) schedule(static)
    for (int64_t it = 0; it < items; ++it)
      flat_split_sum<Load, HasE>(g, e, it * kGroup, std::min(n, (it + 1) * kGroup), part + 3 * it);
    finish_flat_means(part, items, R, hi, lo);
    return;
  }
  // Work items: (row slab, tile of kTile columns). Each item sums its columns over its rows in
  // row order into double accumulators; slabs are then combined in slab order.
  const int64_t nslab = std::clamp<int64_t>(std::min(R / 16, n >> 18), 1, 64);
  const int64_t ntile = (C + kTile - 1) / kTile;
  ws.host.resize(static_cast<size_t>(3 * nslab * C));
  double* part = ws.host.data();  // [slab][3][C]
  const int T = threads_for(n);
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t it = 0; it < nslab * ntile; ++it) {
    const int64_t slab = it / ntile, tile = it % ntile;
    const int64_t r0 = R * slab / nslab, r1 = R * (slab + 1) / nslab;
    const int64_t c0 = tile * kTile, c1 = std::min(C, c0 + kTile), w = c1 - c0;
    double sp[kTile], sn[kTile], cp[kTile];
    float fp[kTile], fn[kTile], fc[kTile];
    for (int64_t c = 0; c < w; ++c) sp[c] = sn[c] = cp[c] = 0.0;
    for (int64_t rb = r0; rb < r1; rb += 32) {  // fp32 over <= 32 rows, then into double
      const int64_t re = std::min(r1, rb + 32);
      for (int64_t c = 0; c < w; ++c) fp[c] = fn[c] = fc[c] = 0.0f;
      for (int64_t r = rb; r < re; ++r) {
        const int64_t base = r * C + c0;
        int64_t c = 0;
#if GC_ONEBIT_SSE
        if constexpr (std::is_same_v<Load, F32Load>) {
          const float* gf = static_cast<const float*>(g) + base;
          const float* ef = HasE ? e + base : nullptr;
          const __m128 zero = _mm_setzero_ps(), one = _mm_set1_ps(1.0f);
          for (; c + 4 <= w; c += 4) {
            __m128 x = _mm_loadu_ps(gf + c);
            if (HasE) x = compensate_ps(x, _mm_loadu_ps(ef + c));
            const __m128 m = _mm_cmpge_ps(x, zero);
            _mm_storeu_ps(fp + c, _mm_add_ps(_mm_loadu_ps(fp + c), _mm_and_ps(m, x)));
            _mm_storeu_ps(fn + c, _mm_add_ps(_mm_loadu_ps(fn + c), _mm_andnot_ps(m, x)));
            _mm_storeu_ps(fc + c, _mm_add_ps(_mm_loadu_ps(fc + c), _mm_and_ps(m, one)));
          }
        }
#endif
        for (; c < w; ++c) {
          const float x = xval<Load>(g, HasE ? e : nullptr, base + c);
          const bool p = sign_bit(x);
          fp[c] += p ? x : 0.0f;
          fn[c] += p ? 0.0f : x;
          fc[c] += p ? 1.0f : 0.0f;
        }
      }
      for (int64_t c = 0; c < w; ++c) {
        sp[c] += fp[c];
        sn[c] += fn[c];
        cp[c] += fc[c];
      }
    }
    double* out = part + 3 * slab * C;
    for (int64_t c = 0; c < w; ++c) {
      out[c0 + c] = sp[c];
      out[C + c0 + c] = cp[c];
      out[2 * C + c0 + c] = sn[c];
    }
  }
  finish_column_means(part, nslab, C, R, hi, lo);
}

// ---- pass 2 and decode: per-word helpers ------------------------------------------------------

/// Walks the words [wb, we) keeping track of the scales that apply to each word.
struct ScaleCursor {
  const OneBitGeom& geo;
  const float* scales;
  int64_t k = 0, rem = 0, wpc = 1;  // sign: chunk index, word within chunk, words per chunk
  int64_t c0 = 0;                   // columns: column of the word's first element
  ScaleCursor(const OneBitGeom& g, const float* s, int64_t w) : geo(g), scales(s) {
    if (geo.columns) {
      c0 = (32 * w) % geo.cols;
    } else {
      wpc = geo.chunk / 32;
      k = w / wpc;
      rem = w % wpc;
    }
  }
  void advance() {
    if (geo.columns) {
      c0 += 32;
      while (c0 >= geo.cols) c0 -= geo.cols;
    } else if (++rem == wpc) {
      rem = 0;
      ++k;
    }
  }
  /// True when the 32 elements of the word use constant hi/lo (written to hi, lo).
  bool constant(float* hi, float* lo) const {
    if (!geo.columns) {
      *hi = scales[k];
      *lo = -scales[k];
      return true;
    }
    if (geo.cols == 1) {
      *hi = scales[0];
      *lo = scales[1];
      return true;
    }
    return false;
  }
  /// Columns: true when the word's columns are contiguous (no wrap inside the word).
  bool contiguous() const { return c0 + 32 <= geo.cols; }
  /// hi / lo of element j of the word (any geometry; for the scalar path).
  void element(int j, float* hi, float* lo) const {
    if (!geo.columns) {
      *hi = scales[k];
      *lo = -scales[k];
      return;
    }
    int64_t c = c0 + j;
    while (c >= geo.cols) c -= geo.cols;
    *hi = scales[c];
    *lo = scales[geo.cols + c];
  }
};

/// Calls body(w, i0, len, cur) for every 32-bit word w of the payload: its elements are i0 to
/// i0 + len - 1 and cur is the scale cursor at w (over `scales`). The words are split into one
/// contiguous range per thread, each walked in order with one cursor: what quantize, the error
/// finalization and decode share.
template <class Body>
void for_each_word(const OneBitGeom& geo, const float* scales, Body&& body) {
  const int64_t n = geo.n, W = geo.num_words();
  const int T = threads_for(n);
#pragma omp parallel num_threads(T)
  {
    const int t = omp_get_thread_num();
    const int64_t wb = W * t / T, we = W * (t + 1) / T;
    ScaleCursor cur(geo, scales, wb);
    for (int64_t w = wb; w < we; ++w, cur.advance()) {
      const int64_t i0 = 32 * w;
      body(w, i0, static_cast<int>(std::min<int64_t>(32, n - i0)), cur);
    }
  }
}

/// Scalar quantization of elements [0, len) of word w (the shared math, any case).
template <class Load>
uint32_t quantize_scalar(const void* g, const float* e_in, float* e_out, int64_t i0, int len,
                         const ScaleCursor& cur) {
  uint32_t word = 0;
  for (int j = 0; j < len; ++j) {
    const int64_t i = i0 + j;
    const float x = xval<Load>(g, e_in, i);
    const bool b = sign_bit(x);
    word |= static_cast<uint32_t>(b) << j;
    if (e_out) {
      float hi, lo;
      cur.element(j, &hi, &lo);
      e_out[i] = error_update(x, reconstruct(b, hi, lo));
    }
  }
  return word;
}

#if GC_ONEBIT_SSE
/// One full word with SSE. g is fp32 (or a converted copy); hiA/loA null = constant hi/lo.
inline uint32_t quantize_word_sse(const float* g, const float* e_in, float* e_out, float hi,
                                  float lo, const float* hiA, const float* loA) {
  const __m128 zero = _mm_setzero_ps();
  const __m128 H = _mm_set1_ps(hi), L = _mm_set1_ps(lo);
  const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  __m128 top = zero;  // max |x| of the word (NaN when some x is NaN)
  uint32_t word = 0;
  for (int j = 0; j < 32; j += 4) {
    __m128 x = _mm_loadu_ps(g + j);
    if (e_in) x = _mm_add_ps(x, _mm_loadu_ps(e_in + j));  // saturated below where it overflowed
    top = _mm_max_ps(top, _mm_and_ps(x, absmask));        // maxps returns its NaN second operand
    const __m128 m = _mm_cmpge_ps(x, zero);               // x >= 0: false for NaN, true for -0
    word |= static_cast<uint32_t>(_mm_movemask_ps(m)) << j;
    if (e_out) {
      const __m128 h = hiA ? _mm_loadu_ps(hiA + j) : H;
      const __m128 l = loA ? _mm_loadu_ps(loA + j) : L;
      const __m128 d = _mm_or_ps(_mm_and_ps(m, h), _mm_andnot_ps(m, l));
      _mm_storeu_ps(e_out + j, _mm_sub_ps(x, d));
    }
  }
  if (e_in && e_out && _mm_movemask_ps(_mm_cmpnle_ps(top, _mm_set1_ps(kMaxFinite))) != 0) {
    // rare: some x is +-Inf or NaN. Where g is finite (e is), x = g + e overflowed: compensate
    // gives +-FLT_MAX (same sign, same bit), and x - d was +-Inf, so the stored value's sign is
    // x's sign (e_out may be e_in, whose old value is gone).
    for (int j = 0; j < 32; ++j)
      if (is_finite_bits(g[j]) && !is_finite_bits(e_out[j])) {
        const bool b = get_bit(word, static_cast<uint32_t>(j));
        const float hj = hiA ? hiA[j] : hi, lj = loA ? loA[j] : lo;
        e_out[j] = error_update(saturate(e_out[j]), reconstruct(b, hj, lj));
      }
  }
  return word;
}

/// Lane masks of 4 consecutive bits of a word: lane l set when bit (j + l) is set.
inline __m128 bit_mask4(uint32_t word, int j) {
  const __m128i sel = _mm_setr_epi32(1, 2, 4, 8);
  const __m128i v = _mm_set1_epi32(static_cast<int>(word >> j));
  return _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(v, sel), sel));
}
#endif

template <class Load>
void quantize_t(const void* g, const float* e_in, float* e_out, const OneBitGeom& geo,
                const float* scales, uint32_t* bits) {
  for_each_word(geo, scales, [&](int64_t w, int64_t i0, int len, const ScaleCursor& cur) {
#if GC_ONEBIT_SSE
    float hi = 0, lo = 0;
    const bool cst = cur.constant(&hi, &lo);
    if (len == 32 && (cst || cur.contiguous())) {
      const float* gx;
      float conv[32];
      if constexpr (std::is_same_v<Load, F32Load>) {
        gx = static_cast<const float*>(g) + i0;
      } else {
        for (int j = 0; j < 32; ++j) conv[j] = Load::load(g, i0 + j);
        gx = conv;
      }
      const float* hiA = cst ? nullptr : scales + cur.c0;
      const float* loA = cst ? nullptr : scales + geo.cols + cur.c0;
      bits[w] = quantize_word_sse(gx, e_in ? e_in + i0 : nullptr, e_out ? e_out + i0 : nullptr, hi,
                                  lo, hiA, loA);
      return;
    }
#endif
    bits[w] = quantize_scalar<Load>(g, e_in, e_out, i0, len, cur);
  });
}

/// Decoded value of element j of a word.
inline float decoded(uint32_t word, int j, const ScaleCursor& cur) {
  float hi, lo;
  cur.element(j, &hi, &lo);
  return reconstruct(get_bit(word, static_cast<uint32_t>(j)), hi, lo);
}

// ---- one-pass compress (lazy error feedback) --------------------------------------------------
//
// One sweep per step reads g and the state, writes the packed bits and x = g + e into the state,
// and sums the scale terms of x. The reductions keep the fixed groups and lane order of the
// two-pass scale functions above (flat: 8 fp32 lanes per block of kLaneBlock elements folded
// into double per group of kGroup; columns: fp32 over 32-row blocks folded into double per slab),
// so the scales do not depend on the thread count.

/// x of one element: g, or g + e with e read from the state (lazily corrected with hi / lo).
template <bool HasE, bool Lazy>
inline float x_elem(float gv, const float* in, int64_t i, float phi, float plo) {
  if constexpr (!HasE) return gv;
  const float e = Lazy ? lazy_error(in[i], phi, plo) : in[i];
  return compensate(gv, e);
}

/// 32 fp32 gradient values of word starting at i0 (converted into conv for fp16 / bf16).
template <class Load>
inline const float* g_word(const void* g, int64_t i0, float* conv) {
  if constexpr (std::is_same_v<Load, F32Load>) {
    return static_cast<const float*>(g) + i0;
  } else {
    for (int j = 0; j < 32; ++j) conv[j] = Load::load(g, i0 + j);
    return conv;
  }
}

/// Adds element x with bit p to lane l of the flat accumulators (mode M).
template <int M>
inline void lane_add(float* a, float* an, float* ac, int l, float x, bool p) {
  if constexpr (M == kColumnMeans) {
    a[l] += p ? x : 0.0f;
    an[l] += p ? 0.0f : x;
    ac[l] += p ? 1.0f : 0.0f;
  } else {
    a[l] += norm_term<M>(x);
  }
}

#if GC_ONEBIT_SSE
/// x of 4 elements. Sat: onebit::compensate (saturating); else the plain fp32 g + e of the sign
/// modes, whose overflow shows as an Inf block sum and is fixed up there (fix_block).
template <bool HasE, bool Lazy, bool Sat = true>
inline __m128 x_vec(const float* g, const float* in, __m128 ph, __m128 pl) {
  __m128 x = _mm_loadu_ps(g);
  if constexpr (HasE) {
    __m128 e = _mm_loadu_ps(in);
    if constexpr (Lazy) {  // e = x_prev - (x_prev >= 0 ? hi : lo), as lazy_error
      const __m128 m = _mm_cmpge_ps(e, _mm_setzero_ps());
      e = _mm_sub_ps(e, _mm_or_ps(_mm_and_ps(m, ph), _mm_andnot_ps(m, pl)));
    }
    x = Sat ? compensate_ps(x, e) : _mm_add_ps(x, e);
  }
  return x;
}

template <bool NT>
inline void put_vec(float* p, __m128 v) {
  if constexpr (NT)
    _mm_stream_ps(p, v);
  else
    _mm_storeu_ps(p, v);
}

/// One full word of the flat geometries (constant previous hi / lo).
template <int M, bool HasE, bool Lazy, bool NT>
inline uint32_t flat_word_sse(const float* gx, const float* in, float* out, __m128 ph, __m128 pl,
                              FlatLanes<M>& lanes) {
  const __m128 zero = _mm_setzero_ps();
  uint32_t word = 0;
  for (int j = 0; j < 32; j += 8) {
    constexpr bool kSat = M == kColumnMeans;
    const __m128 x0 = x_vec<HasE, Lazy, kSat>(gx + j, HasE ? in + j : nullptr, ph, pl);
    const __m128 x1 = x_vec<HasE, Lazy, kSat>(gx + j + 4, HasE ? in + j + 4 : nullptr, ph, pl);
    const __m128 m0 = _mm_cmpge_ps(x0, zero), m1 = _mm_cmpge_ps(x1, zero);
    word |= static_cast<uint32_t>(_mm_movemask_ps(m0) | (_mm_movemask_ps(m1) << 4)) << j;
    lanes.add(x0, x1, m0, m1);
    if constexpr (HasE) {
      put_vec<NT>(out + j, x0);
      put_vec<NT>(out + j + 4, x1);
    }
  }
  return word;
}

/// One full word whose 32 elements lie in consecutive columns (previous hi / lo per column;
/// fp / fn / fc: the fp32 column accumulators at the word's first column).
template <bool HasE, bool Lazy, bool NT>
inline uint32_t column_word_sse(const float* gx, const float* in, float* out, const float* phA,
                                const float* plA, float* fp, float* fn, float* fc) {
  const __m128 zero = _mm_setzero_ps(), one = _mm_set1_ps(1.0f);
  uint32_t word = 0;
  for (int j = 0; j < 32; j += 4) {
    const __m128 ph = Lazy ? _mm_loadu_ps(phA + j) : zero;
    const __m128 pl = Lazy ? _mm_loadu_ps(plA + j) : zero;
    const __m128 x = x_vec<HasE, Lazy>(gx + j, HasE ? in + j : nullptr, ph, pl);
    const __m128 m = _mm_cmpge_ps(x, zero);
    word |= static_cast<uint32_t>(_mm_movemask_ps(m)) << j;
    _mm_storeu_ps(fp + j, _mm_add_ps(_mm_loadu_ps(fp + j), _mm_and_ps(m, x)));
    _mm_storeu_ps(fn + j, _mm_add_ps(_mm_loadu_ps(fn + j), _mm_andnot_ps(m, x)));
    _mm_storeu_ps(fc + j, _mm_add_ps(_mm_loadu_ps(fc + j), _mm_and_ps(m, one)));
    if constexpr (HasE) put_vec<NT>(out + j, x);
  }
  return word;
}
#endif

/// Flat item [b, end) (b a multiple of 32; end too unless it is n) with constant previous hi / lo:
/// bits, state, and the item's sums (res[0] = the norm sum or the non-negative sum, res[1] = the
/// non-negative count, res[2] = the negative sum).
template <class Load, int M, bool HasE, bool Lazy, bool NT>
void flat_item(const void* g, const float* in, float* out, int64_t b, int64_t end, float phi,
               float plo, uint32_t* bits, double* res) {
  double t0 = 0.0, t1 = 0.0, t2 = 0.0;
  [[maybe_unused]] float conv[32];
#if GC_ONEBIT_SSE
  const __m128 ph = _mm_set1_ps(phi), pl = _mm_set1_ps(plo);
#endif
  for (int64_t i = b; i < end; i += kLaneBlock) {
    const int64_t stop = std::min(end, i + kLaneBlock);
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, an[8] = {0, 0, 0, 0, 0, 0, 0, 0},
          ac[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i0 = i;
#if GC_ONEBIT_SSE
    {
      FlatLanes<M> lanes;
      for (; i0 + 32 <= stop; i0 += 32)
        bits[i0 >> 5] =
            flat_word_sse<M, HasE, Lazy, NT>(g_word<Load>(g, i0, conv), HasE ? in + i0 : nullptr,
                                             HasE ? out + i0 : nullptr, ph, pl, lanes);
      lanes.store(a, an, ac);
    }
#endif
    for (; i0 < stop; i0 += 32) {  // scalar words (the partial last word with SSE)
      const int len = static_cast<int>(std::min<int64_t>(32, stop - i0));
      const int full8 = len / 8 * 8;
      uint32_t word = 0;
      for (int j = 0; j < len; ++j) {
        const int64_t idx = i0 + j;
        const float x = x_elem<HasE, Lazy>(Load::load(g, idx), in, idx, phi, plo);
        const bool p = sign_bit(x);
        word |= static_cast<uint32_t>(p) << j;
        if constexpr (HasE) out[idx] = x;
        lane_add<M>(a, an, ac, j < full8 ? j % 8 : 0, x, p);
      }
      bits[i0 >> 5] = word;
    }
    if constexpr (M == kColumnMeans) {
      for (int l = 0; l < 8; ++l) {
        t0 += a[l];
        t2 += an[l];
        t1 += ac[l];
      }
    } else {
      double s = 0.0;
      for (int l = 0; l < 8; ++l) s += a[l];
      if (needs_wide_sum<M>(s)) {  // rare: the block again in double, x as written to the state
        if constexpr (HasE) {
          // the SSE words' x = g + e was not saturated: an overflow to +-Inf (finite g and e)
          // becomes compensate's +-FLT_MAX; a non-finite g keeps its Inf / NaN
          for (int64_t k = i; k < stop; ++k)
            if (!is_finite_bits(out[k]) && is_finite_bits(Load::load(g, k)))
              out[k] = saturate(out[k]);
          s = wide_sum<M>(i, stop, [out](int64_t k) { return out[k]; });
        } else {
          s = wide_sum<M>(i, stop, [g](int64_t k) { return Load::load(g, k); });
        }
      }
      t0 += s;
    }
  }
  res[0] = t0;
  if constexpr (M == kColumnMeans) {
    res[1] = t1;
    res[2] = t2;
  }
}

/// Column item: rows [r0, r1) (r0 a multiple of 32) x columns [c0, c1) of a C-column matrix.
/// whole_rows: c0 = 0, c1 = C and the item is the contiguous range [r0 C, r1 C) (any C); else C
/// is a multiple of 32 and every row segment is whole, column-contiguous words. facc: 3 (c1 - c0)
/// floats of scratch; dsum: the slab's [3][C] double sums (this item owns columns [c0, c1)).
template <class Load, bool HasE, bool Lazy, bool NT>
void column_item(const void* g, const float* in, float* out, int64_t C, int64_t r0, int64_t r1,
                 int64_t c0, int64_t c1, bool whole_rows, const float* prev, uint32_t* bits,
                 float* facc, double* dsum) {
  const int64_t W = c1 - c0;
  float* fp = facc;
  float* fn = facc + W;
  float* fc = facc + 2 * W;
  for (int64_t c = c0; c < c1; ++c) dsum[c] = dsum[C + c] = dsum[2 * C + c] = 0.0;
  [[maybe_unused]] float conv[32];
  // scalar element (wrapping words, partial last word, no SSE): column c, local index c - c0
  auto scalar = [&](int64_t idx, int64_t c, uint32_t* word, int j) {
    const float phi = Lazy ? prev[c] : 0.0f, plo = Lazy ? prev[C + c] : 0.0f;
    const float x = x_elem<HasE, Lazy>(Load::load(g, idx), in, idx, phi, plo);
    const bool p = sign_bit(x);
    *word |= static_cast<uint32_t>(p) << j;
    if constexpr (HasE) out[idx] = x;
    fp[c - c0] += p ? x : 0.0f;
    fn[c - c0] += p ? 0.0f : x;
    fc[c - c0] += p ? 1.0f : 0.0f;
  };
  // one word starting at flat index i0 (column c); len elements
  auto do_word = [&](int64_t i0, int64_t c, int len) {
#if GC_ONEBIT_SSE
    if (len == 32 && c + 32 <= c1) {
      bits[i0 >> 5] = column_word_sse<HasE, Lazy, NT>(
          g_word<Load>(g, i0, conv), HasE ? in + i0 : nullptr, HasE ? out + i0 : nullptr,
          Lazy ? prev + c : nullptr, Lazy ? prev + C + c : nullptr, fp + (c - c0), fn + (c - c0),
          fc + (c - c0));
      return;
    }
#endif
    uint32_t word = 0;
    int64_t cc = c;
    for (int j = 0; j < len; ++j) {
      scalar(i0 + j, cc, &word, j);
      if (++cc == C) cc = 0;
    }
    bits[i0 >> 5] = word;
  };
  for (int64_t rb = r0; rb < r1; rb += 32) {
    const int64_t re = std::min(r1, rb + 32);
    for (int64_t k = 0; k < 3 * W; ++k) facc[k] = 0.0f;
    if (whole_rows) {
      const int64_t end = re * C;
      int64_t c = 0;
      for (int64_t i0 = rb * C; i0 < end; i0 += 32) {
        do_word(i0, c, static_cast<int>(std::min<int64_t>(32, end - i0)));
        c = (c + 32) % C;
      }
    } else {
      for (int64_t r = rb; r < re; ++r)
        for (int64_t c = c0; c < c1; c += 32) do_word(r * C + c, c, 32);
    }
    for (int64_t c = c0; c < c1; ++c) {
      dsum[c] += fp[c - c0];
      dsum[C + c] += fc[c - c0];
      dsum[2 * C + c] += fn[c - c0];
    }
  }
}

template <class Load, bool HasE, bool Lazy, bool NT>
void compress_t(const void* g, const float* in, float* out, const float* prev,
                const OneBitGeom& geo, int norm, float* scales, uint32_t* bits,
                OneBitWorkspace& ws) {
  const int64_t n = geo.n;
  const int T = threads_for(n);
  if (!geo.columns) {  // sign modes: items = (chunk, group of kGroup)
    const int64_t S = geo.chunk, K = geo.num_scales();
    const int64_t spc = (std::min(S, n) + kGroup - 1) / kGroup;
    const int64_t items = K * spc;
    ws.host.resize(static_cast<size_t>(items));
    double* part = ws.host.data();
#pragma omp parallel num_threads(T)
    {
#pragma omp for schedule(static)
      for (int64_t it = 0; it < items; ++it) {
        const int64_t k = it / spc, s = it % spc;
        const int64_t ce = std::min(n, (k + 1) * S);
        const int64_t b = k * S + s * kGroup, end = std::min(ce, b + kGroup);
        const float ps = Lazy ? prev[k] : 0.0f;
        double v = 0.0;
        if (b < end) {
          if (norm == kL1)
            flat_item<Load, kL1, HasE, Lazy, NT>(g, in, out, b, end, ps, -ps, bits, &v);
          else
            flat_item<Load, kL2, HasE, Lazy, NT>(g, in, out, b, end, ps, -ps, bits, &v);
        }
        part[it] = v;
      }
#if GC_ONEBIT_SSE
      if constexpr (NT) _mm_sfence();
#endif
    }
    finish_sign_scales(part, K, spc, n, S, norm, scales);
    return;
  }
  const int64_t C = geo.cols, R = n / C;
  if (C == 1) {  // one column: flat items of kGroup
    const int64_t items = (n + kGroup - 1) / kGroup;
    ws.host.resize(static_cast<size_t>(3 * items));
    double* part = ws.host.data();
    const float phi = Lazy ? prev[0] : 0.0f, plo = Lazy ? prev[1] : 0.0f;
#pragma omp parallel num_threads(T)
    {
#pragma omp for schedule(static)
      for (int64_t it = 0; it < items; ++it)
        flat_item<Load, kColumnMeans, HasE, Lazy, NT>(
            g, in, out, it * kGroup, std::min(n, (it + 1) * kGroup), phi, plo, bits, part + 3 * it);
#if GC_ONEBIT_SSE
      if constexpr (NT) _mm_sfence();
#endif
    }
    finish_flat_means(part, items, R, scales, scales + 1);
    return;
  }
  // Items: (slab of whole 32-row blocks, column tile). Tiles of kTile columns when C is a
  // multiple of 32 (every word then lies in one tile of one row); otherwise one tile of all
  // columns, so that an item is a contiguous, word-aligned range and no word is shared.
  const bool whole_rows = C % 32 != 0 || C <= kTile;
  const int64_t tile = whole_rows ? C : kTile;
  const int64_t ntile = (C + tile - 1) / tile;
  const int64_t RB = (R + 31) / 32;
  const int64_t nslab = std::clamp<int64_t>(std::min(RB, n >> 18), 1, 64);
  ws.host.resize(static_cast<size_t>(3 * nslab * C));
  double* part = ws.host.data();  // [slab][3][C]
  float* facc_all = ws.aux.get<float>(static_cast<size_t>(T) * 3 * tile);
#pragma omp parallel num_threads(T)
  {
    float* facc = facc_all + static_cast<int64_t>(omp_get_thread_num()) * 3 * tile;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nslab * ntile; ++it) {
      const int64_t slab = it / ntile, t = it % ntile;
      const int64_t r0 = std::min(R, 32 * (RB * slab / nslab));
      const int64_t r1 = std::min(R, 32 * (RB * (slab + 1) / nslab));
      const int64_t c0 = t * tile, c1 = std::min(C, c0 + tile);
      column_item<Load, HasE, Lazy, NT>(g, in, out, C, r0, r1, c0, c1, whole_rows, prev, bits, facc,
                                        part + 3 * slab * C);
    }
#if GC_ONEBIT_SSE
    if constexpr (NT) _mm_sfence();
#endif
  }
  float* hi = scales;
  float* lo = scales + C;
  finish_column_means(part, nslab, C, R, hi, lo);
}

/// The check_finite result of a pass that computed the scales of g: a NaN / Inf in g makes some
/// scale NaN / Inf, and only then is g scanned for the index of its first non-finite value;
/// -1 when every scale is finite.
int64_t first_nonfinite_if_scales_are(const void* g, DType t, const OneBitGeom& geo,
                                      const float* scales) {
  bool ok = true;
  const int64_t K = geo.num_scales();
  for (int64_t k = 0; k < K; ++k) ok = ok && is_finite_bits(scales[k]);
  if (ok) return -1;
  int64_t bad = -1;
  with_loader(t, [&](auto L) { bad = first_nonfinite<decltype(L)>(g, geo.n); });
  return bad;
}

}  // namespace

int64_t onebit_scales(const void* g, DType t, const float* e, const OneBitGeom& geo, int norm,
                      bool check_finite, float* scales, OneBitWorkspace& ws) {
  if (geo.n == 0) return -1;
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
    if (geo.columns)
      e ? column_scales<Load, true>(g, e, geo, scales, ws)
        : column_scales<Load, false>(g, e, geo, scales, ws);
    else
      e ? sign_scales<Load, true>(g, e, geo, norm, scales, ws)
        : sign_scales<Load, false>(g, e, geo, norm, scales, ws);
  });
  return check_finite ? first_nonfinite_if_scales_are(g, t, geo, scales) : -1;
}

int64_t onebit_compress(const void* g, DType t, const float* state_in, const float* prev_scales,
                        float* state_out, const OneBitGeom& geo, int norm, bool check_finite,
                        float* scales, uint32_t* bits, OneBitWorkspace& ws) {
  if (geo.n == 0) return -1;
  const bool has_e = state_in != nullptr, lazy = has_e && prev_scales != nullptr;
#if GC_ONEBIT_SSE
  const bool nt =
      has_e && state_out != state_in && reinterpret_cast<uintptr_t>(state_out) % 16 == 0;
#else
  const bool nt = false;
#endif
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
    auto run = [&](auto E, auto Z, auto N) {
      compress_t<Load, decltype(E)::value, decltype(Z)::value, decltype(N)::value>(
          g, state_in, state_out, prev_scales, geo, norm, scales, bits, ws);
    };
    using Y = std::true_type;
    using F = std::false_type;
    if (!has_e)
      run(F{}, F{}, F{});
    else if (!lazy)
      nt ? run(Y{}, F{}, Y{}) : run(Y{}, F{}, F{});
    else
      nt ? run(Y{}, Y{}, Y{}) : run(Y{}, Y{}, F{});
  });
  return check_finite ? first_nonfinite_if_scales_are(g, t, geo, scales) : -1;
}

void onebit_finalize_error(float* x, const OneBitGeom& geo, const float* scales) {
  if (geo.n == 0) return;
  for_each_word(geo, scales, [&](int64_t, int64_t i0, int len, const ScaleCursor& cur) {
    float hi, lo;
    if (cur.constant(&hi, &lo)) {
      for (int j = 0; j < len; ++j) x[i0 + j] = lazy_error(x[i0 + j], hi, lo);
    } else {
      for (int j = 0; j < len; ++j) {
        cur.element(j, &hi, &lo);
        x[i0 + j] = lazy_error(x[i0 + j], hi, lo);
      }
    }
  });
}

void onebit_quantize(const void* g, DType t, const float* e_in, float* e_out, const OneBitGeom& geo,
                     const float* scales, uint32_t* bits) {
  if (geo.n == 0) return;
  with_loader(t, [&](auto L) { quantize_t<decltype(L)>(g, e_in, e_out, geo, scales, bits); });
}

void onebit_decode(const uint32_t* bits, const float* scales, const OneBitGeom& geo, float scale,
                   bool accumulate, float* dense) {
  const float* s = scales;
  onebit_decode_average(&bits, &s, 1, geo, scale, accumulate, dense);
}

namespace {
/// Element j of word w through onebit::decode_wide: the decoded values of the count payloads
/// added in order in double (the redo of a decode whose fp32 form came out non-finite).
float decode_wide_at(const uint32_t* const* bits, const float* const* scales, int count,
                     const ScaleCursor& cur, int64_t w, int j, float dense, float scale,
                     bool accumulate) {
  double sum = 0.0;
  for (int p = 0; p < count; ++p) {
    ScaleCursor cp = cur;
    cp.scales = scales[p];
    sum = add_rn_d(sum, static_cast<double>(decoded(bits[p][w], j, cp)));
  }
  return decode_wide(dense, scale, sum, accumulate);
}
}  // namespace

void onebit_decode_average(const uint32_t* const* bits, const float* const* scales, int count,
                           const OneBitGeom& geo, float scale, bool accumulate, float* dense) {
  if (geo.n == 0) return;
  // the cursor walks payload 0's scales; a copy with another payload's scales serves that one
  // (the payloads share the geometry, not the scales)
  for_each_word(geo, scales[0], [&](int64_t w, int64_t i0, int len, const ScaleCursor& cur) {
    float* out = dense + i0;
#if GC_ONEBIT_SSE
    float hi0, lo0;
    const bool cst = cur.constant(&hi0, &lo0);
    if (len == 32 && (cst || cur.contiguous())) {
      __m128 acc[8];
      for (int q = 0; q < 8; ++q) acc[q] = _mm_setzero_ps();
      for (int p = 0; p < count; ++p) {
        const uint32_t word = bits[p][w];
        ScaleCursor cp = cur;
        cp.scales = scales[p];
        float hi = 0, lo = 0;
        cp.constant(&hi, &lo);
        const float* hiA = cst ? nullptr : scales[p] + cur.c0;
        const float* loA = cst ? nullptr : scales[p] + geo.cols + cur.c0;
        for (int q = 0; q < 8; ++q) {
          const __m128 m = bit_mask4(word, 4 * q);
          const __m128 h = hiA ? _mm_loadu_ps(hiA + 4 * q) : _mm_set1_ps(hi);
          const __m128 l = loA ? _mm_loadu_ps(loA + 4 * q) : _mm_set1_ps(lo);
          acc[q] = _mm_add_ps(acc[q], _mm_or_ps(_mm_and_ps(m, h), _mm_andnot_ps(m, l)));
        }
      }
      const __m128 sc = _mm_set1_ps(scale);
      const __m128 big = _mm_set1_ps(kMaxFinite);
      const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
      __m128 res[8], bad = _mm_setzero_ps();
      for (int q = 0; q < 8; ++q) {
        const __m128 v = _mm_mul_ps(sc, acc[q]);
        res[q] = accumulate ? _mm_add_ps(_mm_loadu_ps(out + 4 * q), v) : v;
        bad = _mm_or_ps(bad, _mm_cmpnle_ps(_mm_and_ps(res[q], absmask), big));  // Inf, NaN
      }
      if (_mm_movemask_ps(bad) != 0) {  // rare: the word's non-finite lanes, redone wide
        float tmp[32];
        for (int q = 0; q < 8; ++q) _mm_storeu_ps(tmp + 4 * q, res[q]);
        for (int j = 0; j < 32; ++j)
          if (!is_finite_bits(tmp[j]))
            tmp[j] = decode_wide_at(bits, scales, count, cur, w, j, out[j], scale, accumulate);
        std::memcpy(out, tmp, sizeof(tmp));
        return;
      }
      for (int q = 0; q < 8; ++q) _mm_storeu_ps(out + 4 * q, res[q]);
      return;
    }
#endif
    float acc[32];
    for (int j = 0; j < len; ++j) acc[j] = 0.0f;
    for (int p = 0; p < count; ++p) {
      ScaleCursor cp = cur;
      cp.scales = scales[p];
      const uint32_t word = bits[p][w];
      for (int j = 0; j < len; ++j) acc[j] = add_rn(acc[j], decoded(word, j, cp));
    }
    for (int j = 0; j < len; ++j) {
      const float r = decode_store(out[j], scale, acc[j], accumulate);
      out[j] = is_finite_bits(r)
                   ? r
                   : decode_wide_at(bits, scales, count, cur, w, j, out[j], scale, accumulate);
    }
  });
}

}  // namespace cpu
}  // namespace gradcomp::kernels

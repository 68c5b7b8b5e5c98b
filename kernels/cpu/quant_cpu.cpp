// SPDX-License-Identifier: Apache-2.0
// CPU backend of the multi-bit family. The compress is one pass over memory: each block of the
// chunk (at most 8192 elements: 32 KiB of fp32, in L1/L2) is formed once (x = g + e), its scale
// taken, and its codes, packed words and new error written while it is still in cache; so a step
// moves read g + read e + write e + write codes, nothing else. Blocks are independent (OpenMP
// over blocks): the result does not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/simd.hpp"
#include "kernels/cpu/threads.hpp"
#include "kernels/quant_kernels.hpp"
#include "kernels/quant_math.h"

namespace gradcomp::kernels::cpu {
namespace {

using namespace quant;

constexpr int64_t kMaxBlock = 8192;

inline void store_scale(uint8_t* area, int64_t slot, uint32_t v, bool half) {
  if (half) {
    const auto h = static_cast<uint16_t>(v);
    std::memcpy(area + 2 * slot, &h, 2);
  } else {
    std::memcpy(area + 4 * slot, &v, 4);
  }
}
inline uint32_t load_scale(const uint8_t* area, int64_t slot, bool half) {
  if (half) {
    uint16_t h;
    std::memcpy(&h, area + 2 * slot, 2);
    return h;
  }
  uint32_t v;
  std::memcpy(&v, area + 4 * slot, 4);
  return v;
}

/// Packs len codes into words (B bits each, 32 / B per word, least significant first; the last
/// word's unused bits 0).
template <int B>
inline void pack(const uint32_t* codes, int64_t len, uint32_t* words) {
  constexpr int per = 32 / B;
  const int64_t full = len / per;
  int64_t w = 0;
#if defined(__SSE4_1__)
  if constexpr (B == 8) {  // 16 codes -> 16 bytes = 4 words per step
    for (; w + 4 <= full; w += 4) {
      const auto* c = reinterpret_cast<const __m128i*>(codes + w * per);
      const __m128i a = _mm_packus_epi32(_mm_loadu_si128(c), _mm_loadu_si128(c + 1));
      const __m128i b = _mm_packus_epi32(_mm_loadu_si128(c + 2), _mm_loadu_si128(c + 3));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(words + w), _mm_packus_epi16(a, b));
    }
  }
#endif
  for (; w < full; ++w) {
    uint32_t v = 0;
    for (int k = 0; k < per; ++k) v |= codes[w * per + k] << (k * B);
    words[w] = v;
  }
  if (full * per < len) {
    uint32_t v = 0;
    for (int64_t k = 0; full * per + k < len; ++k)
      v |= codes[full * per + k] << (static_cast<int>(k) * B);
    words[full] = v;
  }
}

/// Pass 1 of a block: x = g + e into x[0, len), and its max, min, max |x|; returns whether some x
/// is not finite. The SSE loop and the scalar tail take max and min in the same operand order
/// (v > m ? v : m), so the results are those of the scalar loop (a tie of -0 and +0 aside).
template <class Load, bool HasE>
bool form_block(const void* g, const float* e, int64_t i0, int64_t len, float* x, float& mx,
                float& mn, float& amax) {
  mx = -onebit::kMaxFinite;
  mn = onebit::kMaxFinite;
  amax = 0.0f;
  uint32_t nonfinite = 0;
  int64_t j = 0;
#if defined(__SSE4_1__)
  if constexpr (std::is_same_v<Load, F32Load>) {
    const float* gf = static_cast<const float*>(g) + i0;
    __m128 vmx = _mm_set1_ps(mx), vmn = _mm_set1_ps(mn), vam = _mm_setzero_ps();
    __m128i bad = _mm_setzero_si128();
    const __m128i expm = _mm_set1_epi32(0x7f800000);
    const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    for (; j + 4 <= len; j += 4) {
      __m128 v = _mm_loadu_ps(gf + j);
      if constexpr (HasE) v = compensate_ps(v, _mm_loadu_ps(e + i0 + j));
      _mm_storeu_ps(x + j, v);
      bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(v), expm), expm));
      vmx = _mm_max_ps(v, vmx);
      vmn = _mm_min_ps(v, vmn);
      vam = _mm_max_ps(_mm_and_ps(v, absmask), vam);
    }
    alignas(16) float a[4], b[4], c[4];
    _mm_store_ps(a, vmx);
    _mm_store_ps(b, vmn);
    _mm_store_ps(c, vam);
    for (int k = 0; k < 4; ++k) {
      mx = a[k] > mx ? a[k] : mx;
      mn = b[k] < mn ? b[k] : mn;
      amax = c[k] > amax ? c[k] : amax;
    }
    nonfinite = static_cast<uint32_t>(_mm_movemask_epi8(bad));
  }
#endif
  for (; j < len; ++j) {
    const float gj = Load::load(g, i0 + j);
    const float v = HasE ? onebit::compensate(gj, e[i0 + j]) : gj;
    x[j] = v;
    nonfinite |= static_cast<uint32_t>(!is_finite_bits(v));
    mx = v > mx ? v : mx;
    mn = v < mn ? v : mn;
    const float a = std::fabs(v);
    amax = a > amax ? a : amax;
  }
  return nonfinite != 0;
}

/// Pass 2 of a block, nearest rounding: the stored codes of x[0, len) and, when err, the new
/// error err[j] = x - decode(code). The SSE loop is encode() / decode() of quant_math.h lane by
/// lane (clamp in the same operand order, round to nearest even, the integer code back to float).
template <int B, bool Asym>
void encode_nearest(const float* x, int64_t len, const Grid& gr, uint32_t* code, float* err) {
  int64_t j = 0;
#if defined(__SSE4_1__)
  constexpr int L = (1 << (B - 1)) - 1, M = (1 << B) - 1;
  const __m128 inv = _mm_set1_ps(gr.inv), step = _mm_set1_ps(gr.step), base = _mm_set1_ps(gr.base);
  const __m128 hi = _mm_set1_ps(static_cast<float>(Asym ? M : L));
  const __m128 lo = _mm_set1_ps(static_cast<float>(Asym ? 0 : -L));
  const __m128i off = _mm_set1_epi32(Asym ? 0 : L);
  for (; j + 4 <= len; j += 4) {
    const __m128 v = _mm_loadu_ps(x + j);
    __m128 t = Asym ? _mm_mul_ps(saturate_ps(_mm_sub_ps(v, base)), inv) : _mm_mul_ps(v, inv);
    t = _mm_and_ps(t, _mm_cmpeq_ps(t, t));  // NaN -> 0, as encode()
    t = _mm_max_ps(lo, _mm_min_ps(hi, t));
    const __m128i ci =
        _mm_cvttps_epi32(_mm_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(code + j), _mm_add_epi32(ci, off));
    if (err) {
      const __m128 c = _mm_cvtepi32_ps(ci);
      const __m128 d =
          saturate_ps(Asym ? _mm_add_ps(base, _mm_mul_ps(c, step)) : _mm_mul_ps(c, step));
      _mm_storeu_ps(err + j, saturate_ps(_mm_sub_ps(v, d)));
    }
  }
#endif
  for (; j < len; ++j) {
    code[j] = encode(x[j], gr, B, Asym, false, 0.0f);
    if (err) err[j] = saturate_f32(sub_rn(x[j], decode(code[j], gr, B, Asym)));
  }
}

/// Compresses block b; returns the first non-finite index in it (check) or -1.
template <class Load, bool HasE, int B, bool Asym>
int64_t compress_block(const void* g, const float* e_in, float* e_out, const QuantGeom& geo,
                       const QuantRng& rng, bool check, uint8_t* body, int64_t b) {
  alignas(64) float x[kMaxBlock];
  alignas(64) uint32_t code[kMaxBlock];
  const int64_t i0 = b * geo.block, len = std::min(geo.block, geo.n - i0);
  float mx, mn, amax;
  const bool nonfinite = form_block<Load, HasE>(g, e_in, i0, len, x, mx, mn, amax);
  if (check && nonfinite) {
    for (int64_t j = 0; j < len; ++j)
      if (!is_finite_bits(x[j])) return i0 + j;
  }
  uint32_t stored[2] = {0, 0};
  const Grid grid = Asym
                        ? asym_grid(mn, mx, B, geo.half, stored)
                        : sym_grid(amax, B, geo.half, stored, sym_divisor(B, rng.stochastic, HasE));
  for (int k = 0; k < geo.scales_per_block(); ++k)
    store_scale(body, b * geo.scales_per_block() + k, stored[k], geo.half);
  float* err = e_out ? e_out + i0 : nullptr;
  if (rng.stochastic) {
    // four uniforms per Philox block; i0 and the chunk's first index are multiples of 4
    const uint64_t base = stream_index(rng.role, rng.first + static_cast<uint64_t>(i0));
    for (int64_t j = 0; j < len; j += 4) {
      const Philox4 r = rng.key.block((base + static_cast<uint64_t>(j)) >> 2);
      for (int k = 0; k < 4 && j + k < len; ++k)
        code[j + k] = encode(x[j + k], grid, B, Asym, true, uniform_of(r.v[k]));
    }
    if (err)
      for (int64_t j = 0; j < len; ++j)
        err[j] = saturate_f32(sub_rn(x[j], decode(code[j], grid, B, Asym)));
  } else {
    encode_nearest<B, Asym>(x, len, grid, code, err);
  }
  auto* words = reinterpret_cast<uint32_t*>(body + geo.codes_offset());
  pack<B>(code, len, words + i0 / (32 / B));
  return -1;
}

template <class Load, bool HasE, int B, bool Asym>
int64_t compress_all(const void* g, const float* e_in, float* e_out, const QuantGeom& geo,
                     const QuantRng& rng, bool check, uint8_t* body) {
  const int64_t nb = geo.num_blocks();
  int64_t first_bad = INT64_MAX;
  // a block after a bad one is still compressed (an OpenMP loop does not stop early): harmless,
  // the caller drops the step; the smallest bad index is returned
#pragma omp parallel for schedule(static) num_threads(threads_for(geo.n)) reduction(min : first_bad)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t bad =
        compress_block<Load, HasE, B, Asym>(g, e_in, e_out, geo, rng, check, body, b);
    if (bad >= 0) first_bad = std::min(first_bad, bad);
  }
  return first_bad == INT64_MAX ? -1 : first_bad;
}

/// Calls f(std::integral_constant<int, B>, std::bool_constant<Asym>) for the geometry.
template <class F>
void with_codec(const QuantGeom& geo, F&& f) {
  auto asym = [&](auto bits) {
    if (geo.asym)
      f(bits, std::true_type{});
    else
      f(bits, std::false_type{});
  };
  switch (geo.bits) {
    case 2:
      return asym(std::integral_constant<int, 2>{});
    case 4:
      return asym(std::integral_constant<int, 4>{});
    default:
      return asym(std::integral_constant<int, 8>{});
  }
}

#if defined(__SSE4_1__)
/// The codes of one word as 32 / B int32 lanes, 4 per vector (SSE4.1): out[0 .. 32 / B / 4).
template <int B>
inline void unpack_word(uint32_t w, __m128i* out) {
  const __m128i b = _mm_cvtsi32_si128(static_cast<int>(w));
  if constexpr (B == 8) {
    out[0] = _mm_cvtepu8_epi32(b);
  } else if constexpr (B == 4) {
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i q =
        _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    out[0] = _mm_cvtepu8_epi32(q);
    out[1] = _mm_cvtepu8_epi32(_mm_srli_si128(q, 4));
  } else {
    const __m128i m = _mm_set1_epi8(0x03);
    const __m128i c0 = _mm_and_si128(b, m), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(b, 4), m),
                  c3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
    const __m128i q = _mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3));
    out[0] = _mm_cvtepu8_epi32(q);
    out[1] = _mm_cvtepu8_epi32(_mm_srli_si128(q, 4));
    out[2] = _mm_cvtepu8_epi32(_mm_srli_si128(q, 8));
    out[3] = _mm_cvtepu8_epi32(_mm_srli_si128(q, 12));
  }
}
#endif

/// acc[0, len) += decode of one block's codes (w0: the block's first word, grid g0), then, when
/// w1 is not null, += those of a second payload's block (w1, g1): two payloads per pass over acc,
/// added in the same order as two calls would.
template <int B, bool Asym>
void decode_add_block(const uint32_t* w0, const Grid& g0, const uint32_t* w1, const Grid& g1,
                      int64_t len, float* acc) {
  constexpr int per = 32 / B;
  int64_t j = 0;
#if defined(__SSE4_1__)
  const __m128 s0 = _mm_set1_ps(g0.step), b0 = _mm_set1_ps(g0.base);
  const __m128 s1 = _mm_set1_ps(g1.step), b1 = _mm_set1_ps(g1.base);
  const __m128i off = _mm_set1_epi32(Asym ? 0 : (1 << (B - 1)) - 1);
  auto value = [&](__m128i c, __m128 step, __m128 base, auto saturating) {
    const __m128 v = _mm_cvtepi32_ps(_mm_sub_epi32(c, off));
    const __m128 d = Asym ? _mm_add_ps(base, _mm_mul_ps(v, step)) : _mm_mul_ps(v, step);
    if constexpr (decltype(saturating)::value) return saturate_ps(d);
    return d;
  };
  auto lanes = [&](auto saturating, auto two) {
    for (; j + per <= len; j += per) {
      __m128i c0[per / 4], c1[per / 4];
      unpack_word<B>(w0[j / per], c0);
      if constexpr (decltype(two)::value) unpack_word<B>(w1[j / per], c1);
      for (int k = 0; k < per / 4; ++k) {
        __m128 a = _mm_add_ps(_mm_loadu_ps(acc + j + 4 * k), value(c0[k], s0, b0, saturating));
        if constexpr (decltype(two)::value) a = _mm_add_ps(a, value(c1[k], s1, b1, saturating));
        _mm_storeu_ps(acc + j + 4 * k, a);
      }
    }
  };
  // a symmetric code is at most 2^(B-1) steps from zero: when that many steps are finite, no
  // decode of the block can overflow and the saturation is the identity (skipped: faster)
  auto fits = [](const Grid& g) {
    return is_finite_bits(g.step * static_cast<float>(1 << (B - 1)));
  };
  const bool sat = Asym || !fits(g0) || (w1 && !fits(g1));
  auto with_sat = [&](auto two) {
    if (sat)
      lanes(std::true_type{}, two);
    else
      lanes(std::false_type{}, two);
  };
  if (w1)
    with_sat(std::true_type{});
  else
    with_sat(std::false_type{});
#endif
  constexpr uint32_t mask = (1u << B) - 1u;
  for (; j < len; ++j) {
    acc[j] = add_rn(acc[j], decode((w0[j / per] >> ((j % per) * B)) & mask, g0, B, Asym));
    if (w1) acc[j] = add_rn(acc[j], decode((w1[j / per] >> ((j % per) * B)) & mask, g1, B, Asym));
  }
}

template <int B, bool Asym>
void decode_average_all(const uint8_t* const* bodies, int count, const QuantGeom& geo, float scale,
                        float* dense) {
  const int64_t nb = geo.num_blocks();
  const int spb = geo.scales_per_block();
  constexpr int per = 32 / B;
  constexpr uint32_t mask = (1u << B) - 1u;
#pragma omp parallel for schedule(static) num_threads(threads_for(geo.n* count))
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) float acc[kMaxBlock];
    const int64_t i0 = b * geo.block, len = std::min(geo.block, geo.n - i0);
    std::fill(acc, acc + len, 0.0f);
    auto grid_of = [&](int p) {
      uint32_t stored[2] = {0, 0};
      for (int k = 0; k < spb; ++k) stored[k] = load_scale(bodies[p], b * spb + k, geo.half);
      return read_grid(stored, Asym, geo.half);
    };
    // the P payloads summed in rank order (every rank gets the same bits)
    auto words_of = [&](int p) {
      return reinterpret_cast<const uint32_t*>(bodies[p] + geo.codes_offset()) + i0 / per;
    };
    for (int p = 0; p < count; p += 2) {
      if (p + 1 < count)
        decode_add_block<B, Asym>(words_of(p), grid_of(p), words_of(p + 1), grid_of(p + 1), len,
                                  acc);
      else
        decode_add_block<B, Asym>(words_of(p), grid_of(p), nullptr, Grid{}, len, acc);
    }
    bool finite = true;
    int64_t j = 0;
#if defined(__SSE4_1__)
    const __m128 sc = _mm_set1_ps(scale);
    const __m128i expm = _mm_set1_epi32(0x7f800000);
    __m128i bad = _mm_setzero_si128();
    for (; j + 4 <= len; j += 4) {
      const __m128 v = _mm_mul_ps(sc, _mm_load_ps(acc + j));
      _mm_storeu_ps(dense + i0 + j, v);
      bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(v), expm), expm));
    }
    finite = _mm_movemask_epi8(bad) == 0;
#endif
    for (; j < len; ++j) {
      const float v = mul_rn(scale, acc[j]);
      dense[i0 + j] = v;
      finite &= is_finite_bits(v);
    }
    if (finite) continue;
    // an fp32 sum of finite decodes overflowed: that element again in double, saturated (the
    // others keep their fp32 bits)
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = i0 + j;
      if (is_finite_bits(dense[i])) continue;
      double sum = 0.0;
      for (int p = 0; p < count; ++p) {
        const auto* words = reinterpret_cast<const uint32_t*>(bodies[p] + geo.codes_offset());
        const uint32_t c = (words[i / per] >> ((i % per) * B)) & mask;
        sum += static_cast<double>(decode(c, grid_of(p), B, Asym));
      }
      dense[i] = onebit::decode_wide(0.0f, scale, sum, false);
    }
  }
}

}  // namespace

int64_t quant_compress(const void* g, DType t, const float* e_in, float* e_out,
                       const QuantGeom& geo, const QuantRng& rng, bool check_finite,
                       uint8_t* body) {
  if (geo.n <= 0) return -1;
  int64_t r = -1;
  with_loader(t, [&](auto L) {
    with_codec(geo, [&](auto bits, auto asym) {
      using Load = decltype(L);
      constexpr int B = decltype(bits)::value;
      constexpr bool A = decltype(asym)::value;
      r = e_in ? compress_all<Load, true, B, A>(g, e_in, e_out, geo, rng, check_finite, body)
               : compress_all<Load, false, B, A>(g, e_in, e_out, geo, rng, check_finite, body);
    });
  });
  return r;
}

void quant_decode_average(const uint8_t* const* bodies, int count, const QuantGeom& geo,
                          float scale, float* dense) {
  if (geo.n <= 0) return;
  with_codec(geo, [&](auto bits, auto asym) {
    decode_average_all<decltype(bits)::value, decltype(asym)::value>(bodies, count, geo, scale,
                                                                     dense);
  });
}

}  // namespace gradcomp::kernels::cpu

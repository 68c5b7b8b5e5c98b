// SPDX-License-Identifier: Apache-2.0
// The per-block math of the multi-bit family (gradcomp/quant.hpp), written once for the CPU loops
// and the CUDA kernels: the grid, the scales (fp32 or fp16), the rounding, the code layout and
// the decode. Every arithmetic step is one IEEE round-to-nearest fp32 operation (add_rn / mul_rn:
// nvcc cannot contract them into an FMA), so both backends produce the same codes, scales and
// errors from the same inputs.
//
// Code layout. Codes are unsigned b-bit integers packed 32 / b to a 32-bit word, least
// significant first: element j of a chunk is bits [(j % (32/b)) b, ...) of word j / (32/b).
// Symmetric codes are c + L for c in [-L, L] (2L + 1 of the 2^b codes are used), asymmetric
// codes are c in [0, 2^b - 1]. Unused bits of the last word are 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "gradcomp/detail/macros.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/rng.hpp"
#include "kernels/onebit_math.h"

namespace gradcomp::kernels::quant {

using onebit::add_rn;
using onebit::mul_rn;
using onebit::sub_rn;

/// The symmetric grid's largest code magnitude L = 2^(b-1) - 1 and the asymmetric grid's largest
/// code 2^b - 1.
GC_HD int sym_levels(int bits) { return (1 << (bits - 1)) - 1; }
GC_HD int asym_levels(int bits) { return (1 << bits) - 1; }
/// Codes per 32-bit word.
GC_HD int codes_per_word(int bits) { return 32 / bits; }

/// fp16 bits of the smallest fp16 value >= v (v finite, >= 0), saturating at 65504; +0 for
/// v <= 0 (either zero, and anything a caller did not mean).
GC_HD uint16_t half_up(float v) {
  if (!(v > 0.0f)) return 0;
  uint16_t h = float_to_half(v);
  if (h >= 0x7c00u) return 0x7bffu;  // beyond fp16: its largest finite value
  if (half_to_float(h) < v) ++h;     // one fp16 ulp up (a carry into the exponent is right too)
  return h >= 0x7c00u ? static_cast<uint16_t>(0x7bffu) : h;
}
/// fp16 bits of the largest fp16 value <= v (v finite), saturating at -65504 / 65504.
GC_HD uint16_t half_down(float v) {
  if (v == 0.0f) return 0;  // -0 too: its fp16 bits 0x8000 must not pass for a large value
  if (v > 0.0f) {
    uint16_t h = float_to_half(v);
    if (h >= 0x7c00u) return 0x7bffu;
    if (half_to_float(h) > v) --h;  // h > 0 here: only a positive value rounds up
    return h;
  }
  return static_cast<uint16_t>(half_up(-v) | 0x8000u);  // -(smallest >= |v|)
}

/// A block's grid: code c decodes to base + c * step. Symmetric: base = -L s, step = s (so the
/// code L is exactly 0: base + L s is formed as (c - L) s instead, see decode). inv = 1 / step,
/// saturated to FLT_MAX (a denormal step) and 0 for an all-zero block.
struct Grid {
  float base = 0.0f;  ///< asymmetric: lo
  float step = 0.0f;
  float inv = 0.0f;
};

GC_HD float inverse_of(float step) {
  if (!(step > 0.0f)) return 0.0f;
  const float r = 1.0f / step;
  return is_finite_bits(r) ? r : onebit::kMaxFinite;
}

/// What the symmetric grid's step divides the block's max |x| by: L = 2^(bits-1) - 1, except for
/// stochastic rounding with error feedback at 2 bits (L = 1), where it is 2.
/// Why: error feedback only converges when each step's error is smaller than what it compresses.
/// Stochastic rounding's error reaches a whole step, and at L = 1 a whole step is the block's max
/// itself: an element of size a, rounded to 0 or to the max, errs by a (max - a) on average, more
/// than a^2 for all but the largest elements, so the carried error held more than the gradient,
/// raised the next block's max, and grew with it (2 ranks, 400 steps: the sum of the averages off
/// by 14-18x the largest gradient, single averages 22-45x). With the step at half the max the
/// elements above it are clipped to it (the clipped part is carried as any error) and the error
/// is a fraction of the signal (bounded over 400 steps: tests/comm/test_make_plan.cpp,
/// ErrorFeedbackStaysBoundedForEveryFamily).
/// Nearest rounding errs by at most half a step, and 4 and 8 bits have 7 and 127 levels: their
/// steps stay at max / L. Without error feedback nothing is carried and stochastic rounding stays
/// unbiased (max / 1).
GC_HD int sym_divisor(int bits, bool stochastic, bool error_feedback) {
  const int L = sym_levels(bits);
  return (L == 1 && stochastic && error_feedback) ? 2 : L;
}

/// The symmetric grid from the block's max |x| (finite): s = amax / divisor (sym_divisor; codes
/// stay within +-L), rounded up to fp16 when half (stored: `stored`, fp32 or fp16 bits).
GC_HD Grid sym_grid(float amax, int bits, bool half, uint32_t* stored, int divisor = 0) {
  const int L = divisor > 0 ? divisor : sym_levels(bits);
  float s = static_cast<float>(static_cast<double>(amax) / L);
  if (half) {
    const uint16_t h = half_up(s);
    s = half_to_float(h);
    *stored = h;
  } else {
    *stored = float_bits(s);
  }
  Grid g;
  g.step = s;
  g.inv = inverse_of(s);
  return g;
}

/// The asymmetric grid from the block's min and max (finite): lo = min (rounded down to fp16
/// when half), d = (max - lo) / (2^b - 1) in double rounded once (up to fp16 when half).
/// stored[0] = lo, stored[1] = d.
GC_HD Grid asym_grid(float mn, float mx, int bits, bool half, uint32_t* stored) {
  const int M = asym_levels(bits);
  // -0 and +0 tie in the max / min reductions, whose order differs between the backends: a zero
  // is stored as +0 so that both send the same bytes
  mn = mn == 0.0f ? 0.0f : mn;
  mx = mx == 0.0f ? 0.0f : mx;
  float lo = mn;
  if (half) {
    const uint16_t h = half_down(mn);
    lo = half_to_float(h);
    stored[0] = h;
  } else {
    stored[0] = float_bits(lo);
  }
  float d = static_cast<float>((static_cast<double>(mx) - static_cast<double>(lo)) / M);
  if (half) {
    const uint16_t h = half_up(d);
    d = half_to_float(h);
    stored[1] = h;
  } else {
    stored[1] = float_bits(d);
  }
  Grid g;
  g.base = lo;
  g.step = d;
  g.inv = inverse_of(d);
  return g;
}

/// The grid of a received block from its stored scale(s).
GC_HD Grid read_grid(const uint32_t* stored, bool asym, bool half) {
  auto val = [&](uint32_t u) {
    return half ? half_to_float(static_cast<uint16_t>(u)) : bits_float(u);
  };
  Grid g;
  if (asym) {
    g.base = val(stored[0]);
    g.step = val(stored[1]);
  } else {
    g.step = val(stored[0]);
  }
  return g;
}

/// The code of x (finite) on the grid: t = x / step (x - lo for asymmetric, saturated), clamped to
/// the grid, rounded to nearest (ties to even) or, with u in [0, 1), down after adding u
/// (stochastic: up with probability frac(t)). Returned as the stored unsigned code.
GC_HD uint32_t encode(float x, const Grid& g, int bits, bool asym, bool stochastic, float u) {
  float t, lo_c, hi_c;
  if (asym) {
    t = mul_rn(saturate_f32(sub_rn(x, g.base)), g.inv);
    lo_c = 0.0f;
    hi_c = static_cast<float>(asym_levels(bits));
  } else {
    t = mul_rn(x, g.inv);
    hi_c = static_cast<float>(sym_levels(bits));
    lo_c = -hi_c;
  }
  t = t == t ? t : 0.0f;  // NaN (only with the finiteness check off): a code in range, not UB
  t = t < lo_c ? lo_c : (t > hi_c ? hi_c : t);
  float c = stochastic ? floorf(add_rn(t, u)) : rintf(t);
  c = c > hi_c ? hi_c : c;  // t + u may round up to hi + 1
  const int ci = static_cast<int>(c);
  return static_cast<uint32_t>(asym ? ci : ci + sym_levels(bits));
}

/// The value of a stored code, saturated to +-FLT_MAX: L s and base + c d may round past FLT_MAX
/// for a block near the top of the range, and a code or scale that no encoder made (a corrupt
/// chunk with finite scales) must still decode to a finite value.
GC_HD float decode(uint32_t code, const Grid& g, int bits, bool asym) {
  if (asym) return saturate_f32(add_rn(g.base, mul_rn(static_cast<float>(code), g.step)));
  return saturate_f32(
      mul_rn(static_cast<float>(static_cast<int>(code) - sym_levels(bits)), g.step));
}

/// Stochastic rounding's uniform number for stream index i (see stream_index): 24 random bits.
GC_HD float uniform_of(uint32_t word) {
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

/// The random stream of one role: worker w draws at role w, the server of chunk r at world + r,
/// each at the element's global index (a bucket has at most 2^40 elements), so no two roles of
/// a step share numbers. Random words come four per Philox block: block index = stream index / 4.
GC_HD uint64_t stream_index(uint64_t role, uint64_t i) { return (role << 41) + i; }

}  // namespace gradcomp::kernels::quant

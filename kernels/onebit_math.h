// SPDX-License-Identifier: Apache-2.0
// The element-wise math of the 1-bit family, written once for the CPU loops and the CUDA kernels:
// the sign bit, the bit order, the reconstruction, the error-feedback update and the scale
// formulas. Every arithmetic step is a single IEEE round-to-nearest fp32 operation (the device
// side spells it with __fadd_rn / __fmul_rn so that nvcc cannot contract it into an FMA), so the
// CPU and the GPU produce the same bits from the same inputs.
//
// Range. Every finite input gives finite scales, states and decodes. The scale sums (|x| for L1,
// x^2 for L2) run in fp32 as the fast path and are checked per slice (needs_wide_sum): a slice
// whose fp32 total came out non-finite (a term or a partial sum overflowed) or, for x^2, tiny
// (squares may have underflowed) is summed again in double from norm_term_wide, which holds the
// square of every finite float (denormals included) without overflow or underflow. The scale is
// rounded to fp32 once; an RMS or a mean absolute value of finite floats is at most their largest
// magnitude, so it is finite. The two fp32 sums that can leave the range, the compensation g + e
// and the decode, saturate to +-FLT_MAX when their operands are finite (see compensate and
// decode_wide).
#pragma once

#include <cmath>
#include <cstdint>

#include "gradcomp/detail/macros.hpp"
#include "gradcomp/detail/numeric.hpp"

namespace gradcomp::kernels::onebit {

/// Bit order: element i lives in word i / 32 at bit i % 32 (least significant bit first).
GC_HD int64_t word_index(int64_t i) { return i >> 5; }
GC_HD uint32_t bit_position(int64_t i) { return static_cast<uint32_t>(i & 31); }
/// Number of 32-bit words that hold n bits.
GC_HD int64_t num_words(int64_t n) { return (n + 31) >> 5; }

/// The transmitted bit: 1 when x >= 0 (-0.0 gives 1, NaN gives 0).
GC_HD bool sign_bit(float x) { return x >= 0.0f; }
/// Bit (i % 32) of a packed word.
GC_HD bool get_bit(uint32_t word, uint32_t pos) { return ((word >> pos) & 1u) != 0u; }

GC_HD float add_rn(float a, float b) { return GC_DEVICE_OR_HOST(__fadd_rn(a, b), a + b); }
GC_HD float sub_rn(float a, float b) { return GC_DEVICE_OR_HOST(__fsub_rn(a, b), a - b); }
GC_HD float mul_rn(float a, float b) { return GC_DEVICE_OR_HOST(__fmul_rn(a, b), a * b); }

GC_HD double add_rn_d(double a, double b) { return GC_DEVICE_OR_HOST(__dadd_rn(a, b), a + b); }
GC_HD double mul_rn_d(double a, double b) { return GC_DEVICE_OR_HOST(__dmul_rn(a, b), a * b); }

/// The largest finite fp32 value (FLT_MAX).
constexpr float kMaxFinite = 3.40282346638528859811704183484516925e+38f;
/// r clamped to [-FLT_MAX, FLT_MAX]; NaN stays NaN (the SSE twin: min(M, max(-M, r)), whose
/// operand order also returns a NaN r).
GC_HD float saturate(float r) { return saturate_f32(r); }

/// The compensated value x = g + e (error feedback), or g when error feedback is off. The sum of
/// a finite g and a finite e that rounds past the fp32 range saturates to +-FLT_MAX, so a finite
/// gradient never makes x, the scale or the state non-finite (the exact value is then lost, as
/// by any rounding; the state's e stays finite by induction and load_state_dict checks it). A
/// non-finite g passes through unchanged, so the finiteness check still sees it.
GC_HD float compensate(float g, float e) {
  const float r = add_rn(g, e);
  return is_finite_bits(g) ? saturate(r) : r;
}
/// Reconstruction of one element from its bit: hi for a set bit, lo for a clear one.
GC_HD float reconstruct(bool bit, float hi, float lo) { return bit ? hi : lo; }
/// The new error-feedback memory: what the payload does not carry.
GC_HD float error_update(float x, float decoded) { return sub_rn(x, decoded); }
/// Lazy error feedback: a state that holds the previous step's x (not yet corrected) stands for
/// the error x - decode(encode(x)); the bit is recomputed from x itself (it is sign_bit(x)), so
/// only the previous reconstruction values (hi, lo) are kept. Same rounding as error_update.
GC_HD float lazy_error(float x_prev, float hi, float lo) {
  return error_update(x_prev, reconstruct(sign_bit(x_prev), hi, lo));
}
/// Decode step: dense + scale * v (accumulate) or scale * v (overwrite).
GC_HD float decode_store(float dense, float scale, float v, bool accumulate) {
  const float t = mul_rn(scale, v);
  return accumulate ? add_rn(dense, t) : t;
}
/// The decode's wide redo, used only where decode_store (with v, the fp32 sum of the decoded
/// values) came out non-finite: sum = the same decoded values added in the same order in double
/// (no overflow for finite values), then dense + scale * sum in double, rounded once to fp32 and
/// saturated to +-FLT_MAX. An infinite or NaN operand still gives Inf / NaN. Finite decodes keep
/// decode_store's bits; a finite payload and a finite dense never decode to Inf / NaN.
GC_HD float decode_wide(float dense, float scale, double sum, bool accumulate) {
  const double t = mul_rn_d(static_cast<double>(scale), sum);
  const double r = accumulate ? add_rn_d(static_cast<double>(dense), t) : t;
  if (!(r - r == 0.0)) return static_cast<float>(r);  // Inf or NaN: an operand was one
  const double m = static_cast<double>(kMaxFinite);
  return r > m ? kMaxFinite : (r < -m ? -kMaxFinite : static_cast<float>(r));
}

/// Scale of the sign modes from the chunk's sum (|x| for L1, x^2 for L2: fp32 slice sums, each
/// slice redone in double where needs_wide_sum says so) over len elements, rounded once to fp32.
/// The mean / RMS in double is within a few ulps of the exact value, which is at most max |x|, a
/// float, so finite inputs give a finite scale, nonzero for a nonzero block.
GC_HD float l1_scale(double sum_abs, int64_t len) {
  return len > 0 ? static_cast<float>(sum_abs / static_cast<double>(len)) : 0.0f;
}
GC_HD float l2_scale(double sum_sq, int64_t len) {
  return len > 0 ? static_cast<float>(sqrt(sum_sq / static_cast<double>(len))) : 0.0f;
}
/// 1-bit SGD's reconstruction value: the mean of a set, 0 for an empty set.
GC_HD float mean_or_zero(double sum, double count) {
  return count > 0.0 ? static_cast<float>(sum / count) : 0.0f;
}

/// The plan's randomized Hadamard rotation (DRIVE, Vargaftik et al., NeurIPS 2021): each full
/// block of S elements (S a power of two) is sent as z = H D x / sqrt(S), with H the S x S
/// Walsh-Hadamard matrix and D a fixed diagonal of signs, and restored as x = D H z / sqrt(S).
/// Rotated blocks look Gaussian whatever the gradient's tails, so one sign and one scale per
/// block lose about a third of the block's energy (1 - 2/pi for the L1 scale) instead of most of
/// it for a block with a few large entries. D's sign for global element index i: bit i % 32 of
/// a 32-bit mix of the word index w = i / 32 (MurmurHash3's finalizer over w's low 32 bits xor
/// its scaled high bits), 1 for -1: one hash per 32 elements. A fixed pattern: every rank and
/// every step uses the same rotation, which error feedback and the linear server average need.
GC_HD uint32_t rotation_hash(uint32_t lo, uint32_t hi) {
  uint32_t h = lo ^ (hi * 0x9E3779B9u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
/// The 32 signs of word w = i / 32 as bits (bit k: element 32 w + k).
GC_HD uint32_t rotation_word(int64_t w) {
  const auto u = static_cast<uint64_t>(w);
  return rotation_hash(static_cast<uint32_t>(u), static_cast<uint32_t>(u >> 32));
}
GC_HD float rotation_sign(int64_t i) {
  return ((rotation_word(i >> 5) >> (i & 31)) & 1u) ? -1.0f : 1.0f;
}
/// 1 / sqrt(S) rounded once from double (the same float on host and device).
GC_HD float rotation_norm(int64_t S) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(S)));
}
/// One butterfly of the fast Walsh-Hadamard transform: (a, b) -> (a + b, a - b).
GC_HD void butterfly(float& a, float& b) {
  const float s = add_rn(a, b), d = sub_rn(a, b);
  a = s;
  b = d;
}

/// Norm selector of the scale pass.
enum Norm : int { kColumnMeans = 0, kL1 = 1, kL2 = 2 };

/// The per-element term of the sign modes' reduction, fp32 (the fast path): |x| (L1) or x^2 (L2),
/// summed in fp32 over short runs, folded into double per slice.
template <int N>
GC_HD float norm_term(float x) {
  return N == kL1 ? fabsf(x) : mul_rn(x, x);
}
/// The same term formed in double (exact: a float's square has at most 48 significant bits and
/// its exponent fits a double), summed in double: the redo of a slice that needs_wide_sum flags.
template <int N>
GC_HD double norm_term_wide(float x) {
  const double d = static_cast<double>(x);
  return N == kL1 ? fabs(d) : mul_rn_d(d, d);
}
/// Below this fp32 total of x^2 a slice may have lost squares to underflow (fp32 squares of
/// |x| < 2^-63 are denormal or zero): 2^-100. A slice at or above it loses at most the underflow
/// error of its terms, under 2^-149 each, which is below 2^-30 of its total for any slice size
/// the backends use; |x| terms never underflow, so L1 has no such bound.
constexpr double kTinySumSq = 7.8886090522101180541e-31;  // 2^-100
/// True when a slice's fp32-summed total of norm_term<N> (folded into double) cannot be used as
/// is and the slice must be summed again from norm_term_wide: the total is Inf or NaN (an fp32
/// term or partial sum overflowed, or an input was non-finite; the redo then keeps a non-finite
/// input's Inf / NaN), or, for L2, it is below kTinySumSq (squares may have underflowed; an
/// all-zero slice is redone too and stays 0).
template <int N>
GC_HD bool needs_wide_sum(double total) {
  return !(total - total == 0.0) || (N == kL2 && total < kTinySumSq);
}

}  // namespace gradcomp::kernels::onebit

// SPDX-License-Identifier: Apache-2.0
// fp16 / bf16 <-> fp32 conversions, written once for CPU and CUDA so both backends round
// identically (round to nearest even; NaN stays NaN).
//
// A NaN widened to fp32 comes out quiet (payload and sign kept, quiet bit set), as the F16C
// instruction and IEEE 754 arithmetic give it: compilers do not honour signalling NaNs (clang
// folds `div == 1 ? x : x / div` into `x / div`, which quiets), so a signalling result would
// differ between builds and between a kernel's vector and scalar paths.
#pragma once

#include <cstdint>
#include <cstring>

#include "gradcomp/detail/macros.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp {

namespace detail {
/// The bytes of `from` read as a To of the same size (host code: the GPU has intrinsics).
template <class To, class From>
inline To host_bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}
}  // namespace detail

GC_HD uint32_t float_bits(float f) {
  return GC_DEVICE_OR_HOST(__float_as_uint(f), detail::host_bit_cast<uint32_t>(f));
}

GC_HD float bits_float(uint32_t u) {
  return GC_DEVICE_OR_HOST(__uint_as_float(u), detail::host_bit_cast<float>(u));
}

/// The bits of a widened NaN made quiet (see the top of this file); other values unchanged.
GC_HD uint32_t quiet_nan_bits(uint32_t u) {
  return (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : u;
}

/// bf16 bits -> float (exact; a NaN comes out quiet).
GC_HD float bf16_to_float(uint16_t h) {
  return bits_float(quiet_nan_bits(static_cast<uint32_t>(h) << 16));
}

/// float -> bf16 bits, round to nearest even.
GC_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// IEEE fp16 bits -> float (exact; a NaN comes out quiet).
GC_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(quiet_nan_bits(sign | 0x7f800000u | (man << 13)));
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: value = man * 2^-24
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

/// float -> IEEE fp16 bits, round to nearest even, overflow to Inf.
GC_HD uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {               // below 2^-14: subnormal half or zero
    if (a < 0x33000000u) return sign;  // < 2^-25 rounds to zero
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // in [14, 24]
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half_ulp = 1u << (shift - 1u);
    if (rem > half_ulp || (rem == half_ulp && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

/// Loads element i of an array of the given storage type as float.
struct F32Load {
  GC_HD static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
};
struct F16Load {
  GC_HD static float load(const void* p, int64_t i) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  }
};
struct BF16Load {
  GC_HD static float load(const void* p, int64_t i) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
};

/// Stores v as element i of an fp32 / fp16 / bf16 array (rounded to nearest even): the loaders'
/// inverse.
GC_HD void store_float(void* p, DType t, int64_t i, float v) {
  if (t == DType::kFloat32)
    static_cast<float*>(p)[i] = v;
  else if (t == DType::kFloat16)
    static_cast<uint16_t*>(p)[i] = float_to_half(v);
  else
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

/// Calls f(Loader{}) with the loader of storage dtype t (F32Load, F16Load or BF16Load): the one
/// place where a kernel's dtype switch is written (host code; the loaders themselves run anywhere).
///
/// Example:  gradcomp::with_loader(g.dtype, [&](auto L) { kernel<decltype(L)>(g.data, n); });
template <class F>
void with_loader(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      f(F32Load{});
      return;
    case DType::kFloat16:
      f(F16Load{});
      return;
    case DType::kBFloat16:
      f(BF16Load{});
      return;
  }
  throw InvalidArgument(detail::cat("unsupported dtype code ", static_cast<int>(t),
                                    " (expected fp32, fp16 or bf16)"));
}

/// |x| as ordered bits: for finite floats, a > b  <=>  abs_bits(a) > abs_bits(b).
GC_HD uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }

/// True for finite x (not NaN, not +-Inf), from the bits so that fast-math cannot remove it.
GC_HD bool is_finite_bits(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

/// r clamped to [-FLT_MAX, FLT_MAX]; NaN stays NaN (every comparison with it is false). For a sum
/// of finite operands that rounded past the fp32 range: the state it goes into stays finite (the
/// excess is lost, as by any rounding) instead of turning into Inf for good.
GC_HD float saturate_f32(float r) {
  constexpr float kMax = 0x1.fffffep127f;
  return r > kMax ? kMax : (r < -kMax ? -kMax : r);
}

}  // namespace gradcomp

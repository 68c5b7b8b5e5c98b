// SPDX-License-Identifier: Apache-2.0
// Element-wise math of the communication layer, written once for the CPU loops and the CUDA
// kernels: the rank-ordered sum of one element in its wire type, and the averaging cast.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/detail/macros.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp::kernels {

/// a + b in the storage type of the wire: fp16/bf16 round to the type after every addition (as
/// NCCL and the in-process simulator do), integers wrap.
GC_HD float add_f32(float a, float b) { return a + b; }
GC_HD uint16_t add_f16(uint16_t a, uint16_t b) {
  return float_to_half(half_to_float(a) + half_to_float(b));
}
GC_HD uint16_t add_bf16(uint16_t a, uint16_t b) {
  return float_to_bf16(bf16_to_float(a) + bf16_to_float(b));
}

/// Element i of the widened sum (sum_widened in reduce_kernels.hpp): the P half-precision values
/// b[r * stride + i] (fp16, or bf16 when bf) widened to fp32, summed in rank order in fp32 and
/// rounded once back to the half type.
GC_HD uint16_t sum_widened_at(const uint16_t* b, bool bf, size_t nb, size_t stride, int64_t i) {
  float acc = bf ? bf16_to_float(b[i]) : half_to_float(b[i]);
  for (size_t r = 1; r < nb; ++r) {
    const uint16_t v = b[r * stride + static_cast<size_t>(i)];
    acc = add_f32(acc, bf ? bf16_to_float(v) : half_to_float(v));
  }
  return bf ? float_to_bf16(acc) : float_to_half(acc);
}

/// Stores the widened sum w (fp16, or bf16 when bf) as element i of out in dtype out_t: the
/// wire type itself as its bits (NaN payloads too), fp32 exactly, the other half type rounded.
GC_HD void store_widened(uint16_t w, bool bf, void* out, DType out_t, int64_t i) {
  if (out_t == (bf ? DType::kBFloat16 : DType::kFloat16)) {
    static_cast<uint16_t*>(out)[i] = w;
    return;
  }
  const float v = bf ? bf16_to_float(w) : half_to_float(w);
  if (out_t == DType::kFloat32)
    static_cast<float*>(out)[i] = v;
  else
    static_cast<uint16_t*>(out)[i] = out_t == DType::kFloat16 ? float_to_half(v) : float_to_bf16(v);
}

/// The averaging cast: value / divisor computed in fp32, then rounded to the destination type.
GC_HD float scaled(float x, float divisor) { return divisor == 1.0f ? x : x / divisor; }

/// The saturating narrowing of fp32 to fp16 / bf16 (the 1-bit plan's output): a finite x beyond
/// the type's largest finite value (fp16 65504, bf16 0x7f7f = 3.3895314e38) becomes that value
/// with x's sign, then rounds to nearest even as the plain cast; +-Inf and NaN go through the
/// plain cast unchanged (a NaN output signals a skipped step). fp32 destinations: x itself.
GC_HD float saturate_for(float x, DType dt) {
  constexpr float kFltMax = 0x1.fffffep127f;
  const float m = dt == DType::kFloat16    ? 0x1.ffcp15f
                  : dt == DType::kBFloat16 ? 0x1.fep127f
                                           : kFltMax;
  const float a = x < 0.0f ? -x : x;
  if (!(a > m) || a > kFltMax) return x;  // in range, NaN, or +-Inf
  return x < 0.0f ? -m : m;
}

}  // namespace gradcomp::kernels

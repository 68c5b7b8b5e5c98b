// SPDX-License-Identifier: Apache-2.0
// Element-wise math of the communication layer, written once for the CPU loops and the CUDA
// kernels: the rank-ordered sum of one element in its wire type, and the averaging cast.
#pragma once

#include <cstdint>

#include "gradcomp/macros.hpp"
#include "gradcomp/numeric.hpp"

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

/// The averaging cast: value / divisor computed in fp32, then rounded to the destination type.
GC_HD float scaled(float x, float divisor) { return divisor == 1.0f ? x : x / divisor; }

}  // namespace gradcomp::kernels

// SPDX-License-Identifier: Apache-2.0
// The float4 scan for the first non-finite element of fp32 data, shared by the finiteness check
// (first_nonfinite, kernels/scan_kernels.hpp) and the 1-bit family's fused compress (which must
// know before it writes its state in place). Scalar 4-byte loads reached about half the copy
// bandwidth on an H200; float4 loads read at the copy bandwidth.
#pragma once

#include <cstdint>

#include "gradcomp/detail/numeric.hpp"

namespace gradcomp::kernels::cuda {

/// atomicMin(best, the first index i with g[i] not finite), g 16-byte aligned. Each thread stops
/// at its first find (its later indices are larger). `static`: each translation unit that
/// launches it has its own copy (the library is built without relocatable device code).
static __global__ void first_nonfinite_f32x4_kernel(const float* g, int64_t n,
                                                    unsigned long long* best) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n4 = n / 4;
  for (int64_t q = t; q < n4; q += stride) {
    const float4 v = reinterpret_cast<const float4*>(g)[q];
    const int c = !is_finite_bits(v.x)   ? 0
                  : !is_finite_bits(v.y) ? 1
                  : !is_finite_bits(v.z) ? 2
                  : !is_finite_bits(v.w) ? 3
                                         : 4;
    if (c < 4) {
      atomicMin(best, static_cast<unsigned long long>(4 * q + c));
      return;
    }
  }
  for (int64_t i = 4 * n4 + t; i < n; i += stride)
    if (!is_finite_bits(g[i])) {
      atomicMin(best, static_cast<unsigned long long>(i));
      return;
    }
}

}  // namespace gradcomp::kernels::cuda

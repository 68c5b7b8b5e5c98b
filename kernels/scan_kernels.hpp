// SPDX-License-Identifier: Apache-2.0
// Whole-tensor scans every family uses on the CPU (implemented in kernels/cpu/topk_cpu.cpp).
#pragma once

#include <cstdint>

#include "gradcomp/tensor.hpp"

namespace gradcomp::kernels::cpu {
/// Index of the first non-finite element of g (n elements of dtype t), or -1.
int64_t first_nonfinite(const void* g, DType t, int64_t n);
}  // namespace gradcomp::kernels::cpu

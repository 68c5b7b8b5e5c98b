// SPDX-License-Identifier: Apache-2.0
// Whole-tensor scans every family uses (kernels/entry.hpp). The CPU twin is in
// kernels/cpu/topk_cpu.cpp, the CUDA twin in kernels/cuda/topk_cuda.cu.
#pragma once

#include <cstdint>

#include "gradcomp/tensor.hpp"
#include "kernels/entry.hpp"

namespace gradcomp::kernels {

struct SelectWorkspace;  // kernels/topk_kernels.hpp

/// Index of the first non-finite element of g (n elements of dtype t), or -1. ws: the CUDA twin's
/// scratch and read-back slot.
GC_KERNEL_ENTRY_CUDA_EXTRA(int64_t, first_nonfinite, "finiteness check on a CUDA tensor",
                           (const void* g, DType t, int64_t n), (g, t, n), (SelectWorkspace & ws),
                           (ws))

}  // namespace gradcomp::kernels

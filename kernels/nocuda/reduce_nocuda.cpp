// SPDX-License-Identifier: Apache-2.0
// CPU-only build: the CUDA entry points of the communication layer throw "built without CUDA".
#include "gradcomp/runtime.hpp"
#include "kernels/reduce_kernels.hpp"

namespace gradcomp::kernels::cuda {

void reduce_blocks(const void*, size_t, size_t, size_t, ElemType, void*, void*) {
  throw_not_built_with_cuda("rank-ordered reduction of CUDA buffers");
}
void convert(const void*, DType, void*, DType, int64_t, float, void*) {
  throw_not_built_with_cuda("cast of a CUDA tensor");
}
void convert_saturating(const float*, void*, DType, int64_t, void*) {
  throw_not_built_with_cuda("cast of a CUDA tensor");
}

void sum_widened(const uint16_t*, DType, size_t, size_t, size_t, uint16_t*, void*, DType, void*) {
  throw_not_built_with_cuda("rank-ordered sum of CUDA buffers");
}

}  // namespace gradcomp::kernels::cuda

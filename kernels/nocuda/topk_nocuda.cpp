// SPDX-License-Identifier: Apache-2.0
// CPU-only build: the CUDA entry points of the top-k family throw "built without CUDA".
#include "kernels/topk_kernels.hpp"

namespace gradcomp::kernels::cuda {

int64_t select(const float*, int64_t, int64_t, const SelectOptions&, const RngKey&, uint32_t*,
               SelectWorkspace&, void*) {
  throw_not_built_with_cuda("top-k selection on a CUDA tensor");
}
int64_t first_nonfinite(const void*, DType, int64_t, SelectWorkspace&, void*) {
  throw_not_built_with_cuda("finiteness check on a CUDA tensor");
}
double sum_squares(const void*, DType, int64_t, SelectWorkspace&, void*) {
  throw_not_built_with_cuda("norm of a CUDA tensor");
}
void dgc_accumulate(const void*, DType, int64_t, float, float, bool, float*, float*, void*,
                    const float*, const float*) {
  throw_not_built_with_cuda("DGC accumulation on a CUDA tensor");
}
void gather_and_clear(float*, float*, const uint32_t*, int64_t, void*, DType, void*,
                      const ValueShare*) {
  throw_not_built_with_cuda("top-k gather on a CUDA tensor");
}
void gather(const float*, const uint32_t*, int64_t, void*, DType, void*) {
  throw_not_built_with_cuda("top-k gather on a CUDA tensor");
}
void randomk_indices(int64_t, int64_t, const RngKey&, uint32_t*, void*, const uint32_t*, int64_t) {
  throw_not_built_with_cuda("random-k indices on CUDA");
}
void scatter_add(const uint32_t*, const void*, DType, int64_t, float, float*, void*) {
  throw_not_built_with_cuda("sparse decode on a CUDA tensor");
}
void indices_to_bitmap(const uint32_t*, int64_t, int64_t, uint8_t*, void*) {
  throw_not_built_with_cuda("bitmap encode on CUDA");
}
int64_t bitmap_to_indices(const uint8_t*, int64_t, uint32_t*, int64_t, SelectWorkspace&, void*) {
  throw_not_built_with_cuda("bitmap decode on CUDA");
}
int64_t check_indices(const uint32_t*, int64_t, int64_t, SelectWorkspace&, void*) {
  throw_not_built_with_cuda("index validation on CUDA");
}

}  // namespace gradcomp::kernels::cuda

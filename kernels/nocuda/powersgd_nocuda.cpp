// SPDX-License-Identifier: Apache-2.0
// CPU-only build: the CUDA entry points of PowerSGD throw "built without CUDA".
#include "kernels/powersgd_kernels.hpp"

namespace gradcomp::kernels {

PsgdContext::~PsgdContext() = default;

namespace cuda {
void load(const void*, DType, int64_t, float*, bool, void*) {
  throw_not_built_with_cuda("PowerSGD on a CUDA tensor");
}
void divide(float*, int64_t, float, void*) { throw_not_built_with_cuda("PowerSGD on CUDA"); }
void store_mean(const float*, int64_t, float, void*, DType, void*) {
  throw_not_built_with_cuda("PowerSGD on CUDA");
}
void store_result(const float*, void*, DType, int64_t, float*, void*) {
  throw_not_built_with_cuda("PowerSGD on CUDA");
}
void fill_q(const PsgdGroup&, uint64_t, uint64_t, bool, void*) {
  throw_not_built_with_cuda("PowerSGD Q initialization on CUDA");
}
void prescale_blocks(float*, int64_t, int64_t, float, void*) {
  throw_not_built_with_cuda("PowerSGD Q scaling on CUDA");
}
void compute_p(const PsgdGroup&, PsgdContext&) {
  throw_not_built_with_cuda("PowerSGD GEMM on CUDA");
}
void compute_q(const PsgdGroup&, PsgdContext&) {
  throw_not_built_with_cuda("PowerSGD GEMM on CUDA");
}
void reconstruct(const PsgdGroup&, int64_t, int64_t, float*, PsgdContext&) {
  throw_not_built_with_cuda("PowerSGD GEMM on CUDA");
}
void orthogonalize(float*, int64_t, int64_t, int, float, Orthogonalization, PsgdContext&) {
  throw_not_built_with_cuda("PowerSGD orthogonalization on CUDA");
}
}  // namespace cuda

}  // namespace gradcomp::kernels

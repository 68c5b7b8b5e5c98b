// SPDX-License-Identifier: Apache-2.0
// CPU-only build: the CUDA entry points of the 1-bit family throw "built without CUDA".
#include "gradcomp/runtime.hpp"
#include "kernels/onebit_kernels.hpp"

namespace gradcomp::kernels::cuda {

int64_t onebit_scales(const void*, DType, const float*, const OneBitGeom&, int, bool, float*,
                      OneBitWorkspace&, void*) {
  throw_not_built_with_cuda("1-bit scales of a CUDA tensor");
}
void onebit_quantize(const void*, DType, const float*, float*, const OneBitGeom&, const float*,
                     uint32_t*, void*) {
  throw_not_built_with_cuda("1-bit quantization of a CUDA tensor");
}
int64_t onebit_compress(const void*, DType, const float*, const float*, float*, const OneBitGeom&,
                        int, bool, float*, uint32_t*, OneBitWorkspace&, void*) {
  throw_not_built_with_cuda("1-bit compression of a CUDA tensor");
}
void onebit_finalize_error(float*, const OneBitGeom&, const float*, void*) {
  throw_not_built_with_cuda("1-bit error feedback of a CUDA tensor");
}
void onebit_decode_average(const uint32_t* const*, const float* const*, int, const OneBitGeom&,
                           float, bool, float*, OneBitWorkspace&, void*) {
  throw_not_built_with_cuda("1-bit decode into a CUDA tensor");
}

void hadamard_rotate(float*, int64_t, int64_t, int64_t, bool, void*) {
  throw_not_built_with_cuda("1-bit rotation of a CUDA tensor");
}

}  // namespace gradcomp::kernels::cuda

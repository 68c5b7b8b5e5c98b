// SPDX-License-Identifier: Apache-2.0
// CPU-only build: the CUDA entry points of the multi-bit family throw "built without CUDA".
#include "gradcomp/runtime.hpp"
#include "kernels/quant_kernels.hpp"

namespace gradcomp::kernels::cuda {

int64_t quant_compress(const void*, DType, const float*, float*, const QuantGeom&, const QuantRng&,
                       bool, uint8_t*, void*) {
  throw_not_built_with_cuda("multi-bit quantization of a CUDA tensor");
}
void quant_decode_average(const uint8_t* const*, int, const QuantGeom&, float, float*,
                          QuantWorkspace&, void*) {
  throw_not_built_with_cuda("multi-bit decode into a CUDA tensor");
}

}  // namespace gradcomp::kernels::cuda

// SPDX-License-Identifier: Apache-2.0
// CUDA error checks for .cu files: a failure becomes gradcomp::BackendError naming the call.
#pragma once

#include <cuda_runtime.h>

#include "gradcomp/error.hpp"

#define GC_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    cudaError_t gc_err_ = (call);                                                    \
    if (gc_err_ != cudaSuccess)                                                      \
      throw ::gradcomp::BackendError(::gradcomp::detail::cat(                        \
          "CUDA error ", cudaGetErrorName(gc_err_), " (", cudaGetErrorString(gc_err_), \
          ") in ", #call, " at ", __FILE__, ":", __LINE__));                         \
  } while (0)

/// Checks the last kernel launch.
#define GC_CUDA_CHECK_LAUNCH() GC_CUDA_CHECK(cudaGetLastError())

namespace gradcomp::cuda_detail {
inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
}  // namespace gradcomp::cuda_detail

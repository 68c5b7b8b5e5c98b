// SPDX-License-Identifier: Apache-2.0
// The host-device macro: shared element-wise math is written once and compiled by both the C++
// compiler (CPU twin) and nvcc (CUDA kernel).
#pragma once

#if defined(__CUDACC__)
#define GC_HD __host__ __device__ __forceinline__
#define GC_HOST_DEVICE __host__ __device__
#else
#define GC_HD inline
#define GC_HOST_DEVICE
#endif

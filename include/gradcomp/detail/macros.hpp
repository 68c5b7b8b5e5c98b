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

/// In a GC_HD function: `device_expr` where nvcc compiles it for the GPU, `host_expr` elsewhere.
/// For the few operations whose device spelling is an intrinsic (a rounding nvcc must not fuse
/// into an FMA, a bit cast, a high multiply) and whose host spelling is plain C++.
#if defined(__CUDA_ARCH__)
#define GC_DEVICE_OR_HOST(device_expr, host_expr) (device_expr)
#else
#define GC_DEVICE_OR_HOST(device_expr, host_expr) (host_expr)
#endif

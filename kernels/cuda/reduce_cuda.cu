// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the communication layer's local work; the twin of kernels/cpu/reduce_cpu.cpp
// (same math from reduce_math.h, same rank order per element, so the bits agree).
#include <cstring>

#include "core/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/reduce_kernels.hpp"
#include "kernels/reduce_math.h"

namespace gradcomp::kernels::cuda {
namespace {

inline unsigned blocks_for(int64_t n) { return grid_for(n, kThreads, 65535 * 16); }

struct AddF32 { __device__ float operator()(float a, float b) const { return add_f32(a, b); } };
struct AddF16 { __device__ uint16_t operator()(uint16_t a, uint16_t b) const { return add_f16(a, b); } };
struct AddBF16 { __device__ uint16_t operator()(uint16_t a, uint16_t b) const { return add_bf16(a, b); } };
template <class T>
struct AddInt { __device__ T operator()(T a, T b) const { return static_cast<T>(a + b); } };

template <class T, class Add>
// (no __restrict__: d may alias block 0, each element read before its thread writes it)
__global__ void reduce_kernel(const T* b, size_t nb, int64_t n, size_t stride, T* d) {
  Add add;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    T acc = b[i];
    for (size_t r = 1; r < nb; ++r) acc = add(acc, b[r * stride + i]);
    d[i] = acc;
  }
}

template <class T, class Add>
void launch_reduce(const void* b, size_t nb, size_t count, size_t stride, void* d, void* s) {
  const auto n = static_cast<int64_t>(count);
  reduce_kernel<T, Add><<<blocks_for(n), kThreads, 0, cuda_detail::as_stream(s)>>>(
      static_cast<const T*>(b), nb, n, stride, static_cast<T*>(d));
  GC_CUDA_CHECK_LAUNCH();
}

template <class Load>
__global__ void convert_kernel(const void* src, void* dst, DType dt, int64_t n, float div) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    store_float(dst, dt, i, scaled(Load::load(src, i), div));
  }
}

/// fp32 -> fp16 / bf16 through saturate_for (the twin of cpu::convert_saturating).
__global__ void convert_saturating_kernel(const float* src, uint16_t* dst, DType dt, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = saturate_for(src[i], dt);
    dst[i] = dt == DType::kFloat16 ? float_to_half(v) : float_to_bf16(v);
  }
}

/// The twin of cpu::sum_widened: one thread per element, the ranks in order (no __restrict__:
/// wire_out and out may alias block 0).
__global__ void sum_widened_kernel(const uint16_t* b, bool bf, size_t nb, int64_t n,
                                   size_t stride, uint16_t* wire_out, void* out, DType out_t) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint16_t w = sum_widened_at(b, bf, nb, stride, i);
    if (wire_out) wire_out[i] = w;
    if (out) store_widened(w, bf, out, out_t, i);
  }
}

}  // namespace

void sum_widened(const uint16_t* blocks, DType wire, size_t nb, size_t count, size_t stride,
                 uint16_t* wire_out, void* out, DType out_t, void* stream) {
  if (count == 0 || nb == 0) return;
  const auto n = static_cast<int64_t>(count);
  sum_widened_kernel<<<blocks_for(n), kThreads, 0, cuda_detail::as_stream(stream)>>>(
      blocks, wire == DType::kBFloat16, nb, n, stride, wire_out, out, out_t);
  GC_CUDA_CHECK_LAUNCH();
}

void reduce_blocks(const void* blocks, size_t nb, size_t count, size_t stride, ElemType t,
                   void* dst, void* stream) {
  if (count == 0 || nb == 0) return;
  switch (t) {
    case ElemType::kF32: return launch_reduce<float, AddF32>(blocks, nb, count, stride, dst, stream);
    case ElemType::kF16: return launch_reduce<uint16_t, AddF16>(blocks, nb, count, stride, dst, stream);
    case ElemType::kBF16:
      return launch_reduce<uint16_t, AddBF16>(blocks, nb, count, stride, dst, stream);
    case ElemType::kU8:
      return launch_reduce<uint8_t, AddInt<uint8_t>>(blocks, nb, count, stride, dst, stream);
    case ElemType::kU32:
      return launch_reduce<uint32_t, AddInt<uint32_t>>(blocks, nb, count, stride, dst, stream);
    case ElemType::kI64:
      return launch_reduce<int64_t, AddInt<int64_t>>(blocks, nb, count, stride, dst, stream);
  }
}

void convert(const void* src, DType st, void* dst, DType dt, int64_t n, float divisor,
             void* stream) {
  if (n <= 0) return;
  auto s = cuda_detail::as_stream(stream);
  if (st == dt && divisor == 1.0f) {
    if (src != dst)
      GC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(st), cudaMemcpyDefault, s));
    return;
  }
  switch (st) {
    case DType::kFloat32: convert_kernel<F32Load><<<blocks_for(n), kThreads, 0, s>>>(src, dst, dt, n, divisor); break;
    case DType::kFloat16: convert_kernel<F16Load><<<blocks_for(n), kThreads, 0, s>>>(src, dst, dt, n, divisor); break;
    case DType::kBFloat16: convert_kernel<BF16Load><<<blocks_for(n), kThreads, 0, s>>>(src, dst, dt, n, divisor); break;
  }
  GC_CUDA_CHECK_LAUNCH();
}

void convert_saturating(const float* src, void* dst, DType dt, int64_t n, void* stream) {
  if (n <= 0) return;
  auto s = cuda_detail::as_stream(stream);
  if (dt == DType::kFloat32) {
    if (static_cast<const void*>(src) != dst)
      GC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * sizeof(float), cudaMemcpyDefault, s));
    return;
  }
  convert_saturating_kernel<<<blocks_for(n), kThreads, 0, s>>>(src, static_cast<uint16_t*>(dst),
                                                               dt, n);
  GC_CUDA_CHECK_LAUNCH();
}

}  // namespace gradcomp::kernels::cuda

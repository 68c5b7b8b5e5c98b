// SPDX-License-Identifier: Apache-2.0
// CUDA twin of the fp8 family's kernels (kernels/fp8_kernels.hpp; the CPU twin is
// kernels/cpu/fp8_cpu.cpp). One warp per block of values: each lane takes the values lane,
// lane + 32, ... (so a warp's loads and its code stores are contiguous), the block's largest
// magnitude and finiteness are reduced by shuffles (a max is exact in any order), every lane forms
// the same scale, and a second pass writes the codes. The sum recomputes each rank-ordered value in
// that second pass instead of keeping a block's values (up to 4096) anywhere: the same operations
// in the same order, so the same bits.
#include <cstdint>

#include "core/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/fp8_kernels.hpp"

namespace gradcomp::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

/// The block's scale from each lane's largest finite magnitude and finiteness.
__device__ float warp_scale(float amax, bool finite, bool e5m2) {
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  finite = __all_sync(0xffffffffu, finite);
  return fp8_scale(amax, finite, e5m2);
}

__device__ void fold(float v, float& amax, bool& finite) {
  if (!is_finite_bits(v))
    finite = false;
  else
    amax = fmaxf(amax, fabsf(v));
}

template <class Load>
__global__ void encode_kernel(const void* x, int64_t n, int64_t nblocks, int block, bool e5m2,
                              uint8_t* records) {
  const int lane = threadIdx.x & 31;
  const size_t rb = fp8_record_bytes(block);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); b < nblocks; b += warps) {
    const int64_t first = b * block;
    float amax = 0.0f;
    bool finite = true;
    for (int j = lane; j < block; j += 32)
      fold(first + j < n ? Load::load(x, first + j) : 0.0f, amax, finite);
    const float s = warp_scale(amax, finite, e5m2);
    uint8_t* rec = records + static_cast<size_t>(b) * rb;
    if (lane == 0) fp8_set_record_scale(rec, s);
    for (int j = lane; j < block; j += 32)
      rec[4 + j] = fp8_code_of(first + j < n ? Load::load(x, first + j) : 0.0f, s, e5m2);
  }
}

__device__ float summed(const uint8_t* rec0, int nranks, size_t rank_stride, int j, bool e5m2,
                        float divisor) {
  float acc = fp8_value_of(rec0[4 + j], fp8_record_scale(rec0), e5m2);
  for (int r = 1; r < nranks; ++r) {
    const uint8_t* rec = rec0 + static_cast<size_t>(r) * rank_stride;
    acc = acc + fp8_value_of(rec[4 + j], fp8_record_scale(rec), e5m2);
  }
  return acc / divisor;
}

__global__ void sum_kernel(const uint8_t* records, int nranks, size_t rank_stride, int64_t nblocks,
                           int block, bool e5m2, float divisor, uint8_t* records_out, void* out,
                           DType out_t, int64_t n_out) {
  const int lane = threadIdx.x & 31;
  const size_t rb = fp8_record_bytes(block);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); b < nblocks; b += warps) {
    const uint8_t* rec0 = records + static_cast<size_t>(b) * rb;
    const int64_t first = b * block;
    float amax = 0.0f;
    bool finite = true;
    for (int j = lane; j < block; j += 32) {
      const float v = summed(rec0, nranks, rank_stride, j, e5m2, divisor);
      if (out != nullptr && first + j < n_out) store_float(out, out_t, first + j, v);
      fold(v, amax, finite);
    }
    if (records_out == nullptr) continue;  // the same for every lane of the warp
    const float s = warp_scale(amax, finite, e5m2);
    uint8_t* dst = records_out + static_cast<size_t>(b) * rb;
    if (lane == 0) fp8_set_record_scale(dst, s);
    for (int j = lane; j < block; j += 32)
      dst[4 + j] = fp8_code_of(summed(rec0, nranks, rank_stride, j, e5m2, divisor), s, e5m2);
  }
}

unsigned grid_of(int64_t nblocks) { return grid_for(nblocks, kWarpsPerBlock); }

}  // namespace

void fp8_encode_blocks(const void* x, DType t, int64_t n, int64_t nblocks, int block, bool e5m2,
                       uint8_t* records, void* stream) {
  if (nblocks <= 0) return;
  with_loader(t, [&](auto L) {
    encode_kernel<decltype(L)><<<grid_of(nblocks), kThreads, 0, cuda_detail::as_stream(stream)>>>(
        x, n, nblocks, block, e5m2, records);
  });
  GC_CUDA_CHECK(cudaGetLastError());
}

void fp8_sum_blocks(const uint8_t* records, int nranks, size_t rank_stride, int64_t nblocks,
                    int block, bool e5m2, float divisor, uint8_t* records_out, void* out,
                    DType out_t, int64_t n_out, void* stream) {
  if (nblocks <= 0) return;
  sum_kernel<<<grid_of(nblocks), kThreads, 0, cuda_detail::as_stream(stream)>>>(
      records, nranks, rank_stride, nblocks, block, e5m2, divisor, records_out, out, out_t, n_out);
  GC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gradcomp::kernels::cuda

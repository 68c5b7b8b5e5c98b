// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the multi-bit family; the CPU twin is kernels/cpu/quant_cpu.cpp and both call
// the math of kernels/quant_math.h, so codes, scales, errors and decodes are the same bits.
//  - compress: one thread block per quantization block (grid-stride over blocks): the block's
//    x = g + e is staged in shared memory, its max / min / max |x| reduced with cub::BlockReduce
//    (max and min are exact, so the order does not matter), thread 0 forms the grid, then each
//    thread packs whole code words and writes their errors.
//  - decode_average: one thread per element, summing the P payloads in rank order.
#include <cub/cub.cuh>
#include <vector>

#include "core/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/quant_kernels.hpp"
#include "kernels/quant_math.h"

namespace gradcomp::kernels::cuda {
namespace {

using namespace quant;
using cuda_detail::as_stream;

struct Geo {
  int64_t n, block, codes_offset;
  int bits, spb;
  bool asym, half;
};
Geo to_geo(const QuantGeom& g) {
  return Geo{g.n, g.block, g.codes_offset(), g.bits, g.scales_per_block(), g.asym, g.half};
}

/// max / min in the CPU twin's operand order (v > m ? v : m), for cub::BlockReduce.
struct MaxOp {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};
struct MinOp {
  __device__ float operator()(float a, float b) const { return a < b ? a : b; }
};

__device__ uint32_t load_scale(const uint8_t* body, int64_t slot, bool half) {
  if (half) return reinterpret_cast<const uint16_t*>(body)[slot];
  return reinterpret_cast<const uint32_t*>(body)[slot];
}

template <class Load, bool HasE>
__global__ void compress_kernel(const void* g, const float* e_in, float* e_out, Geo geo,
                                QuantRng rng, uint8_t* body) {
  extern __shared__ float x[];
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ Grid grid;
  const int64_t nb = (geo.n + geo.block - 1) / geo.block;
  const int per = codes_per_word(geo.bits);
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const int64_t i0 = b * geo.block;
    const int64_t len = min(geo.block, geo.n - i0);
    float mx = -onebit::kMaxFinite, mn = onebit::kMaxFinite, amax = 0.0f;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      const float gj = Load::load(g, i0 + j);
      const float v = HasE ? onebit::compensate(gj, e_in[i0 + j]) : gj;
      x[j] = v;
      mx = v > mx ? v : mx;
      mn = v < mn ? v : mn;
      const float a = fabsf(v);
      amax = a > amax ? a : amax;
    }
    const float bmx = Reduce(tmp).Reduce(mx, MaxOp{});
    __syncthreads();
    const float bmn = Reduce(tmp).Reduce(mn, MinOp{});
    __syncthreads();
    const float bam = Reduce(tmp).Reduce(amax, MaxOp{});
    if (threadIdx.x == 0) {
      uint32_t stored[2] = {0, 0};
      grid = geo.asym ? asym_grid(bmn, bmx, geo.bits, geo.half, stored)
                      : sym_grid(bam, geo.bits, geo.half, stored);
      for (int k = 0; k < geo.spb; ++k) {
        const int64_t slot = b * geo.spb + k;
        if (geo.half)
          reinterpret_cast<uint16_t*>(body)[slot] = static_cast<uint16_t>(stored[k]);
        else
          reinterpret_cast<uint32_t*>(body)[slot] = stored[k];
      }
    }
    __syncthreads();
    const Grid gr = grid;
    auto* words = reinterpret_cast<uint32_t*>(body + geo.codes_offset);
    const int64_t nw = (len + per - 1) / per;
    const uint64_t base = stream_index(rng.role, rng.first + static_cast<uint64_t>(i0));
    for (int64_t w = threadIdx.x; w < nw; w += blockDim.x) {
      uint32_t v = 0;
      for (int k = 0; k < per; ++k) {
        const int64_t j = w * per + k;
        if (j >= len) break;
        float u = 0.0f;
        if (rng.stochastic) u = uniform_of(rng.key.block((base + j) >> 2).v[(base + j) & 3]);
        const uint32_t c = encode(x[j], gr, geo.bits, geo.asym, rng.stochastic, u);
        v |= c << (k * geo.bits);
        if (e_out) e_out[i0 + j] = saturate_f32(sub_rn(x[j], decode(c, gr, geo.bits, geo.asym)));
      }
      words[(i0 / per) + w] = v;
    }
    __syncthreads();
  }
}

__global__ void decode_kernel(const uint8_t* const* bodies, int count, Geo geo, float scale,
                              float* dense) {
  const int per = codes_per_word(geo.bits);
  const uint32_t mask = (1u << geo.bits) - 1u;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < geo.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / geo.block;
    float acc = 0.0f;
    for (int p = 0; p < count; ++p) {
      uint32_t stored[2] = {0, 0};
      for (int k = 0; k < geo.spb; ++k)
        stored[k] = load_scale(bodies[p], b * geo.spb + k, geo.half);
      const Grid gr = read_grid(stored, geo.asym, geo.half);
      const auto* words = reinterpret_cast<const uint32_t*>(bodies[p] + geo.codes_offset);
      const uint32_t c = (words[i / per] >> ((i % per) * geo.bits)) & mask;
      acc = add_rn(acc, decode(c, gr, geo.bits, geo.asym));
    }
    float v = mul_rn(scale, acc);
    if (!is_finite_bits(v)) {  // the CPU twin's wide redo of an overflowing element
      double sum = 0.0;
      for (int p = 0; p < count; ++p) {
        uint32_t stored[2] = {0, 0};
        for (int k = 0; k < geo.spb; ++k)
          stored[k] = load_scale(bodies[p], b * geo.spb + k, geo.half);
        const Grid gr = read_grid(stored, geo.asym, geo.half);
        const auto* words = reinterpret_cast<const uint32_t*>(bodies[p] + geo.codes_offset);
        const uint32_t c = (words[i / per] >> ((i % per) * geo.bits)) & mask;
        sum += static_cast<double>(decode(c, gr, geo.bits, geo.asym));
      }
      v = onebit::decode_wide(0.0f, scale, sum, false);
    }
    dense[i] = v;
  }
}

}  // namespace

int64_t quant_compress(const void* g, DType t, const float* e_in, float* e_out,
                       const QuantGeom& geo, const QuantRng& rng, bool, uint8_t* body,
                       void* stream) {
  if (geo.n <= 0) return -1;
  const unsigned blocks = grid_for(geo.num_blocks(), 1, 1 << 20);
  const size_t shmem = static_cast<size_t>(geo.block) * sizeof(float);
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
    if (e_in)
      compress_kernel<Load, true>
          <<<blocks, kThreads, shmem, as_stream(stream)>>>(g, e_in, e_out, to_geo(geo), rng, body);
    else
      compress_kernel<Load, false>
          <<<blocks, kThreads, shmem, as_stream(stream)>>>(g, e_in, e_out, to_geo(geo), rng, body);
  });
  GC_CUDA_CHECK_LAUNCH();
  return -1;
}

void quant_decode_average(const uint8_t* const* bodies, int count, const QuantGeom& geo,
                          float scale, float* dense, QuantWorkspace& ws, void* stream) {
  if (geo.n <= 0 || count <= 0) return;
  cudaStream_t s = as_stream(stream);
  ws.ptrs.set_stream(stream);
  std::vector<const uint8_t*> host(bodies, bodies + count);
  const auto** dev = ws.ptrs.get<const uint8_t*>(host.size());
  // pageable source: the call returns after the source was staged, so `host` may go away
  GC_CUDA_CHECK(
      cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice, s));
  decode_kernel<<<grid_for(geo.n, kThreads), kThreads, 0, s>>>(dev, count, to_geo(geo), scale,
                                                               dense);
  GC_CUDA_CHECK_LAUNCH();
}

}  // namespace gradcomp::kernels::cuda

// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the top-k family's updates and codecs: finiteness scan, squared norm, the DGC
// update, gather-and-clear, random-k's indices, scatter-add and the index codecs. Same contracts
// as the CPU twins in kernels/cpu/topk_cpu.cpp; the selections are in topk_select_cuda.cu.
//
// This file is compiled with --fmad=false (cmake/topk.cmake) so that a * b + c rounds twice as
// on the CPU: the DGC update, clipping and decode give bitwise the CPU's values.
#include "kernels/cuda/nonfinite.cuh"
#include "kernels/cuda/topk_common.cuh"

namespace gradcomp::kernels::cuda {
namespace {

using namespace topk_detail;
using cuda_detail::as_stream;

// ------------------------------------------------------------------------------------------------
// Element-wise kernels.

template <class Load>
__global__ void __launch_bounds__(kThreads)
    nonfinite_kernel(const void* g, int64_t n, unsigned long long* best) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    if (!is_finite_bits(Load::load(g, i))) {
      atomicMin(best, static_cast<unsigned long long>(i));  // later i of this thread are larger
      break;
    }
  }
}

template <class Load>
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const void* g, int64_t n, double* partial) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const double v = Load::load(g, i);
    acc += v * v;
  }
  const double total = Reduce(tmp).Sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads)
    sum_final_kernel(const double* partial, int nb, double* out) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  double acc = 0.0;
  for (int j = threadIdx.x; j < nb; j += kThreads) acc += partial[j];
  const double total = Reduce(tmp).Sum(acc);
  if (threadIdx.x == 0) *out = total;
}

/// Four consecutive gradient elements starting at 4q (aligned vector load).
template <class Load>
__device__ __forceinline__ void load4(const void* g, int64_t q, float (&f)[4]) {
  if constexpr (std::is_same_v<Load, F32Load>) {
    const float4 w = static_cast<const float4*>(g)[q];
    f[0] = w.x;
    f[1] = w.y;
    f[2] = w.z;
    f[3] = w.w;
  } else {
    const uint2 w = static_cast<const uint2*>(g)[q];  // little-endian: element 0 in the low bits
    const uint16_t h[4] = {static_cast<uint16_t>(w.x & 0xffffu), static_cast<uint16_t>(w.x >> 16),
                           static_cast<uint16_t>(w.y & 0xffffu), static_cast<uint16_t>(w.y >> 16)};
    for (int e = 0; e < 4; ++e)
      f[e] = std::is_same_v<Load, F16Load> ? half_to_float(h[e]) : bf16_to_float(h[e]);
  }
}

template <class Load, bool kMomentum>
__device__ __forceinline__ void dgc_one(const void* g, int64_t i, float coef, float m,
                                        bool nesterov, const float* us, const float* vs, float* u,
                                        float* v) {
  if constexpr (kMomentum) {
    float uu = us[i], vv = vs[i];
    dgc_update(coef * Load::load(g, i), m, nesterov, uu, vv);
    u[i] = uu;
    v[i] = vv;
  } else {
    v[i] = dgc_residual(vs[i], coef * Load::load(g, i));
  }
}

/// Vectorised DGC update: groups of four (g, u, v aligned), then the tail one by one.
template <class Load, bool kMomentum, bool kVector>
__global__ void __launch_bounds__(kThreads)
    dgc_kernel(const void* g, int64_t n, float coef, float m, bool nesterov, const float* us,
               const float* vs, float* u, float* v) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t done = 0;
  if constexpr (kVector) {
    const int64_t n4 = n / 4;
    for (int64_t q = tid; q < n4; q += stride) {
      float gf[4];
      load4<Load>(g, q, gf);
      float4 vv = reinterpret_cast<const float4*>(vs)[q];
      if constexpr (kMomentum) {
        float4 uu = reinterpret_cast<const float4*>(us)[q];
        dgc_update(coef * gf[0], m, nesterov, uu.x, vv.x);
        dgc_update(coef * gf[1], m, nesterov, uu.y, vv.y);
        dgc_update(coef * gf[2], m, nesterov, uu.z, vv.z);
        dgc_update(coef * gf[3], m, nesterov, uu.w, vv.w);
        reinterpret_cast<float4*>(u)[q] = uu;
      } else {
        vv.x = dgc_residual(vv.x, coef * gf[0]);
        vv.y = dgc_residual(vv.y, coef * gf[1]);
        vv.z = dgc_residual(vv.z, coef * gf[2]);
        vv.w = dgc_residual(vv.w, coef * gf[3]);
      }
      reinterpret_cast<float4*>(v)[q] = vv;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride)
    dgc_one<Load, kMomentum>(g, i, coef, m, nesterov, us, vs, u, v);
}

/// Stores x as value j in the value dtype; returns what a receiver decodes from it.
template <DType VT>
__device__ __forceinline__ float store_value(void* values, int64_t j, float v,
                                             const ValueShare* share = nullptr) {
  const float x = share ? value_share(v, share->divisor, share->limit) : value_to_send(v, VT);
  if constexpr (VT == DType::kFloat32) {
    static_cast<float*>(values)[j] = x;
    return x;
  } else if constexpr (VT == DType::kFloat16) {
    const uint16_t h = float_to_half(x);
    static_cast<uint16_t*>(values)[j] = h;
    return half_to_float(h);
  } else {
    const uint16_t h = float_to_bf16(x);
    static_cast<uint16_t*>(values)[j] = h;
    return bf16_to_float(h);
  }
}

template <DType VT>
__global__ void __launch_bounds__(kThreads)
    gather_clear_kernel(float* v, float* u, const uint32_t* idx, int64_t k, void* values,
                        bool shared, ValueShare share) {
  const ValueShare* sh = shared ? &share : nullptr;
  const float divisor = shared ? share.divisor : 1.0f;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint32_t i = idx[j];
    v[i] = residual_after_send(v[i], store_value<VT>(values, j, v[i], sh), divisor);
    if (u) u[i] = 0.0f;
  }
}

template <DType VT>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const float* v, const uint32_t* idx, int64_t k, void* values) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kThreads)
    store_value<VT>(values, j, plus_zero(v[idx[j]]));
}

__global__ void __launch_bounds__(kThreads)
    randomk_kernel(int64_t n, int64_t k, RngKey key, uint32_t* out, const uint32_t* ranges,
                   int64_t nr) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kThreads)
    out[j] = randomk_position(static_cast<uint64_t>(j), static_cast<uint64_t>(k),
                              static_cast<uint64_t>(n), key, ranges, nr);
}

template <class Load>
__global__ void __launch_bounds__(kThreads)
    scatter_add_kernel(const uint32_t* idx, const void* values, int64_t k, float scale,
                       float* dense) {
  // indices are distinct (validated by the decoder), so no two threads write the same element
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kThreads)
    dense[idx[j]] += scale * Load::load(values, j);
}

__global__ void __launch_bounds__(kThreads)
    check_indices_kernel(const uint32_t* idx, int64_t k, uint64_t n, unsigned long long* bad) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint32_t i = idx[j];
    if (i >= n || (j > 0 && i <= idx[j - 1])) {
      atomicMin(bad, static_cast<unsigned long long>(j));
      break;
    }
  }
}

/// Bitmap encode without atomics: the first index of each byte (indices ascending) builds the
/// whole byte and stores it, so no word outside the ceil(n/8) bytes is touched and any alignment
/// of the section works.
__global__ void __launch_bounds__(kThreads)
    bitmap_encode_kernel(const uint32_t* idx, int64_t k, uint64_t n, uint8_t* bitmap) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint32_t b = idx[j] >> 3;
    if (j > 0 && (idx[j - 1] >> 3) == b) continue;  // not the first index of its byte
    uint32_t byte = 0;
    for (int64_t t = j; t < k && (idx[t] >> 3) == b; ++t)
      if (idx[t] < n) byte |= 1u << (idx[t] & 7u);
    if (static_cast<uint64_t>(b) * 8 < n) bitmap[b] = static_cast<uint8_t>(byte);
  }
}

/// Valid bits of bitmap byte `byte` (bits at positions >= n masked off).
__device__ __forceinline__ uint32_t bitmap_byte(const uint8_t* bm, int64_t byte, int64_t nb,
                                                int64_t n) {
  if (byte >= nb) return 0;
  uint32_t b = bm[byte];
  const int64_t first = byte * 8;
  if (first + 8 > n) b &= (1u << (n - first)) - 1u;  // n - first in [1, 7]
  return b;
}

__global__ void __launch_bounds__(kThreads)
    bitmap_count_kernel(const uint8_t* bm, int64_t nb, int64_t n, uint64_t* blk, uint32_t* bad) {
  using Reduce = cub::BlockReduce<uint64_t, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t start =
      static_cast<int64_t>(blockIdx.x) * kBmChunk + int64_t{threadIdx.x} * kBmItems;
  uint64_t c = 0;
  for (int t = 0; t < kBmItems; ++t) c += __popc(bitmap_byte(bm, start + t, nb, n));
  const int64_t last = nb - 1;
  if ((n & 7) != 0 && start <= last && last < start + kBmItems && (bm[last] >> (n & 7)) != 0)
    *bad = 1u;  // a bit at a position >= n
  const uint64_t total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) blk[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads)
    bitmap_write_kernel(const uint8_t* bm, int64_t nb, int64_t n, const uint64_t* incl,
                        uint64_t cap, uint32_t* idx) {
  using Scan = cub::BlockScan<uint64_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t start =
      static_cast<int64_t>(blockIdx.x) * kBmChunk + int64_t{threadIdx.x} * kBmItems;
  uint64_t c = 0;
  for (int t = 0; t < kBmItems; ++t) c += __popc(bitmap_byte(bm, start + t, nb, n));
  uint64_t off;
  Scan(tmp).ExclusiveSum(c, off);
  uint64_t p = (blockIdx.x > 0 ? incl[blockIdx.x - 1] : 0) + off;
  for (int t = 0; t < kBmItems; ++t) {
    uint32_t bits = bitmap_byte(bm, start + t, nb, n);
    while (bits != 0) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1u;
      if (p < cap) idx[p] = static_cast<uint32_t>((start + t) * 8 + b);
      ++p;
    }
  }
}

template <class F>
void by_value_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      f(std::integral_constant<DType, DType::kFloat32>{});
      return;
    case DType::kFloat16:
      f(std::integral_constant<DType, DType::kFloat16>{});
      return;
    case DType::kBFloat16:
      f(std::integral_constant<DType, DType::kBFloat16>{});
      return;
  }
  GC_CHECK_ARG(false, "unsupported value dtype code ", int(t));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

// ------------------------------------------------------------------------------------------------
// Entry points.

int64_t first_nonfinite(const void* g, DType t, int64_t n, SelectWorkspace& ws, void* stream) {
  if (n <= 0) return -1;
  const cudaStream_t s = as_stream(stream);
  bind(ws, stream);
  auto* best = ws.c.get<unsigned long long>(1);
  GC_CUDA_CHECK(cudaMemsetAsync(best, 0xff, sizeof(unsigned long long), s));
  if (t == DType::kFloat32 && aligned(g, 16)) {
    first_nonfinite_f32x4_kernel<<<grid_for(n, int64_t{kThreads} * 16, kMaxGrid), kThreads, 0, s>>>(
        static_cast<const float*>(g), n, best);
  } else {
    const int grid = grid_for(n, int64_t{kThreads} * 4, kMaxGrid);
    with_loader(
        t, [&](auto L) { nonfinite_kernel<decltype(L)><<<grid, kThreads, 0, s>>>(g, n, best); });
  }
  GC_CUDA_CHECK_LAUNCH();
  uint64_t* host = pinned_slot(ws);
  GC_CUDA_CHECK(cudaMemcpyAsync(host, best, sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
  GC_CUDA_CHECK(cudaStreamSynchronize(s));
  return host[0] == ~uint64_t{0} ? -1 : static_cast<int64_t>(host[0]);
}

double sum_squares(const void* g, DType t, int64_t n, SelectWorkspace& ws, void* stream) {
  if (n <= 0) return 0.0;
  const cudaStream_t s = as_stream(stream);
  bind(ws, stream);
  // the grid depends only on n, so the summation order (and result) is the same on every GPU
  const int grid = grid_for(n, int64_t{kThreads} * 4, 1024);
  double* partial = ws.c.get<double>(static_cast<size_t>(grid) + 1);
  with_loader(
      t, [&](auto L) { sum_squares_kernel<decltype(L)><<<grid, kThreads, 0, s>>>(g, n, partial); });
  GC_CUDA_CHECK_LAUNCH();
  sum_final_kernel<<<1, kThreads, 0, s>>>(partial, grid, partial + grid);
  GC_CUDA_CHECK_LAUNCH();
  double* host = reinterpret_cast<double*>(pinned_slot(ws));
  GC_CUDA_CHECK(cudaMemcpyAsync(host, partial + grid, sizeof(double), cudaMemcpyDeviceToHost, s));
  GC_CUDA_CHECK(cudaStreamSynchronize(s));
  return host[0];
}

void dgc_accumulate(const void* g, DType t, int64_t n, float coef, float momentum, bool nesterov,
                    float* u, float* v, const float* u_src, const float* v_src, void* stream) {
  if (n <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const float* us = u_src ? u_src : u;
  const float* vs = v_src ? v_src : v;
  const bool vec = aligned(g, 4 * static_cast<size_t>(dtype_size(t))) && aligned(v, 16) &&
                   aligned(vs, 16) && (u == nullptr || (aligned(u, 16) && aligned(us, 16)));
  const int grid = grid_for(vec ? (n + 3) / 4 : n, kThreads, kMaxGrid);
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
    if (u == nullptr) {
      if (vec)
        dgc_kernel<Load, false, true>
            <<<grid, kThreads, 0, s>>>(g, n, coef, momentum, nesterov, us, vs, u, v);
      else
        dgc_kernel<Load, false, false>
            <<<grid, kThreads, 0, s>>>(g, n, coef, momentum, nesterov, us, vs, u, v);
    } else {
      if (vec)
        dgc_kernel<Load, true, true>
            <<<grid, kThreads, 0, s>>>(g, n, coef, momentum, nesterov, us, vs, u, v);
      else
        dgc_kernel<Load, true, false>
            <<<grid, kThreads, 0, s>>>(g, n, coef, momentum, nesterov, us, vs, u, v);
    }
  });
  GC_CUDA_CHECK_LAUNCH();
}

void gather_and_clear(float* v, float* u, const uint32_t* idx, int64_t k, void* values, DType vt,
                      const ValueShare* share, void* stream) {
  if (k <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const int grid = grid_for(k, kThreads, kMaxGrid);
  const ValueShare sh = share ? *share : ValueShare{};  // (by value: a kernel argument)
  by_value_dtype(vt, [&](auto VT) {
    gather_clear_kernel<decltype(VT)::value>
        <<<grid, kThreads, 0, s>>>(v, u, idx, k, values, share != nullptr, sh);
  });
  GC_CUDA_CHECK_LAUNCH();
}

void gather(const float* v, const uint32_t* idx, int64_t k, void* values, DType vt, void* stream) {
  if (k <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const int grid = grid_for(k, kThreads, kMaxGrid);
  by_value_dtype(vt, [&](auto VT) {
    gather_kernel<decltype(VT)::value><<<grid, kThreads, 0, s>>>(v, idx, k, values);
  });
  GC_CUDA_CHECK_LAUNCH();
}

void randomk_indices(int64_t n, int64_t k, const RngKey& key, uint32_t* out, const uint32_t* ranges,
                     int64_t nr, void* stream) {
  if (k <= 0) return;
  GC_CHECK_ARG(k <= n, "random-k: k = ", k, " exceeds n = ", n);
  randomk_kernel<<<grid_for(k, kThreads, kMaxGrid), kThreads, 0, as_stream(stream)>>>(
      n, k, key, out, ranges, nr);
  GC_CUDA_CHECK_LAUNCH();
}

void scatter_add(const uint32_t* idx, const void* values, DType vt, int64_t k, float scale,
                 float* dense, void* stream) {
  if (k <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const int grid = grid_for(k, kThreads, kMaxGrid);
  with_loader(vt, [&](auto L) {
    scatter_add_kernel<decltype(L)><<<grid, kThreads, 0, s>>>(idx, values, k, scale, dense);
  });
  GC_CUDA_CHECK_LAUNCH();
}

void indices_to_bitmap(const uint32_t* idx, int64_t k, int64_t n, uint8_t* bitmap, void* stream) {
  if (n <= 0) return;
  const cudaStream_t s = as_stream(stream);
  GC_CUDA_CHECK(cudaMemsetAsync(bitmap, 0, static_cast<size_t>((n + 7) / 8), s));
  if (k <= 0) return;
  bitmap_encode_kernel<<<grid_for(k, kThreads, kMaxGrid), kThreads, 0, s>>>(
      idx, k, static_cast<uint64_t>(n), bitmap);
  GC_CUDA_CHECK_LAUNCH();
}

int64_t bitmap_to_indices(const uint8_t* bitmap, int64_t n, uint32_t* idx, int64_t cap,
                          SelectWorkspace& ws, void* stream) {
  if (n <= 0) return 0;
  const cudaStream_t s = as_stream(stream);
  bind(ws, stream);
  const int64_t nb = (n + 7) / 8;
  const int64_t blocks = (nb + kBmChunk - 1) / kBmChunk;
  size_t temp_bytes = 0;
  GC_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes,
                                              static_cast<const uint64_t*>(nullptr),
                                              static_cast<uint64_t*>(nullptr), blocks));
  Carve cv;
  const size_t o_bad = cv.take<uint64_t>(1);
  const size_t o_blk = cv.take<uint64_t>(blocks);
  const size_t o_incl = cv.take<uint64_t>(blocks);
  const size_t o_tmp = cv.take<char>(temp_bytes);
  void* base = ws.c.get<char>(cv.bytes());
  auto* bad = at<uint32_t>(base, o_bad);
  uint64_t* blk = at<uint64_t>(base, o_blk);
  uint64_t* incl = at<uint64_t>(base, o_incl);
  GC_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(uint64_t), s));
  const int g = static_cast<int>(blocks);
  bitmap_count_kernel<<<g, kThreads, 0, s>>>(bitmap, nb, n, blk, bad);
  GC_CUDA_CHECK_LAUNCH();
  GC_CUDA_CHECK(
      cub::DeviceScan::InclusiveSum(at<char>(base, o_tmp), temp_bytes, blk, incl, blocks, s));
  bitmap_write_kernel<<<g, kThreads, 0, s>>>(bitmap, nb, n, incl,
                                             static_cast<uint64_t>(std::max<int64_t>(cap, 0)), idx);
  GC_CUDA_CHECK_LAUNCH();
  uint64_t* host = pinned_slot(ws);
  GC_CUDA_CHECK(
      cudaMemcpyAsync(host, incl + (blocks - 1), sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
  GC_CUDA_CHECK(cudaMemcpyAsync(host + 1, bad, sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
  GC_CUDA_CHECK(cudaStreamSynchronize(s));
  if (host[1] != 0) return -1;
  return static_cast<int64_t>(host[0]);
}

int64_t check_indices(const uint32_t* idx, int64_t k, int64_t n, SelectWorkspace& ws,
                      void* stream) {
  if (k <= 0) return -1;
  const cudaStream_t s = as_stream(stream);
  bind(ws, stream);
  auto* bad = ws.c.get<unsigned long long>(1);
  GC_CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof(unsigned long long), s));
  check_indices_kernel<<<grid_for(k, kThreads, kMaxGrid), kThreads, 0, s>>>(
      idx, k, static_cast<uint64_t>(std::max<int64_t>(n, 0)), bad);
  GC_CUDA_CHECK_LAUNCH();
  uint64_t* host = pinned_slot(ws);
  GC_CUDA_CHECK(cudaMemcpyAsync(host, bad, sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
  GC_CUDA_CHECK(cudaStreamSynchronize(s));
  return host[0] == ~uint64_t{0} ? -1 : static_cast<int64_t>(host[0]);
}

}  // namespace gradcomp::kernels::cuda

// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the 1-bit family; the CPU twins are kernels/cpu/onebit_cpu.cpp (scales, quantize,
// decode) and hadamard_cpu.cpp (the rotation), and both call the
// math of kernels/onebit_math.h.
//  - small flat chunks (up to 1024 elements, the hook's 128 among them): one warp per chunk,
//    fp32 terms per lane folded into double and summed by an xor butterfly; aligned fp32 chunks
//    that are multiples of 128 are compressed in one fused pass (compress_warp_kernel).
//  - scales of larger chunks: per-block partial sums (sign modes: fp32 per thread, a group whose
//  total
//    needs_wide_sum summed again in double from norm_term_wide, as the CPU's slices;
//    cub::BlockReduce / cub::WarpReduce, in double), combined in
//    a fixed order by a finalize kernel, so results are deterministic run to run. The first
//    non-finite gradient index is found in the same pass (atomicMin) when asked.
//  - quantize: one pass; fp32 16-byte aligned data goes through float4 loads, one warp per 128
//    elements, four __ballot_sync per warp, bit-interleaved into four words; everything else
//    (fp16/bf16, misaligned, the tail) one warp per 32-element word with one __ballot_sync.
//  - decode: one thread per element, the warp reads its word once (broadcast); the averaging
//    variant sums the P payloads in order in registers before one read-modify-write of dense.
// All work is stream-ordered on the caller's stream; the only synchronisation is the optional
// finiteness check (one 8-byte copy to pinned memory).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cub/cub.cuh>
#include <type_traits>
#include <vector>

#include "core/cuda/check.cuh"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/nonfinite.cuh"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"

namespace gradcomp::kernels::cuda {
namespace {

using namespace onebit;
using cuda_detail::as_stream;

constexpr int64_t kGroupCuda = 8192;  // elements per block of the flat scale pass
constexpr unsigned kFull = 0xffffffffu;

/// Plain-data copy of the geometry for kernels.
struct Geo {
  int64_t n, cols, chunk;
  bool columns;
};
Geo to_geo(const OneBitGeom& g) { return Geo{g.n, g.cols, g.chunk, g.columns}; }

__device__ __forceinline__ void hilo(const Geo& g, const float* scales, int64_t i, float& hi,
                                     float& lo) {
  if (g.columns) {
    const int64_t c = i % g.cols;
    hi = scales[c];
    lo = scales[g.cols + c];
  } else {
    const float s = scales[i / g.chunk];
    hi = s;
    lo = -s;
  }
}

/// The error of element i held by a state: e[i] itself, or (prev != nullptr, a lazy state
/// holding the previous x) lazy_error(e[i], previous hi, previous lo).
__device__ __forceinline__ float state_error(const float* e, const float* prev, const Geo& geo,
                                             int64_t i) {
  const float v = e[i];
  if (prev == nullptr) return v;
  float hi, lo;
  hilo(geo, prev, i, hi, lo);
  return lazy_error(v, hi, lo);
}

template <class Load, bool HasE>
__device__ __forceinline__ float load_x(const void* g, const float* e, const float* prev,
                                        const Geo& geo, int64_t i, bool check,
                                        unsigned long long* bad) {
  const float gv = Load::load(g, i);
  if (check && !is_finite_bits(gv)) atomicMin(bad, static_cast<unsigned long long>(i));
  return HasE ? compensate(gv, state_error(e, prev, geo, i)) : gv;
}

// ---- scales: sign modes -----------------------------------------------------------------------

template <class Load, int N, bool HasE>
__global__ void sign_partial_kernel(const void* g, const float* e, const float* prev, int64_t n,
                                    int64_t chunk, int64_t spc, bool check, unsigned long long* bad,
                                    double* part) {
  const Geo geo{n, 1, chunk, false};
  using BR = cub::BlockReduce<double, kThreads>;
  __shared__ typename BR::TempStorage tmp;
  const int64_t it = blockIdx.x;
  const int64_t k = it / spc, s = it % spc;
  const int64_t ce = min(n, (k + 1) * chunk);
  const int64_t b = k * chunk + s * kGroupCuda, end = min(ce, b + kGroupCuda);
  __shared__ bool wide;
  float acc = 0.0f;
  for (int64_t i = b + threadIdx.x; i < end; i += kThreads)
    acc = add_rn(acc, norm_term<N>(load_x<Load, HasE>(g, e, prev, geo, i, check, bad)));
  double total = BR(tmp).Sum(static_cast<double>(acc));
  if (threadIdx.x == 0) wide = needs_wide_sum<N>(total);
  __syncthreads();  // wide is read by every thread; tmp is reused below
  if (wide) {       // rare (block-uniform): the group again in double, as the CPU twin's slices
    double dacc = 0.0;
    for (int64_t i = b + threadIdx.x; i < end; i += kThreads)
      dacc = add_rn_d(dacc, norm_term_wide<N>(load_x<Load, HasE>(g, e, prev, geo, i, false, bad)));
    total = BR(tmp).Sum(dacc);
  }
  if (threadIdx.x == 0) part[it] = total;
}

/// One warp per chunk: lanes stride over the chunk's partials, then a warp reduction.
template <int N>
__global__ void sign_finalize_kernel(const double* part, int64_t K, int64_t spc, int64_t n,
                                     int64_t chunk, float* scales) {
  using WR = cub::WarpReduce<double>;
  __shared__ typename WR::TempStorage tmp[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + warp;
  if (k >= K) return;  // whole warps leave together
  double acc = 0.0;
  for (int64_t s = lane; s < spc; s += 32) acc += part[k * spc + s];
  const double sum = WR(tmp[warp]).Sum(acc);
  if (lane == 0) {
    const int64_t len = min(n, (k + 1) * chunk) - k * chunk;
    scales[k] = N == kL1 ? l1_scale(sum, len) : l2_scale(sum, len);
  }
}

/// Spreads the 8 low bits of b to bits 0, 4, 8, ..., 28.
__device__ __forceinline__ uint32_t spread4(uint32_t b) {
  b &= 0xffu;
  b = (b | (b << 12)) & 0x000f000fu;
  b = (b | (b << 6)) & 0x03030303u;
  b = (b | (b << 3)) & 0x11111111u;
  return b;
}

// ---- small chunks: one warp per chunk
// ------------------------------------------------------------ A block-wide reduction per chunk
// (sign_partial_kernel) leaves most of a 256-thread block idle on the hook's 128-element chunks and
// pays a block reduction and a finalize launch for 128 elements; up to kWarpChunkMax elements, one
// warp per chunk with a shuffle reduction instead.

constexpr int64_t kWarpChunkMax = 1024;

/// Sum over the warp in double by an xor butterfly: at every stage each lane adds the same two
/// operands as its partner (in the other order; addition commutes), so every lane ends with the
/// same total, and the total does not depend on the launch.
__device__ __forceinline__ double warp_sum(double v) {
  for (int m = 16; m > 0; m >>= 1) v = add_rn_d(v, __shfl_xor_sync(kFull, v, m));
  return v;
}

/// Sign-mode scales of chunks of at most kWarpChunkMax elements (any dtype and alignment): warp
/// per chunk, lanes stride through it, fp32 terms per lane folded into double, the chunk redone
/// in double when needs_wide_sum says so (as sign_partial_kernel does per group).
template <class Load, int N, bool HasE>
__global__ void sign_warp_kernel(const void* g, const float* e, const float* prev, int64_t n,
                                 int64_t chunk, int64_t K, bool check, unsigned long long* bad,
                                 float* scales) {
  const Geo geo{n, 1, chunk, false};
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t k = warp; k < K; k += nwarps) {
    const int64_t b = k * chunk, end = min(n, b + chunk);
    float acc = 0.0f;
    for (int64_t i = b + lane; i < end; i += 32)
      acc = add_rn(acc, norm_term<N>(load_x<Load, HasE>(g, e, prev, geo, i, check, bad)));
    double total = warp_sum(static_cast<double>(acc));
    if (needs_wide_sum<N>(total)) {  // warp-uniform: every lane holds the same total
      double d = 0.0;
      for (int64_t i = b + lane; i < end; i += 32)
        d = add_rn_d(d, norm_term_wide<N>(load_x<Load, HasE>(g, e, prev, geo, i, false, bad)));
      total = warp_sum(d);
    }
    if (lane == 0) scales[k] = N == kL1 ? l1_scale(total, end - b) : l2_scale(total, end - b);
  }
}

/// The one-pass compress of fp32, 16-byte aligned data in full chunks of S = 128 G elements
/// (G <= 8): one warp per chunk holds the chunk's x = g + e in registers (G float4 per lane),
/// reduces its scale, packs its bits (the word layout of quantize_vec4_kernel) and stores x as the
/// lazy state, so a step reads g and the state once and writes the state and the payload once.
/// No finiteness check here: the caller checks g first (see onebit_compress).
template <int N, bool HasE, int G>
__global__ void compress_warp_kernel(const float* g, const float* e, const float* prev,
                                     float* st_out, int64_t K, float* scales, uint32_t* bits) {
  constexpr int64_t S = 128 * G;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const auto* g4 = reinterpret_cast<const float4*>(g);
  const auto* e4 = reinterpret_cast<const float4*>(e);
  for (int64_t k = warp; k < K; k += nwarps) {
    float4 x[G];
    float acc = 0.0f;
    const float ps = HasE && prev ? prev[k] : 0.0f;
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t q = (k * S + j * 128) / 4 + lane;
      float4 v = g4[q];
      if (HasE) {
        float4 ev = e4[q];
        if (prev) {
          ev.x = lazy_error(ev.x, ps, -ps);
          ev.y = lazy_error(ev.y, ps, -ps);
          ev.z = lazy_error(ev.z, ps, -ps);
          ev.w = lazy_error(ev.w, ps, -ps);
        }
        v.x = compensate(v.x, ev.x);
        v.y = compensate(v.y, ev.y);
        v.z = compensate(v.z, ev.z);
        v.w = compensate(v.w, ev.w);
      }
      x[j] = v;
      acc = add_rn(acc, norm_term<N>(v.x));
      acc = add_rn(acc, norm_term<N>(v.y));
      acc = add_rn(acc, norm_term<N>(v.z));
      acc = add_rn(acc, norm_term<N>(v.w));
    }
    double total = warp_sum(static_cast<double>(acc));
    if (needs_wide_sum<N>(total)) {  // warp-uniform
      double d = 0.0;
#pragma unroll
      for (int j = 0; j < G; ++j) {
        d = add_rn_d(d, norm_term_wide<N>(x[j].x));
        d = add_rn_d(d, norm_term_wide<N>(x[j].y));
        d = add_rn_d(d, norm_term_wide<N>(x[j].z));
        d = add_rn_d(d, norm_term_wide<N>(x[j].w));
      }
      total = warp_sum(d);
    }
    if (lane == 0) scales[k] = N == kL1 ? l1_scale(total, S) : l2_scale(total, S);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const uint32_t v0 = __ballot_sync(kFull, sign_bit(x[j].x));
      const uint32_t v1 = __ballot_sync(kFull, sign_bit(x[j].y));
      const uint32_t v2 = __ballot_sync(kFull, sign_bit(x[j].z));
      const uint32_t v3 = __ballot_sync(kFull, sign_bit(x[j].w));
      if (lane < 4) {
        const int sh = 8 * lane;
        bits[(k * G + j) * 4 + lane] = spread4(v0 >> sh) | (spread4(v1 >> sh) << 1) |
                                       (spread4(v2 >> sh) << 2) | (spread4(v3 >> sh) << 3);
      }
      if (st_out) reinterpret_cast<float4*>(st_out)[(k * S + j * 128) / 4 + lane] = x[j];
    }
  }
}

// ---- scales: column means ---------------------------------------------------------------------

/// Few columns (C < 32): block (slab, column) walks its rows; three block reductions.
template <class Load, bool HasE>
__global__ void column_narrow_kernel(const void* g, const float* e, const float* prev, int64_t R,
                                     int64_t C, int64_t nslab, bool check, unsigned long long* bad,
                                     double* part) {
  const Geo geo{R * C, C, 32, true};
  using BR = cub::BlockReduce<double, kThreads>;
  __shared__ typename BR::TempStorage tmp;
  const int64_t slab = blockIdx.x, c = blockIdx.y;
  const int64_t r0 = R * slab / nslab, r1 = R * (slab + 1) / nslab;
  float sp = 0.0f, sn = 0.0f;
  int cp = 0;
  for (int64_t r = r0 + threadIdx.x; r < r1; r += kThreads) {
    const float x = load_x<Load, HasE>(g, e, prev, geo, r * C + c, check, bad);
    const bool p = sign_bit(x);
    sp += p ? x : 0.0f;
    sn += p ? 0.0f : x;
    cp += p ? 1 : 0;
  }
  const double tsp = BR(tmp).Sum(static_cast<double>(sp));
  __syncthreads();
  const double tcp = BR(tmp).Sum(static_cast<double>(cp));
  __syncthreads();
  const double tsn = BR(tmp).Sum(static_cast<double>(sn));
  if (threadIdx.x == 0) {
    double* out = part + 3 * slab * C;
    out[c] = tsp;
    out[C + c] = tcp;
    out[2 * C + c] = tsn;
  }
}

/// Many columns (C >= 32): block (32 columns) x (8 row lanes) over a slab of rows, coalesced
/// along the row; the 8 row lanes are combined in a fixed order through shared memory.
template <class Load, bool HasE>
__global__ void column_tiled_kernel(const void* g, const float* e, const float* prev, int64_t R,
                                    int64_t C, int64_t nslab, bool check, unsigned long long* bad,
                                    double* part) {
  const Geo geo{R * C, C, 32, true};
  __shared__ double s_sp[8][32], s_sn[8][32], s_cp[8][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + tx;
  const int64_t slab = blockIdx.y;
  const int64_t r0 = R * slab / nslab, r1 = R * (slab + 1) / nslab;
  float sp = 0.0f, sn = 0.0f;
  int cp = 0;
  if (c < C) {
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      const float x = load_x<Load, HasE>(g, e, prev, geo, r * C + c, check, bad);
      const bool p = sign_bit(x);
      sp += p ? x : 0.0f;
      sn += p ? 0.0f : x;
      cp += p ? 1 : 0;
    }
  }
  s_sp[ty][tx] = sp;
  s_sn[ty][tx] = sn;
  s_cp[ty][tx] = cp;
  __syncthreads();
  if (ty == 0 && c < C) {
    double a = 0, b = 0, d = 0;
    for (int y = 0; y < 8; ++y) {
      a += s_sp[y][tx];
      b += s_cp[y][tx];
      d += s_sn[y][tx];
    }
    double* out = part + 3 * slab * C;
    out[c] = a;
    out[C + c] = b;
    out[2 * C + c] = d;
  }
}

__global__ void column_finalize_kernel(const double* part, int64_t R, int64_t C, int64_t nslab,
                                       float* scales) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double sp = 0, cp = 0, sn = 0;
  for (int64_t s = 0; s < nslab; ++s) {
    const double* p = part + 3 * s * C;
    sp += p[c];
    cp += p[C + c];
    sn += p[2 * C + c];
  }
  scales[c] = mean_or_zero(sp, cp);
  scales[C + c] = mean_or_zero(sn, static_cast<double>(R) - cp);
}

// ---- quantize ---------------------------------------------------------------------------------

/// fp32, 16-byte aligned: one warp per group of 128 elements (4 words), float4 per lane.
/// Lane l holds elements 4l..4l+3; ballot j has bit l = sign of element 4l + j, so word k
/// (elements 32k..32k+31, lanes 8k..8k+7) interleaves byte k of the four ballots.
/// prev != nullptr: e_in is a lazy state (see state_error). store_x: e_out = x (the lazy state of
/// the one-pass compress) instead of the error update x - decode (scales unused then).
__global__ void quantize_vec4_kernel(const float* g, const float* e_in, const float* prev,
                                     float* e_out, bool store_x, Geo geo, const float* scales,
                                     uint32_t* bits, int64_t groups) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t grp = warp; grp < groups; grp += nwarps) {
    const int64_t i0 = grp * 128 + 4 * lane;
    float4 x = reinterpret_cast<const float4*>(g)[i0 / 4];
    if (e_in) {
      float4 ev = reinterpret_cast<const float4*>(e_in)[i0 / 4];
      if (prev) {
        float hi, lo;
        hilo(geo, prev, i0, hi, lo);
        ev.x = lazy_error(ev.x, hi, lo);
        hilo(geo, prev, i0 + 1, hi, lo);
        ev.y = lazy_error(ev.y, hi, lo);
        hilo(geo, prev, i0 + 2, hi, lo);
        ev.z = lazy_error(ev.z, hi, lo);
        hilo(geo, prev, i0 + 3, hi, lo);
        ev.w = lazy_error(ev.w, hi, lo);
      }
      x.x = compensate(x.x, ev.x);
      x.y = compensate(x.y, ev.y);
      x.z = compensate(x.z, ev.z);
      x.w = compensate(x.w, ev.w);
    }
    const bool b0 = sign_bit(x.x), b1 = sign_bit(x.y), b2 = sign_bit(x.z), b3 = sign_bit(x.w);
    const uint32_t v0 = __ballot_sync(kFull, b0), v1 = __ballot_sync(kFull, b1);
    const uint32_t v2 = __ballot_sync(kFull, b2), v3 = __ballot_sync(kFull, b3);
    if (lane < 4) {
      const int sh = 8 * lane;
      bits[grp * 4 + lane] = spread4(v0 >> sh) | (spread4(v1 >> sh) << 1) |
                             (spread4(v2 >> sh) << 2) | (spread4(v3 >> sh) << 3);
    }
    if (e_out && store_x) {
      reinterpret_cast<float4*>(e_out)[i0 / 4] = x;
    } else if (e_out) {
      float4 d;
      if (geo.columns) {
        int64_t c = i0 % geo.cols;
        float hi = scales[c], lo = scales[geo.cols + c];
        d.x = error_update(x.x, reconstruct(b0, hi, lo));
        if (++c == geo.cols) c = 0;
        hi = scales[c];
        lo = scales[geo.cols + c];
        d.y = error_update(x.y, reconstruct(b1, hi, lo));
        if (++c == geo.cols) c = 0;
        hi = scales[c];
        lo = scales[geo.cols + c];
        d.z = error_update(x.z, reconstruct(b2, hi, lo));
        if (++c == geo.cols) c = 0;
        hi = scales[c];
        lo = scales[geo.cols + c];
        d.w = error_update(x.w, reconstruct(b3, hi, lo));
      } else {  // 4 consecutive elements lie in one word, hence in one chunk
        const float s = scales[i0 / geo.chunk];
        d.x = error_update(x.x, reconstruct(b0, s, -s));
        d.y = error_update(x.y, reconstruct(b1, s, -s));
        d.z = error_update(x.z, reconstruct(b2, s, -s));
        d.w = error_update(x.w, reconstruct(b3, s, -s));
      }
      reinterpret_cast<float4*>(e_out)[i0 / 4] = d;
    }
  }
}

/// Any dtype / alignment: one warp per 32-element word, one ballot.
template <class Load>
__global__ void quantize_word_kernel(const void* g, const float* e_in, const float* prev,
                                     float* e_out, bool store_x, Geo geo, const float* scales,
                                     uint32_t* bits, int64_t w_begin, int64_t w_end) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t w = w_begin + warp; w < w_end; w += nwarps) {
    const int64_t i = 32 * w + lane;
    const bool valid = i < geo.n;
    float x = 0.0f;
    if (valid) {
      const float gv = Load::load(g, i);
      x = e_in ? compensate(gv, state_error(e_in, prev, geo, i)) : gv;
    }
    const bool b = valid && sign_bit(x);
    const uint32_t word = __ballot_sync(kFull, b);
    if (lane == 0) bits[w] = word;
    if (valid && e_out && store_x) {
      e_out[i] = x;
    } else if (valid && e_out) {
      float hi, lo;
      hilo(geo, scales, i, hi, lo);
      e_out[i] = error_update(x, reconstruct(b, hi, lo));
    }
  }
}

/// Materializes a lazy state in place: x = lazy_error(x, hi, lo).
__global__ void finalize_error_kernel(float* x, Geo geo, const float* scales) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < geo.n;
       i += stride) {
    float hi, lo;
    hilo(geo, scales, i, hi, lo);
    x[i] = lazy_error(x[i], hi, lo);
  }
}

// ---- decode -----------------------------------------------------------------------------------

__global__ void decode_kernel(const uint32_t* const* bits_arr, const float* const* scales_arr,
                              const uint32_t* bits0, const float* scales0, int count, Geo geo,
                              float scale, bool accumulate, float* dense) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < geo.n;
       i += stride) {
    const int64_t w = word_index(i);
    const uint32_t pos = bit_position(i);
    float acc = 0.0f;
    for (int p = 0; p < count; ++p) {
      const uint32_t* bits = bits_arr ? bits_arr[p] : bits0;
      const float* sc = scales_arr ? scales_arr[p] : scales0;
      float hi, lo;
      hilo(geo, sc, i, hi, lo);
      acc = add_rn(acc, reconstruct(get_bit(bits[w], pos), hi, lo));
    }
    const float d0 = accumulate ? dense[i] : 0.0f;
    float r = decode_store(d0, scale, acc, accumulate);
    if (!is_finite_bits(r)) {  // rare: redone wide (decode_wide), as the CPU twin does
      double sum = 0.0;
      for (int p = 0; p < count; ++p) {
        const uint32_t* bits = bits_arr ? bits_arr[p] : bits0;
        const float* sc = scales_arr ? scales_arr[p] : scales0;
        float hi, lo;
        hilo(geo, sc, i, hi, lo);
        sum = add_rn_d(sum, static_cast<double>(reconstruct(get_bit(bits[w], pos), hi, lo)));
      }
      r = decode_wide(d0, scale, sum, accumulate);
    }
    dense[i] = r;
  }
}

// ---- host helpers -----------------------------------------------------------------------------

constexpr int64_t kGridCap = int64_t{1} << 20;  // the 1-bit kernels' grid-stride cap

/// Calls f(integral_constant<int, norm>, bool_constant<has_e>) for the sign modes' runtime norm
/// (kL1 or kL2) and whether an error state is read: the kernels take both as template arguments.
template <class F>
void with_norm_e(int norm, bool has_e, F&& f) {
  using L1 = std::integral_constant<int, kL1>;
  using L2 = std::integral_constant<int, kL2>;
  if (norm == kL1)
    has_e ? f(L1{}, std::true_type{}) : f(L1{}, std::false_type{});
  else
    has_e ? f(L2{}, std::true_type{}) : f(L2{}, std::false_type{});
}

/// Reads back the index in `bad` (one synchronisation); -1 when none.
int64_t read_bad(const unsigned long long* bad, OneBitWorkspace& ws, cudaStream_t s) {
  if (!ws.pinned) ws.pinned = gradcomp::cuda::malloc_host(sizeof(unsigned long long));
  GC_CUDA_CHECK(
      cudaMemcpyAsync(ws.pinned, bad, sizeof(unsigned long long), cudaMemcpyDeviceToHost, s));
  GC_CUDA_CHECK(cudaStreamSynchronize(s));
  const unsigned long long v = *static_cast<unsigned long long*>(ws.pinned);
  return v == ULLONG_MAX ? -1 : static_cast<int64_t>(v);
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

/// The scale pass of x = g + state_error(e, prev) (prev == nullptr: e is the error itself).
static int64_t scales_impl(const void* g, DType t, const float* e, const float* prev,
                           const OneBitGeom& geo, int norm, bool check_finite, float* scales,
                           OneBitWorkspace& ws, void* stream) {
  if (geo.n == 0) return -1;
  cudaStream_t s = as_stream(stream);
  ws.partials.set_stream(stream);
  ws.aux.set_stream(stream);
  unsigned long long* bad = nullptr;
  if (check_finite) {
    bad = ws.aux.get<unsigned long long>(1);
    GC_CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof(unsigned long long), s));
  }
  const int64_t n = geo.n;
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
    if (geo.columns) {
      const int64_t C = geo.cols, R = n / C;
      const bool narrow = C < 32;
      const int64_t nslab =
          narrow ? std::clamp<int64_t>(R / 4096, 1, 1024) : std::clamp<int64_t>(R / 64, 1, 1024);
      double* part = ws.partials.get<double>(static_cast<size_t>(3 * nslab * C));
      if (narrow) {
        const dim3 grid(static_cast<unsigned>(nslab), static_cast<unsigned>(C));
        if (e)
          column_narrow_kernel<Load, true>
              <<<grid, kThreads, 0, s>>>(g, e, prev, R, C, nslab, check_finite, bad, part);
        else
          column_narrow_kernel<Load, false>
              <<<grid, kThreads, 0, s>>>(g, e, prev, R, C, nslab, check_finite, bad, part);
      } else {
        const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(nslab));
        const dim3 block(32, 8);
        if (e)
          column_tiled_kernel<Load, true>
              <<<grid, block, 0, s>>>(g, e, prev, R, C, nslab, check_finite, bad, part);
        else
          column_tiled_kernel<Load, false>
              <<<grid, block, 0, s>>>(g, e, prev, R, C, nslab, check_finite, bad, part);
      }
      GC_CUDA_CHECK_LAUNCH();
      column_finalize_kernel<<<static_cast<unsigned>((C + 127) / 128), 128, 0, s>>>(part, R, C,
                                                                                    nslab, scales);
      GC_CUDA_CHECK_LAUNCH();
      return;
    }
    const int64_t S = geo.chunk, K = geo.num_scales();
    if (S <= kWarpChunkMax) {
      const unsigned wgrid = grid_for(K, kThreads / 32, kGridCap);
      with_norm_e(norm, e != nullptr, [&](auto Nc, auto HasEc) {
        sign_warp_kernel<Load, decltype(Nc)::value, decltype(HasEc)::value>
            <<<wgrid, kThreads, 0, s>>>(g, e, prev, n, S, K, check_finite, bad, scales);
      });
      GC_CUDA_CHECK_LAUNCH();
      return;
    }
    const int64_t spc = (std::min(S, n) + kGroupCuda - 1) / kGroupCuda;
    const int64_t items = K * spc;
    GC_CHECK(items < (int64_t{1} << 31), "too many scale blocks: ", items);
    double* part = ws.partials.get<double>(static_cast<size_t>(items));
    const unsigned grid = static_cast<unsigned>(items);
    with_norm_e(norm, e != nullptr, [&](auto Nc, auto HasEc) {
      sign_partial_kernel<Load, decltype(Nc)::value, decltype(HasEc)::value>
          <<<grid, kThreads, 0, s>>>(g, e, prev, n, S, spc, check_finite, bad, part);
    });
    GC_CUDA_CHECK_LAUNCH();
    const unsigned fgrid = static_cast<unsigned>((K + kThreads / 32 - 1) / (kThreads / 32));
    if (norm == kL1)
      sign_finalize_kernel<kL1><<<fgrid, kThreads, 0, s>>>(part, K, spc, n, S, scales);
    else
      sign_finalize_kernel<kL2><<<fgrid, kThreads, 0, s>>>(part, K, spc, n, S, scales);
    GC_CUDA_CHECK_LAUNCH();
  });
  return check_finite ? read_bad(bad, ws, s) : -1;
}

/// The bits pass: x = g + state_error(e_in, prev); bits; e_out = x (store_x) or x - decode.
static void quantize_impl(const void* g, DType t, const float* e_in, const float* prev,
                          float* e_out, bool store_x, const OneBitGeom& geo, const float* scales,
                          uint32_t* bits, void* stream) {
  if (geo.n == 0) return;
  cudaStream_t s = as_stream(stream);
  const Geo gg = to_geo(geo);
  const int64_t W = geo.num_words();
  int64_t w_begin = 0;
  if (t == DType::kFloat32 && aligned16(g) && aligned16(e_in) && aligned16(e_out)) {
    const int64_t groups = geo.n / 128;
    if (groups > 0) {
      quantize_vec4_kernel<<<grid_for(groups, kThreads / 32, kGridCap), kThreads, 0, s>>>(
          static_cast<const float*>(g), e_in, prev, e_out, store_x, gg, scales, bits, groups);
      GC_CUDA_CHECK_LAUNCH();
    }
    w_begin = 4 * groups;
  }
  if (w_begin < W) {
    with_loader(t, [&](auto L) {
      quantize_word_kernel<decltype(L)>
          <<<grid_for(W - w_begin, kThreads / 32, kGridCap), kThreads, 0, s>>>(
              g, e_in, prev, e_out, store_x, gg, scales, bits, w_begin, W);
    });
    GC_CUDA_CHECK_LAUNCH();
  }
}

int64_t onebit_scales(const void* g, DType t, const float* e, const OneBitGeom& geo, int norm,
                      bool check_finite, float* scales, OneBitWorkspace& ws, void* stream) {
  return scales_impl(g, t, e, nullptr, geo, norm, check_finite, scales, ws, stream);
}

void onebit_quantize(const void* g, DType t, const float* e_in, float* e_out, const OneBitGeom& geo,
                     const float* scales, uint32_t* bits, void* stream) {
  quantize_impl(g, t, e_in, nullptr, e_out, false, geo, scales, bits, stream);
}

namespace {
template <int N, bool HasE>
void launch_compress_warp(int G, unsigned grid, cudaStream_t s, const float* g, const float* e,
                          const float* prev, float* st_out, int64_t K, float* scales,
                          uint32_t* bits) {
  switch (G) {
#define GC_ONEBIT_G(GG)                                                  \
  case GG:                                                               \
    compress_warp_kernel<N, HasE, GG>                                    \
        <<<grid, kThreads, 0, s>>>(g, e, prev, st_out, K, scales, bits); \
    break;
    GC_ONEBIT_G(1)
    GC_ONEBIT_G(2)
    GC_ONEBIT_G(3)
    GC_ONEBIT_G(4)
    GC_ONEBIT_G(5)
    GC_ONEBIT_G(6)
    GC_ONEBIT_G(7)
    GC_ONEBIT_G(8)
#undef GC_ONEBIT_G
    default:
      GC_CHECK(false, "onebit: no fused kernel for ", G, " groups of 128");
  }
  GC_CUDA_CHECK_LAUNCH();
}
}  // namespace

int64_t onebit_compress(const void* g, DType t, const float* state_in, const float* prev_scales,
                        float* state_out, const OneBitGeom& geo, int norm, bool check_finite,
                        float* scales, uint32_t* bits, OneBitWorkspace& ws, void* stream) {
  if (geo.n == 0) return -1;
  const float* prev = state_in ? prev_scales : nullptr;
  const int64_t S = geo.chunk;
  if (!geo.columns && t == DType::kFloat32 && S % 128 == 0 && S <= kWarpChunkMax && aligned16(g) &&
      aligned16(state_in) && aligned16(state_out)) {
    // Small chunks, fp32, aligned: full chunks in one fused pass (compress_warp_kernel), the
    // partial last chunk through the two kernels. The fused pass writes the state as it goes, so
    // a finiteness check runs first, over g alone (4n bytes read), and a rejected call writes
    // nothing, also in place.
    cudaStream_t s = as_stream(stream);
    const auto* gf = static_cast<const float*>(g);
    if (check_finite) {
      ws.aux.set_stream(stream);
      auto* bad = ws.aux.get<unsigned long long>(1);
      GC_CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof(unsigned long long), s));
      first_nonfinite_f32x4_kernel<<<grid_for(geo.n, int64_t{kThreads} * 4), kThreads, 0, s>>>(
          gf, geo.n, bad);
      GC_CUDA_CHECK_LAUNCH();
      const int64_t b = read_bad(bad, ws, s);
      if (b >= 0) return b;
    }
    const int64_t K = geo.n / S, tail = geo.n - K * S;
    if (K > 0) {
      const int G = static_cast<int>(S / 128);
      const unsigned grid = grid_for(K, kThreads / 32, kGridCap);
      if (norm == kL1)
        state_in ? launch_compress_warp<kL1, true>(G, grid, s, gf, state_in, prev, state_out, K,
                                                   scales, bits)
                 : launch_compress_warp<kL1, false>(G, grid, s, gf, nullptr, nullptr, nullptr, K,
                                                    scales, bits);
      else
        state_in ? launch_compress_warp<kL2, true>(G, grid, s, gf, state_in, prev, state_out, K,
                                                   scales, bits)
                 : launch_compress_warp<kL2, false>(G, grid, s, gf, nullptr, nullptr, nullptr, K,
                                                    scales, bits);
    }
    if (tail > 0) {  // the last chunk: a geometry of its own, offset by whole chunks and words
      const int64_t off = K * S;
      OneBitGeom tg = geo;
      tg.n = tail;
      scales_impl(gf + off, t, state_in ? state_in + off : nullptr, prev ? prev + K : nullptr, tg,
                  norm, false, scales + K, ws, stream);
      quantize_impl(gf + off, t, state_in ? state_in + off : nullptr, prev ? prev + K : nullptr,
                    state_out ? state_out + off : nullptr, true, tg, scales + K, bits + off / 32,
                    stream);
    }
    return -1;
  }
  // The scale pass reads the bad index back (when checking) before anything is written.
  const int64_t bad =
      scales_impl(g, t, state_in, prev, geo, norm, check_finite, scales, ws, stream);
  if (bad >= 0) return bad;
  quantize_impl(g, t, state_in, prev, state_out, true, geo, scales, bits, stream);
  return -1;
}

void onebit_finalize_error(float* x, const OneBitGeom& geo, const float* scales, void* stream) {
  if (geo.n == 0) return;
  finalize_error_kernel<<<grid_for(geo.n, kThreads, kGridCap), kThreads, 0, as_stream(stream)>>>(
      x, to_geo(geo), scales);
  GC_CUDA_CHECK_LAUNCH();
}

namespace {
/// dense = [dense +] scale * decode(bits, scales): onebit_decode_average's one-payload case,
/// without staging a pointer array.
void decode_one(const uint32_t* bits, const float* scales, const OneBitGeom& geo, float scale,
                bool accumulate, float* dense, void* stream) {
  if (geo.n == 0) return;
  decode_kernel<<<grid_for(geo.n, kThreads, kGridCap), kThreads, 0, as_stream(stream)>>>(
      nullptr, nullptr, bits, scales, 1, to_geo(geo), scale, accumulate, dense);
  GC_CUDA_CHECK_LAUNCH();
}
}  // namespace

void onebit_decode_average(const uint32_t* const* bits, const float* const* scales, int count,
                           const OneBitGeom& geo, float scale, bool accumulate, float* dense,
                           OneBitWorkspace& ws, void* stream) {
  if (geo.n == 0 || count <= 0) return;
  if (count == 1) {
    decode_one(bits[0], scales[0], geo, scale, accumulate, dense, stream);
    return;
  }
  cudaStream_t s = as_stream(stream);
  ws.ptrs.set_stream(stream);
  std::vector<const void*> host(2 * static_cast<size_t>(count));
  for (int p = 0; p < count; ++p) {
    host[p] = bits[p];
    host[count + p] = scales[p];
  }
  const void** dev = ws.ptrs.get<const void*>(host.size());
  // pageable source: the call returns after the source was staged, so `host` may go away
  GC_CUDA_CHECK(
      cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice, s));
  decode_kernel<<<grid_for(geo.n, kThreads, kGridCap), kThreads, 0, s>>>(
      reinterpret_cast<const uint32_t* const*>(dev),
      reinterpret_cast<const float* const*>(dev + count), nullptr, nullptr, count, to_geo(geo),
      scale, accumulate, dense);
  GC_CUDA_CHECK_LAUNCH();
}

namespace {
/// One thread block per S-element block (grid-stride over blocks): the block is staged in shared
/// memory and transformed stage by stage, each butterfly (j, j + h) by one thread, the same
/// operations as the CPU twin's loops.
__global__ void hadamard_kernel(float* x, int64_t nblocks, int64_t S, int64_t first_block,
                                bool inverse, float r) {
  extern __shared__ float v[];
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    float* xb = x + b * S;
    const int64_t base = (first_block + b) * S;
    for (int64_t j = threadIdx.x; j < S; j += blockDim.x)
      v[j] = inverse ? xb[j] : onebit::mul_rn(xb[j], onebit::rotation_sign(base + j));
    __syncthreads();
    for (int64_t h = 1; h < S; h <<= 1) {
      for (int64_t p = threadIdx.x; p < S / 2; p += blockDim.x) {
        const int64_t j = (p / h) * 2 * h + p % h;
        onebit::butterfly(v[j], v[j + h]);
      }
      __syncthreads();
    }
    for (int64_t j = threadIdx.x; j < S; j += blockDim.x) {
      const float t = onebit::mul_rn(v[j], r);
      xb[j] = inverse ? onebit::mul_rn(t, onebit::rotation_sign(base + j)) : t;
    }
    __syncthreads();  // v is reused by the next block of this thread block
  }
}
}  // namespace

void hadamard_rotate(float* x, int64_t nblocks, int64_t S, int64_t first_block, bool inverse,
                     void* stream) {
  if (nblocks <= 0) return;
  const int threads = static_cast<int>(std::clamp<int64_t>(S / 2, 32, kThreads));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(nblocks, int64_t{1} << 20));
  hadamard_kernel<<<grid, threads, static_cast<size_t>(S) * sizeof(float), as_stream(stream)>>>(
      x, nblocks, S, first_block, inverse, onebit::rotation_norm(S));
  GC_CUDA_CHECK_LAUNCH();
}

}  // namespace gradcomp::kernels::cuda

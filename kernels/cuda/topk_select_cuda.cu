// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the top-k family. Same contracts as the CPU twins in kernels/cpu/topk_cpu.cpp.
//
// Exact selection is a radix select on the 31 magnitude bits in the style of AIR top-k (Zhang et
// al., SC'23): three digit levels ([30:20], [19:9], [8:0]); each level is one pass that builds a
// per-block shared-memory histogram and adds it to a global one, and a one-block kernel that finds
// the digit holding the k-th largest magnitude and what is left to take from it, on the device
// (no host round trip between passes). The second pass also writes the members of the first
// level's bucket to a list (when it is small enough), so the third pass reads only those. An
// ordered compaction then writes the result ascending: per-block counts of |x| > T and |x| == T,
// a CUB scan over the blocks, and a write pass that keeps the first `need` ties in index order.
// The result is identical to the CPU's and the selection itself never synchronises the host.
//
// Sampled selection follows the CPU step by step (same strided sample and RNG offset, same
// threshold rank, same retry rule), so its result equals the CPU's too; each attempt reads its
// candidate count back once (pinned memory, one synchronisation per attempt). Few candidates are
// appended unordered in one read and their positions sorted; more go through the ordered
// compaction. Over x itself (no candidate list, 16-byte aligned) the compaction reads float4.
//
// Compiled with --fmad=false like the rest of the family (cmake/topk.cmake).
#include "kernels/cuda/topk_common.cuh"

namespace gradcomp::kernels::cuda {
namespace {

using namespace topk_detail;
using cuda_detail::as_stream;

// ------------------------------------------------------------------------------------------------
// Radix select on a "source": element i of x, or element list[i] of x when a candidate list is
// given (ascending, so positions in the source order like indices in x).

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

struct Src {
  const float* x;
  const uint32_t* list;  // null: the identity
  uint32_t m;            // elements in the source
  __device__ __forceinline__ uint32_t pos(int64_t i) const {
    return list ? list[i] : static_cast<uint32_t>(i);
  }
  __device__ __forceinline__ uint32_t bits(int64_t i) const { return abs_bits(x[pos(i)]); }
};

/// Device-side state of one radix select; written by the digit-search kernel, read by the passes.
struct RadixState {
  uint32_t prefix;     // known high bits of T (the k-th largest magnitude); all 31 at the end
  uint32_t need;       // elements still to take from the bucket `prefix` (ties to take at the end)
  uint32_t in_bucket;  // elements in the bucket `prefix`
  uint32_t filtered;   // 1 when pass 1 writes the level-0 bucket's positions to the filter list
  uint32_t nfilt;      // length of the filter list
};

/// Histogram pass of level L. L = 0: digit a >> 20 of all elements. L = 1: digit (a >> 9) & 2047
/// of the bucket (a >> 20) == prefix, also appending its positions to `filt` when filtered.
/// L = 2: digit a & 511 of the bucket (a >> 9) == prefix, read from `filt` when filtered.
template <int L>
__global__ void __launch_bounds__(kThreads)
    radix_hist_kernel(Src src, RadixState* st, uint32_t* hist, uint32_t* filt) {
  __shared__ uint32_t sh[kBins];
  for (int d = threadIdx.x; d < kBins; d += kThreads) sh[d] = 0;
  __syncthreads();
  const int64_t m = src.m;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  if constexpr (L == 0) {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < m; i += stride)
      atomicAdd(&sh[src.bits(i) >> 20], 1u);
  } else if constexpr (L == 1) {
    const uint32_t p = st->prefix;
    const bool filter = st->filtered != 0;
    const unsigned lane = threadIdx.x & 31u;
    // block-uniform loop so that whole warps take part in the ballot
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < m; base += stride) {
      const int64_t i = base + threadIdx.x;
      bool hit = false;
      uint32_t a = 0;
      if (i < m) {
        a = src.bits(i);
        hit = (a >> 20) == p;
      }
      if (hit) atomicAdd(&sh[(a >> 9) & (kBins - 1)], 1u);
      if (filter) {
        const unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (mask != 0) {
          const int leader = __ffs(mask) - 1;
          uint32_t slot = 0;
          if (lane == static_cast<unsigned>(leader)) slot = atomicAdd(&st->nfilt, __popc(mask));
          slot = __shfl_sync(0xffffffffu, slot, leader);
          if (hit) filt[slot + __popc(mask & ((1u << lane) - 1u))] = static_cast<uint32_t>(i);
        }
      }
    }
  } else {
    const uint32_t p = st->prefix;
    if (st->filtered != 0) {
      const int64_t nf = st->nfilt;
      for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < nf;
           j += stride) {
        const uint32_t a = src.bits(filt[j]);
        if ((a >> 9) == p) atomicAdd(&sh[a & 511u], 1u);
      }
    } else {
      for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < m;
           i += stride) {
        const uint32_t a = src.bits(i);
        if ((a >> 9) == p) atomicAdd(&sh[a & 511u], 1u);
      }
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kBins; d += kThreads)
    if (sh[d] != 0) atomicAdd(&hist[d], sh[d]);
}

/// Digit search of level L (one block): walks the histogram from the top digit down to the digit
/// d where the running count reaches `need`, then narrows the state to that bucket.
template <int L>
__global__ void __launch_bounds__(kThreads)
    radix_choose_kernel(const uint32_t* hist, RadixState* st, uint32_t k, uint32_t filter_cap) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const uint32_t need = L == 0 ? k : st->need;
  uint32_t cnt[kScanItems], incl[kScanItems];
  // rank r = t * kScanItems + j counts from the top digit: digit kBins - 1 - r
  for (int j = 0; j < kScanItems; ++j) cnt[j] = hist[kBins - 1 - (threadIdx.x * kScanItems + j)];
  Scan(tmp).InclusiveSum(cnt, incl);
  __syncthreads();  // every thread has read st->need before the one writer below changes it
  for (int j = 0; j < kScanItems; ++j) {
    const uint32_t excl = incl[j] - cnt[j];
    if (excl < need && need <= incl[j]) {  // exactly one digit satisfies this
      const uint32_t d = kBins - 1 - (threadIdx.x * kScanItems + j);
      constexpr int dbits = L == 2 ? 9 : 11;
      st->prefix = L == 0 ? d : ((st->prefix << dbits) | d);
      st->need = need - excl;
      st->in_bucket = cnt[j];
      if (L == 0) st->filtered = cnt[j] <= filter_cap ? 1u : 0u;
    }
  }
}

/// Per-block counts over chunk b of kChunk elements, packed as (above << 32) | ties.
/// kTies: above = |x| > T, ties = |x| == T. Otherwise: above = |x| >= T, ties = 0.
template <bool kTies>
__global__ void __launch_bounds__(kThreads)
    block_count_kernel(Src src, const uint32_t* thr, uint64_t* blk) {
  using Reduce = cub::BlockReduce<uint64_t, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const uint32_t t = *thr;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = imin(begin + kChunk, static_cast<int64_t>(src.m));
  uint64_t c = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const uint32_t a = src.bits(i);
    if (kTies)
      c += (static_cast<uint64_t>(a > t) << 32) | static_cast<uint64_t>(a == t);
    else
      c += static_cast<uint64_t>(a >= t) << 32;
  }
  const uint64_t total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) blk[blockIdx.x] = total;
}

/// Where chunk blockIdx.x of an ordered write starts: the elements above T and the ties before it
/// (from the inclusive scan of the packed block counts), the ties wanted, and whether the chunk
/// has nothing to write (no element above T, and no tie that is still wanted).
struct ChunkStart {
  uint64_t above, ties, need;
  bool skip;
};
template <bool kTies>
__device__ __forceinline__ ChunkStart chunk_start(const uint32_t* need_ptr, const uint64_t* incl) {
  constexpr uint64_t kLow = 0xffffffffull;
  ChunkStart c{};
  if constexpr (kTies) c.need = *need_ptr;
  const uint64_t before = blockIdx.x > 0 ? incl[blockIdx.x - 1] : 0;
  const uint64_t mine = incl[blockIdx.x] - before;
  c.above = before >> 32;
  c.ties = before & kLow;
  c.skip = (mine >> 32) == 0 && (!kTies || (mine & kLow) == 0 || c.ties >= c.need);
  return c;
}

/// Ordered write over the chunks: element i is kept when it is above, or a tie among the first
/// `need` ties in index order; it goes to position (above before i) + min(ties before i, need),
/// when that is below `cap`. `incl` is the inclusive scan of the block counts.
template <bool kTies>
__global__ void __launch_bounds__(kThreads)
    ordered_write_kernel(Src src, const uint32_t* thr, const uint32_t* need_ptr,
                         const uint64_t* incl, uint64_t cap, uint32_t* out) {
  using Scan = cub::BlockScan<uint64_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  constexpr uint64_t kLow = 0xffffffffull;
  const uint32_t t = *thr;
  const ChunkStart cs = chunk_start<kTies>(need_ptr, incl);
  if (cs.skip) return;
  const uint64_t need = cs.need;
  uint64_t above = cs.above, ties = cs.ties;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = imin(begin + kChunk, static_cast<int64_t>(src.m));
  for (int64_t base = begin; base < end; base += kThreads) {  // block-uniform loop
    const int64_t i = base + threadIdx.x;
    bool ab = false, eq = false;
    if (i < end) {
      const uint32_t a = src.bits(i);
      if (kTies) {
        ab = a > t;
        eq = a == t;
      } else {
        ab = a >= t;
      }
    }
    const uint64_t flag = (static_cast<uint64_t>(ab) << 32) | static_cast<uint64_t>(eq);
    uint64_t excl, agg;
    Scan(tmp).ExclusiveSum(flag, excl, agg);
    const uint64_t a_before = above + (excl >> 32), t_before = ties + (excl & kLow);
    if constexpr (kTies) {
      if (ab || (eq && t_before < need)) {
        const uint64_t p = a_before + (t_before < need ? t_before : need);
        if (p < cap) out[p] = src.pos(i);
      }
    } else {
      if (ab && a_before < cap) out[a_before] = src.pos(i);
    }
    above += agg >> 32;
    ties += agg & kLow;
    __syncthreads();  // tmp is reused by the next tile
  }
}

/// The counts of block_count_kernel over x itself (no list), x 16-byte aligned: float4 loads.
template <bool kTies>
__global__ void __launch_bounds__(kThreads)
    block_count_vec_kernel(const float* x, int64_t m, const uint32_t* thr, uint64_t* blk) {
  using Reduce = cub::BlockReduce<uint64_t, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const uint32_t t = *thr;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = imin(begin + kChunk, m);
  auto one = [t](uint32_t a) -> uint64_t {
    return kTies ? (static_cast<uint64_t>(a > t) << 32) | static_cast<uint64_t>(a == t)
                 : static_cast<uint64_t>(a >= t) << 32;
  };
  uint64_t c = 0;
  for (int64_t i = begin + 4 * threadIdx.x; i < end; i += 4 * kThreads) {
    if (i + 4 <= end) {
      const float4 v = reinterpret_cast<const float4*>(x)[i / 4];
      c += one(abs_bits(v.x)) + one(abs_bits(v.y)) + one(abs_bits(v.z)) + one(abs_bits(v.w));
    } else {
      for (int64_t j = i; j < end; ++j) c += one(abs_bits(x[j]));
    }
  }
  const uint64_t total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) blk[blockIdx.x] = total;
}

/// ordered_write_kernel over x itself (no list), x 16-byte aligned: tiles of 4 kThreads elements,
/// four consecutive elements per thread (one float4); a thread's place in the tile is a warp
/// scan of its (above, tie) counts, packed 16 + 16 bits (at most 1024 each per tile), plus the
/// totals of the warps before it, instead of a block-wide 64-bit scan per kThreads elements.
template <bool kTies>
__global__ void __launch_bounds__(kThreads)
    ordered_write_vec_kernel(const float* x, int64_t m, const uint32_t* thr,
                             const uint32_t* need_ptr, const uint64_t* incl, uint64_t cap,
                             uint32_t* out) {
  __shared__ uint32_t wt[kThreads / 32];
  const uint32_t t = *thr;
  const ChunkStart cs = chunk_start<kTies>(need_ptr, incl);
  if (cs.skip) return;
  const uint64_t need = cs.need;
  uint64_t above = cs.above, ties = cs.ties;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = imin(begin + kChunk, m);
  for (int64_t base = begin; base < end; base += 4 * kThreads) {  // block-uniform loop
    const int64_t i0 = base + 4 * threadIdx.x;
    uint32_t a[4] = {0, 0, 0, 0};
    bool valid[4];
    if (i0 + 4 <= end) {
      const float4 v = reinterpret_cast<const float4*>(x)[i0 / 4];
      a[0] = abs_bits(v.x);
      a[1] = abs_bits(v.y);
      a[2] = abs_bits(v.z);
      a[3] = abs_bits(v.w);
#pragma unroll
      for (int c = 0; c < 4; ++c) valid[c] = true;
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        valid[c] = i0 + c < end;
        if (valid[c]) a[c] = abs_bits(x[i0 + c]);
      }
    }
    bool ab[4], eq[4];
    uint32_t na = 0, ne = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      ab[c] = valid[c] && (kTies ? a[c] > t : a[c] >= t);
      eq[c] = kTies && valid[c] && a[c] == t;
      na += ab[c];
      ne += eq[c];
    }
    const uint32_t p = (na << 16) | ne;
    uint32_t inc = p;
    for (int d = 1; d < 32; d <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += y;
    }
    if (lane == 31) wt[warp] = inc;
    __syncthreads();
    uint32_t woff = 0, tot = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      const uint32_t v = wt[w];
      if (w < warp) woff += v;
      tot += v;
    }
    const uint32_t ex = woff + inc - p;
    uint64_t a_before = above + (ex >> 16), t_before = ties + (ex & 0xffffu);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (kTies) {
        if (ab[c] || (eq[c] && t_before < need)) {
          const uint64_t q = a_before + (t_before < need ? t_before : need);
          if (q < cap) out[q] = static_cast<uint32_t>(i0 + c);
        }
      } else {
        if (ab[c] && a_before < cap) out[a_before] = static_cast<uint32_t>(i0 + c);
      }
      a_before += ab[c];
      t_before += eq[c];
    }
    above += tot >> 16;
    ties += tot & 0xffffu;
    __syncthreads();  // wt is rewritten by the next tile
  }
}

/// Scratch of one ordered compaction over `m` source elements.
struct CompactLayout {
  size_t blk, incl, temp;
  size_t temp_bytes = 0;
  int64_t blocks = 0;
  void plan(Carve& cv, int64_t m) {
    blocks = std::max<int64_t>(1, (m + kChunk - 1) / kChunk);
    GC_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes,
                                                static_cast<const uint64_t*>(nullptr),
                                                static_cast<uint64_t*>(nullptr), blocks));
    blk = cv.take<uint64_t>(blocks);
    incl = cv.take<uint64_t>(blocks);
    temp = cv.take<char>(temp_bytes);
  }
};

/// Count, scan, write. The packed total (above << 32 | ties) ends at incl[blocks - 1].
template <bool kTies>
void ordered_compact(const Src& src, const uint32_t* thr, const uint32_t* need, uint64_t cap,
                     uint32_t* out, const CompactLayout& L, void* base, cudaStream_t s) {
  const int g = static_cast<int>(L.blocks);
  uint64_t* blk = at<uint64_t>(base, L.blk);
  uint64_t* incl = at<uint64_t>(base, L.incl);
  const bool vec = src.list == nullptr && reinterpret_cast<uintptr_t>(src.x) % 16 == 0;
  if (vec)
    block_count_vec_kernel<kTies><<<g, kThreads, 0, s>>>(src.x, src.m, thr, blk);
  else
    block_count_kernel<kTies><<<g, kThreads, 0, s>>>(src, thr, blk);
  GC_CUDA_CHECK_LAUNCH();
  size_t tb = L.temp_bytes;
  GC_CUDA_CHECK(cub::DeviceScan::InclusiveSum(at<char>(base, L.temp), tb, blk, incl, L.blocks, s));
  if (vec)
    ordered_write_vec_kernel<kTies><<<g, kThreads, 0, s>>>(src.x, src.m, thr, need, incl, cap, out);
  else
    ordered_write_kernel<kTies><<<g, kThreads, 0, s>>>(src, thr, need, incl, cap, out);
  GC_CUDA_CHECK_LAUNCH();
}

/// Exact top-k of the source (1 <= k < m) into out, ascending, ties by lowest position. Uses ws.a.
/// No host synchronisation.
void radix_select(const Src& src, int64_t k, uint32_t* out, SelectWorkspace& ws, cudaStream_t s) {
  const int64_t m = src.m;
  // the level-0 bucket is written to a list for the last pass when it has at most this many
  const int64_t filter_cap = std::min<int64_t>(m, std::max<int64_t>(m / 16, 1 << 14));
  Carve cv;
  const size_t o_state = cv.take<RadixState>(1);
  const size_t o_hist = cv.take<uint32_t>(3 * kBins);
  const size_t zero_bytes = cv.bytes();  // state and histograms start at zero
  CompactLayout cl;
  cl.plan(cv, m);
  const size_t o_filt = cv.take<uint32_t>(static_cast<size_t>(filter_cap));
  void* base = ws.a.get<char>(cv.bytes());
  auto* st = at<RadixState>(base, o_state);
  uint32_t* hist = at<uint32_t>(base, o_hist);
  uint32_t* filt = at<uint32_t>(base, o_filt);
  GC_CUDA_CHECK(cudaMemsetAsync(base, 0, zero_bytes, s));

  const int g = grid_for(m, int64_t{kThreads} * 8, int64_t{sm_count()} * 8);
  const uint32_t kk = static_cast<uint32_t>(k), fc = static_cast<uint32_t>(filter_cap);
  radix_hist_kernel<0><<<g, kThreads, 0, s>>>(src, st, hist, filt);
  GC_CUDA_CHECK_LAUNCH();
  radix_choose_kernel<0><<<1, kThreads, 0, s>>>(hist, st, kk, fc);
  GC_CUDA_CHECK_LAUNCH();
  radix_hist_kernel<1><<<g, kThreads, 0, s>>>(src, st, hist + kBins, filt);
  GC_CUDA_CHECK_LAUNCH();
  radix_choose_kernel<1><<<1, kThreads, 0, s>>>(hist + kBins, st, kk, fc);
  GC_CUDA_CHECK_LAUNCH();
  radix_hist_kernel<2><<<g, kThreads, 0, s>>>(src, st, hist + 2 * kBins, filt);
  GC_CUDA_CHECK_LAUNCH();
  radix_choose_kernel<2><<<1, kThreads, 0, s>>>(hist + 2 * kBins, st, kk, fc);
  GC_CUDA_CHECK_LAUNCH();
  // now st->prefix = T (all 31 bits) and st->need = ties at T to take, the lowest-index ones
  ordered_compact<true>(src, &st->prefix, &st->need, static_cast<uint64_t>(k), out, cl, base, s);
}

// ------------------------------------------------------------------------------------------------
// Sampled selection.

constexpr int64_t kSampleBlock = 16;  // contiguous elements per sample position (as on the CPU)

/// Sample element j: element j % kSampleBlock of the run at offset + (j / kSampleBlock) * stride.
__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* x, int64_t s, int64_t offset, int64_t stride, uint32_t* out) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < s;
       j += static_cast<int64_t>(gridDim.x) * kThreads)
    out[j] = abs_bits(x[offset + (j / kSampleBlock) * stride + (j % kSampleBlock)]);
}

/// Appends the positions i with |x[i]| >= *thr (magnitude bits) to out, in no particular order,
/// the first `cap` of them, and counts them all in *count: one read of x (float4 when x is 16-byte
/// aligned), one atomic per warp that finds any. The sampled select sorts the (few) positions
/// afterwards, which costs less than the ordered compaction's count pass and second read.
__global__ void __launch_bounds__(kThreads)
    append_above_kernel(const float* x, int64_t n, const uint32_t* thr, uint64_t cap, uint32_t* out,
                        unsigned long long* count) {
  const uint32_t t = *thr;
  const int lane = threadIdx.x & 31;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t n4 = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? n / 4 : 0;
  // block-uniform loop so that whole warps take part in the votes and shuffles
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < n4; base += stride) {
    const int64_t q = base + threadIdx.x;
    unsigned hits = 0;  // bit c: element 4 q + c
    if (q < n4) {
      const float4 v = reinterpret_cast<const float4*>(x)[q];
      hits = static_cast<unsigned>(abs_bits(v.x) >= t) |
             (static_cast<unsigned>(abs_bits(v.y) >= t) << 1) |
             (static_cast<unsigned>(abs_bits(v.z) >= t) << 2) |
             (static_cast<unsigned>(abs_bits(v.w) >= t) << 3);
    }
    const int c = __popc(hits);
    if (__any_sync(0xffffffffu, c != 0)) {
      int incl = c;  // inclusive scan of the lanes' counts
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      unsigned long long slot = 0;
      if (lane == 31) slot = atomicAdd(count, static_cast<unsigned long long>(incl));
      slot = __shfl_sync(0xffffffffu, slot, 31);
      uint64_t p = slot + static_cast<uint64_t>(incl - c);
      for (int e = 0; e < 4; ++e)
        if ((hits >> e) & 1u) {
          if (p < cap) out[p] = static_cast<uint32_t>(4 * q + e);
          ++p;
        }
    }
  }
  for (int64_t i = 4 * n4 + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride)
    if (abs_bits(x[i]) >= t) {
      const unsigned long long p = atomicAdd(count, 1ull);
      if (p < cap) out[p] = static_cast<uint32_t>(i);
    }
}

__global__ void __launch_bounds__(kThreads) iota_kernel(uint32_t* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    out[i] = static_cast<uint32_t>(i);
}

int64_t sampled_select(const float* x, int64_t n, int64_t k, const SelectOptions& opt,
                       const RngKey& key, uint32_t* out, SelectWorkspace& ws, cudaStream_t s) {
  // Identical arithmetic to the CPU twin (sizes, sample positions, ranks, retry rule).
  const int64_t ss = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(opt.sample_rate * n)));
  const Src full{x, nullptr, static_cast<uint32_t>(n)};
  if (n < 4096 || ss < 64 || 2 * ss > n) {
    radix_select(full, k, out, ws, s);
    return k;
  }
  // runs of kSampleBlock elements at a constant stride from a random offset, as on the CPU
  const int64_t blocks = (ss + kSampleBlock - 1) / kSampleBlock;
  const int64_t stride = n / blocks;  // >= 2 * kSampleBlock since 2 ss <= n
  const int64_t offset =
      static_cast<int64_t>(key.below(0, static_cast<uint64_t>(stride - kSampleBlock + 1)));
  const int64_t s_used = blocks * kSampleBlock;
  double want = opt.oversample * static_cast<double>(k);
  const int64_t min_ok = static_cast<int64_t>(std::ceil(opt.min_fraction * static_cast<double>(k)));
  const int64_t cap = std::max<int64_t>(2 * k, static_cast<int64_t>(opt.oversample * 2 * k)) + 64;

  // Candidates: for few (cap at most n / 128, densities up to about 0.3%), one read appending
  // them unordered and a sort of the positions; for more, the ordered compaction (two reads, no
  // sort): on an H200 the append and sort of 1.25% of 110M elements cost 0.14 ms more than the
  // ordered compaction had, while at 0.1% they saved 0.29 ms.
  const bool append = cap * 128 <= n;
  // candidate positions are sorted on their significant bits only
  int pos_bits = 1;
  while (pos_bits < 32 && (int64_t{1} << pos_bits) < n) ++pos_bits;
  size_t sort_bytes = 0, cand_sort_bytes = 0;
  GC_CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(
      nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      s_used, 0, 31));
  GC_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, cand_sort_bytes,
                                               static_cast<const uint32_t*>(nullptr),
                                               static_cast<uint32_t*>(nullptr), cap, 0, pos_bits));
  Carve cv;
  const size_t o_count = cv.take<unsigned long long>(1);
  const size_t o_in = cv.take<uint32_t>(s_used);
  const size_t o_sorted = cv.take<uint32_t>(s_used);
  const size_t o_sort_tmp = cv.take<char>(std::max(sort_bytes, cand_sort_bytes));
  const size_t o_raw = cv.take<uint32_t>(static_cast<size_t>(cap));
  const size_t o_cand = cv.take<uint32_t>(static_cast<size_t>(cap));
  CompactLayout cl;
  cl.plan(cv, n);
  void* base = ws.b.get<char>(cv.bytes());
  auto* total = at<unsigned long long>(base, o_count);
  uint32_t* sample = at<uint32_t>(base, o_in);
  uint32_t* sorted = at<uint32_t>(base, o_sorted);
  uint32_t* raw = at<uint32_t>(base, o_raw);
  uint32_t* cand = at<uint32_t>(base, o_cand);

  sample_kernel<<<grid_for(s_used, kThreads, kMaxGrid), kThreads, 0, s>>>(x, s_used, offset, stride,
                                                                          sample);
  GC_CUDA_CHECK_LAUNCH();
  GC_CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(at<char>(base, o_sort_tmp), sort_bytes,
                                                         sample, sorted, s_used, 0, 31, s));
  uint64_t* host = pinned_slot(ws);
  for (int attempt = 0; attempt <= opt.max_retries; ++attempt) {
    int64_t r = static_cast<int64_t>(
        std::ceil(want * static_cast<double>(s_used) / static_cast<double>(n)));
    if (r > s_used) break;  // the sample cannot place a threshold that low: be exact
    r = std::max<int64_t>(r, 1);
    // threshold = the r-th largest sampled magnitude, read on the device
    int64_t count = 0;
    if (append) {
      GC_CUDA_CHECK(cudaMemsetAsync(total, 0, sizeof(unsigned long long), s));
      append_above_kernel<<<grid_for(n, int64_t{kThreads} * 16, int64_t{sm_count()} * 16), kThreads,
                            0, s>>>(x, n, sorted + (r - 1), static_cast<uint64_t>(cap), raw, total);
      GC_CUDA_CHECK_LAUNCH();
      GC_CUDA_CHECK(cudaMemcpyAsync(host, total, sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
      GC_CUDA_CHECK(cudaStreamSynchronize(s));
      count = static_cast<int64_t>(host[0]);
      if (count > cap) break;  // heavy ties (e.g. constant input): exact selection handles them
      if (count >= min_ok && count > 0) {  // ascending positions, as the ordered compaction gives
        size_t tb = std::max(sort_bytes, cand_sort_bytes);
        GC_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(at<char>(base, o_sort_tmp), tb, raw, cand,
                                                     count, 0, pos_bits, s));
      }
    } else {
      ordered_compact<false>(full, sorted + (r - 1), nullptr, static_cast<uint64_t>(cap), cand, cl,
                             base, s);
      const uint64_t* incl_last = at<uint64_t>(base, cl.incl) + (cl.blocks - 1);
      GC_CUDA_CHECK(cudaMemcpyAsync(host, incl_last, sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
      GC_CUDA_CHECK(cudaStreamSynchronize(s));
      count = static_cast<int64_t>(host[0] >> 32);
      if (count > cap) break;  // heavy ties (e.g. constant input): exact selection handles them
    }
    if (count >= k) {
      if (count == k) {
        GC_CUDA_CHECK(
            cudaMemcpyAsync(out, cand, static_cast<size_t>(k) * 4, cudaMemcpyDeviceToDevice, s));
      } else {
        radix_select(Src{x, cand, static_cast<uint32_t>(count)}, k, out, ws, s);
      }
      return k;
    }
    if (count >= min_ok) {
      if (count > 0)
        GC_CUDA_CHECK(cudaMemcpyAsync(out, cand, static_cast<size_t>(count) * 4,
                                      cudaMemcpyDeviceToDevice, s));
      return count;
    }
    // too few: aim lower, in proportion to the shortfall
    want *= 1.5 * static_cast<double>(k) / static_cast<double>(std::max<int64_t>(count, 1));
  }
  radix_select(full, k, out, ws, s);
  return k;
}

}  // namespace

int64_t select(const float* x, int64_t n, int64_t k, const SelectOptions& opt, const RngKey& key,
               uint32_t* out, SelectWorkspace& ws, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (k <= 0 || n == 0) return 0;
  GC_CHECK_ARG(n < (int64_t{1} << 32), "top-k selection: ", n,
               " elements do not fit uint32 indices");
  if (k >= n) {
    iota_kernel<<<grid_for(n, kThreads, kMaxGrid), kThreads, 0, s>>>(out, n);
    GC_CUDA_CHECK_LAUNCH();
    return n;
  }
  bind(ws, stream);
  if (opt.method == SelectMethod::kExact) {
    radix_select(Src{x, nullptr, static_cast<uint32_t>(n)}, k, out, ws, s);
    return k;
  }
  return sampled_select(x, n, k, opt, key, out, ws, s);
}

}  // namespace gradcomp::kernels::cuda

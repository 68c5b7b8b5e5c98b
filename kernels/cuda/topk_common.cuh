// SPDX-License-Identifier: Apache-2.0
// What the top-k family's CUDA files share (topk_select_cuda.cu: the selections;
// topk_cuda.cu: the DGC update, random-k and the index codecs): launch sizes, the workspace's
// carving and pinned slot. Internal to kernels/cuda.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <type_traits>

#include "core/cuda/check.cuh"
#include "gradcomp/detail/numeric.hpp"
#include "kernels/cuda/launch.cuh"
#include "kernels/topk_kernels.hpp"
#include "kernels/topk_math.h"

namespace gradcomp::kernels::cuda::topk_detail {

using cuda_detail::as_stream;

constexpr int kItems = 16;                    // elements per thread in the ordered passes
constexpr int kChunk = kThreads * kItems;     // elements per block in the ordered passes
constexpr int kBins = 2048;                   // 11-bit digits
constexpr int kScanItems = kBins / kThreads;  // digits per thread in the digit search
constexpr int kBmItems = 16;                  // bitmap bytes per thread
constexpr int kBmChunk = kThreads * kBmItems;

static_assert(kScanItems * kThreads == kBins, "digit search covers all bins");

// ------------------------------------------------------------------------------------------------
// Host helpers: workspace carving, pinned slot, launch sizes.

/// Lays out several arrays in one Buffer (256-byte aligned), so one grow-only get() serves a call.
class Carve {
 public:
  template <class T>
  size_t take(size_t n) {
    const size_t o = off_;
    off_ = (off_ + n * sizeof(T) + 255) / 256 * 256;
    return o;
  }
  size_t bytes() const { return off_ > 0 ? off_ : 256; }

 private:
  size_t off_ = 0;
};

template <class T>
inline T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

inline void bind(SelectWorkspace& ws, void* stream) {
  ws.a.set_stream(stream);
  ws.b.set_stream(stream);
  ws.c.set_stream(stream);
  ws.d.set_stream(stream);
}

/// The workspace's pinned host slot (8 x uint64), allocated on first use.
inline uint64_t* pinned_slot(SelectWorkspace& ws) {
  if (ws.pinned == nullptr) ws.pinned = gradcomp::cuda::malloc_host(64);
  return static_cast<uint64_t*>(ws.pinned);
}

inline int sm_count() {
  int dev = 0, sms = 0;
  GC_CUDA_CHECK(cudaGetDevice(&dev));
  GC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return std::max(sms, 1);
}

}  // namespace gradcomp::kernels::cuda::topk_detail

// SPDX-License-Identifier: Apache-2.0
// Backend entry points of the top-k family (kernels/entry.hpp). compressors/ and plans/ call the
// dispatch with the data's execution context; kernels/cpu implements `cpu::`, kernels/cuda
// `cuda::`. Every CUDA entry point but the index-section codecs has a CPU twin with the same
// contract; the CUDA tests compare them.
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/rng.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/entry.hpp"
#include "kernels/scan_kernels.hpp"

namespace gradcomp::kernels {

/// Scratch memory reused by the selection across calls (grow-only; no steady-state allocation).
struct SelectWorkspace {
  explicit SelectWorkspace(Device dev = Device::kCPU) : a(dev), b(dev), c(dev), d(dev) {}
  std::vector<std::vector<uint32_t>> local_sel, local_cand;  // CPU: per-thread lists
  std::vector<uint32_t> host_bits;                           // CPU: candidate keys
  Buffer a, b, c, d;                                         // backend-specific scratch
  void* pinned = nullptr;                                    // CUDA: pinned count slot
  ~SelectWorkspace();
};

/// Values sent as shares of a sum over ranks (value_share in topk_math.h): each divided by
/// `divisor` and saturated to `limit`.
struct ValueShare {
  float divisor = 1.0f;
  float limit = 0.0f;
};

/// Indices (ascending) of the selected elements of x by |x|; returns how many (<= k). See
/// gradcomp::SelectOptions for the contract of each method.
GC_KERNEL_ENTRY_R(int64_t, select, "top-k selection on a CUDA tensor",
                  (const float* x, int64_t n, int64_t k, const SelectOptions& opt,
                   const RngKey& key, uint32_t* out, SelectWorkspace& ws),
                  (x, n, k, opt, key, out, ws))
// first_nonfinite(g, t, n): kernels/scan_kernels.hpp
/// Sum of squares in double. ws: the CUDA twin's scratch.
GC_KERNEL_ENTRY_CUDA_EXTRA(double, sum_squares, "norm of a CUDA tensor",
                           (const void* g, DType t, int64_t n), (g, t, n), (SelectWorkspace & ws),
                           (ws))
/// u, v <- DGC update with g * coef (u may be null when momentum == 0). With u_src / v_src the
/// update reads the old values there and writes the new ones to u / v (a step whose state change
/// can still be dropped: same traffic as in place); null: in place.
GC_KERNEL_ENTRY(dgc_accumulate, "DGC accumulation on a CUDA tensor",
                (const void* g, DType t, int64_t n, float coef, float momentum, bool nesterov,
                 float* u, float* v, const float* u_src, const float* v_src),
                (g, t, n, coef, momentum, nesterov, u, v, u_src, v_src))
/// values[j] = v[idx[j]] (converted to vt); then v[idx] = 0 and, if u, u[idx] = 0. With a share
/// (not null): values[j] = value_share(v[idx[j]], divisor, limit), and v[idx] keeps
/// v - divisor * values[j].
GC_KERNEL_ENTRY(gather_and_clear, "top-k gather on a CUDA tensor",
                (float* v, float* u, const uint32_t* idx, int64_t k, void* values, DType vt,
                 const ValueShare* share),
                (v, u, idx, k, values, vt, share))
/// values[j] = v[idx[j]] (converted to vt; -0 sent as +0, as 0 + v would be), v unchanged: the
/// gather of a selection made on the gradient itself (no error feedback, no momentum, no clip).
GC_KERNEL_ENTRY(gather, "top-k gather on a CUDA tensor",
                (const float* v, const uint32_t* idx, int64_t k, void* values, DType vt),
                (v, idx, k, values, vt))
/// Stratified random-k indices over n elements (ascending), mapped through the nr ranges of
/// `ranges` when nr > 0 (randomk_position in topk_math.h; memory on the device of the call;
/// null and 0: no mapping).
GC_KERNEL_ENTRY(randomk_indices, "random-k indices on CUDA",
                (int64_t n, int64_t k, const RngKey& key, uint32_t* out, const uint32_t* ranges,
                 int64_t nr),
                (n, k, key, out, ranges, nr))
/// dense[idx[j]] += scale * values[j].
GC_KERNEL_ENTRY(scatter_add, "sparse decode on a CUDA tensor",
                (const uint32_t* idx, const void* values, DType vt, int64_t k, float scale,
                 float* dense),
                (idx, values, vt, k, scale, dense))

// ---- CUDA only: the index sections of a payload on a GPU (the CPU codes them on the host) ----
/// Builds a bitmap index section (ceil(n/8) bytes, zeroed first) from ascending indices.
GC_CUDA_ONLY_ENTRY(void, indices_to_bitmap, "bitmap encode on CUDA",
                   (const uint32_t* idx, int64_t k, int64_t n, uint8_t* bitmap),
                   (idx, k, n, bitmap))
/// Decodes a bitmap section into ascending indices (at most `cap` written); returns the count
/// found, or -1 when a bit at a position >= n is set (synchronises once).
GC_CUDA_ONLY_ENTRY(int64_t, bitmap_to_indices, "bitmap decode on CUDA",
                   (const uint8_t* bitmap, int64_t n, uint32_t* idx, int64_t cap,
                    SelectWorkspace& ws),
                   (bitmap, n, idx, cap, ws))
/// Checks raw indices: strictly ascending and < n. Returns the first bad position or -1.
GC_CUDA_ONLY_ENTRY(int64_t, check_indices, "index validation on CUDA",
                   (const uint32_t* idx, int64_t k, int64_t n, SelectWorkspace& ws),
                   (idx, k, n, ws))

}  // namespace gradcomp::kernels

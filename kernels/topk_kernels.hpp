// SPDX-License-Identifier: Apache-2.0
// Backend entry points of the top-k family. compressors/ call these through the device of the
// data; kernels/cpu implements `cpu::`, kernels/cuda (or kernels/nocuda) implements `cuda::`.
// Every CUDA entry point has a CPU twin with the same contract; the CUDA tests compare them.
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/rng.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
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

namespace cpu {
/// Indices (ascending) of the selected elements of x by |x|; returns how many (<= k). See
/// gradcomp::SelectOptions for the contract of each method.
int64_t select(const float* x, int64_t n, int64_t k, const SelectOptions& opt, const RngKey& key,
               uint32_t* out, SelectWorkspace& ws);
// first_nonfinite(g, t, n): kernels/scan_kernels.hpp
/// Sum of squares in double.
double sum_squares(const void* g, DType t, int64_t n);
/// u, v <- DGC update with g * coef (u may be null when momentum == 0). With u_src / v_src the
/// update reads the old values there and writes the new ones to u / v (a step whose state change
/// can still be dropped: same traffic as in place); null: in place.
void dgc_accumulate(const void* g, DType t, int64_t n, float coef, float momentum, bool nesterov,
                    float* u, float* v, const float* u_src = nullptr, const float* v_src = nullptr);
/// values[j] = v[idx[j]] (converted to vt); then v[idx] = 0 and, if u, u[idx] = 0. With a share:
/// values[j] = value_share(v[idx[j]], divisor, limit), and v[idx] keeps v - divisor * values[j].
void gather_and_clear(float* v, float* u, const uint32_t* idx, int64_t k, void* values, DType vt,
                      const ValueShare* share = nullptr);
/// values[j] = v[idx[j]] (converted to vt; -0 sent as +0, as 0 + v would be), v unchanged: the
/// gather of a selection made on the gradient itself (no error feedback, no momentum, no clip).
void gather(const float* v, const uint32_t* idx, int64_t k, void* values, DType vt);
/// Stratified random-k indices over n elements (ascending), mapped through the nr ranges of
/// `ranges` when nr > 0 (randomk_position in topk_math.h; host memory here).
void randomk_indices(int64_t n, int64_t k, const RngKey& key, uint32_t* out,
                     const uint32_t* ranges = nullptr, int64_t nr = 0);
/// dense[idx[j]] += scale * values[j].
void scatter_add(const uint32_t* idx, const void* values, DType vt, int64_t k, float scale,
                 float* dense);
}  // namespace cpu

namespace cuda {
int64_t select(const float* x, int64_t n, int64_t k, const SelectOptions& opt, const RngKey& key,
               uint32_t* out, SelectWorkspace& ws, void* stream);
int64_t first_nonfinite(const void* g, DType t, int64_t n, SelectWorkspace& ws, void* stream);
double sum_squares(const void* g, DType t, int64_t n, SelectWorkspace& ws, void* stream);
void dgc_accumulate(const void* g, DType t, int64_t n, float coef, float momentum, bool nesterov,
                    float* u, float* v, void* stream, const float* u_src = nullptr,
                    const float* v_src = nullptr);
void gather_and_clear(float* v, float* u, const uint32_t* idx, int64_t k, void* values, DType vt,
                      void* stream, const ValueShare* share = nullptr);
void gather(const float* v, const uint32_t* idx, int64_t k, void* values, DType vt, void* stream);
/// As the CPU twin; `ranges` in device memory.
void randomk_indices(int64_t n, int64_t k, const RngKey& key, uint32_t* out, void* stream,
                     const uint32_t* ranges = nullptr, int64_t nr = 0);
void scatter_add(const uint32_t* idx, const void* values, DType vt, int64_t k, float scale,
                 float* dense, void* stream);
/// Builds a bitmap index section (ceil(n/8) bytes, zeroed first) from ascending indices.
void indices_to_bitmap(const uint32_t* idx, int64_t k, int64_t n, uint8_t* bitmap, void* stream);
/// Decodes a bitmap section into ascending indices (at most `cap` written); returns the count
/// found, or -1 when a bit at a position >= n is set (synchronises once).
int64_t bitmap_to_indices(const uint8_t* bitmap, int64_t n, uint32_t* idx, int64_t cap,
                          SelectWorkspace& ws, void* stream);
/// Checks raw indices: strictly ascending and < n. Returns the first bad position or -1.
int64_t check_indices(const uint32_t* idx, int64_t k, int64_t n, SelectWorkspace& ws, void* stream);
}  // namespace cuda

}  // namespace gradcomp::kernels

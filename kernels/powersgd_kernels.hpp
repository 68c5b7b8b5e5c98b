// SPDX-License-Identifier: Apache-2.0
// Backend entry points of PowerSGD. compressors/powersgd_state.cpp calls these through the device
// of the state; kernels/cpu implements `cpu::` (OpenMP + BLAS/LAPACKE), kernels/cuda (or
// kernels/nocuda) `cuda::` (CUDA + cuBLAS/cuSOLVER). Every CUDA entry point has a CPU twin with the
// same contract. All matrices are row-major fp32: M n x m, P n x r, Q m x r; a group is `batch`
// same-shape matrices stored back to back (strides n*m, n*r, m*r).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/orthogonalization.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/scan_kernels.hpp"

namespace gradcomp::kernels {

struct PsgdGroup {
  int64_t batch = 0, n = 0, m = 0;
  int r = 0;
  float* M = nullptr;
  float* P = nullptr;
  float* Q = nullptr;
  const uint32_t* ids = nullptr;  ///< RNG tensor ids of the members (on the group's device)
  /// CPU finish(): where the new error goes (null: into M, in place). A second buffer lets a
  /// plan keep the error before the step at no extra traffic (the pass reads one and writes the
  /// other instead of reading and writing one).
  float* M_out = nullptr;
};

/// Library handles and scratch, made once per state and reused (no steady-state allocation).
struct PsgdContext {
  explicit PsgdContext(Device dev, void* s = nullptr)
      : device(dev), stream(s), work(dev, s), work2(dev, s), info(dev, s) {}
  ~PsgdContext();  // defined by the backend that owns the handles (cuda/ or nocuda/)
  PsgdContext(const PsgdContext&) = delete;
  PsgdContext& operator=(const PsgdContext&) = delete;
  Device device;
  void* stream;
  void* cublas = nullptr;    ///< cublasHandle_t (CUDA)
  void* cusolver = nullptr;  ///< cusolverDnHandle_t (CUDA)
  Buffer work, work2, info;  ///< solver / transpose / reconstruction scratch
  std::vector<float> host_work;
  std::vector<float> host_tiles;    ///< CPU: per-thread tile scratch, partial Q sums
  std::vector<int64_t> host_items;  ///< CPU: work list of the fused phases
  std::vector<int64_t> host_slots;  ///< CPU: partial-Q slot of each work item
};

namespace cpu {
// first_nonfinite(g, t, n): kernels/scan_kernels.hpp.
/// dst = (add ? dst : 0) + float(g).
void load(const void* g, DType t, int64_t n, float* dst, bool add);
/// x = x / world.
void divide(float* x, int64_t n, float world);
/// g = dtype(src / world).
void store_mean(const float* src, int64_t n, float world, void* g, DType t);
/// g = dtype(r) (skipped when r is g itself, fp32); then, if m_err, m_err -= float(g).
void store_result(const float* r, void* g, DType t, int64_t n, float* m_err);
/// Draws Q of every member (only its all-zero columns when only_zero_columns).
void fill_q(const PsgdGroup& g, uint64_t seed, uint64_t step, bool only_zero_columns);
/// Brings a block of len floats near 1 by an exact power of two where its range needs it (see
/// psgd_prescale_exponent in powersgd_math.h): one read of the block, a write only when scaled.
void prescale(float* A, int64_t len, float eps);
/// prescale() of each of `batch` consecutive blocks of len floats.
void prescale_blocks(float* X, int64_t batch, int64_t len, float eps);
/// P = M Q, for every member.
void compute_p(const PsgdGroup& g, PsgdContext& ctx);
/// Q = M^T P, for every member.
void compute_q(const PsgdGroup& g, PsgdContext& ctx);
/// out = P Q^T for member b (n x m, row-major).
void reconstruct(const PsgdGroup& g, int64_t b, float* out, PsgdContext& ctx);
/// Orthonormalizes the columns of every n x r matrix of P (batch of them).
void orthogonalize(float* P, int64_t batch, int64_t n, int r, float eps, Orthogonalization how,
                   PsgdContext& ctx);

// Fused step (what compressors/powersgd_state.cpp runs on the CPU), over all batch groups of a
// bucket at once: ONE OpenMP region per phase, work items (row tiles of about 64K floats that stay
// in cache, or chunks of them) handed out dynamically, so a thread that the OS preempts does not
// hold the others at a barrier per layer. Every GEMM is a per-tile call small enough to run
// single-threaded inside OpenBLAS, so OpenBLAS's thread pool never competes with the OpenMP
// threads. Results do not depend on the thread count or the schedule. grads[g][b] is the gradient
// of member b of group g (dtype t). `direct` (fp32 without error feedback): the gradient itself is
// M, nothing is copied.
/// Per tile: M = float(g) (+ error when add), then P_tile = M_tile Q: one pass over g (and the
/// error) instead of a load pass plus a GEMM pass. direct: P_tile = g_tile Q. With add the sum is
/// formed in a per-thread tile in cache and the error buffer (g.M) is NOT written: the state stays
/// as it was until finish(), so a step can still be rejected after this phase (a NaN/Inf in the
/// gradient shows up as a non-finite row of P: NaN * 0 and Inf * 0 are NaN).
void compress_p(const std::vector<PsgdGroup>& groups, const std::vector<std::vector<void*>>& grads,
                DType t, bool add, bool direct, PsgdContext& ctx);
/// Orthonormalizes every P block of every group (fused MGS: one serial MGS per block, blocks
/// handed out dynamically in one region; other methods: per group, as orthogonalize()).
void orthogonalize_groups(const std::vector<PsgdGroup>& groups, float eps, Orthogonalization how,
                          PsgdContext& ctx);
/// Q = M^T P (M = the gradients when direct; with ef M = error + float(g) formed per tile again,
/// bitwise as in compress_p): chunks of rows give partial sums, added per member in chunk order.
void compute_q_fused(const std::vector<PsgdGroup>& groups,
                     const std::vector<std::vector<void*>>& grads, DType t, bool ef, bool direct,
                     PsgdContext& ctx);
/// Per tile: R = P Q^T (in cache), M = error + float(g), g = dtype(R), and with ef
/// error = M - float(g) (into M_out when set): one pass reading g and the error and writing both.
/// Without ef (fp32): the GEMM writes g directly.
void finish(const std::vector<PsgdGroup>& groups, const std::vector<std::vector<void*>>& grads,
            DType t, bool ef, PsgdContext& ctx);
}  // namespace cpu

namespace cuda {
void load(const void* g, DType t, int64_t n, float* dst, bool add, void* stream);
void divide(float* x, int64_t n, float world, void* stream);
void store_mean(const float* src, int64_t n, float world, void* g, DType t, void* stream);
void store_result(const float* r, void* g, DType t, int64_t n, float* m_err, void* stream);
void fill_q(const PsgdGroup& g, uint64_t seed, uint64_t step, bool only_zero_columns, void* stream);
void prescale_blocks(float* X, int64_t batch, int64_t len, float eps, void* stream);
void compute_p(const PsgdGroup& g, PsgdContext& ctx);
void compute_q(const PsgdGroup& g, PsgdContext& ctx);
/// out[b - b0] = P_b Q_b^T for members b0 .. b0 + count - 1 (one strided-batched GEMM).
void reconstruct(const PsgdGroup& g, int64_t b0, int64_t count, float* out, PsgdContext& ctx);
void orthogonalize(float* P, int64_t batch, int64_t n, int r, float eps, Orthogonalization how,
                   PsgdContext& ctx);
}  // namespace cuda

}  // namespace gradcomp::kernels

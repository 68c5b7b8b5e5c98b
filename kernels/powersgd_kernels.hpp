// SPDX-License-Identifier: Apache-2.0
// Backend entry points of PowerSGD (kernels/entry.hpp). plans/powersgd_plan.cpp and
// compressors/powersgd_state.cpp call the dispatch with the state's execution context;
// kernels/cpu implements `cpu::` (OpenMP + BLAS/LAPACKE), kernels/cuda `cuda::` (CUDA +
// cuBLAS/cuSOLVER). Every CUDA entry point has a CPU twin with the same contract. All matrices
// are row-major fp32: M n x m, P n x r, Q m x r; a group is `batch` same-shape matrices stored
// back to back (strides n*m, n*r, m*r).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/orthogonalization.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/entry.hpp"
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
  ~PsgdContext();  // releases the CUDA handles (kernels/cuda; a default one without CUDA)
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

/// One step's view of a bucket's batch groups: grads[g][b] is the gradient of member b of group g
/// (dtype), direct: fp32 without error feedback (the gradient itself is M).
struct PsgdBucket {
  const std::vector<PsgdGroup>& groups;
  const std::vector<std::vector<void*>>& grads;
  DType dtype;
  bool error_feedback;
  bool direct;
};

// first_nonfinite(g, t, n): kernels/scan_kernels.hpp.
/// dst = (add ? dst : 0) + float(g).
GC_KERNEL_ENTRY(load, "PowerSGD on a CUDA tensor",
                (const void* g, DType t, int64_t n, float* dst, bool add), (g, t, n, dst, add))
/// x = x / world.
GC_KERNEL_ENTRY(divide, "PowerSGD on CUDA", (float* x, int64_t n, float world), (x, n, world))
/// g = dtype(src / world).
GC_KERNEL_ENTRY(store_mean, "PowerSGD on CUDA",
                (const float* src, int64_t n, float world, void* g, DType t), (src, n, world, g, t))
/// g = dtype(r) (skipped when r is g itself, fp32); then, if m_err, m_err -= float(g).
GC_KERNEL_ENTRY(store_result, "PowerSGD on CUDA",
                (const float* r, void* g, DType t, int64_t n, float* m_err), (r, g, t, n, m_err))
/// Draws Q of every member (only its all-zero columns when only_zero_columns).
GC_KERNEL_ENTRY(fill_q, "PowerSGD Q initialization on CUDA",
                (const PsgdGroup& g, uint64_t seed, uint64_t step, bool only_zero_columns),
                (g, seed, step, only_zero_columns))
/// prescale() (below) of each of `batch` consecutive blocks of len floats. On a warm-started Q
/// (X = g.Q, batch = g.batch, len = g.m * g.r) it brings Q near 1 where its range needs it: Q
/// carries the gradient's magnitude, so P = M Q would square it and overflow (|g| above about
/// 1e17) or underflow (below about 1e-20). P's scale does not reach the result (it is
/// orthonormalized), so this changes no bits where nothing overflowed.
GC_KERNEL_ENTRY(prescale_blocks, "PowerSGD Q scaling on CUDA",
                (float* X, int64_t batch, int64_t len, float eps), (X, batch, len, eps))

// ---- the phases of a step, over a bucket's batch groups: the CPU runs its fused tile passes
// (one OpenMP region per phase over all groups: cpu::compress_p and the others below), CUDA
// runs each group as cuBLAS / cuSOLVER calls on ctx's handles and stream ----
/// Whether psgd_compute_p forms M = grad (+ error) itself (the CPU, tile by tile, storing nothing)
/// rather than reading an M the caller loaded with load() (CUDA; direct: the gradient is M).
inline bool psgd_forms_m_itself(const Exec& e) { return !e.cuda(); }
/// P = M Q for every group.
GC_KERNEL_ENTRY(psgd_compute_p, "PowerSGD GEMM on CUDA", (const PsgdBucket& b, PsgdContext& ctx),
                (b, ctx))
/// P_hat = orth(P), then Q = M^T P_hat, for every group.
GC_KERNEL_ENTRY(psgd_project, "PowerSGD orthogonalization on CUDA",
                (const PsgdBucket& b, float eps, Orthogonalization how, PsgdContext& ctx),
                (b, eps, how, ctx))
/// grad = P_hat Q^T in its dtype and, with error feedback, error = M - grad, for every group.
/// scratch (CUDA): scratch_floats floats for the batched reconstruction.
GC_KERNEL_ENTRY_CUDA_EXTRA(void, psgd_finish, "PowerSGD GEMM on CUDA",
                           (const PsgdBucket& b, PsgdContext& ctx), (b, ctx),
                           (float* scratch, int64_t scratch_floats), (scratch, scratch_floats))

namespace cpu {
/// Brings a block of len floats near 1 by an exact power of two where its range needs it (see
/// psgd_prescale_exponent in powersgd_math.h): one read of the block, a write only when scaled.
void prescale(float* A, int64_t len, float eps);
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

#if GRADCOMP_HAS_CUDA
// The CUDA phases' per-group steps (cuBLAS / cuSOLVER on ctx's handles and stream), which the
// CUDA tests also run alone.
namespace cuda {
void compute_p(const PsgdGroup& g, PsgdContext& ctx);
void compute_q(const PsgdGroup& g, PsgdContext& ctx);
/// out[b - b0] = P_b Q_b^T for members b0 .. b0 + count - 1 (one strided-batched GEMM).
void reconstruct(const PsgdGroup& g, int64_t b0, int64_t count, float* out, PsgdContext& ctx);
void orthogonalize(float* P, int64_t batch, int64_t n, int r, float eps, Orthogonalization how,
                   PsgdContext& ctx);
}  // namespace cuda
#endif

}  // namespace gradcomp::kernels

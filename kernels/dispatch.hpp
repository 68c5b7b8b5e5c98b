// SPDX-License-Identifier: Apache-2.0
// One CPU/CUDA dispatch per kernel entry point: the algorithms above (compressors/, plans/) call
// these with an execution context and never branch on the device themselves. Each function has
// the contract of its kernels::cpu / kernels::cuda twin (kernels/onebit_kernels.hpp,
// kernels/topk_kernels.hpp, kernels/scan_kernels.hpp); on the CPU the stream is ignored.
//
// Covered: the shared scan (first_nonfinite), the 1-bit and multi-bit families, the DGC/top-k local
// steps and PowerSGD's phases (the same phase API; the CPU runs fused tile passes, CUDA per-group
// BLAS).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/rng.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/tensor.hpp"
#include "kernels/entry.hpp"  // Exec
#include "kernels/onebit_kernels.hpp"
#include "kernels/powersgd_kernels.hpp"
#include "kernels/quant_kernels.hpp"
#include "kernels/topk_kernels.hpp"

namespace gradcomp::kernels {

namespace dispatch {

// ---- scans every family uses ----
/// Index of the first non-finite element of x (n elements of dtype t), or -1. ws: CUDA scratch.
int64_t first_nonfinite(const Exec& e, const void* x, DType t, int64_t n, SelectWorkspace& ws);

// ---- 1-bit ----
int64_t onebit_compress(const Exec& e, const void* g, DType t, const float* state_in,
                        const float* prev_scales, float* state_out, const OneBitGeom& geo, int norm,
                        bool check_finite, float* scales, uint32_t* bits, OneBitWorkspace& ws);
void onebit_finalize_error(const Exec& e, float* x, const OneBitGeom& geo, const float* scales);
int64_t onebit_scales(const Exec& e, const void* g, DType t, const float* err,
                      const OneBitGeom& geo, int norm, bool check_finite, float* scales,
                      OneBitWorkspace& ws);
void onebit_quantize(const Exec& e, const void* g, DType t, const float* e_in, float* e_out,
                     const OneBitGeom& geo, const float* scales, uint32_t* bits);
/// bits / scales: host arrays of pointers on the device of e.
void onebit_decode_average(const Exec& e, const uint32_t* const* bits, const float* const* scales,
                           int count, const OneBitGeom& geo, float scale, bool accumulate,
                           float* dense, OneBitWorkspace& ws);
void hadamard_rotate(const Exec& e, float* x, int64_t nblocks, int64_t S, int64_t first_block,
                     bool inverse);

// ---- multi-bit ----
/// On CUDA the compress checks nothing (returns -1): scan with first_nonfinite first.
int64_t quant_compress(const Exec& e, const void* g, DType t, const float* e_in, float* e_out,
                       const QuantGeom& geo, const QuantRng& rng, bool check_finite, uint8_t* body);
/// bodies: a host array of pointers on the device of e.
void quant_decode_average(const Exec& e, const uint8_t* const* bodies, int count,
                          const QuantGeom& geo, float scale, float* dense, QuantWorkspace& ws);

// ---- top-k / random-k / DGC ----
int64_t select(const Exec& e, const float* x, int64_t n, int64_t k, const SelectOptions& opt,
               const RngKey& key, uint32_t* out, SelectWorkspace& ws);
double sum_squares(const Exec& e, const void* g, DType t, int64_t n, SelectWorkspace& ws);
void dgc_accumulate(const Exec& e, const void* g, DType t, int64_t n, float coef, float momentum,
                    bool nesterov, float* u, float* v, const float* u_src = nullptr,
                    const float* v_src = nullptr);
void gather_and_clear(const Exec& e, float* v, float* u, const uint32_t* idx, int64_t k,
                      void* values, DType vt, const ValueShare* share = nullptr);
void gather(const Exec& e, const float* v, const uint32_t* idx, int64_t k, void* values, DType vt);
void randomk_indices(const Exec& e, int64_t n, int64_t k, const RngKey& key, uint32_t* out,
                     const uint32_t* ranges = nullptr, int64_t nr = 0);
void scatter_add(const Exec& e, const uint32_t* idx, const void* values, DType vt, int64_t k,
                 float scale, float* dense);

// ---- PowerSGD ----
/// One step's view of a bucket's batch groups: grads[g][b] is the gradient of member b of group g
/// (dtype), direct: fp32 without error feedback (the gradient itself is M).
struct PsgdBucket {
  const std::vector<PsgdGroup>& groups;
  const std::vector<std::vector<void*>>& grads;
  DType dtype;
  bool error_feedback;
  bool direct;
};
void psgd_load(const Exec& e, const void* g, DType t, int64_t n, float* dst, bool add);
void psgd_divide(const Exec& e, float* x, int64_t n, float world);
void psgd_store_mean(const Exec& e, const float* src, int64_t n, float world, void* g, DType t);
void psgd_fill_q(const Exec& e, const PsgdGroup& g, uint64_t seed, uint64_t step,
                 bool only_zero_columns);
/// A warm-started Q brought near 1 by an exact power of two where its range needs it (see
/// psgd_prescale_exponent): Q carries the gradient's magnitude, so P = M Q would square it and
/// overflow (|g| above about 1e17) or underflow (below about 1e-20). P's scale does not reach the
/// result (it is orthonormalized), so this changes no bits where nothing overflowed.
void psgd_prescale_q(const Exec& e, const PsgdGroup& g, float eps);
/// Whether psgd_compute_p forms M = grad (+ error) itself (the CPU, tile by tile, storing nothing)
/// rather than reading an M the caller loaded with psgd_load (CUDA; direct: the gradient is M).
bool psgd_forms_m_itself(const Exec& e);
/// P = M Q for every group.
void psgd_compute_p(const Exec& e, const PsgdBucket& b, PsgdContext& ctx);
/// P_hat = orth(P), then Q = M^T P_hat, for every group.
void psgd_project(const Exec& e, const PsgdBucket& b, float eps, Orthogonalization how,
                  PsgdContext& ctx);
/// grad = P_hat Q^T in its dtype and, with error feedback, error = M - grad, for every group.
/// scratch (CUDA): scratch_floats floats for the batched reconstruction.
void psgd_finish(const Exec& e, const PsgdBucket& b, float* scratch, int64_t scratch_floats,
                 PsgdContext& ctx);

}  // namespace dispatch
}  // namespace gradcomp::kernels

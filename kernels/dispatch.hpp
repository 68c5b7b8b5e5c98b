// SPDX-License-Identifier: Apache-2.0
// One CPU/CUDA dispatch per kernel entry point: the algorithms above (compressors/, plans/) call
// these with an execution context and never branch on the device themselves. Each function has
// the contract of its kernels::cpu / kernels::cuda twin (kernels/onebit.hpp, kernels/topk.hpp,
// kernels/scan.hpp); on the CPU the stream is ignored.
//
// Covered so far: the shared scans (first_nonfinite), the 1-bit family and the DGC/top-k local
// steps. PowerSGD's CPU step is a fused algorithm of its own and still branches in
// plans/powersgd.cpp (docs/ARCHITECTURE.md, known debts).
#pragma once

#include <cstdint>

#include "gradcomp/rng.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/tensor.hpp"
#include "kernels/onebit.hpp"
#include "kernels/topk.hpp"

namespace gradcomp::kernels {

/// Where a kernel runs: the data's device and, on CUDA, the stream (cudaStream_t).
struct Exec {
  Device device = Device::kCPU;
  void* stream = nullptr;
  bool cuda() const { return device == Device::kCUDA; }
};

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

// ---- top-k / random-k / DGC ----
int64_t select(const Exec& e, const float* x, int64_t n, int64_t k, const SelectOptions& opt,
               const RngKey& key, uint32_t* out, SelectWorkspace& ws);
double sum_squares(const Exec& e, const void* g, DType t, int64_t n, SelectWorkspace& ws);
void dgc_accumulate(const Exec& e, const void* g, DType t, int64_t n, float coef, float momentum,
                    bool nesterov, float* u, float* v);
void gather_and_clear(const Exec& e, float* v, float* u, const uint32_t* idx, int64_t k,
                      void* values, DType vt);
void randomk_indices(const Exec& e, int64_t n, int64_t k, const RngKey& key, uint32_t* out);
void scatter_add(const Exec& e, const uint32_t* idx, const void* values, DType vt, int64_t k,
                 float scale, float* dense);

}  // namespace dispatch
}  // namespace gradcomp::kernels

// SPDX-License-Identifier: Apache-2.0
// kernels/dispatch.hpp: each entry point calls its CPU or CUDA twin by the context's device.
// (A CPU-only build links the kernels/nocuda stubs, which throw "built without CUDA".)
#include "kernels/dispatch.hpp"

#include "kernels/scan_kernels.hpp"

namespace gradcomp::kernels::dispatch {

int64_t first_nonfinite(const Exec& e, const void* x, DType t, int64_t n, SelectWorkspace& ws) {
  return e.cuda() ? cuda::first_nonfinite(x, t, n, ws, e.stream) : cpu::first_nonfinite(x, t, n);
}

int64_t onebit_compress(const Exec& e, const void* g, DType t, const float* state_in,
                        const float* prev_scales, float* state_out, const OneBitGeom& geo, int norm,
                        bool check_finite, float* scales, uint32_t* bits, OneBitWorkspace& ws) {
  return e.cuda() ? cuda::onebit_compress(g, t, state_in, prev_scales, state_out, geo, norm,
                                          check_finite, scales, bits, ws, e.stream)
                  : cpu::onebit_compress(g, t, state_in, prev_scales, state_out, geo, norm,
                                         check_finite, scales, bits, ws);
}

void onebit_finalize_error(const Exec& e, float* x, const OneBitGeom& geo, const float* scales) {
  if (e.cuda())
    cuda::onebit_finalize_error(x, geo, scales, e.stream);
  else
    cpu::onebit_finalize_error(x, geo, scales);
}

int64_t onebit_scales(const Exec& e, const void* g, DType t, const float* err,
                      const OneBitGeom& geo, int norm, bool check_finite, float* scales,
                      OneBitWorkspace& ws) {
  return e.cuda() ? cuda::onebit_scales(g, t, err, geo, norm, check_finite, scales, ws, e.stream)
                  : cpu::onebit_scales(g, t, err, geo, norm, check_finite, scales, ws);
}

void onebit_quantize(const Exec& e, const void* g, DType t, const float* e_in, float* e_out,
                     const OneBitGeom& geo, const float* scales, uint32_t* bits) {
  if (e.cuda())
    cuda::onebit_quantize(g, t, e_in, e_out, geo, scales, bits, e.stream);
  else
    cpu::onebit_quantize(g, t, e_in, e_out, geo, scales, bits);
}

void onebit_decode_average(const Exec& e, const uint32_t* const* bits, const float* const* scales,
                           int count, const OneBitGeom& geo, float scale, bool accumulate,
                           float* dense, OneBitWorkspace& ws) {
  if (e.cuda())
    cuda::onebit_decode_average(bits, scales, count, geo, scale, accumulate, dense, ws, e.stream);
  else
    cpu::onebit_decode_average(bits, scales, count, geo, scale, accumulate, dense);
}

void hadamard_rotate(const Exec& e, float* x, int64_t nblocks, int64_t S, int64_t first_block,
                     bool inverse) {
  if (e.cuda())
    cuda::hadamard_rotate(x, nblocks, S, first_block, inverse, e.stream);
  else
    cpu::hadamard_rotate(x, nblocks, S, first_block, inverse);
}

int64_t quant_compress(const Exec& e, const void* g, DType t, const float* e_in, float* e_out,
                       const QuantGeom& geo, const QuantRng& rng, bool check_finite,
                       uint8_t* body) {
  return e.cuda() ? cuda::quant_compress(g, t, e_in, e_out, geo, rng, check_finite, body, e.stream)
                  : cpu::quant_compress(g, t, e_in, e_out, geo, rng, check_finite, body);
}

void quant_decode_average(const Exec& e, const uint8_t* const* bodies, int count,
                          const QuantGeom& geo, float scale, float* dense, QuantWorkspace& ws) {
  if (e.cuda())
    cuda::quant_decode_average(bodies, count, geo, scale, dense, ws, e.stream);
  else
    cpu::quant_decode_average(bodies, count, geo, scale, dense);
}

int64_t select(const Exec& e, const float* x, int64_t n, int64_t k, const SelectOptions& opt,
               const RngKey& key, uint32_t* out, SelectWorkspace& ws) {
  return e.cuda() ? cuda::select(x, n, k, opt, key, out, ws, e.stream)
                  : cpu::select(x, n, k, opt, key, out, ws);
}

double sum_squares(const Exec& e, const void* g, DType t, int64_t n, SelectWorkspace& ws) {
  return e.cuda() ? cuda::sum_squares(g, t, n, ws, e.stream) : cpu::sum_squares(g, t, n);
}

void dgc_accumulate(const Exec& e, const void* g, DType t, int64_t n, float coef, float momentum,
                    bool nesterov, float* u, float* v, const float* u_src, const float* v_src) {
  if (e.cuda())
    cuda::dgc_accumulate(g, t, n, coef, momentum, nesterov, u, v, e.stream, u_src, v_src);
  else
    cpu::dgc_accumulate(g, t, n, coef, momentum, nesterov, u, v, u_src, v_src);
}

void gather_and_clear(const Exec& e, float* v, float* u, const uint32_t* idx, int64_t k,
                      void* values, DType vt, const ValueShare* share) {
  if (e.cuda())
    cuda::gather_and_clear(v, u, idx, k, values, vt, e.stream, share);
  else
    cpu::gather_and_clear(v, u, idx, k, values, vt, share);
}

void gather(const Exec& e, const float* v, const uint32_t* idx, int64_t k, void* values, DType vt) {
  if (e.cuda())
    cuda::gather(v, idx, k, values, vt, e.stream);
  else
    cpu::gather(v, idx, k, values, vt);
}

void randomk_indices(const Exec& e, int64_t n, int64_t k, const RngKey& key, uint32_t* out,
                     const uint32_t* ranges, int64_t nr) {
  if (e.cuda())
    cuda::randomk_indices(n, k, key, out, e.stream, ranges, nr);
  else
    cpu::randomk_indices(n, k, key, out, ranges, nr);
}

void scatter_add(const Exec& e, const uint32_t* idx, const void* values, DType vt, int64_t k,
                 float scale, float* dense) {
  if (e.cuda())
    cuda::scatter_add(idx, values, vt, k, scale, dense, e.stream);
  else
    cpu::scatter_add(idx, values, vt, k, scale, dense);
}

}  // namespace gradcomp::kernels::dispatch

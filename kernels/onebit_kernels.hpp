// SPDX-License-Identifier: Apache-2.0
// Backend entry points of the 1-bit family (kernels/entry.hpp). compressors/onebit_codec.cpp and
// plans/ call the dispatch with the data's execution context; kernels/cpu implements `cpu::`,
// kernels/cuda `cuda::`. Every CUDA entry point has a CPU twin with the same contract; the CUDA
// tests compare them (bits bitwise, scales to rounding, decodes bitwise for the same payload).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/entry.hpp"

namespace gradcomp::kernels {

/// Geometry of one 1-bit payload of n elements.
///  columns == true:  cols > 0 divides n; element i uses hi = scales[i % cols],
///                    lo = scales[cols + i % cols] (2 * cols floats).
///  columns == false: chunk is a positive multiple of 32; element i uses s = scales[i / chunk],
///                    hi = s, lo = -s (ceil(n / chunk) floats).
struct OneBitGeom {
  int64_t n = 0;
  bool columns = false;
  int64_t cols = 1;
  int64_t chunk = 32;
  int64_t num_words() const { return (n + 31) / 32; }
  int64_t num_scales() const { return columns ? 2 * cols : (n + chunk - 1) / chunk; }
};

/// Scratch reused across calls (grow-only; no steady-state allocation).
struct OneBitWorkspace {
  explicit OneBitWorkspace(Device dev = Device::kCPU) : partials(dev), aux(dev), ptrs(dev) {}
  Buffer partials, aux, ptrs;
  std::vector<double> host;
  void* pinned = nullptr;  ///< CUDA: pinned slot for the first-non-finite index
  ~OneBitWorkspace();
  OneBitWorkspace(const OneBitWorkspace&) = delete;
  OneBitWorkspace& operator=(const OneBitWorkspace&) = delete;
};

/// The one-pass compress (onebit_compress) and its lazy error-feedback state.
///
/// The state buffer holds either the error e itself (prev_scales == nullptr) or, lazily, the
/// previous step's compensated value x_prev together with that step's scales (prev_scales): the
/// error it stands for is lazy_error(x_prev, hi_prev, lo_prev) = x_prev - decode(sign_bit(x_prev))
/// (the transmitted bit is the sign of x, so it need not be kept). A compress step then reads g
/// and the state once, writes the packed bits and x = g + e into the state, and accumulates the
/// scales of x on the way: the new error x - decode(bits, scales) cannot be formed before the
/// per-tensor scales are known, so it is formed by the next step's read (or by
/// onebit_finalize_error when someone asks for e). Bits and scales do not depend on the scales of
/// the step, only on x, so they are exactly those of the two-pass form; the error values too
/// (the same fp32 operations in the same order).
///
/// Non-finite input: the return value is the first non-finite index of g (check_finite) or -1.
/// On a rejection, `state_in` is left unchanged when state_out != state_in (both backends) and,
/// on CUDA, also in place (the check finishes before anything is written). The CPU pass is one
/// sweep that cannot know about a NaN ahead of it, so an in-place CPU call that rejects its input
/// has already overwritten part of the state: the compressor gives the CPU a second buffer when
/// it checks finiteness (compressors/onebit_codec.cpp).
///
/// state_in == nullptr: no error feedback (x = g) and state_out must be nullptr too.

/// One pass: x = g + e(state_in, prev_scales); bits of x; state_out = x (when not null); scales
/// of x for the geometry (norm as in onebit_scales). Returns the first non-finite index of g when
/// check_finite and some scale came out non-finite, else -1 (scales, bits, state_out garbage
/// then). state_out may equal state_in; if it does not, it is written with non-temporal stores.
/// CUDA: flat chunks of 128 .. 1024 elements (multiples of 128) of aligned fp32 data: one fused
/// pass, a warp per chunk (scale, bits and state from registers), preceded, with check_finite, by
/// a scan of g alone whose result is read back first. Otherwise two kernels (scale pass, then
/// bits + state pass) with the bad index read back between them. Either way a rejected CUDA call
/// writes nothing, also in place.
GC_KERNEL_ENTRY_R(int64_t, onebit_compress, "1-bit compression of a CUDA tensor",
                  (const void* g, DType t, const float* state_in, const float* prev_scales,
                   float* state_out, const OneBitGeom& geo, int norm, bool check_finite,
                   float* scales, uint32_t* bits, OneBitWorkspace& ws),
                  (g, t, state_in, prev_scales, state_out, geo, norm, check_finite, scales, bits,
                   ws))
/// Materializes a lazy state in place: x := lazy_error(x, hi, lo) with the given scales.
GC_KERNEL_ENTRY(onebit_finalize_error, "1-bit error feedback of a CUDA tensor",
                (float* x, const OneBitGeom& geo, const float* scales), (x, geo, scales))
/// Pass 1: the scales of x = g + e (e == nullptr: x = g) for the geometry; norm is
/// onebit::kColumnMeans / kL1 / kL2 (columns geometry iff kColumnMeans). When check_finite,
/// returns the index of the first non-finite element of g, else -1 (scales are then garbage).
/// Changes nothing but `scales` and `ws`.
GC_KERNEL_ENTRY_R(int64_t, onebit_scales, "1-bit scales of a CUDA tensor",
                  (const void* g, DType t, const float* e, const OneBitGeom& geo, int norm,
                   bool check_finite, float* scales, OneBitWorkspace& ws),
                  (g, t, e, geo, norm, check_finite, scales, ws))
/// Pass 2 (fused): x = g + e_in; bits[w] packed by the bit order; when e_out, e_out = x - decode.
/// e_in may be null (x = g) and e_out may equal e_in (in place).
GC_KERNEL_ENTRY(onebit_quantize, "1-bit quantization of a CUDA tensor",
                (const void* g, DType t, const float* e_in, float* e_out, const OneBitGeom& geo,
                 const float* scales, uint32_t* bits),
                (g, t, e_in, e_out, geo, scales, bits))
/// dense = [dense +] scale * (sum over p in order of decode(bits[p], scales[p])); one pass.
/// bits / scales: host arrays of pointers on the device of the call (on CUDA copied to the device
/// through ws).
GC_KERNEL_ENTRY_CUDA_EXTRA(void, onebit_decode_average, "1-bit decode into a CUDA tensor",
                           (const uint32_t* const* bits, const float* const* scales, int count,
                            const OneBitGeom& geo, float scale, bool accumulate, float* dense),
                           (bits, scales, count, geo, scale, accumulate, dense),
                           (OneBitWorkspace & ws), (ws))
/// The plan's rotation (onebit::rotation_sign) of nblocks consecutive blocks of S elements at x,
/// in place; block b of x is global block first_block + b (D's signs follow the global index).
/// inverse == false: z = H D x / sqrt(S); true: x = D H z / sqrt(S). S: a power of two in
/// [2, 8192]. Stage by stage the same butterflies in the same order on both backends, so the
/// results are bitwise equal (for finite inputs: NaN payload bits may differ).
/// On x86-64 CPUs with AVX2 the CPU loop runs in an AVX2 build (same bits, wider vectors).
GC_KERNEL_ENTRY(hadamard_rotate, "1-bit rotation of a CUDA tensor",
                (float* x, int64_t nblocks, int64_t S, int64_t first_block, bool inverse),
                (x, nblocks, S, first_block, inverse))

namespace cpu {
/// hadamard_rotate in the library's baseline build, whatever the CPU (tests and the benchmark
/// compare).
void hadamard_rotate_baseline(float* x, int64_t nblocks, int64_t S, int64_t first_block,
                              bool inverse);
/// Whether hadamard_rotate runs the AVX2 build on this CPU.
bool hadamard_rotate_uses_avx2();
}  // namespace cpu

}  // namespace gradcomp::kernels

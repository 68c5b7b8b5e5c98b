// SPDX-License-Identifier: Apache-2.0
// Backend entry points of the multi-bit family (gradcomp/quant.hpp; kernels/entry.hpp).
// plans/quant_plan.cpp calls the dispatch; kernels/cpu implements `cpu::`, kernels/cuda `cuda::`,
// with the same contract and the same bits (kernels/quant_math.h).
#pragma once

#include <cstdint>
#include <vector>

#include "gradcomp/rng.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/entry.hpp"

namespace gradcomp::kernels {

/// Geometry of one quantized chunk of n elements: blocks of `block` elements (the last may be
/// shorter), each with `scales_per_block` scales of `scale_bytes` bytes, then the packed codes.
/// Body layout: [scales of block 0, 1, ... (fp32 or fp16 bits), padded to 8 bytes | code words].
struct QuantGeom {
  int64_t n = 0;
  int bits = 4;
  int64_t block = 128;
  bool asym = false;
  bool half = false;  ///< fp16 scales
  /// Elements the body is laid out for (>= n; 0: n): a chunk slot of the plan has room for its
  /// full size, and a shorter last chunk keeps the slot's layout.
  int64_t capacity = 0;
  int64_t num_blocks() const { return (n + block - 1) / block; }
  int64_t slot_elems() const { return capacity > n ? capacity : n; }
  /// Byte offset of the code words in the body.
  int64_t codes_offset() const { return scale_area((slot_elems() + block - 1) / block); }
  /// Bytes of a body: scale area and code words for slot_elems() elements.
  int64_t body_bytes() const { return codes_offset() + 4 * code_words(slot_elems()); }
  int scales_per_block() const { return asym ? 2 : 1; }
  int scale_bytes() const { return half ? 2 : 4; }
  /// Bytes of the scale area for `blocks` blocks (padded to 8).
  int64_t scale_area(int64_t blocks) const {
    return (blocks * scales_per_block() * scale_bytes() + 7) / 8 * 8;
  }
  int64_t code_words(int64_t elems) const {
    const int64_t per = 32 / bits;
    return (elems + per - 1) / per;
  }
};

/// Stochastic rounding: the key and the role (kernels/quant_math.h, stream_index); `first` is the
/// global index of the chunk's element 0.
struct QuantRng {
  bool stochastic = false;
  RngKey key;
  uint64_t role = 0;
  uint64_t first = 0;
};

/// Scratch reused across calls (CUDA: the pointer tables and the non-finite index).
struct QuantWorkspace {
  explicit QuantWorkspace(Device dev = Device::kCPU) : ptrs(dev), flag(dev) {}
  Buffer ptrs, flag;
};

/// The fused compress of one chunk, block by block in one pass over memory: x = g + e_in
/// (onebit::compensate; e_in null: x = g), the block's scale(s) from x, the codes of x packed
/// into `body` (geometry geo, scale area then code words: every word of ceil(n / (32/b)) is
/// written, unused bits 0), and e_out = x - decode(code) when e_out is not null (e_out may equal
/// e_in). When check_finite, a block holding a non-finite x stops the pass and its first bad
/// index is returned (body and e_out are then partly written: the caller double-buffers); else
/// -1. The CUDA twin checks nothing and returns -1: its callers scan the gradient first
/// (first_nonfinite).
GC_KERNEL_ENTRY_R(int64_t, quant_compress, "multi-bit quantization of a CUDA tensor",
                  (const void* g, DType t, const float* e_in, float* e_out, const QuantGeom& geo,
                   const QuantRng& rng, bool check_finite, uint8_t* body),
                  (g, t, e_in, e_out, geo, rng, check_finite, body))
/// dense = scale * (sum over p = 0..count-1, in order, of decode(body[p])) for n elements, the
/// sum in fp32 (a block whose result is not finite is summed again in double and saturated, as
/// the 1-bit decode: finite payloads never decode to Inf). bodies: a host array of pointers on
/// the device of the call (on CUDA copied to the device through ws).
GC_KERNEL_ENTRY_CUDA_EXTRA(void, quant_decode_average, "multi-bit decode into a CUDA tensor",
                           (const uint8_t* const* bodies, int count, const QuantGeom& geo,
                            float scale, float* dense),
                           (bodies, count, geo, scale, dense), (QuantWorkspace & ws), (ws))

}  // namespace gradcomp::kernels

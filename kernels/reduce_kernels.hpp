// SPDX-License-Identifier: Apache-2.0
// Backend entry points of the communication layer's local work: the rank-ordered reduction of P
// blocks (what makes every driver's allreduce bitwise reproducible) and the casts of the cast
// and averaging steps. kernels/cpu implements `cpu::`, kernels/cuda `cuda::` (kernels/entry.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/tensor.hpp"
#include "gradcomp/types.hpp"  // ElemType
#include "kernels/entry.hpp"

namespace gradcomp::kernels {

/// dst[i] = ((blocks[0][i] + blocks[1][i]) + ...) + blocks[P-1][i], each addition in type t
/// (see reduce_math.h), where block r starts at blocks + r * stride elements. dst may alias
/// block 0 (not the others).
GC_KERNEL_ENTRY(reduce_blocks, "rank-ordered reduction of CUDA buffers",
                (const void* blocks, size_t nblocks, size_t count, size_t stride, ElemType t,
                 void* dst),
                (blocks, nblocks, count, stride, t, dst))
/// dst[i] = cast_dt(float(src[i]) / divisor) for fp32/fp16/bf16; src and dst may alias when the
/// types have the same size.
GC_KERNEL_ENTRY(convert, "cast of a CUDA tensor",
                (const void* src, DType st, void* dst, DType dt, int64_t n, float divisor),
                (src, st, dst, dt, n, divisor))
/// dst[i] = cast_dt(saturate_for(src[i], dt)) from fp32 (see reduce_math.h): finite values
/// beyond the destination's range become its largest finite value; Inf and NaN stay. src and dst
/// may alias when the types have the same size.
GC_KERNEL_ENTRY(convert_saturating, "cast of a CUDA tensor",
                (const float* src, void* dst, DType dt, int64_t n), (src, dst, dt, n))
/// The rank-ordered fp32 sum of nb blocks of fp16 / bf16 values (`wire`; block r starts at
/// blocks + r * stride elements), rounded once to the wire type: w[i] = cast_wire(((float(b0[i])
/// + float(b1[i])) + ...) + float(b_{nb-1}[i])). Written to wire_out[i] when wire_out is not null
/// (it may alias block 0, not the others) and, cast to dtype out_t (the wire type: w's bits), to
/// out[i] when out is not null (out may alias block 0 when out_t is 2 bytes wide). The bits of
/// convert (widen to fp32) + reduce_blocks (kF32) + convert (to the wire type) + convert (to
/// out_t), in one pass over the blocks that never stores them widened: the cast plans' sum of
/// what every rank sent. A NaN sum's sign and payload follow the backend's fp32 addition (x86 and
/// CUDA differ there, as the other kernels' NaNs do); every other value is the same on both.
GC_KERNEL_ENTRY(sum_widened, "rank-ordered sum of CUDA buffers",
                (const uint16_t* blocks, DType wire, size_t nb, size_t count, size_t stride,
                 uint16_t* wire_out, void* out, DType out_t),
                (blocks, wire, nb, count, stride, wire_out, out, out_t))

}  // namespace gradcomp::kernels

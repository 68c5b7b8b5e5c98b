// SPDX-License-Identifier: Apache-2.0
// The fp8 family's element math and kernel entry points. fp8 values travel in blocks: a record of
// `block` values is its fp32 scale (4 bytes) followed by `block` one-byte codes, value j being
// decode(code j) * scale. The scale maps the block's largest magnitude to the format's largest
// value, so the three (e4m3) or two (e5m2) mantissa bits are spent on the block's own range.
//
// Formats (the OCP 8-bit floating point formats, what H100-class tensor cores and torch's
// float8_e4m3fn / float8_e5m2 use): e4m3 ("fn": 4 exponent bits, bias 7, 3 mantissa bits, no
// infinities, S.1111.111 is NaN, largest 448) and e5m2 (5 exponent bits, bias 15, 2 mantissa bits,
// IEEE infinities and NaNs, largest 57344).
//
// Written once for both twins (kernels/cpu/fp8_cpu.cpp, kernels/cuda/fp8_cuda.cu): each block's
// largest magnitude (a max is exact in any order), its scale (one correctly rounded division),
// each code (one division, then integer rounding) and the rank-ordered fp32 sums are the same
// operations on both, so the records and sums are the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "gradcomp/detail/macros.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/tensor.hpp"
#include "kernels/entry.hpp"

namespace gradcomp::kernels {

/// The largest finite value of the format.
GC_HD float fp8_max(bool e5m2) { return e5m2 ? 57344.0f : 448.0f; }

/// The value of code c (exact in fp32). e4m3's NaN codes and e5m2's NaN / infinity codes decode to
/// NaN / infinity.
GC_HD float fp8_decode(uint8_t c, bool e5m2) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mbits = e5m2 ? 2u : 3u, bias = e5m2 ? 15u : 7u;
  const uint32_t e = (c & 0x7fu) >> mbits, m = c & ((1u << mbits) - 1u);
  if (e5m2 && e == 31u) return bits_float(sign | 0x7f800000u | (m != 0u ? 0x00400000u : 0u));
  if (!e5m2 && e == 15u && m == 7u) return bits_float(sign | 0x7fc00000u);
  if (e == 0u) {  // subnormal: m units of 2^(1 - bias - mbits)
    const float v = static_cast<float>(m) * (e5m2 ? 0x1p-16f : 0x1p-9f);
    return sign != 0u ? -v : v;
  }
  return bits_float(sign | ((e + 127u - bias) << 23) | (m << (23u - mbits)));
}

/// The code of the value nearest x (ties to the even code); a magnitude beyond the largest finite
/// value (infinity included) saturates to it, NaN becomes the NaN code (e4m3 0x7f, e5m2 0x7e).
GC_HD uint8_t fp8_encode(float x, bool e5m2) {
  const uint32_t u = float_bits(x);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | (e5m2 ? 0x7eu : 0x7fu));
  const uint32_t mbits = e5m2 ? 2u : 3u, bias = e5m2 ? 15u : 7u;
  const uint32_t largest = e5m2 ? 0x7bu : 0x7eu;  // e5m2 1.75 * 2^15, e4m3 1.75 * 2^8
  if (a >= (128u - bias) << 23) {                 // the format's normal range
    const uint32_t shift = 23u - mbits;
    // round the fp32 mantissa to mbits bits, ties to even (a carry moves into the exponent)
    const uint32_t r = (a + ((1u << (shift - 1u)) - 1u) + ((a >> shift) & 1u)) >> shift;
    const uint32_t code = r - ((127u - bias) << mbits);  // fp32 exponent bias -> the format's
    return static_cast<uint8_t>(sign | (code > largest ? largest : code));
  }
  // below the smallest normal: a whole number of units of 2^(1 - bias - mbits); the scaling by a
  // power of two is exact, and adding and subtracting 2^23 rounds to an integer, ties to even
  const float units = bits_float(a) * (e5m2 ? 0x1p16f : 0x1p9f);
  const float r = (units + 0x1p23f) - 0x1p23f;
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(r));
}

/// Bytes of one record: the fp32 scale, then `block` codes.
GC_HD size_t fp8_record_bytes(int block) { return 4u + static_cast<size_t>(block); }

/// The scale of a block whose largest finite magnitude is amax: amax / the largest value, or NaN
/// when some element is not finite, which decodes every element of the block to NaN (so a NaN or
/// Inf anywhere in a block reaches the sum instead of being saturated away).
GC_HD float fp8_scale(float amax, bool finite, bool e5m2) {
  return finite ? amax / fp8_max(e5m2) : bits_float(0x7fc00000u);
}

/// The code of x in a block of scale s: code 0 where the scale is 0 or NaN. The scale is 0 for
/// an all-zero block, and also where the largest magnitude is below about 6e-43 (its quotient by
/// the largest value underflows fp32): such a block decodes to zeros.
GC_HD uint8_t fp8_code_of(float x, float s, bool e5m2) {
  return s > 0.0f ? fp8_encode(x / s, e5m2) : uint8_t{0};
}

/// The value of code c in a block of scale s: one rounded product. On a GPU it is spelled
/// __fmul_rn, because nvcc would otherwise fuse it with the sum it feeds (acc + value) into one
/// FMA, rounding once where the CPU rounds twice.
GC_HD float fp8_value_of(uint8_t c, float s, bool e5m2) {
  return GC_DEVICE_OR_HOST(__fmul_rn(fp8_decode(c, e5m2), s), fp8_decode(c, e5m2) * s);
}

/// The scale of a record (its first 4 bytes).
GC_HD float fp8_record_scale(const uint8_t* record) {
  float s;
  memcpy(&s, record, sizeof s);
  return s;
}

/// Writes the scale of a record.
GC_HD void fp8_set_record_scale(uint8_t* record, float s) { memcpy(record, &s, sizeof s); }

// ---- entry points (kernels/entry.hpp) ----

/// Encodes x (n elements of dtype t: fp32, fp16 or bf16) into `nblocks` records of `block` values
/// (block in [32, 4096], a multiple of 32): record b holds elements [b block, (b + 1) block), those
/// at or past n taken as 0. records: nblocks * fp8_record_bytes(block) bytes, 4-byte aligned.
GC_KERNEL_ENTRY(fp8_encode_blocks, "fp8 encode of a CUDA buffer",
                (const void* x, DType t, int64_t n, int64_t nblocks, int block, bool e5m2,
                 uint8_t* records),
                (x, t, n, nblocks, block, e5m2, records))

/// The rank-ordered sum of `nranks` arrays of `nblocks` records (rank r's at records + r *
/// rank_stride bytes): value j of block b is v = (((d_0 + d_1) + ...) + d_{P-1}) / divisor in
/// fp32, d_r the value of rank r's code. Written, when records_out is not null, as `nblocks`
/// records (encoded as fp8_encode_blocks does; it must not overlap the input) and, when out is
/// not null, as elements b block + j < n_out of out in dtype out_t. With nranks 1 and divisor 1
/// it is the decode.
GC_KERNEL_ENTRY(fp8_sum_blocks, "rank-ordered sum of fp8 records in CUDA memory",
                (const uint8_t* records, int nranks, size_t rank_stride, int64_t nblocks, int block,
                 bool e5m2, float divisor, uint8_t* records_out, void* out, DType out_t,
                 int64_t n_out),
                (records, nranks, rank_stride, nblocks, block, e5m2, divisor, records_out, out,
                 out_t, n_out))

}  // namespace gradcomp::kernels

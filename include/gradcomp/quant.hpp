// SPDX-License-Identifier: Apache-2.0
// Multi-bit quantization (2, 4 or 8 bits per value) with per-block scales: the step between the
// 1-bit plan (about 26x fewer bytes than fp32, lossy enough to need rotation) and an fp16 cast
// (2x). Used by QuantPlan (plans/quant_plan.hpp), the two-phase compressed allreduce of
// the 1-bit plan with a b-bit codec.
//
// Blocks. The values are cut into blocks of `block_size` elements (a power of two in [32, 8192]);
// each block has its own scale, so layers of different magnitude never share one. With
// kSymmetric a block of max |x| = a is sent on the grid s * {-L, ..., L}, L = 2^(bits-1) - 1
// (s = a / L; bits 2, 4, 8 give L = 1, 7, 127): zero is exact and one scale is sent. With
// kAsymmetric the grid is lo + d * {0, ..., 2^bits - 1} (lo = min, d = (max - min) / (2^bits - 1)):
// every code is used, which pays for one-signed blocks (after a ReLU, say) and costs one more
// scale per block.
//
// Rounding. kNearest rounds to the nearest grid point (ties to even) and keeps what was lost as
// error feedback (worker and server error, as the 1-bit plan). kStochastic rounds up with
// probability equal to the fractional position (Philox keyed by seed, step, bucket and rank, so
// every rank draws its own independent numbers reproducibly): unbiased (QSGD), so it needs no
// error feedback (error_feedback may still be set). Stochastic rounding errs by up to a whole
// step, which at 2 bits symmetric (levels -1, 0, 1) is the block's max itself: with error
// feedback that error did not shrink from step to step and grew without bound, so there the
// step is half the block's max and the values above it are clipped, the clipped part carried as
// error (kernels/quant_math.h, sym_divisor; without error feedback the step stays the max, and
// the rounding unbiased).
//
// Scales. fp32, or fp16 (2 bytes instead of 4 per scale: at block 128 and 4 bits, 4.125 instead
// of 4.25 bits per value). An fp16 symmetric scale is rounded up, so the grid still covers the
// block; a block whose fp32 scale exceeds fp16's largest value (65504, i.e. max |x| above
// 65504 L) is clipped to that grid and one whose scale is below fp16's smallest (2^-24) gets
// 2^-24 and sends zeros: error feedback carries the rest to later steps. fp32 scales have no such
// limits.
//
// Example (through make_plan, gradcomp/make_plan.hpp):
//   auto plan = gradcomp::make_plan("quant", bucket, {{"bits", int64_t{4}}});
#pragma once

#include <cstdint>

#include "gradcomp/types.hpp"

namespace gradcomp {

enum class QuantRounding : uint8_t {
  kNearest = 0,     ///< deterministic, with error feedback
  kStochastic = 1,  ///< random rounding, unbiased without error feedback (see Rounding)
};

enum class QuantScale : uint8_t {
  kSymmetric = 0,   ///< one scale per block: max |x| / (2^(bits-1) - 1)
  kAsymmetric = 1,  ///< two per block: the minimum and the step (max - min) / (2^bits - 1)
};

struct QuantConfig {
  int bits = 4;              ///< 2, 4 or 8
  int64_t block_size = 128;  ///< elements per scale: a power of two in [32, 8192]
  QuantRounding rounding = QuantRounding::kNearest;
  QuantScale scale = QuantScale::kSymmetric;
  DType scale_dtype = DType::kFloat32;  ///< kFloat32 or kFloat16
  bool error_feedback = true;           ///< worker and server error (see the top of this header)
  /// Rotate each full block by the 1-bit plan's fixed randomized Hadamard transform before
  /// quantizing (and back after the average): a rotated block is near-Gaussian, so its max |x| is
  /// a few RMS instead of set by a single outlier, and the grid is finer for the rest.
  bool rotate = true;
  /// Skip (or raise, OnNonFinite) a step in which some rank's gradient holds NaN or Inf, leaving
  /// the state unchanged. The errors are double-buffered whatever this says (4 more bytes per
  /// element), so a step that fails on a bad peer chunk changes nothing either, and undo_step()
  /// can always take a kept step back.
  bool check_finite = true;
  uint64_t seed = 0;       ///< stochastic rounding's key
  uint32_t tensor_id = 0;  ///< the bucket (keys the random numbers)
  void validate() const;
};

/// Bits on the wire per value for a config, scales included (headers and chunk padding aside).
double quant_bits_per_value(const QuantConfig& cfg);

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<QuantRounding> {
  static constexpr const char* what = "quant rounding";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<QuantRounding> table[] = {{"nearest", QuantRounding::kNearest},
                                                      {"stochastic", QuantRounding::kStochastic}};
};

template <>
struct EnumNames<QuantScale> {
  static constexpr const char* what = "quant scale";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<QuantScale> table[] = {{"symmetric", QuantScale::kSymmetric},
                                                   {"asymmetric", QuantScale::kAsymmetric}};
};

}  // namespace gradcomp

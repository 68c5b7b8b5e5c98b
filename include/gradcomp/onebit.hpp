// SPDX-License-Identifier: Apache-2.0
// The 1-bit family: 1-bit SGD (Seide et al. 2014, column-wise reconstruction values), scaled sign
// (EF-SignSGD, ||x||_1 / n) and the L2 form of 1-bit Adam (||x||_2 / sqrt(n)), all with error
// feedback, bit-packed, on CPU and CUDA (the two-phase compressed allreduce of 1-bit Adam is a
// plan built by make_plan("onebit", ...)).
//
// Matrix view and "column". A tensor of shape [d0, d1, ...] (row-major, contiguous) is viewed as
// a matrix of rows = d0 and cols = numel / d0 (TensorView::rows() / cols()). Element (r, c) is
// flat index i = r * cols + c, so column c is the strided set {c, c + cols, c + 2 cols, ...} and
// the column of flat element i is i % cols. A 1-D tensor [n] is n x 1: one column holding every
// element (vectors, e.g. biases, are one column, as in the paper). A [1, n] tensor has n columns
// of one element each, so each element carries its own two values (no compression: pass such a
// tensor as 1-D).
//
// Bit order (shared by the CPU and CUDA backends; a payload made by one decodes identically on
// the other): element i is bit (i % 32) of 32-bit word (i / 32), least significant bit first,
// words little-endian. The bit is 1 when x >= 0 (so -0.0 gives 1 and NaN gives 0). Unused bits
// of the last word are written as 0 and ignored on decode.
//
// Reconstruction: a set bit decodes to hi, a clear bit to lo, where
//   kColumnMeans: hi = mean of the non-negative entries of x in the element's column, lo = mean of
//                 its negative entries (0 for an empty set);
//   kSignL1:      hi = s, lo = -s with s = ||x_chunk||_1 / len(chunk);
//   kSignL2:      hi = s, lo = -s with s = ||x_chunk||_2 / sqrt(len(chunk)).
// Error feedback: x = g + e_prev, e = x - decode(encode(x)) (off: x = g and e stays 0).
//
// Payload (wire.hpp): 64-byte header, kind kOneBit, value_dtype fp32 (the scales), index_coding
// none, flags = OneBitScaling, numel = count = n, aux = cols (kColumnMeans) or elements per scale
// (sign modes); section 1 = packed bits (4 * ceil(n / 32) bytes), section 2 = scales (fp32:
// hi[0..cols) then lo[0..cols) for kColumnMeans, one s per chunk for the sign modes). Section 0
// (indices) is empty.
//
// Example (1-bit SGD on a 1024 x 1000 weight gradient):
//   gradcomp::OneBitConfig cfg;                  // kColumnMeans, error feedback on
//   gradcomp::OneBitCompressor comp(cfg, 1024, 1000);
//   gradcomp::Payload p;
//   comp.encode(gradcomp::TensorView::cpu(g.data(), {1024, 1000}), p);
//   // ... send p.data(), p.size(); on the receiver:
//   comp.decode_add(bytes, nbytes, gradcomp::TensorView::cpu(avg.data(), {1024, 1000}), 1.0f / P);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "gradcomp/compressor.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp {

/// How the two reconstruction values of a group of bits are chosen.
enum class OneBitScaling : uint8_t {
  kColumnMeans = 0,  ///< 1-bit SGD: per column, mean of non-negative / mean of negative entries
  kSignL1 = 1,       ///< scaled sign: +-||x||_1 / n per tensor or chunk (EF-SignSGD)
  kSignL2 = 2,       ///< scaled sign: +-||x||_2 / sqrt(n) per tensor or chunk (1-bit Adam)
};

/// OneBitConfig{} is 1-bit SGD's codec (column means, no blocks); the plans and the Python codec
/// take the onebit family's defaults instead (scaled sign, an L2 scale per block of 128):
/// onebit_config({}) in make_plan.hpp gives them.
// (GCC warns of the deprecated member in the constructors it writes for every OneBitConfig; the
// pragma limits the warning to code that names chunk_size.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
struct OneBitConfig {
  OneBitScaling scaling = OneBitScaling::kColumnMeans;
  bool error_feedback = true;  ///< keep e = x - decode(encode(x)); off for ablations
  /// Sign modes: elements per scale, a positive multiple of 32; 0 = one scale for the tensor.
  /// Must be 0 for kColumnMeans (its groups are the columns). The option tables' name as well.
  int64_t block_size = 0;
  /// block_size's earlier name, still accepted from C++ code written against it: -1 = not set.
  /// When set it is block_size (with block_size left at 0, or given the same value; two different
  /// values are refused). The library reads block_size only: resolved() folds this into it.
  [[deprecated("OneBitConfig::chunk_size is now block_size")]] int64_t chunk_size = -1;
  /// Reject a gradient with NaN/Inf (naming the first bad index) leaving the state unchanged.
  /// The check rides on the scale sums: it costs no pass unless a scale comes out non-finite. On
  /// the CPU the one-pass compress then writes the new state into a second buffer (4 bytes per
  /// element of memory, no extra traffic); with check_finite off it works in place.
  bool check_finite = true;
  uint32_t tensor_id = 0;  ///< written to the payload header
  /// OneBitAllreducePlan only (0 for the compressor): momentum m in [0, 1) applied before
  /// compression. Each rank keeps u = m u + g and compresses x = u + worker_error, so the plan
  /// returns the average momentum and the optimizer must apply none (plain SGD): as in 1-bit
  /// Adam, the smoother momentum loses far less to the sign than the raw gradient does.
  double momentum = 0.0;
  /// OneBitAllreducePlan only (false for the compressor): rotate every full block of block_size
  /// elements by a fixed randomized Hadamard transform before the sign (DRIVE, Vargaftik et al.
  /// 2021) and back after the average. Gradient blocks are heavy-tailed (a few large entries: the
  /// sign with one scale then loses most of the block's energy to error feedback); rotated blocks
  /// are near-Gaussian and lose 0.36 (L1 scale) to 0.40 (L2) of it. Needs a sign scaling and
  /// block_size a power of two in [32, 8192]. The trailing partial block (numel % block_size
  /// elements) is not rotated. The plan's error and momentum buffers then hold rotated values. Same
  /// bytes on the wire.
  bool rotate = false;
  /// InvalidArgument for settings no plan or codec accepts (chunk_size included).
  void validate() const;
  /// This configuration with chunk_size folded into block_size (and chunk_size unset);
  /// InvalidArgument if the two names were given different values.
  OneBitConfig resolved() const;
};
#pragma GCC diagnostic pop

/// Elements per scale actually used for n elements (sign modes): block_size, or n rounded up to
/// a multiple of 32 (at least 32) when block_size is 0.
int64_t onebit_effective_chunk(const OneBitConfig& cfg, int64_t n);
/// Exact payload bytes of a 1-bit payload: header + bits + scales (each section 8-byte aligned).
uint64_t onebit_payload_bytes(const OneBitConfig& cfg, int64_t rows, int64_t cols);

/// 1-bit compressor with error feedback for one tensor viewed as rows x cols. Not thread-safe;
/// one object per tensor (or bucket).
///
/// Example: see the top of this header.
class OneBitCompressor : public Compressor {
 public:
  /// rows * cols elements; for kColumnMeans the gradient's cols() must equal `cols` (a 1-D
  /// gradient is n x 1). For the sign modes only the element count matters.
  OneBitCompressor(const OneBitConfig& cfg, int64_t rows, int64_t cols = 1,
                   DType grad_dtype = DType::kFloat32, Device device = Device::kCPU,
                   int device_index = 0, void* stream = nullptr);
  /// Takes shape, dtype, device and stream from a view of the gradient (its data is not read).
  OneBitCompressor(const OneBitConfig& cfg, const TensorView& like);
  ~OneBitCompressor() override;
  std::string name() const override { return "onebit"; }
  void encode(const TensorView& grad, Payload& out) override;
  /// dense += scale * decode(payload). Decoding is self-describing (mode and grouping come from
  /// the validated header), so any 1-bit payload of numel() elements decodes.
  void decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                  float scale = 1.0f) override;
  /// dense += scale * sum_p decode(payload_p), the sum taken in order p = 0..P-1 in fp32, in one
  /// pass over dense. All payloads are validated before dense is touched.
  ///
  /// Example: comp.decode_average(ptrs.data(), sizes.data(), P, out, 1.0f / P);
  void decode_average(const void* const* payloads, const size_t* nbytes, int count,
                      const TensorView& dense, float scale);
  std::vector<uint8_t> state_dict() const override;
  void load_state_dict(const uint8_t* data, size_t nbytes) override;
  int64_t step() const override { return step_; }
  int64_t numel() const override { return rows_ * cols_; }
  Device device() const override { return device_; }
  const CompressionStats& last_stats() const override { return stats_; }
  const OneBitConfig& config() const { return cfg_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  /// The error-feedback memory e (numel floats) on the compressor's device. Between steps the
  /// compressor keeps e lazily (the last x and its scales: e = x - decode(sign(x)), formed by the
  /// next encode's single pass); this call materializes it in place first (one pass over e; the
  /// value, and every later payload, is the same either way). The pointer is valid until the
  /// next encode.
  const float* error() const;

 private:
  void start(const TensorView& grad, const TensorView* out);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  OneBitConfig cfg_;
  int64_t rows_, cols_;
  Device device_;
  int64_t step_ = 0;
  CompressionStats stats_;
};

// The 1-bit two-phase allreduce plan (OneBitAllreducePlan) is private to the library
// (plans/onebit_plan.hpp): make_plan("onebit", ...) builds it.

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<OneBitScaling> {
  static constexpr const char* what = "1-bit scaling";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<OneBitScaling> table[] = {{"column_means", OneBitScaling::kColumnMeans},
                                                      {"sign_l1", OneBitScaling::kSignL1},
                                                      {"sign_l2", OneBitScaling::kSignL2},
                                                      {"1bit_sgd", OneBitScaling::kColumnMeans}};
};

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The 1-bit family: 1-bit SGD (Seide et al. 2014, column-wise reconstruction values), scaled sign
// (EF-SignSGD, ||x||_1 / n) and the L2 form of 1-bit Adam (||x||_2 / sqrt(n)), all with error
// feedback, bit-packed, on CPU and CUDA; and 1-bit Adam's two-phase compressed allreduce as a
// Plan.
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
#include "gradcomp/plan.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp {

/// How the two reconstruction values of a group of bits are chosen.
enum class OneBitScaling : uint8_t {
  kColumnMeans = 0,  ///< 1-bit SGD: per column, mean of non-negative / mean of negative entries
  kSignL1 = 1,       ///< scaled sign: +-||x||_1 / n per tensor or chunk (EF-SignSGD)
  kSignL2 = 2,       ///< scaled sign: +-||x||_2 / sqrt(n) per tensor or chunk (1-bit Adam)
};

struct OneBitConfig {
  OneBitScaling scaling = OneBitScaling::kColumnMeans;
  bool error_feedback = true;  ///< keep e = x - decode(encode(x)); off for ablations
  /// Sign modes: elements per scale, a positive multiple of 32; 0 = one scale for the tensor.
  /// Must be 0 for kColumnMeans (its groups are the columns).
  int64_t chunk_size = 0;
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
  /// OneBitAllreducePlan only (false for the compressor): rotate every full block of chunk_size
  /// elements by a fixed randomized Hadamard transform before the sign (DRIVE, Vargaftik et al.
  /// 2021) and back after the average. Gradient blocks are heavy-tailed (a few large entries: the
  /// sign with one scale then loses most of the block's energy to error feedback); rotated blocks
  /// are near-Gaussian and lose 0.36 (L1 scale) to 0.40 (L2) of it. Needs a sign scaling and
  /// chunk_size a power of two in [32, 8192]. The trailing partial block (numel % chunk_size
  /// elements) is not rotated. The plan's error and momentum buffers then hold rotated values. Same
  /// bytes on the wire.
  bool rotate = false;
  void validate() const;
};

/// Elements per scale actually used for n elements (sign modes): chunk_size, or n rounded up to
/// a multiple of 32 (at least 32) when chunk_size is 0.
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

/// 1-bit Adam's compressed allreduce (Tang et al. 2021) as a plan, for one rank of `world`:
///  (1) x = g + worker_error (with cfg.momentum m: u = m u + g, x = u + worker_error) is
///      compressed (scaled sign, one scale per block of S elements) and
///      its bits are split into P server chunks of W words, W = the smallest multiple of S / 32
///      with 32 W P >= n (chunks hold whole blocks; the last chunks are padded with zero bits and
///      an empty block has scale 0). Each chunk holds NB = 32 W / S blocks. Send block p =
///      [NB scales of chunk p (fp32) | W words of bits]: B = 4 (NB + W) bytes.
///  (2) all-to-all (ElemType::kU8, B bytes per rank): rank r receives chunk r from every rank.
///  (3) rank r decodes the P blocks, sums them in rank order, multiplies by 1/P, adds
///      server_error and recompresses its chunk with the same blocks (server error feedback).
///  (4) allgather (ElemType::kU8, B bytes per rank) of the recompressed blocks.
///  (5) every rank decodes all P blocks into the gradient (or `out`): bitwise the same result on
///      every rank.
/// S is cfg.chunk_size (a positive multiple of 32), or 0: one scale per server chunk (the form
/// of the 1-bit Adam paper). One scale for a whole chunk lets layers of very different gradient
/// magnitude share it: the small-gradient layers then get steps far above their own size and the
/// large ones far below, which error feedback cannot repair (measured in
/// experiments/results/fashion_mnist_accuracy_2026-11-23.md); the hook
/// therefore uses S = 128 by default (0.25 bit of scale per element). Uses cfg.scaling kSignL1
/// or kSignL2, error_feedback (worker and server), check_finite.
/// With cfg.rotate (the hook's default), (1) compresses the rotation z = H D x / sqrt(S) of
/// every full block of S elements (kernels/onebit_math.h, rotation_sign: a fixed pattern of the
/// global element index), the server averages rotated values (the rotation is linear and the
/// same on every rank) and (5) rotates each decoded chunk back; the wire layout is unchanged,
/// its bits and scales describe rotated values. Worker error, server error and momentum are
/// kept rotated. The partial last block is sent unrotated.
///
/// Example (one rank; a driver executes the collectives):
///   gradcomp::OneBitAllreducePlan plan(cfg, n, world, rank);
///   plan.begin(TensorView::cpu(g.data(), n));
///   while (auto c = plan.next()) driver.run(*c);   // g now holds the averaged gradient
class OneBitAllreducePlan : public BucketPlan {
 public:
  OneBitAllreducePlan(const OneBitConfig& cfg, int64_t numel, int world, int rank,
                      Device device = Device::kCPU, int device_index = 0, void* stream = nullptr);
  ~OneBitAllreducePlan() override;
  /// Starts a step that averages in place, like every other bucket plan: grad (numel elements,
  /// fp32/fp16/bf16, on the plan's device) receives the average (rounded to its dtype,
  /// saturating: a finite average stays finite) when
  /// next() returns nullopt. Checks sizes, dtype and device before any state changes (throws
  /// InvalidArgument, also if a step is still in progress); a NaN/Inf gradient (check_finite)
  /// does not throw here: the step goes on and is skipped on every rank, or raises on every rank
  /// at its end (OnNonFinite, gradcomp/plan.hpp). With check_finite the worker error, server
  /// error and momentum are double-buffered (4 more bytes per element, 8 with momentum; which
  /// also lets undo_step() take a kept step back). With cfg.rotate an fp32 grad
  /// is rotated in place by begin() (no scratch copy): until the step ends it holds rotated values.
  /// fp16/bf16 gradients, and the form with `out`, are rotated in a scratch copy (4 bytes per
  /// element, kept by the plan).
  void begin(const TensorView& grad) override;
  /// The same, with the average written to a separate fp32 `out` (numel, not aliasing grad);
  /// grad is left as it was.
  void begin(const TensorView& grad, const TensorView& out);
  std::optional<Collective> next() override;
  std::string name() const override { return "onebit-allreduce"; }
  /// Elements per server chunk (32 W), elements per scale (S; = chunk_elems() when
  /// cfg.chunk_size is 0), scales per chunk (NB) and bytes per block (4 (NB + W)).
  int64_t chunk_elems() const { return 32 * words_per_chunk_; }
  int64_t scale_block() const { return scale_block_; }
  int64_t scales_per_chunk() const { return scales_per_chunk_; }
  size_t block_bytes() const {
    return static_cast<size_t>(4 * (words_per_chunk_ + scales_per_chunk_));
  }
  int64_t numel() const override { return numel_; }
  int64_t step() const { return step_; }
  Device device() const { return device_; }
  const OneBitConfig& config() const { return cfg_; }
  /// Worker error (numel floats) and server error (chunk_elems() floats, for this rank's chunk).
  /// With momentum and error feedback off, worker_error() holds the last compressed x instead.
  const float* worker_error() const;
  /// The momentum u (numel floats; null when cfg.momentum == 0).
  const float* momentum_buffer() const;
  const float* server_error() const;
  /// Bytes this rank sends per step (all-to-all + allgather), for compression-ratio reports.
  uint64_t bytes_sent() const { return block_bytes() * static_cast<uint64_t>(world_ + 1); }
  bool stateful() const override { return true; }
  std::vector<uint8_t> state_dict() const override;
  /// Restores state_dict(); throws InvalidArgument on a mismatch and then changes nothing.
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  void start(const TensorView& grad, const TensorView* out);
  void undo_state() override;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  OneBitConfig cfg_;
  int64_t numel_;
  int world_, rank_;
  Device device_;
  int64_t words_per_chunk_ = 0;
  int64_t scale_block_ = 32;
  int64_t scales_per_chunk_ = 1;
  int64_t step_ = 0;
  int phase_ = 0;  ///< 0 idle, 1 begun, 2 all-to-all asked, 3 allgather asked
};

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

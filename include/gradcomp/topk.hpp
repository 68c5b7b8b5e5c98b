// SPDX-License-Identifier: Apache-2.0
// The top-k family: exact and sampled-threshold selection, DGC (residual accumulation, momentum
// correction and factor masking, local clipping, sparsity warm-up) and random-k.
//
// Example (compress a gradient on one rank, decode it on another):
//   gradcomp::TopKConfig cfg;
//   cfg.ratio = 0.001;                 // send 0.1% of the elements
//   cfg.momentum = 0.9;                // DGC momentum correction (use plain SGD as optimizer)
//   gradcomp::TopKCompressor comp(cfg, grad.size());
//   gradcomp::Payload payload;
//   comp.encode(gradcomp::TensorView::cpu(grad.data(), grad.size()), payload);
//   // ... send payload.data(), payload.size() ...
//   comp.decode_add(bytes, nbytes, gradcomp::TensorView::cpu(avg.data(), avg.size()), 1.0f / P);
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gradcomp/compressor.hpp"
#include "gradcomp/rng.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp {

/// Selects the top-k of |x| (fp32, CPU or CUDA) into `out` (capacity k, same device), ascending.
/// Returns the number selected (k for exact; see SelectMethod for sampled). Throws
/// InvalidArgument for k < 0, k > numel, or a non-fp32 x.
///
/// Example:  std::vector<uint32_t> idx(k);
///           int64_t c = gradcomp::topk_indices(TensorView::cpu(x.data(), n), k, {}, {},
///           idx.data());
int64_t topk_indices(const TensorView& x, int64_t k, const SelectOptions& opt, const RngKey& key,
                     uint32_t* out);

/// What top-k and random-k share (Deep Gradient Compression, Lin et al. 2018): the density
/// (with DGC's warm-up), residual accumulation (error feedback), momentum correction with factor
/// masking, local clipping, and the value dtype.
///
/// Momentum correction. With error feedback a sparsifier sends each element rarely (random-k at
/// density d: about once every 1/d steps) carrying the sum of its unsent gradients. An optimizer
/// with momentum then multiplies that burst by 1/(1 - m) again and again: error-feedback random-k
/// at 1% under SGD with momentum 0.9 diverged. With momentum > 0 the compressor
/// accumulates the velocity u = m u + g locally (v += u, Nesterov: v += g + m u), sends from v,
/// and clears u where it sent (masking); the optimizer must then apply no momentum of its own.
struct SparsifyConfig {
  double ratio = 0.001;          ///< density (fraction of elements sent) after warm-up, in (0, 1]
  double momentum = 0.0;         ///< DGC momentum correction factor m in [0, 1); 0 = off
  bool nesterov = false;         ///< Nesterov form of the correction
  bool momentum_masking = true;  ///< clear the momentum where an element was sent
  /// Local gradient clipping by L2 norm before accumulation; 0 = off. A compressor of one
  /// tensor clips at clip_norm; the allreduce plans (TopKAllreducePlan, RandomKAllreducePlan)
  /// clip each of their N ranks at local_clip_norm(N), by default clip_norm / sqrt(N).
  double clip_norm = 0.0;
  /// How a plan of N ranks turns clip_norm into each rank's threshold: kSqrtWorld (DGC, Lin et
  /// al. 2018 Sec. 3.2: clip_norm N^-1/2, so that the sum of N such clipped gradients, when they
  /// are uncorrelated, has norm about clip_norm) or kNone (clip_norm itself on every rank).
  enum class ClipScaling : uint8_t { kSqrtWorld = 0, kNone = 1 };
  ClipScaling clip_scaling = ClipScaling::kSqrtWorld;
  /// Sparsity warm-up: density warmup_ratios[s] during steps [s * warmup_steps, (s+1) *
  /// warmup_steps). Empty = no warm-up. dgc_warmup() gives DGC's exponential schedule.
  std::vector<double> warmup_ratios;
  int64_t warmup_steps = 0;
  DType value_dtype = DType::kFloat32;  ///< dtype of the sent values
  bool error_feedback = true;           ///< keep what is not sent (residual); off for ablations
  /// Find a gradient holding NaN/Inf before any state changes: the codec alone throws naming
  /// the first bad index; the allreduce plans skip the step on every rank (or raise there, see
  /// OnNonFinite in gradcomp/plan.hpp) and keep the state before the step (a second residual and
  /// momentum buffer), which also lets undo_step() take a kept step back. Turning it off saves
  /// one read of the gradient and that memory; a NaN then poisons the residual for good.
  bool check_finite = true;
  uint64_t seed = 0;       ///< RNG seed (sampling offsets, random-k), identical on every rank
  uint32_t tensor_id = 0;  ///< distinguishes tensors in the RNG and the payload header

  /// DGC's warm-up densities 25%, 6.25%, 1.5625%, 0.4%, 0.1% (sparsity 75% ... 99.9%).
  static std::vector<double> dgc_warmup() { return {0.25, 0.0625, 0.015625, 0.004, 0.001}; }
  void validate() const;
  /// Density used at a step (warm-up aware); InvalidArgument for a negative step.
  double ratio_at(int64_t step) const;
  /// The threshold each rank of a `world`-rank allreduce clips at (see clip_scaling);
  /// InvalidArgument for world < 1.
  double local_clip_norm(int world) const;
};

struct TopKConfig : SparsifyConfig {
  SelectOptions select;
  /// Quantized values (SparseLoCo's setting: top-k of an error-fed pseudo-gradient at 2 bits):
  /// 0 sends the k values as value_dtype; 2, 4 or 8 sends each of them as a code of that many
  /// bits on a per-block asymmetric grid (2^bits levels from the block's smallest to its largest
  /// value, two fp32 scales per block of value_block values, rounded to nearest), the multi-bit
  /// family's codec applied to the k selected values in index order. The asymmetric grid
  /// because the selected values are the largest magnitudes: a symmetric grid spends one of
  /// its codes on zero, which at 2 bits rounds every value below half the block's largest to
  /// nothing. With error feedback the rounding error stays in the residual at its element
  /// (residual = v - decode(code)). Needs value_dtype float32 (the values before coding).
  int value_bits = 0;
  int64_t value_block = 128;  ///< values per pair of scales: a power of two in [32, 8192]
  void validate() const;
};

/// The largest top-k payload (bytes, header included) of `count` of n elements under cfg: the
/// index section as sparse_payload_bound's, the values as value_dtype or, with value_bits, the
/// coded values' scales and codes.
uint64_t topk_payload_bound(const TopKConfig& cfg, int64_t count, int64_t n);

/// The largest magnitude any of `count` coded values (value_bits > 0) can decode to, from their
/// section's scales (host memory, the section's first bytes): max over blocks of |lo| and
/// |lo + (2^bits - 1) step|, in double. NaN when a scale is one no encoder writes (lo or step
/// not finite, step negative): such a section must be refused, not decoded.
double topk_coded_values_bound(const TopKConfig& cfg, const void* section, int64_t count);

/// Number of elements sent for a density: ceil(ratio * n), at least 1 when n > 0.
int64_t topk_count(double ratio, int64_t n);

/// The largest sparse payload (bytes, header included) of `count` elements of an n-element
/// tensor: the index section is at most min(4 count, ceil(n / 8)) bytes whichever coding is
/// chosen, the values count * sizeof(value_dtype). A multiple of 8.
uint64_t sparse_payload_bound(int64_t count, int64_t n, DType value_dtype);

/// Top-k / DGC compressor for one tensor. Not thread-safe; one object per tensor (or bucket).
class TopKCompressor : public Compressor {
 public:
  TopKCompressor(const TopKConfig& cfg, int64_t numel, DType grad_dtype = DType::kFloat32,
                 Device device = Device::kCPU, int device_index = 0, void* stream = nullptr);
  ~TopKCompressor() override;
  std::string name() const override { return "topk"; }
  void encode(const TensorView& grad, Payload& out) override;
  void decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                  float scale = 1.0f) override;
  std::vector<uint8_t> state_dict() const override;
  void load_state_dict(const uint8_t* data, size_t nbytes) override;
  int64_t step() const override { return step_; }
  int64_t numel() const override { return numel_; }
  Device device() const override { return device_; }
  const CompressionStats& last_stats() const override { return stats_; }
  const TopKConfig& config() const { return cfg_; }
  /// For the allreduce plans (OnNonFinite, gradcomp/plan.hpp): with staging on, each encode()
  /// writes the step's new residual and momentum into a second buffer set and leaves the state,
  /// step counter included, as it was until commit(); an encode() not committed is dropped by the
  /// next one. encode() then leaves the finiteness check to the plan, which checks the bucket
  /// once and tells the other ranks. Costs a second residual (and momentum) buffer.
  void set_staged(bool on);
  /// Makes the last encode()'s state change permanent (staged mode; a no-op otherwise).
  void commit();
  /// Takes the last commit() back (staged mode): the state before that step's encode() is still
  /// in the second buffer set until the next encode() writes over it. Only right after a commit()
  /// (the plans track that); InvalidArgument when not staged.
  void uncommit();
  /// A payload for this step that carries no data and is flagged kPayloadSkipped (the sender's
  /// gradient held NaN or Inf). The state does not change.
  void encode_skipped(Payload& out);
  /// The largest payload encode() can write at `step` (warm-up aware): what a fixed-stride
  /// exchange pads every rank's payload to.
  uint64_t payload_bound(int64_t step) const;
  /// The accumulated residual v (what was not sent yet), on the compressor's device.
  const float* residual() const;
  /// The corrected momentum u (null when momentum == 0), on the compressor's device.
  const float* momentum_buffer() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  TopKConfig cfg_;
  int64_t numel_;
  Device device_;
  int64_t step_ = 0;
  CompressionStats stats_;
};

/// Random-k: the same options as top-k (SparsifyConfig), density 1% by default, and which of the
/// buffer's tensors are sent whole.
///
/// Why small tensors go whole: at density d a sampled element is applied about once
/// every 1/d steps with all it gathered meanwhile. On the first convolution, the biases and the
/// classifier of a CNN (a few thousand elements of 824k) those bursts made the whole network
/// diverge at 1% under momentum 0.9; sent every step the same run trains to within about a point
/// of plain DDP. 16384 was too low: the same CNN with a 2048-wide head has a 20480-weight
/// classifier, which sampled diverged. A threshold per tensor, not a budget per bucket: DDP's
/// first bucket (1 MB) holds the classifier almost alone, so a budget of ratio x the bucket left
/// it sampled. Top-k needs no such rule: what is large is sent first.
struct RandomKConfig : SparsifyConfig {
  RandomKConfig() { ratio = 0.01; }
  /// The sizes of the tensors laid out back to back in the buffer (a DDP bucket's gradients);
  /// their sum must be the compressor's numel. Empty: the buffer is not split and dense_below
  /// does not apply.
  std::vector<int64_t> segments;
  /// Segments of fewer elements are sent whole every step; the density applies to the others
  /// (k = ceil(ratio x their total)). Where an element is sent every step its momentum is kept
  /// (no masking), so there the correction is exactly SGD with momentum. 0 = none.
  int64_t dense_below = 32768;
  void validate() const;
};

/// Random-k with error feedback: the k indices come from the shared counter-based RNG keyed by
/// (seed, step, tensor id) - one uniform draw in each of k equal strata of [0, n) - so every rank
/// picks the same indices and only values are sent. The values of all ranks can be summed
/// directly (allreduce) before one decode. Momentum correction, masking, clipping and warm-up as
/// for top-k (SparsifyConfig): without momentum correction, use an optimizer without momentum
/// (error-feedback random-k under SGD with momentum 0.9 diverges).
class RandomKCompressor : public Compressor {
 public:
  RandomKCompressor(const RandomKConfig& cfg, int64_t numel, DType grad_dtype = DType::kFloat32,
                    Device device = Device::kCPU, int device_index = 0, void* stream = nullptr);
  ~RandomKCompressor() override;
  std::string name() const override { return "randomk"; }
  void encode(const TensorView& grad, Payload& out) override;
  void decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                  float scale = 1.0f) override;
  /// The state (step, per-element residual and momentum) does not record the segments: it means
  /// the same under any layout of the same numel (an element sent whole has a zero residual after
  /// every step and its momentum), so it loads into a compressor with other segments or another
  /// dense_below, which then samples or sends whole from that state on.
  std::vector<uint8_t> state_dict() const override;
  void load_state_dict(const uint8_t* data, size_t nbytes) override;
  int64_t step() const override { return step_; }
  int64_t numel() const override { return numel_; }
  Device device() const override { return device_; }
  const CompressionStats& last_stats() const override { return stats_; }
  /// For the allreduce plans (OnNonFinite, gradcomp/plan.hpp): with staging on, each encode()
  /// writes the step's new residual and momentum into a second buffer set and leaves the state,
  /// step counter included, as it was until commit(); an encode() not committed is dropped by the
  /// next one. encode() then leaves the finiteness check to the plan, which checks the bucket
  /// once and tells the other ranks. Costs a second residual (and momentum) buffer.
  void set_staged(bool on);
  /// For a plan that sums the values of `ranks` ranks in the value dtype (RandomKAllreducePlan
  /// with fp16 values): from the next encode() on, each value is sent as this rank's share of
  /// the average, v / ranks saturated so that the sum of `ranks` shares cannot overflow the
  /// value dtype (kernels/topk_math.h: value_share, share_limit); the residual keeps
  /// v - ranks * share. Decode such payloads with scale 1 (the sum is the average). ranks = 1:
  /// values as they are (the default).
  void set_shares(int ranks);
  /// Makes the last encode()'s state change permanent (staged mode; a no-op otherwise).
  void commit();
  /// Takes the last commit() back (staged mode): the state before that step's encode() is still
  /// in the second buffer set until the next encode() writes over it. Only right after a commit()
  /// (the plans track that); InvalidArgument when not staged.
  void uncommit();
  /// A payload for this step that carries no data and is flagged kPayloadSkipped (the sender's
  /// gradient held NaN or Inf): count_at(step) NaN values, which make the summed values NaN on
  /// every rank. The state does not change.
  void encode_skipped(Payload& out);
  /// Indices sent at a step, into `out` (capacity count_at(step)) on the compressor's device:
  /// the sampled ones (ascending), then those of the segments sent whole (ascending).
  int64_t indices_at(int64_t step, uint32_t* out) const;
  /// Number of values sent at a step (warm-up aware): sampled plus sent whole.
  int64_t count_at(int64_t step) const;
  /// Number of elements sent whole every step (segments below dense_below).
  int64_t dense_numel() const;
  const float* residual() const;
  /// The corrected momentum u (null when momentum == 0), on the compressor's device.
  const float* momentum_buffer() const;
  const RandomKConfig& config() const { return cfg_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  RandomKConfig cfg_;
  int64_t numel_;
  Device device_;
  int64_t step_ = 0;
  CompressionStats stats_;
};

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<SparsifyConfig::ClipScaling> {
  static constexpr const char* what = "clip_scaling";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<SparsifyConfig::ClipScaling> table[] = {
      {"sqrt_world", SparsifyConfig::ClipScaling::kSqrtWorld},
      {"none", SparsifyConfig::ClipScaling::kNone}};
};

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The 1-bit two-phase allreduce (onebit_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/onebit.hpp"
#include "gradcomp/plan.hpp"

namespace gradcomp {

/// 1-bit Adam's compressed allreduce (Tang et al. 2021) as a plan, for one rank of `world`:
///  (1) x = g + worker_error (with cfg.momentum m: u = m u + g, x = u + worker_error) is
///      compressed (scaled sign, one scale per block of S elements) and
///      its bits are split into P server chunks of W words, W = the smallest multiple of S / 32
///      with 32 W P >= n (chunks hold whole blocks; the last chunks are padded with zero bits and
///      an empty block has scale 0). Each chunk holds NB = 32 W / S blocks. Send block p =
///      [NB scales of chunk p (fp32) | W words of bits]: B = 4 (NB + W) bytes.
///  (2) all-to-all (ElemType::kU8, B + 16 bytes per rank when P > 1): rank r receives chunk r
///      from every rank, each followed by its sender's step envelope (plans/envelope.hpp: the
///      step and a hash of the options). Every rank receives every sender's envelope, so ranks
///      at different steps (a state loaded on one rank only) or with other options fail the step
///      on every rank with InvalidArgument before anything is combined (with check_finite, which
///      double-buffers the state, nothing changed).
///  (3) rank r decodes the P blocks, sums them in rank order, multiplies by 1/P, adds
///      server_error and recompresses its chunk with the same blocks (server error feedback).
///  (4) allgather (ElemType::kU8, B bytes per rank) of the recompressed blocks.
///  (5) every rank decodes all P blocks into the gradient (or `out`): bitwise the same result on
///      every rank.
/// S is cfg.block_size (a positive multiple of 32), or 0: one scale per server chunk (the form
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
  /// cfg.block_size is 0), scales per chunk (NB) and bytes per block (4 (NB + W)).
  int64_t chunk_elems() const { return 32 * words_per_chunk_; }
  int64_t scale_block() const { return scale_block_; }
  int64_t scales_per_chunk() const { return scales_per_chunk_; }
  size_t block_bytes() const {
    return static_cast<size_t>(4 * (words_per_chunk_ + scales_per_chunk_));
  }
  /// Bytes per rank of the all-to-all: a block and the step envelope (16 bytes) when P > 1.
  size_t exchange_block_bytes() const { return block_bytes() + (world_ > 1 ? 16 : 0); }
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
  uint64_t bytes_sent() const {
    return exchange_block_bytes() * static_cast<uint64_t>(world_) + block_bytes();
  }
  bool stateful() const override { return true; }
  std::vector<uint8_t> state_dict() const override;
  /// Restores state_dict(); throws InvalidArgument on a mismatch and then changes nothing.
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  void start(const TensorView& grad, const TensorView* out);
  /// Phase 2: every sender's envelope from the received blocks; InvalidArgument on every rank
  /// when their steps or options differ.
  void check_envelopes();
  uint32_t options_hash_ = 0;  ///< what every rank's blocks depend on (step envelope)
  void undo_state() override;
  /// The state's scalar fields (core/state_schema.hpp) of this plan.
  std::map<std::string, int64_t> state_scalars() const;
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

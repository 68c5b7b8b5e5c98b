// SPDX-License-Identifier: Apache-2.0
// The multi-bit plan: the two-phase allreduce and the reduce-scatter and allgather forms of
// sharded training (quant_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/plan.hpp"
#include "gradcomp/plan_config.hpp"
#include "gradcomp/quant.hpp"

namespace gradcomp {

/// Multi-bit quantized allreduce (gradcomp/quant.hpp): the 1-bit plan's two phases with a b-bit
/// codec (plans/two_phase.hpp holds what they share).
///  (1) x = g + worker_error (or the rotation of g, see QuantConfig::rotate) is cut into P server
///      chunks of CE elements (CE: the bucket's 32-element words split over the ranks, rounded up
///      to whole blocks); chunk q goes to rank q (all-to-all) as [header | scales | codes],
///      B = block_bytes() bytes per chunk. The worker error keeps what the codes lost.
///  (2) rank r decodes chunk r of every rank, sums them in rank order in fp32, multiplies by 1/P,
///      adds its server error and quantizes again (server error feedback, same block grid).
///  (3) allgather of the P averaged chunks; every rank decodes them all (and rotates them back):
///      bitwise the same average on every rank.
/// Every chunk starts with a 24-byte header: the sender's step envelope (plans/envelope.hpp: its
/// step, a hash of the options the chunks depend on - bits, block, scale kind and dtype, rounding,
/// the bucket's size - and a flag), the same in each chunk it sends, then the chunk's element
/// count. Every server receives every rank's envelope, so ranks whose options or steps differ (a
/// checkpoint restored on one rank only) fail the step on every rank with InvalidArgument, the
/// state unchanged, instead of averaging garbage. A NaN/Inf gradient (check_finite) raises the
/// sender's flag and the step is skipped (or raised) on every rank (OnNonFinite). What only one
/// server can see - a chunk whose count or scales were damaged in flight - it passes on in its
/// averaged chunk (a mismatch bit beside the count), so that every rank fails alike. The worker
/// and server errors are double-buffered (the step writes the other copy; a kept step swaps it
/// in), so a failed or skipped step changes no state and undo_step() can take a kept step back.
///
/// The gather route (QuantRoute::kGather, the allreduce form only): phase (1) as above, then one
/// allgather of every rank's P chunks (P B bytes each), and every rank decodes chunk q of every
/// rank, sums them in rank order in fp32 and multiplies by 1/P, as a server does, for every q:
/// one message round instead of two, and no second quantization (no server error: the average
/// of the decoded worker codes, the same bits on every rank). Each rank sends P B bytes to every
/// peer where the two phases send 2 B: the same bytes on 2 ranks, P / 2 times them on more, so
/// it pays where a link's latency costs more than those bytes. Every rank reads every rank's
/// envelope and checks every chunk; a chunk damaged on its way to one rank is refused by that
/// rank alone (as the two phases' averaged chunks are), with no state changed.
/// Its state is the two phases' (the same kind, its server error zero): a state with a server
/// error loads with that error moved into this rank's worker error for its chunk, P times over
/// (the next average delivers it), so the route can change between a save and a restore
/// without losing what error feedback still owes.
///
/// The sharded forms (PlanForm; the bucket is P equal chunks of n/P elements, no rotation):
///  - reduce-scatter: phase (1) with the worker error, then rank r decodes chunk r of every rank,
///    sums them in rank order in fp32 and writes the average (or, with `average` false, the sum)
///    into its chunk r (ZeRO++'s quantized gradients). Stochastic rounding draws element i of chunk
///    q at stream index q * (n/P rounded up to a multiple of 4) + i. No server error: nothing is
///    quantized a second time. Every rank's server sees every rank's envelope, so a NaN/Inf flag
///    or ranks that disagree end the step the same way on every rank (the step skipped, its chunk
///    NaN; or InvalidArgument); only a chunk whose count or scales were damaged in flight is seen
///    by its receiver alone, which then raises alone. check_finite must be on: a non-finite
///    gradient would otherwise give an Inf scale that only its chunk's receiver sees. State kind
///    "quant-reduce-scatter": the worker error.
///  - allgather: rank r quantizes its chunk r to nearest (no error feedback, no finiteness check,
///    no stochastic rounding: parameters are gathered, not summed, and a module's forward and
///    backward gathers must give the same values) and every rank decodes every chunk, its own
///    included, so every rank computes with the same values (ZeRO++'s quantized weights).
///    Stateless.
///
/// Example (one rank; a driver executes the collectives):
///   gradcomp::QuantConfig cfg;  cfg.bits = 4;
///   gradcomp::QuantPlan plan(cfg, n, world, rank);
///   plan.begin(TensorView::cpu(g.data(), n));
///   while (auto c = plan.next()) driver.run(*c);   // g now holds the averaged gradient
/// How the allreduce form moves its chunks (see QuantPlan): the all-to-all and the allgather of
/// the averaged chunks, or one allgather of every rank's chunks.
enum class QuantRoute : uint8_t { kTwoPhase = 0, kGather = 1 };

class QuantPlan : public BucketPlan {
 public:
  QuantPlan(const QuantConfig& cfg, int64_t numel, int world, int rank,
            DType grad_dtype = DType::kFloat32, Device device = Device::kCPU, int device_index = 0,
            void* stream = nullptr, PlanForm form = PlanForm::kAllreduce, bool average = true,
            QuantRoute route = QuantRoute::kTwoPhase);
  ~QuantPlan() override;
  /// Starts a step that averages grad (numel elements of the plan's dtype and device) in place.
  /// Checks before any state changes (InvalidArgument, also while a step is in progress). With
  /// rotate, an fp32 grad holds rotated values until the step ends; fp16/bf16 gradients are
  /// rotated in a scratch copy (4 bytes per element, kept by the plan).
  void begin(const TensorView& grad) override;
  std::optional<Collective> next() override;
  std::string name() const override;
  PlanForm form() const { return form_; }
  QuantRoute route() const { return route_; }
  int64_t numel() const override { return numel_; }
  Device device() const { return device_; }
  int64_t step() const { return step_; }
  const QuantConfig& config() const { return cfg_; }
  /// Elements per server chunk and bytes per chunk on the wire (24-byte header, scales, codes).
  int64_t chunk_elems() const { return chunk_elems_; }
  size_t block_bytes() const { return block_bytes_; }
  /// Bytes this rank hands to the collectives per step (all-to-all and / or allgather).
  uint64_t bytes_sent() const {
    const auto P = static_cast<uint64_t>(world_);
    return block_bytes_ * (form_ == PlanForm::kAllreduce
                               ? (route_ == QuantRoute::kGather ? P : P + 1)
                           : form_ == PlanForm::kReduceScatter ? P
                                                               : 1);
  }
  /// Worker error (numel floats) and this rank's server error (chunk_elems() floats), fp32 on the
  /// plan's device (rotated coordinates with rotate).
  const float* worker_error() const;
  const float* server_error() const;
  /// Floats behind worker_error() and server_error(): numel() and chunk_elems() for the
  /// allreduce (the gather route's server error stays zero), numel() and 0 for the
  /// reduce-scatter (no server error), 0 and 0 for the allgather.
  int64_t worker_error_elems() const { return form_ == PlanForm::kAllgather ? 0 : numel_; }
  int64_t server_error_elems() const { return form_ == PlanForm::kAllreduce ? chunk_elems_ : 0; }
  /// The allgather form keeps no state (no error feedback: what it gathers is parameters).
  bool stateful() const override { return form_ != PlanForm::kAllgather; }
  std::vector<uint8_t> state_dict() const override;
  /// Restores state_dict(); InvalidArgument on a mismatch or during a step (nothing changes).
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  void undo_state() override;
  /// The state's scalar fields (core/state_schema.hpp) of this plan.
  std::map<std::string, int64_t> state_scalars() const;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  QuantConfig cfg_;
  PlanForm form_;
  QuantRoute route_;
  bool average_;
  int64_t numel_;
  int world_, rank_;
  DType dtype_;
  Device device_;
  int64_t chunk_elems_ = 0;
  size_t block_bytes_ = 0;
  int64_t step_ = 0;
  /// 0 idle, 1 begun, 2 all-to-all asked, 3 allgather asked, 4 the gather route's allgather asked
  int phase_ = 0;
  uint32_t options_hash_ = 0;  ///< what every rank's chunks depend on (step envelope)
};

}  // namespace gradcomp

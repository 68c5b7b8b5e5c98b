// SPDX-License-Identifier: Apache-2.0
// The top-k plans: the DGC allreduce (topk_plan.cpp) and its reduce-scatter form
// (topk_shard_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/state_schema.hpp"
#include "gradcomp/compressor.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/topk.hpp"
#include "gradcomp/workspace.hpp"
#include "plans/gradient_plan.hpp"
#include "plans/sparsify_plan.hpp"

namespace gradcomp {

/// The reduce-scatter form of top-k (sharded training): each rank adds its gradient to its
/// residual (error feedback over the whole bucket), takes the k = ceil(ratio n/P) largest
/// magnitudes of every destination chunk (SelectOptions: exact or sampled) and sends chunk q's
/// (index, fp32 value) pairs to rank q in one all-to-all of equal parts (a 24-byte header and k
/// pairs per destination, so no size exchange is needed); rank r adds the P payloads of its chunk
/// in rank order into an fp32 chunk and writes it, divided by P (`average`) or not, into its
/// chunk r. What was not sent stays in the residual. The header is the sender's step envelope
/// (plans/envelope.hpp: its step, a hash of the bucket's size and k, and a NaN/Inf flag), the
/// same in each of its parts, then the part's pair count. Every rank receives every rank's
/// envelope, so ranks at other steps or with other k fail on every rank and a non-finite
/// gradient (check_finite) skips the step on every rank (its chunk NaN, no state changed); the
/// residual is double-buffered so a kept step can be undone. Received counts and indices are
/// checked before use (a part damaged in flight is refused by its receiver alone).
class TopKReduceScatterPlan : public GradientPlan {
 public:
  struct Options {
    double ratio = 0.01;
    SelectOptions select;  ///< exact or sampled threshold
    bool error_feedback = true;
    bool check_finite = true;
    bool average = true;
    uint64_t seed = 0;  ///< keys the sampled selection with (step, chunk)
    uint32_t tensor_id = 0;
  };
  TopKReduceScatterPlan(const Options& o, int64_t numel, DType grad_dtype, int world, int rank,
                        Device device = Device::kCPU, int device_index = 0, void* stream = nullptr);
  ~TopKReduceScatterPlan() override;
  std::optional<Collective> next() override;
  std::string name() const override { return "topk_rs"; }
  int64_t step() const { return step_; }
  int64_t k() const { return k_; }
  /// Bytes per destination chunk on the wire (header + k pairs).
  size_t part_bytes() const { return part_; }
  /// The residual (numel fp32 values on the plan's device).
  const float* residual() const;
  size_t workspace_bytes() const override;
  bool stateful() const override { return true; }
  std::vector<uint8_t> state_dict() const override;
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  detail::StateScalars state_scalars() const;  ///< the state's scalars (core/state_schema.hpp)
  void undo_state() override;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Options o_;
  int rank_;
  int64_t chunk_, k_;
  size_t part_;
  int64_t step_ = 0;
  uint32_t options_hash_ = 0;  ///< what every rank's parts depend on (step envelope)
};

/// Top-k / DGC allreduce. Phases: encode; then the sizes, in one of two ways (option exchange):
///   sizes: allgather (numel, payload bytes) of every rank, payloads later padded to the longest;
///   bound: no collective: every rank pads to the largest payload the step's k allows
///          (TopKCompressor::payload_bound, the same on every rank); the gathered headers give
///          the real sizes. Saves one collective (a latency and the skew between ranks) per
///          bucket for up to ~1.6x the payload bytes (raw-index worst case vs. delta varint).
/// The first step of a plan always exchanges sizes, which also carry each rank's bound and its
/// step envelope (plans/envelope.hpp: the step and a hash of the options below): buckets whose
/// sizes differ, ranks at different steps (one rank's state restored, not the others') or with
/// other options throw on every rank. Later steps use `exchange` (auto: the cheaper by the cost
/// model, with the last step's longest payload, known to every rank, as the estimate; the bound
/// when the route is forced dense). All ranks must build, restore and step their plans alike (as
/// a DDP job does).
/// Every choice that shapes a later step's collectives (exchange, route, bound) is made from the
/// step the ranks last agreed on, not from this rank's own counter: a rank whose state was
/// replaced in a live plan (load_state_dict of another step, within a warm-up whose k changes
/// from step to step too) still issues the collectives of the same sizes as the others, and
/// its payload's header (sparse route) or the step envelope summed after the dense values (dense
/// route: one 0/1 slot per bit of the step and of the options' hash, summed exactly) tell every
/// rank, which throws. A payload longer than the agreed bound (every rank loaded the same older
/// state) is flagged in its header, and the step gathers the payloads again at their real sizes.
/// After a failed step the next one exchanges sizes again.
/// The cost model picks the route from the longest payload (the bound when no sizes were
/// exchanged; the same decision on every rank):
///   sparse: allgather of the padded payloads (~ k (P-1) index/value pairs per rank), then
///           every rank decodes all payloads in rank order;
///   dense:  own payload decoded into an fp32 vector, rank-ordered allreduce (~ 2 n (P-1)/P
///           values per rank);
/// every payload is decoded with scale 1/P, so the average is the rank-ordered sum of the scaled
/// decodes. Both routes and both exchanges give the same bits (0 + v and v + 0 are exact;
/// padding is never decoded). fp32 gradients are decoded straight into the gradient.
///
/// Example:
///   gradcomp::TopKConfig cfg;  cfg.ratio = 0.001;
///   gradcomp::TopKAllreducePlan plan(cfg, n, comm.size(), {.cost = measure_cost_model(comm)});
/// Its compressor, state and undo: detail::SparsifyPlan. A rank whose step differs from the
/// others' after load_state_dict() is told at the next step, on every rank (the size exchange
/// compares steps, the one-collective exchange the payload headers' step).
class TopKAllreducePlan : public detail::SparsifyPlan<TopKCompressor> {
 public:
  TopKAllreducePlan(const TopKConfig& cfg, int64_t numel, int world,
                    const TopKPlanOptions& opt = {}, DType grad_dtype = DType::kFloat32,
                    Device device = Device::kCPU, int device_index = 0, void* stream = nullptr);
  /// A step that fails its checks (ranks at different steps or with other options, a corrupt
  /// payload) throws on every rank and ends: nothing was committed, and the plan is idle again
  /// (load_state_dict() may follow).
  std::optional<Collective> next() override;
  std::string name() const override { return "topk"; }
  size_t workspace_bytes() const override;
  const TopKPlanStats& stats() const { return stats_; }
  /// The route the cost model picks for these sizes (exposed for tests and the benchmark).
  TopKRoute choose(uint64_t max_payload_bytes) const;
  /// The exchange the next step uses (the same on every rank; exposed for tests).
  TopKExchange next_exchange() const;

 private:
  std::optional<Collective> advance();  ///< next() without the failure handling
  float* target();  ///< where the fp32 average is accumulated (the gradient itself when fp32)
  void finish();    ///< casts the accumulator into an fp16/bf16 gradient
  /// Records the route for the longest payload and starts it (dense allreduce or payloads).
  std::optional<Collective> send(uint64_t longest);
  /// Bound exchange: each rank's payload size from the gathered headers (checked); true when a
  /// payload did not fit the bound and the payloads must be gathered again at their sizes.
  bool read_gathered_sizes(const uint8_t* gathered);
  /// Pads this rank's payload to stride_ (the longest payload, rounded) and gathers them all.
  Collective gather_payloads(const char* tag);
  /// Dense route: the step envelope after the n dense values (plans/envelope.hpp; its flag: a
  /// rank's gradient was not finite).
  static constexpr size_t kDenseSlots = 65;
  void put_dense_slots(float* slots);
  /// Checks the summed slots: true when a rank's gradient was not finite (the step is skipped);
  /// throws on every rank when the ranks' steps or options differ.
  bool check_dense_slots();
  TopKPlanOptions opt_;
  TopKPlanStats stats_;
  Payload payload_;
  Buffer sizes_, gathered_, acc_;
  /// The size exchange's fields per rank: numel, payload bytes, payload bound, then the step
  /// envelope (plans/envelope.hpp, 16 bytes in the last two fields: the step and options_hash_).
  static constexpr size_t kSizeFields = 5;
  static constexpr size_t kEnvelopeField = 3;
  /// The options that shape later steps' collectives (the step envelope's options hash).
  uint32_t options_hash_ = 0;
  std::vector<int64_t> host_sizes_;
  std::vector<uint64_t> payload_bytes_;  ///< each rank's payload size (sparse route)
  std::vector<PayloadHeader> headers_;   ///< bound exchange: the gathered headers, on the host
  size_t stride_ = 0;
  TopKRoute route_ = TopKRoute::kSparse;
  TopKExchange exchange_ = TopKExchange::kSizes;
  int64_t own_step_ = 0;      ///< this step: this rank's own step (the compressor's counter)
  uint64_t max_payload_ = 0;  ///< the largest payload any step of the schedule can send
  bool overflowed_ = false;   ///< this step: the payload did not fit the agreed bound
  Buffer dense_;              ///< dense route: the n fp32 values and the consensus slots
  /// Sparse route: whether a gathered payload is flagged kPayloadSkipped.
  bool any_skipped(const uint8_t* gathered);
  /// The gathered payloads' headers into headers_ (host).
  void copy_headers(const uint8_t* gathered);
  /// Keeps (commit) or drops the step's state change and ends the step (GradientPlan::end_step).
  void settle(bool skip);
  /// Whether the step's sum (n fp32 values, the same on every rank) holds a NaN or Inf;
  /// `gathered`: the sparse route's payloads (their values tell when no overflow is possible).
  bool sum_overflowed(const float* sum, const uint8_t* gathered);
};

}  // namespace gradcomp

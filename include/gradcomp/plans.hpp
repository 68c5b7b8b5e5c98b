// SPDX-License-Identifier: Apache-2.0
// Every bucket plan: plain, fp16/bf16 cast, top-k (sparse allgather or densify, chosen per bucket
// by a cost model), random-k, the 1-bit and multi-bit two-phase allreduces and PowerSGD;
// make_plan.hpp builds any of them by name. Each is a step machine (plan.hpp) that any driver
// executes: run_plan() over an MPI or NCCL communicator, run_plans_in_process() in tests, the
// Python driver over torch.distributed.
//
// Usage, every step of every bucket:
//   plan.begin(grad);                  // grad: this rank's gradient bucket (averaged in place)
//   gradcomp::run_plan(plan, comm);    // or PlanRunner::run, or any other driver
//
// Every plan ends with the same bits on every rank: all sums are taken in rank order (rank 0
// first) and the averaging is one division by the number of ranks, in fp32.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/compressor.hpp"
#include "gradcomp/cost_model.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/quant.hpp"
#include "gradcomp/topk.hpp"
#include "gradcomp/types.hpp"
#include "gradcomp/workspace.hpp"

namespace gradcomp {

/// Element type of a gradient dtype on the wire.
ElemType elem_type(DType t);

/// Shared part of the plans of this header: bucket size, dtype, device, rank count, the bound
/// gradient and the phase counter.
class GradientPlan : public BucketPlan {
 public:
  GradientPlan(int64_t numel, DType dtype, int world, Device device, int device_index,
               void* stream);
  ~GradientPlan() override;
  /// Binds this step's gradient (numel, dtype and device fixed at construction; checked) and
  /// restarts the step machine. The average is written back into `grad` when next() returns
  /// nullopt.
  void begin(const TensorView& grad) override;
  int64_t numel() const override { return numel_; }
  int world() const { return world_; }
  /// Bytes of workspace this plan holds (grow-only; stable after the first steps).
  virtual size_t workspace_bytes() const = 0;

 protected:
  /// A collective on this plan's device and stream.
  Collective make(CollectiveKind kind, ElemType type, const void* send, void* recv, size_t count,
                  const char* tag) const;
  /// Checks that begin() was called; next() after completion returns nullopt.
  void require_begun() const;
  /// InvalidArgument unless no step is in progress (`what`: the refused call).
  void require_idle(const char* what) const;
  static constexpr int kDone = 1 << 20;  ///< phase_ of a finished step
  virtual void on_begin() {}
  /// The first index of the bound gradient that holds NaN or Inf, or -1.
  int64_t first_nonfinite();
  /// The same for n elements of dtype t at `data` (on the plan's device and stream).
  int64_t first_nonfinite(const void* data, DType t, int64_t n);
  /// Ends a step whose data said whether some rank's gradient was not finite (`skip`): a skipped
  /// step fills the gradient with NaN, records it and, with OnNonFinite::kRaise, throws
  /// InvalidArgument on this rank (`bad_index`: this rank's first bad index, or -1). `undoable`:
  /// a kept step whose prior state the plan still holds (see BucketPlan::undo_step()).
  void end_step(bool skip, int64_t bad_index, bool undoable = false);

  int64_t numel_;
  DType dtype_;
  int world_;
  Device device_;
  int device_index_;
  void* stream_;
  TensorView grad_;
  int phase_ = -1;  ///< -1: no step bound; 0: begun; higher: plan-specific

 private:
  struct Scan;
  std::unique_ptr<Scan> scan_;
};

/// Plain allreduce: sum in the gradient's dtype (in place), then divide by the rank count.
///
/// Example:  gradcomp::DenseAllreducePlan plan(n, gradcomp::DType::kFloat32, comm.size());
class DenseAllreducePlan : public GradientPlan {
 public:
  DenseAllreducePlan(int64_t numel, DType dtype, int world, Device device = Device::kCPU,
                     int device_index = 0, void* stream = nullptr);
  std::optional<Collective> next() override;
  std::string name() const override { return "dense"; }
  size_t workspace_bytes() const override { return 0; }
};

/// How a cast plan sums.
enum class CastRoute : uint8_t {
  /// One allreduce in the wire type: rank-ordered sum, rounding to the wire type after every
  /// addition. Where the backend sums fp16/bf16 fast (NCCL).
  kAllreduce = 0,
  /// All-to-all of wire-type chunks (chunk r of every rank to rank r), a rank-ordered fp32 sum of
  /// the P chunks rounded once to the wire type, then an allgather of the reduced chunks. The
  /// same bytes on each link as a ring allreduce (2(P-1)/P of the buffer), but the backend only
  /// moves bytes: for backends that sum half precision slowly (gloo on CPU) or not at all.
  kReduceScatter = 1,
  /// One allgather of the whole wire-type buffer, then the same rank-ordered fp32 sum of the P
  /// copies rounded once (bitwise the reduce-scatter route's result): one message round where
  /// the reduce-scatter route takes two (an all-to-all, then an allgather) and a ring allreduce
  /// 2(P-1), for (P-1) times the buffer on each link. On 2 ranks that is the ring's bytes for
  /// half its rounds; on more, it pays where latency outweighs bytes (links of tens of ms).
  kGather = 2,
};

/// Cast allreduce: wire = cast_to_wire(grad / P) (divided first, so fp16 does not overflow),
/// summed by `route` (see CastRoute), grad = the sum. Every rank ends with the same bits on
/// either route.
///
/// Example:  gradcomp::CastAllreducePlan plan(n, DType::kFloat32, DType::kFloat16, P);
class CastAllreducePlan : public GradientPlan {
 public:
  CastAllreducePlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world,
                    Device device = Device::kCPU, int device_index = 0, void* stream = nullptr,
                    CastRoute route = CastRoute::kAllreduce);
  std::optional<Collective> next() override;
  std::string name() const override;
  CastRoute route() const { return route_; }
  size_t workspace_bytes() const override { return wire_.capacity() + chunks_.capacity(); }

 private:
  std::optional<Collective> next_reduce_scatter();
  std::optional<Collective> next_gather();
  DType wire_dtype_;
  CastRoute route_;
  Buffer wire_;
  Buffer chunks_;  ///< kReduceScatter: the P received chunks, then the own reduced chunk;
                   ///< kGather: the P buffers (summed widened in one pass, never stored in fp32)
};

/// What a plan computes over a bucket of P equal chunks (chunk r: elements [r n/P, (r+1) n/P)).
/// Sharded data parallelism (FSDP2, ZeRO) needs the two halves of an allreduce: gradients leave a
/// rank by a reduce-scatter and parameters arrive by an allgather.
enum class PlanForm : uint8_t {
  kAllreduce = 0,      ///< every rank ends with the whole average (DDP)
  kReduceScatter = 1,  ///< rank r ends with the average (or sum) of chunk r in its chunk r; the
                       ///< rest of the bucket is left as scratch (unspecified values)
  kAllgather = 2,      ///< rank r's chunk r is its input; every rank ends with every rank's chunk
};

/// The reduce-scatter and allgather forms of the plain and cast plans (PlanForm): chunks move in
/// `wire_dtype` (float32 = lossless for an fp32 bucket; float16 / bfloat16 = half the bytes) and
/// are summed in fp32 in rank order, so every rank's chunk has the same bits whoever computes
/// it. Reduce-scatter: an all-to-all of the wire chunks, then rank r sums the P chunks r and
/// writes sum / P (`average`, else the sum) into its chunk r in the bucket's dtype; an fp16 or
/// bf16 wire divides before the cast (so fp16 does not overflow), an fp32 wire after the sum (so
/// the result is what a rank-ordered fp32 reduce-scatter gives). Allgather: each rank's chunk r
/// in the wire dtype to every rank, widened back into the bucket. Stateless: a NaN simply travels.
/// The bucket's numel must be a multiple of P.
///
/// Example:  gradcomp::ShardCastPlan rs(n, DType::kFloat32, DType::kBFloat16, P,
///                                      PlanForm::kReduceScatter);
class ShardCastPlan : public GradientPlan {
 public:
  ShardCastPlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world, int rank,
                PlanForm form, bool average = true, Device device = Device::kCPU,
                int device_index = 0, void* stream = nullptr);
  std::optional<Collective> next() override;
  std::string name() const override;
  PlanForm form() const { return form_; }
  int64_t chunk_elems() const { return chunk_; }
  size_t workspace_bytes() const override {
    return wire_.capacity() + chunks_.capacity() + wide_.capacity();
  }

 private:
  DType wire_dtype_;
  int rank_;
  PlanForm form_;
  bool average_;
  int64_t chunk_;
  Buffer wire_, chunks_, wide_;
};

/// The reduce-scatter form of top-k (sharded training): each rank adds its gradient to its
/// residual (error feedback over the whole bucket), takes the k = ceil(ratio n/P) largest
/// magnitudes of every destination chunk (SelectOptions: exact or sampled) and sends chunk q's
/// (index, fp32 value) pairs to rank q in one all-to-all of equal parts (a 24-byte header and k
/// pairs per destination, so no size exchange is needed); rank r adds the P payloads of its chunk
/// in rank order into an fp32 chunk and writes it, divided by P (`average`) or not, into its
/// chunk r. What was not sent stays in the residual. The header carries the step, k and a
/// NaN/Inf flag: ranks at other steps or with other k fail on every rank, a non-finite gradient
/// (check_finite) skips the step on every rank (its chunk NaN, no state changed); the residual is
/// double-buffered so a kept step can be undone. Received indices are checked before use.
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
  void undo_state() override;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Options o_;
  int rank_;
  int64_t chunk_, k_;
  size_t part_;
  int64_t step_ = 0;
};

/// Which exchange a top-k step used.
enum class TopKRoute : uint8_t {
  kAuto = 0,    ///< (option) let the cost model choose per step
  kSparse = 1,  ///< allgather of the padded payloads, every rank decodes all in rank order
  kDense = 2,   ///< decode own payload into a dense fp32 vector, rank-ordered allreduce
};

/// How a top-k step learns the payload sizes before the payload allgather.
enum class TopKExchange : uint8_t {
  kAuto = 0,   ///< (option) the cost model chooses per step from the last step's payloads
  kBound = 1,  ///< one allgather, every payload padded to the largest a step can write
  kSizes = 2,  ///< allgather of the sizes first, then the payloads padded to the longest
};

struct TopKPlanOptions {
  TopKRoute route = TopKRoute::kAuto;
  TopKExchange exchange = TopKExchange::kAuto;
  /// Measured speed of the communicator (measure_cost_model); identical on every rank.
  CostModel cost;
};

/// What a top-k plan did (per plan object, i.e. per bucket).
struct TopKPlanStats {
  int64_t steps = 0;
  int64_t sparse_steps = 0;
  int64_t dense_steps = 0;
  int64_t bound_steps = 0;  ///< steps that exchanged no sizes (one collective)
  TopKRoute last_route = TopKRoute::kAuto;
  TopKExchange last_exchange = TopKExchange::kAuto;
  uint64_t last_stride = 0;         ///< bytes per rank of the last payload allgather
  uint64_t last_max_payload = 0;    ///< largest payload of the last step (bytes; 0: unknown)
  uint64_t last_total_payload = 0;  ///< sum over ranks of the last step's payloads (0: unknown)
  double last_sparse_cost_s = 0, last_dense_cost_s = 0;  ///< the model's estimates
};

/// Top-k / DGC allreduce. Phases: encode; then the sizes, in one of two ways (option exchange):
///   sizes: allgather (numel, payload bytes) of every rank, payloads later padded to the longest;
///   bound: no collective: every rank pads to the largest payload the step's k allows
///          (TopKCompressor::payload_bound, the same on every rank); the gathered headers give
///          the real sizes. Saves one collective (a latency and the skew between ranks) per
///          bucket for up to ~1.6x the payload bytes (raw-index worst case vs. delta varint).
/// The first step of a plan always exchanges sizes, which also carry each rank's step and bound:
/// buckets whose sizes differ, ranks at different steps (one rank's state restored, not the
/// others') or with different densities throw on every rank naming both values. Later steps use
/// `exchange` (auto: the cheaper by the cost model, with the last step's longest payload, known
/// to every rank, as the estimate; the bound when the route is forced dense). All ranks must
/// build, restore and step their plans alike (as a DDP job does).
/// Every choice that shapes a later step's collectives (exchange, route, bound) is made from the
/// step the ranks last agreed on, not from this rank's own counter: a rank whose state was
/// replaced in a live plan (load_state_dict of another step, within a warm-up whose k changes
/// from step to step too) still issues the collectives of the same sizes as the others, and
/// its payload's header (sparse route) or the consensus slots after the dense values (dense
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
class TopKAllreducePlan : public GradientPlan {
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
  TopKCompressor& compressor() { return comp_; }
  bool stateful() const override { return true; }
  /// The compressor's state (residual, momentum, step).
  std::vector<uint8_t> state_dict() const override { return comp_.state_dict(); }
  /// Restores state_dict(); InvalidArgument during a step or on a mismatch (nothing changes).
  /// A rank whose step then differs from the others' is told at the next step, on every rank
  /// (the size exchange compares steps, the one-collective exchange the payload headers' step).
  void load_state_dict(const uint8_t* data, size_t nbytes) override {
    require_idle("load_state_dict()");
    comp_.load_state_dict(data, nbytes);
    start_step();
  }
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
  TopKCompressor comp_;
  TopKPlanOptions opt_;
  TopKPlanStats stats_;
  Payload payload_;
  Buffer sizes_, gathered_, acc_;
  /// The size exchange's fields per rank: numel, payload bytes, step, payload bound, and a
  /// fingerprint of the options that shape later steps' collectives (config_fingerprint_).
  static constexpr size_t kSizeFields = 5;
  int64_t config_fingerprint_ = 0;
  std::vector<int64_t> host_sizes_;
  std::vector<uint64_t> payload_bytes_;  ///< each rank's payload size (sparse route)
  std::vector<PayloadHeader> headers_;   ///< bound exchange: the gathered headers, on the host
  size_t stride_ = 0;
  TopKRoute route_ = TopKRoute::kSparse;
  TopKExchange exchange_ = TopKExchange::kSizes;
  bool check_finite_ = true;
  int64_t bad_ = -1;  ///< this step: this rank's first non-finite index, or -1
  /// The step every rank was at when the last step ended (+1 when it was kept), which sizes the
  /// next step's collectives; -1 when unknown (a new plan, or the last step failed): the next
  /// step then exchanges sizes.
  int64_t agreed_step_ = -1;
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
  void undo_state() override {
    comp_.uncommit();
    if (agreed_step_ > 0) agreed_step_ -= 1;  // every rank takes the same kept step back
  }
};

/// Random-k allreduce: every rank selects the same indices (shared RNG), so the values alone
/// are summed (rank-ordered allreduce in the value dtype) and decoded once with scale 1/P. fp16
/// values (value_dtype) are sent as each rank's share of the average instead (v / P, saturated
/// so that the sum of P shares stays below 65504; RandomKCompressor::set_shares) and decoded
/// with scale 1: a sum of values each below 65504 but past it together is no overflow step.
/// The allreduce's length is decided from the step the ranks last agreed on (the schedule's
/// largest count for a new plan or after a failed step), not from this rank's own counter, so
/// that a rank whose state was replaced in a live plan (within a warm-up whose count changes
/// from step to step too) sums as many values as the others; the consensus slots after them
/// then tell every rank. When every rank's count exceeds the agreed one (every rank loaded the
/// same older state) the step encodes and sums again at that count.
///
/// Example:  gradcomp::RandomKAllreducePlan plan(gradcomp::RandomKConfig{}, n, comm.size());
class RandomKAllreducePlan : public GradientPlan {
 public:
  RandomKAllreducePlan(const RandomKConfig& cfg, int64_t numel, int world,
                       DType grad_dtype = DType::kFloat32, Device device = Device::kCPU,
                       int device_index = 0, void* stream = nullptr);
  std::optional<Collective> next() override;
  std::string name() const override { return "randomk"; }
  size_t workspace_bytes() const override;
  RandomKCompressor& compressor() { return comp_; }
  bool stateful() const override { return true; }
  /// The compressor's state (residual, momentum, step).
  std::vector<uint8_t> state_dict() const override { return comp_.state_dict(); }
  /// Restores state_dict(); InvalidArgument during a step or on a mismatch (nothing changes).
  void load_state_dict(const uint8_t* data, size_t nbytes) override {
    require_idle("load_state_dict()");
    comp_.load_state_dict(data, nbytes);
    start_step();
  }

 private:
  void undo_state() override {
    comp_.uncommit();
    if (agreed_step_ > 0) agreed_step_ -= 1;  // every rank takes the same kept step back
  }
  std::optional<Collective> advance();  ///< next() without the failure handling
  /// Encodes this step and writes the consensus slots after the values the ranks agree to sum
  /// (see next()); returns the allreduce's collective.
  Collective encode_and_send();
  /// Writes the consensus slots after the first `m` values; returns how many elements the
  /// allreduce then sums (values and slots).
  size_t put_consensus(const PayloadHeader& h, size_t m);
  /// After the sum: InvalidArgument on every rank when some rank's step or options differ;
  /// returns whether some rank's values did not fit the agreed count.
  bool check_consensus(const PayloadHeader& h);
  /// Values the allreduce carries: the count at the agreed step, or the schedule's largest.
  size_t agreed_count() const;
  RandomKCompressor comp_;
  Payload payload_;
  Buffer acc_;
  bool check_finite_ = true;
  int64_t bad_ = -1;
  uint32_t options_hash_ = 0;  ///< low bits of detail::OptionsHash (plans/options_hash.hpp)
  /// The step every rank was at when the last step ended (+1 when kept); -1 when unknown (a new
  /// plan, or the last step failed): the next step then sends the schedule's largest count.
  int64_t agreed_step_ = -1;
  int64_t max_count_ = 0;  ///< the largest count of any step of the warm-up schedule
  size_t sent_ = 0;        ///< this step: the values (and slots) the allreduce sums
  bool shares_ = false;    ///< values are sent as shares of the average (fp16 values)
};

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
  /// The state's scalar fields (plans/state_schema.hpp) of this plan.
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
/// The 24-byte chunk header carries the codec (bits, block, scale kind and dtype, rounding), the
/// chunk's element count, the sender's step and two flags; every receiver checks them, so ranks
/// whose options or steps differ (a checkpoint restored on one rank only) fail the step on every
/// rank with InvalidArgument, the state unchanged, instead of averaging garbage. A NaN/Inf
/// gradient (check_finite) is flagged in the header and the step skipped (or raised) on every rank
/// (OnNonFinite). The worker and server errors are double-buffered (the step writes the other
/// copy; a kept step swaps it in), so a failed or skipped step changes no state and undo_step()
/// can take a kept step back.
///
/// The sharded forms (PlanForm; the bucket is P equal chunks of n/P elements, no rotation):
///  - reduce-scatter: phase (1) with the worker error, then rank r decodes chunk r of every rank,
///    sums them in rank order in fp32 and writes the average (or, with `average` false, the sum)
///    into its chunk r (ZeRO++'s quantized gradients). Stochastic rounding draws element i of chunk
///    q at stream index q * (n/P rounded up to a multiple of 4) + i. No server error: nothing is
///    quantized a second time. Every rank's server sees every rank's header, so a NaN/Inf flag or
///    ranks that disagree end the step the same way on every rank (the step skipped, its chunk NaN;
///    or InvalidArgument); only a chunk whose scales were damaged in flight is seen by its receiver
///    alone, which then raises alone. check_finite must be on: a non-finite gradient would
///    otherwise give an Inf scale that only its chunk's receiver sees. State kind
///    "quant-reduce-scatter": the worker error.
///  - allgather: rank r quantizes its chunk r to nearest (no error feedback, no finiteness check,
///    no stochastic rounding: parameters are gathered, not summed, and a module's forward and
///    backward gathers must give the same values) and every rank decodes every chunk, its own
///    included, so every rank computes with the same values (ZeRO++'s quantized weights).
///    Stateless.
///
/// Example (one rank; a driver executes the collectives):
///   gradcomp::QuantConfig cfg;  cfg.bits = 4;
///   gradcomp::QuantAllreducePlan plan(cfg, n, world, rank);
///   plan.begin(TensorView::cpu(g.data(), n));
///   while (auto c = plan.next()) driver.run(*c);   // g now holds the averaged gradient
class QuantAllreducePlan : public BucketPlan {
 public:
  QuantAllreducePlan(const QuantConfig& cfg, int64_t numel, int world, int rank,
                     DType grad_dtype = DType::kFloat32, Device device = Device::kCPU,
                     int device_index = 0, void* stream = nullptr,
                     PlanForm form = PlanForm::kAllreduce, bool average = true);
  ~QuantAllreducePlan() override;
  /// Starts a step that averages grad (numel elements of the plan's dtype and device) in place.
  /// Checks before any state changes (InvalidArgument, also while a step is in progress). With
  /// rotate, an fp32 grad holds rotated values until the step ends; fp16/bf16 gradients are
  /// rotated in a scratch copy (4 bytes per element, kept by the plan).
  void begin(const TensorView& grad) override;
  std::optional<Collective> next() override;
  std::string name() const override;
  PlanForm form() const { return form_; }
  int64_t numel() const override { return numel_; }
  Device device() const { return device_; }
  int64_t step() const { return step_; }
  const QuantConfig& config() const { return cfg_; }
  /// Elements per server chunk and bytes per chunk on the wire (header, scales, codes).
  int64_t chunk_elems() const { return chunk_elems_; }
  size_t block_bytes() const { return block_bytes_; }
  /// Bytes this rank hands to the collectives per step (all-to-all and / or allgather).
  uint64_t bytes_sent() const {
    const auto P = static_cast<uint64_t>(world_);
    return block_bytes_ * (form_ == PlanForm::kAllreduce       ? P + 1
                           : form_ == PlanForm::kReduceScatter ? P
                                                               : 1);
  }
  /// Worker error (numel floats) and this rank's server error (chunk_elems() floats), fp32 on the
  /// plan's device (rotated coordinates with rotate).
  const float* worker_error() const;
  const float* server_error() const;
  /// Floats behind worker_error() and server_error(): numel() and chunk_elems() for the
  /// allreduce, numel() and 0 for the reduce-scatter (no server error), 0 and 0 for the allgather.
  int64_t worker_error_elems() const { return form_ == PlanForm::kAllgather ? 0 : numel_; }
  int64_t server_error_elems() const { return form_ == PlanForm::kAllreduce ? chunk_elems_ : 0; }
  /// The allgather form keeps no state (no error feedback: what it gathers is parameters).
  bool stateful() const override { return form_ != PlanForm::kAllgather; }
  std::vector<uint8_t> state_dict() const override;
  /// Restores state_dict(); InvalidArgument on a mismatch or during a step (nothing changes).
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  void undo_state() override;
  /// The state's scalar fields (plans/state_schema.hpp) of this plan.
  std::map<std::string, int64_t> state_scalars() const;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  QuantConfig cfg_;
  PlanForm form_;
  bool average_;
  int64_t numel_;
  int world_, rank_;
  DType dtype_;
  Device device_;
  int64_t chunk_elems_ = 0;
  size_t block_bytes_ = 0;
  int64_t step_ = 0;
  int phase_ = 0;  ///< 0 idle, 1 begun, 2 all-to-all asked, 3 allgather asked
};

/// One step of PowerSGD on a bucket, as a plan (see plan.hpp). begin() checks the gradients and
/// changes nothing when it throws; a non-finite gradient (check_finite) makes the step skipped
/// (or raising) on every rank at its first collective, changing nothing. next() runs the phases:
///   local (M, P = M Q, pack)  -> allreduce(uncompressed + P)  [or two allreduces, see config]
///   local (P /= world, orth, Q = M^T P_hat) -> allreduce(Q)
///   local (Q /= world, grad = P_hat Q^T, error = M - grad, unpack uncompressed / world)
/// Steps before start_iter: pack everything -> allreduce -> unpack / world.
///
/// Example:  gradcomp::PowerSGDPlan plan(state, 4);
///           plan.begin(grads);
///           gradcomp::run_plans_in_process({&plan0, &plan1, &plan2, &plan3});
class PowerSGDPlan : public BucketPlan {
 public:
  /// A plan over a state the caller keeps alive (several plans may step it in turn).
  PowerSGDPlan(PowerSGDState& state, int world);
  /// A plan that owns its state (what make_plan() builds).
  PowerSGDPlan(std::unique_ptr<PowerSGDState> state, int world);
  /// The bucket's gradients, in the order of the shapes given to the state; written in place.
  void begin(const std::vector<TensorView>& grads);
  /// The bucket as one flat view of its tensors laid out back to back in the state's order (a
  /// DDP bucket: its gradients are views into it); each tensor is viewed with its shape.
  void begin(const TensorView& bucket) override;
  std::optional<Collective> next() override;
  std::string name() const override { return "powersgd"; }
  /// Elements of the bucket (all its tensors), for run_plan()'s size handshake.
  int64_t numel() const override { return st_.compressed_numel() + st_.uncompressed_numel(); }
  /// The state the plan steps (error, Q, step): checkpoint it through the plan as through any
  /// other bucket plan.
  PowerSGDState& state() { return st_; }
  bool stateful() const override { return true; }
  std::vector<uint8_t> state_dict() const override { return st_.state_dict(); }
  /// Restores state_dict() into the state (see PowerSGDState::load_state_dict); throws
  /// InvalidArgument while a step is in progress.
  void load_state_dict(const uint8_t* data, size_t nbytes) override;

 private:
  enum class Phase : uint8_t { kIdle, kStart, kPlainWait, kWaitU, kWaitP, kWaitQ, kDone };
  Collective make(void* buf, size_t count, const char* tag) const;
  void phase_compress();
  void phase_project();
  void phase_finish();
  /// This rank's first bad value, for the message (CPU: a scan of the bucket).
  void find_bad();
  /// Ends a step found bad on some rank: error, Q and step restored, gradients NaN.
  std::optional<Collective> skip_step();
  /// Whether a summed buffer of n floats holds NaN or Inf (a bad rank, or an overflowing sum).
  bool sum_nonfinite(const float* buf, int64_t n);
  /// The step's first allreduce of `count` floats at buf, with the step envelope appended
  /// (plans/envelope.hpp) when world > 1.
  std::optional<Collective> first(float* buf, size_t count, const char* tag);
  /// After the first allreduce: InvalidArgument on every rank when the ranks' steps or options
  /// differ (Q and the error restored, as for a skipped step).
  void check_envelope();
  /// Puts Q (and on CUDA the error) back as they were before a compressed step.
  void restore_state();
  void undo_state() override;
  uint32_t options_hash_ = 0;  ///< what every rank's collectives depend on (envelope)
  float* envelope_ = nullptr;  ///< this step: where the summed envelope lies, until checked
  std::unique_ptr<PowerSGDState> owned_;  ///< null when the caller keeps the state
  bool bad_ = false;  ///< this step: this rank's gradient (or its P) was not finite
  bool q_ready_saved_ = false;
  bool esaved_ = false;   ///< this step copied the error (CUDA, check_finite, error feedback)
  bool flipped_ = false;  ///< this step wrote the error into the other buffer (CPU)
  bool last_compressed_ = false;  ///< the last kept step was compressed (not a plain one)
  int64_t undo_at_ = -1;          ///< the state's step count right after the last kept step
  uint64_t undo_gen_ = 0;         ///< the state's generation then (PowerSGDState::Impl)
  std::string bad_what_;
  PowerSGDState& st_;
  int world_;
  Phase phase_ = Phase::kIdle;
  std::vector<TensorView> grads_;
  std::vector<Collective> issued_;
};

/// A two-level allreduce for clusters of nodes with fast links inside a node and a slower network
/// between nodes. The job's P = N L ranks are N nodes of L ranks, node-major (rank = node L +
/// local rank, as torchrun numbers them). One step:
///  1. reduce-scatter inside the node at full precision (Scope::kNode): the bucket is cut into
///     L shards of c = ceil(n / L) elements (the last ones zero-padded); one all-to-all of the
///     shards in the bucket's dtype, then local rank i sums shard i of its node's ranks in rank
///     order in fp32 and divides by L;
///  2. the inner plan (any family, built for a bucket of c elements and N ranks) averages shard
///     i across the nodes among the ranks of local rank i (Scope::kCross): each rank compresses
///     1/L of the gradient and the cross-node traffic is split over L links;
///  3. allgather of the shards inside the node (Scope::kNode), written back into the bucket.
/// The result is the average over all P ranks, identical on every rank; it equals, shard by
/// shard, the inner plan's average over N ranks of the node means. With one node (N = 1) there
/// is no inner plan: steps 1 and 3 are the whole (full-precision) allreduce; with one rank per
/// node (L = 1) steps 1 and 3 are skipped.
///
/// Agreement. Every shard sent in step 1 carries a 16-byte header (this plan's step and a hash of
/// the family, options, bucket (id, size, shapes) and layout); a rank that receives a header
/// other than its own poisons its shard (NaN) so that its cross group skips the step, and raises
/// once the step is over (the other nodes see a skipped step: with check_finite off, or a
/// stateless family, only the NaN average; nothing more crosses the nodes for it). The
/// allgather of step 3 carries each shard's outcome (kept, skipped, failed), so every rank sees
/// every shard's: when one was skipped (a NaN/Inf in some rank's gradient, found by the inner
/// plan's check_finite) every rank's bucket comes out NaN, the shards that were kept are taken
/// back (undo_step) and the plan's policy (set_on_nonfinite) applies on every rank; when one
/// failed (the inner plan raised on its cross group: ranks at different steps, other options)
/// every rank raises, and no state changed. The inner plan always runs with OnNonFinite::kSkip.
/// A rank never throws before the step's last collective, so no peer is left waiting.
///
/// State: the step counter and the inner plan's state (this rank's shard), checked against the
/// layout on load. A checkpoint resumes on the same layout only.
///
/// Example (2 nodes of 2 ranks; `node` and `cross` are communicators of those groups):
///   gradcomp::BucketSpec b;  b.numel = n;  b.world = 4;  b.rank = r;
///   auto plan = gradcomp::make_hierarchical_plan("topk", b, /*per_node=*/2, {{"ratio", 0.01}});
///   plan->begin(grad);  gradcomp::run_plan(*plan, node, cross);
class HierarchicalPlan : public GradientPlan {
 public:
  /// `inner` averages a bucket of shard_elems(numel, per_node) elements over world / per_node
  /// ranks (nullptr when world == per_node); `options_hash` identifies its family and options
  /// (ranks with another hash fail the step).
  HierarchicalPlan(std::unique_ptr<BucketPlan> inner, int64_t numel, DType dtype, int world,
                   int rank, int per_node, uint64_t options_hash, Device device = Device::kCPU,
                   int device_index = 0, void* stream = nullptr);
  ~HierarchicalPlan() override;
  /// Elements of each shard: ceil(numel / per_node).
  static int64_t shard_elems(int64_t numel, int per_node);
  /// Local rank i's shard's tensors: each tensor of `shapes` (the bucket's, back to back; {} =
  /// one 1-D tensor) cut to [i c, (i + 1) c), whole rows of a matrix kept as a matrix (rows x the
  /// product of the other dimensions), partial rows and vectors as 1-D pieces, and the zero
  /// padding as a last 1-D piece. What the inner plan of a family that reads shapes (PowerSGD,
  /// random-k's dense_below) is built with.
  static std::vector<std::vector<int64_t>> shard_shapes(
      const std::vector<std::vector<int64_t>>& shapes, int64_t numel, int per_node, int local);
  std::optional<Collective> next() override;
  std::string name() const override;
  bool stateful() const override { return inner_ && inner_->stateful(); }
  std::vector<uint8_t> state_dict() const override;
  void load_state_dict(const uint8_t* data, size_t nbytes) override;
  size_t workspace_bytes() const override;
  int per_node() const { return per_node_; }
  int nodes() const { return world_ / per_node_; }
  int local_rank() const { return rank_ % per_node_; }
  int64_t step() const { return step_; }
  /// The plan that averages this rank's shard across nodes (nullptr with one node).
  const BucketPlan* inner() const { return inner_.get(); }

 private:
  void on_begin() override;
  void undo_state() override;
  std::optional<Collective> forward();
  std::optional<Collective> gather_shards();
  void finish();
  /// A collective among the ranks of this node.
  Collective on_node(CollectiveKind kind, const void* send, void* recv, size_t count,
                     const char* tag) const;
  /// Elements of the bucket in shard i (the rest of the shard is zero padding).
  size_t shard_len(size_t i) const;
  struct Impl;
  std::unique_ptr<BucketPlan> inner_;
  int rank_, per_node_;
  int64_t shard_;
  uint64_t options_hash_;
  int64_t step_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<TopKRoute> {
  static constexpr const char* what = "top-k route";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<TopKRoute> table[] = {
      {"auto", TopKRoute::kAuto}, {"sparse", TopKRoute::kSparse}, {"dense", TopKRoute::kDense}};
};

template <>
struct EnumNames<TopKExchange> {
  static constexpr const char* what = "top-k size exchange";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<TopKExchange> table[] = {{"auto", TopKExchange::kAuto},
                                                     {"bound", TopKExchange::kBound},
                                                     {"sizes", TopKExchange::kSizes}};
};

template <>
struct EnumNames<PlanForm> {
  static constexpr const char* what = "plan form";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<PlanForm> table[] = {{"allreduce", PlanForm::kAllreduce},
                                                 {"reduce_scatter", PlanForm::kReduceScatter},
                                                 {"allgather", PlanForm::kAllgather}};
};

template <>
struct EnumNames<CastRoute> {
  static constexpr const char* what = "cast route";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<CastRoute> table[] = {{"allreduce", CastRoute::kAllreduce},
                                                  {"reduce_scatter", CastRoute::kReduceScatter},
                                                  {"gather", CastRoute::kGather}};
};

}  // namespace gradcomp

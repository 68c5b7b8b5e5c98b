// SPDX-License-Identifier: Apache-2.0
// One way to build a bucket plan of any family by name, for C++ callers and for the Python hooks
// alike: the option names, their defaults and their parsing live here, once.
//
// Example:
//   gradcomp::BucketSpec b;  b.numel = n;  b.world = comm.size();  b.rank = comm.rank();
//   auto plan = gradcomp::make_plan("topk", b, {{"ratio", 0.01}, {"momentum", 0.9}});
//   plan->begin(grad);  gradcomp::run_plan(*plan, comm);   // grad now holds the average
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "gradcomp/onebit.hpp"
#include "gradcomp/orthogonalization.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/plan_config.hpp"
#include "gradcomp/quant.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/topk.hpp"

namespace gradcomp {

/// An option value: a flag, an integer, a real, a name, or a list of reals (warm-up ratios).
/// An integer is accepted where a real is expected; nothing else is converted.
using PlanOption = std::variant<bool, int64_t, double, std::string, std::vector<double>>;
using PlanOptions = std::map<std::string, PlanOption>;

/// The bucket a plan is built for, and where it runs.
struct BucketSpec {
  int64_t numel = 0;              ///< elements of the flat bucket
  DType dtype = DType::kFloat32;  ///< the gradients' dtype
  int world = 1;                  ///< ranks in the group
  int rank = 0;                   ///< this rank in the group (the 1-bit plan's server chunk)
  Device device = Device::kCPU;
  int device_index = 0;
  void* stream = nullptr;  ///< cudaStream_t for CUDA buckets
  /// The bucket's tensors in order, laid out back to back (PowerSGD needs their matrix shapes,
  /// random-k their sizes for dense_below; {} = one 1-D tensor of numel elements). A 0-d tensor
  /// is {} inside the list ({1} works too).
  std::vector<std::vector<int64_t>> shapes;
  /// Which bucket of the model this is: keys the RNG of top-k sampling, random-k and PowerSGD's
  /// initial Q, so buckets draw differently. Identical on every rank.
  uint32_t bucket_id = 0;
  /// The backend that will run the collectives ("gloo", "nccl", "mpi", ...; "" = unknown). Only
  /// the cast plans' route="auto" reads it: gloo sums half precision slowly on the CPU, so the
  /// cast then goes all-to-all + rank-ordered fp32 sum + allgather (CastRoute::kReduceScatter);
  /// elsewhere one allreduce in the wire type. Unknown: kReduceScatter on the CPU.
  std::string backend;
};

/// The families make_plan() knows, in the registry's fixed order (plans/families.cpp, where a
/// family is added): "allreduce", "fp16", "bf16", "topk", ...
std::vector<std::string> plan_names();

/// What a caller needs to know about a family without building a plan, read from the one
/// registry the factory uses (so a list kept elsewhere cannot drift from it).
struct FamilyTraits {
  std::string name;
  bool stateful = false;                 ///< plan_is_stateful(name)
  bool uses_shapes = false;              ///< its plans read BucketSpec::shapes (PowerSGD, random-k)
  std::vector<PlanForm> shard_forms;     ///< reduce_scatter / allgather forms (make_shard_plan)
  std::vector<std::string> state_kinds;  ///< the state_dict() kinds its plans write
  /// What an option means (the family's own entries for the options reference): `form` "" for
  /// every table, else "reduce_scatter" / "allgather"; `values`: the accepted names.
  struct Doc {
    std::string option, form, meaning;
    std::vector<std::string> values;
  };
  std::string summary;  ///< one line: what the family is ("" where the reference has its own)
  /// Other spellings make_plan accepts for its options: {spelling, option}.
  std::vector<std::pair<std::string, std::string>> aliases;
  std::vector<Doc> option_docs;
};
/// Every family's traits, in plan_names() order.
std::vector<FamilyTraits> family_traits();

/// Every option of a family with its default (InvalidArgument for an unknown family). These are
/// the recommended settings, and for most options the configuration structs' own defaults; where
/// they differ it is on purpose and said here:
///  - onebit: scaling "sign_l2", block_size 128, rotate true (OneBitConfig{} is the 1-bit Adam
///    paper's form: one scale per server chunk, no rotation; that form was measured
///    collapse or trail plain DDP on Fashion-MNIST).
PlanOptions plan_defaults(const std::string& name);

/// Whether the family's plans carry state between steps (error feedback, momentum, Q): their
/// state_dict() must be checkpointed with the model.
bool plan_is_stateful(const std::string& name);

/// Builds the plan of family `name` for the bucket. Options not given take plan_defaults(name);
/// an unknown option, a value of the wrong type or an invalid value is an InvalidArgument naming
/// it (and the known options), before anything is allocated.
std::unique_ptr<BucketPlan> make_plan(const std::string& name, const BucketSpec& bucket,
                                      const PlanOptions& options = {});

/// Builds family `name`'s two-level plan (HierarchicalPlan, plans/hierarchical_plan.hpp) for a job
/// of bucket.world ranks in nodes of `per_node` ranks, node-major (bucket.rank / per_node is the
/// node): a full-precision reduce-scatter inside the node, the family's plan across the nodes on
/// each shard (built by make_plan for the shard, world / per_node ranks, the options given; its
/// shapes cut by HierarchicalPlan::shard_shapes and its RNG keyed by the bucket and the shard),
/// an allgather inside the node. Run it with run_plan(plan, node, cross) (gradcomp/comm.hpp) or
/// a driver that honours Collective::scope. InvalidArgument as make_plan, and when per_node does
/// not divide the world size.
std::unique_ptr<BucketPlan> make_hierarchical_plan(const std::string& name,
                                                   const BucketSpec& bucket, int per_node,
                                                   const PlanOptions& options = {});

/// The configuration make_plan("topk" / "randomk", ...) gives its compressor, for callers that
/// want the per-tensor codec (TopKCompressor, RandomKCompressor) rather than a bucket plan: the
/// same option table (names, types, defaults). Options that only a plan has (route, exchange,
/// latency_s, bandwidth_Bps, clip_scaling) are refused: a codec has no world size, and clips at
/// clip_norm where a plan clips each rank at clip_norm / sqrt(world) by default. InvalidArgument
/// as make_plan for unknown options, wrong types and invalid values.
TopKConfig topk_config(const PlanOptions& options, uint32_t tensor_id = 0);
RandomKConfig randomk_config(const PlanOptions& options, uint32_t tensor_id = 0);
/// The same for the per-tensor 1-bit codec (OneBitCompressor): the onebit plan's table, so the
/// codec's defaults are the plan's (scaled sign with an L2 scale per block of 128). `scaling`
/// "column_means" (1-bit SGD's per-column means, which the plan refuses: its groups are a
/// matrix's columns) takes block_size 0, the default when block_size is not given. The plan's
/// rotation and momentum are refused when asked for (rotate true, momentum non-zero), as are the
/// options the plan alone has.
OneBitConfig onebit_config(const PlanOptions& options, uint32_t tensor_id = 0);

/// The families with a reduce-scatter and an allgather form (PlanForm), for sharded data
/// parallelism (FSDP2, ZeRO): "allreduce" (plain: the wire is the bucket's dtype), "fp16",
/// "bf16" (ShardCastPlan: fp32 sums in rank order), "topk" (TopKReduceScatterPlan; no allgather
/// form) and "quant" (QuantPlan's forms).
std::vector<std::string> shard_plan_names();
/// The options of a shard plan with their defaults: the family's (plan_defaults) without those
/// that only the allreduce has (the cast route, quant's rotate), plus "average" (reduce-scatter:
/// true = the chunk's average, false = its sum). The quant allgather has no error_feedback,
/// check_finite or on_nonfinite, and 8 bits by default. "topk": ratio (default 0.01), method,
/// sample_rate, error_feedback, check_finite, on_nonfinite, seed, average.
PlanOptions shard_plan_defaults(const std::string& name, PlanForm form);
/// Builds family `name`'s plan of form `form` (reduce_scatter or allgather) for the bucket, which
/// is P equal chunks (numel a multiple of bucket.world); options as make_plan (InvalidArgument
/// for unknown options, wrong types and bad values, and for a family without shard forms).
///
/// Example (FSDP2's reduce-scatter input of n = P c elements; rank r gets chunk r's average):
///   auto rs = gradcomp::make_shard_plan("quant", b, gradcomp::PlanForm::kReduceScatter,
///                                       {{"bits", int64_t{4}}});
///   rs->begin(grad);  gradcomp::run_plan(*rs, comm);   // grad[r c, (r+1) c) holds the average
std::unique_ptr<BucketPlan> make_shard_plan(const std::string& name, const BucketSpec& bucket,
                                            PlanForm form, const PlanOptions& options = {});
/// Resumes a checkpoint on another world size. `states` holds one bucket's plan state_dict()
/// from every rank of a job of P = states.size() ranks, in rank order, all taken after the same
/// step; the result is the state to load into rank `rank` of a job of `world` ranks that runs the
/// same family and options on the same bucket. Families with state: top-k, random-k, 1-bit
/// (the allreduce plan), quant, PowerSGD.
///
/// What is kept, per element of the bucket (each rank's arrays add to the average with weight
/// 1/P, so every new rank gets their element-wise mean, summed in fp64 in rank order and rounded
/// once to fp32; the sums below hold to that rounding):
///  - top-k, random-k: sum over ranks of the residual / P (what the residuals will still send)
///    and of the momentum / P. The new job sends it as the old one would have: top-k the
///    largest first; random-k an element's residual whole at the first step that samples it,
///    each element with probability `ratio` per step (the indices depend on the seed, the step
///    and the bucket, all kept), so after T steps of zero gradients a share (1 - ratio)^T of it
///    is still unsent (0.45 at 1% after 80 steps); with momentum and masking an element's
///    momentum adds to its residual until it is sent and is then dropped;
///  - 1-bit and quant: sum over ranks of the worker error / P, plus the server error, which is
///    re-chunked for the new world size element by element, exactly; the 1-bit momentum as the
///    residual;
///  - PowerSGD: sum over ranks of the error / P; Q (equal on every rank) is kept;
///  - every family: the step counter (warm-up position, RNG keys), which must be equal on every
///    rank. What each old rank held apart from the mean is not kept: it is a P-rank quantity.
/// With world == P the result is states[rank] itself, byte for byte (after the same checks), so a
/// job resumed on as many ranks goes on exactly. InvalidArgument, naming the rank and field, for
/// states that are corrupt, of another kind, or not one job's checkpoint of one step (sizes,
/// options or steps that differ across ranks).
std::vector<uint8_t> reshard_state(const std::vector<std::vector<uint8_t>>& states, int world,
                                   int rank);

}  // namespace gradcomp

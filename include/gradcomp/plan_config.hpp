// SPDX-License-Identifier: Apache-2.0
// What a caller chooses or reads about a bucket plan without seeing its class: the form a plan
// computes (allreduce, reduce-scatter, allgather), the cast and top-k routes, the top-k plan's
// options and statistics, and the wire element type of a gradient dtype. The plan classes
// themselves are private to plans/; make_plan.hpp builds any of them by name, and every one is
// driven through BucketPlan (plan.hpp):
//   plan->begin(grad);                  // grad: this rank's gradient bucket (averaged in place)
//   gradcomp::run_plan(*plan, comm);    // or PlanRunner::run, or any other driver
//
// Every plan ends with the same bits on every rank: all sums are taken in rank order (rank 0
// first) and the averaging is one division by the number of ranks, in fp32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/cost_model.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp {

/// Element type of a gradient dtype on the wire.
ElemType elem_type(DType t);

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

/// What a plan computes over a bucket of P equal chunks (chunk r: elements [r n/P, (r+1) n/P)).
/// Sharded data parallelism (FSDP2, ZeRO) needs the two halves of an allreduce: gradients leave a
/// rank by a reduce-scatter and parameters arrive by an allgather.
enum class PlanForm : uint8_t {
  kAllreduce = 0,      ///< every rank ends with the whole average (DDP)
  kReduceScatter = 1,  ///< rank r ends with the average (or sum) of chunk r in its chunk r; the
                       ///< rest of the bucket is left as scratch (unspecified values)
  kAllgather = 2,      ///< rank r's chunk r is its input; every rank ends with every rank's chunk
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

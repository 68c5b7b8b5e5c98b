// SPDX-License-Identifier: Apache-2.0
// The multi-bit family (2 / 4 / 8-bit block quantization): the allreduce plan and both shard
// forms (QuantPlan runs all three).
#include "core/state_io.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/quant.hpp"
#include "plans/family.hpp"
#include "plans/options.hpp"
#include "plans/quant_plan.hpp"

namespace gradcomp::detail {
namespace {

PlanOptions quant_defaults() {
  const QuantConfig d;
  return {{"bits", int64_t{d.bits}},
          {"block_size", d.block_size},
          {"rounding", std::string(enum_name(d.rounding))},
          {"scale", std::string(enum_name(d.scale))},
          {"scale_dtype", std::string(enum_name(d.scale_dtype))},
          {"rotate", d.rotate},
          {"error_feedback", d.error_feedback},
          {"check_finite", d.check_finite},
          {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))},
          {"seed", static_cast<int64_t>(d.seed)},
          {"route", std::string("auto")}};
}

/// The allreduce's route (see QuantPlan): two message rounds, or one allgather of every chunk.
/// `auto`: the gather route on 2 ranks, where it moves the two phases' bytes in one round, with
/// less local work (every code decoded once per rank, nothing encoded twice) and no second
/// quantization; the two phases on more, where the gather route's bytes grow with P.
QuantRoute quant_route_of(const Options& o, int world) {
  const std::string& r = o.name("route");
  GC_CHECK_ARG(r == "auto" || r == "two_phase" || r == "gather",
               "invalid option for compressor 'quant': route must be 'auto', 'two_phase' or "
               "'gather', got '",
               r, "'");
  return r == "gather" || (r == "auto" && world == 2) ? QuantRoute::kGather : QuantRoute::kTwoPhase;
}

/// The quant options (a form without rotate, error_feedback or check_finite has them off).
QuantConfig quant_config_of(const Options& o, uint32_t tensor_id) {
  QuantConfig c;
  const int64_t bits = o.integer("bits");
  GC_CHECK_ARG(bits == 2 || bits == 4 || bits == 8,
               "invalid option for compressor 'quant': ", "bits must be 2, 4 or 8, got ", bits);
  c.bits = static_cast<int>(bits);
  c.block_size = o.integer("block_size");
  c.rounding = o.pick<QuantRounding>("rounding");
  c.scale = o.pick<QuantScale>("scale");
  c.scale_dtype = o.pick<DType>("scale_dtype");
  c.rotate = o.has("rotate") && o.flag("rotate");
  c.error_feedback = o.has("error_feedback") && o.flag("error_feedback");
  c.check_finite = o.has("check_finite") && o.flag("check_finite");
  c.seed = o.seed("seed");
  c.tensor_id = tensor_id;
  return c;
}

PlanOptions quant_shard_defaults(PlanForm form) {
  PlanOptions o = shard_defaults_from(quant_defaults(), form);
  if (form == PlanForm::kAllgather) {
    // parameters are gathered, not summed: nothing to feed back, no step to skip; 8 bits as
    // ZeRO++'s quantized weights
    o.erase("error_feedback");
    o.erase("check_finite");
    o.erase("on_nonfinite");
    o["bits"] = int64_t{8};
  }
  return o;
}

}  // namespace

const Family& quant_family() {
  static const Family f = [] {
    Family q;
    q.name = "quant";
    q.stateful = true;
    q.defaults = quant_defaults;
    q.build = [](const BucketSpec& b, const Options& o) -> std::unique_ptr<BucketPlan> {
      return std::make_unique<QuantPlan>(quant_config_of(o, b.bucket_id), b.numel, b.world, b.rank,
                                         b.dtype, b.device, b.device_index, b.stream,
                                         PlanForm::kAllreduce, true, quant_route_of(o, b.world));
    };
    q.shard_forms = {PlanForm::kReduceScatter, PlanForm::kAllgather};
    q.shard_defaults = quant_shard_defaults;
    q.build_shard = [](const BucketSpec& b, PlanForm form,
                       const Options& o) -> std::unique_ptr<BucketPlan> {
      const bool average = form == PlanForm::kReduceScatter ? o.flag("average") : true;
      return std::make_unique<QuantPlan>(quant_config_of(o, b.bucket_id), b.numel, b.world, b.rank,
                                         b.dtype, b.device, b.device_index, b.stream, form,
                                         average);
    };
    q.option_docs = {
        {"route",
         "",
         "How the allreduce moves its chunks: `two_phase`, an all-to-all of the worker chunks, "
         "each rank averaging and quantizing its chunk again (server error feedback), and an "
         "allgather of the averaged chunks (two message rounds, 2 chunks of the bucket's codes "
         "per peer); `gather`, one allgather of every rank's whole coded bucket, each rank "
         "averaging every chunk (one round, no second quantization, P chunks per peer: the same "
         "bytes on 2 ranks, less local work); `auto`, `gather` on 2 ranks and `two_phase` on "
         "more. A state of either route loads in the other (a server error moves into the "
         "worker error).",
         {"auto", "two_phase", "gather"}},
    };
    q.states = {{"quant-allreduce", reshard_quant_state},
                {"quant-reduce-scatter", reshard_quant_shard_state}};
    return q;
  }();
  return f;
}

}  // namespace gradcomp::detail

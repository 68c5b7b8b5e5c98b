// SPDX-License-Identifier: Apache-2.0
// The sparsifying families (Deep Gradient Compression's options): top-k and random-k.
#include "compressors/sparsify_state.hpp"
#include "core/state_io.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/topk.hpp"
#include "plans/family.hpp"
#include "plans/options.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gradcomp::detail {

TopKConfig topk_config_of(const Options& o, uint32_t tensor_id) {
  auto c = sparsify_config<TopKConfig>(o, tensor_id);
  c.select.method = o.pick<SelectMethod>("method");
  c.select.sample_rate = o.real("sample_rate");
  const int64_t bits = o.integer("value_bits");
  GC_CHECK_ARG(bits == 0 || bits == 2 || bits == 4 || bits == 8,
               "value_bits must be 0 (values as value_dtype), 2, 4 or 8, got ", bits);
  c.value_bits = static_cast<int>(bits);
  c.value_block = o.integer("value_block");
  c.validate();
  return c;
}

namespace {

PlanOptions topk_defaults() {
  const TopKConfig d;
  const TopKPlanOptions p;
  PlanOptions o = sparsify_defaults(d);
  o["method"] = std::string(enum_name(d.select.method));
  o["sample_rate"] = d.select.sample_rate;
  o["value_bits"] = static_cast<int64_t>(d.value_bits);
  o["value_block"] = d.value_block;
  o["route"] = std::string(enum_name(p.route));
  o["exchange"] = std::string(enum_name(p.exchange));
  o["latency_s"] = p.cost.latency_s;
  o["bandwidth_Bps"] = p.cost.bandwidth_Bps;
  return o;
}

std::unique_ptr<BucketPlan> topk_plan(const BucketSpec& b, const Options& o) {
  const TopKConfig c = topk_config_of(o, b.bucket_id);
  TopKPlanOptions p;
  p.route = o.pick<TopKRoute>("route");
  p.exchange = o.pick<TopKExchange>("exchange");
  p.cost.latency_s = o.real("latency_s");
  p.cost.bandwidth_Bps = o.real("bandwidth_Bps");
  GC_CHECK_ARG(p.cost.latency_s >= 0 && p.cost.bandwidth_Bps > 0,
               "cost model needs latency_s >= 0 and bandwidth_Bps > 0, got ", p.cost.latency_s,
               ", ", p.cost.bandwidth_Bps);
  return std::make_unique<TopKAllreducePlan>(c, b.numel, b.world, p, b.dtype, b.device,
                                             b.device_index, b.stream);
}

PlanOptions topk_shard_defaults(PlanForm) {
  const TopKReduceScatterPlan::Options d;
  return {{"ratio", d.ratio},
          {"method", std::string(enum_name(d.select.method))},
          {"sample_rate", d.select.sample_rate},
          {"error_feedback", d.error_feedback},
          {"check_finite", d.check_finite},
          {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))},
          {"seed", static_cast<int64_t>(d.seed)},
          {"average", d.average}};
}

std::unique_ptr<BucketPlan> topk_shard_plan(const BucketSpec& b, PlanForm, const Options& o) {
  TopKReduceScatterPlan::Options t;
  t.ratio = o.real("ratio");
  t.select.method = o.pick<SelectMethod>("method");
  t.select.sample_rate = o.real("sample_rate");
  t.error_feedback = o.flag("error_feedback");
  t.check_finite = o.flag("check_finite");
  t.average = o.flag("average");
  t.seed = o.seed("seed");
  t.tensor_id = b.bucket_id;
  return std::make_unique<TopKReduceScatterPlan>(t, b.numel, b.dtype, b.world, b.rank, b.device,
                                                 b.device_index, b.stream);
}

PlanOptions randomk_defaults() {
  const RandomKConfig d;
  PlanOptions o = sparsify_defaults(d);
  o["dense_below"] = d.dense_below;
  return o;
}

std::unique_ptr<BucketPlan> randomk_plan(const BucketSpec& b, const Options& o) {
  auto c = sparsify_config<RandomKConfig>(o, b.bucket_id);
  c.dense_below = o.integer("dense_below");
  // the bucket's tensors, for dense_below (the compressor checks that they fill the bucket)
  for (const auto& shape : b.shapes) {
    int64_t e = 1;
    for (int64_t d : shape) {
      GC_CHECK_ARG(d >= 0 && (d == 0 || e <= b.numel / d), "randomk: shape dimension ", d,
                   " is negative or makes a tensor larger than the bucket (", b.numel, ")");
      e *= d;
    }
    c.segments.push_back(e);
  }
  return std::make_unique<RandomKAllreducePlan>(c, b.numel, b.world, b.dtype, b.device,
                                                b.device_index, b.stream);
}

}  // namespace

const Family& topk_family() {
  static const Family f = [] {
    Family t;
    t.name = "topk";
    t.stateful = true;
    t.defaults = topk_defaults;
    t.build = topk_plan;
    t.shard_forms = {PlanForm::kReduceScatter};
    t.missing_form_reason = "parameters are not sparse";
    t.option_docs = {
        {"value_bits",
         "",
         "0 sends the selected values as `value_dtype`; 2, 4 or 8 codes each as that many bits "
         "on a per-block grid of 2^bits levels from the block's smallest to its largest value "
         "(the multi-bit family's codec, two fp32 scales per block), rounded to nearest; with "
         "error feedback the rounding error stays in the residual (SparseLoCo: top-k at 2 bits). "
         "Needs `value_dtype` float32. The allreduce only.",
         {}},
        {"value_block",
         "",
         "Coded values per block (pair of scales) with `value_bits`: a power of two in [32, "
         "8192]; 8 bytes more per block.",
         {}},
    };
    t.shard_defaults = topk_shard_defaults;
    t.build_shard = topk_shard_plan;
    t.states = {{"topk", [](const RankStateList& s, int world,
                            int rank) { return reshard_sparsify_state(s, "topk", world, rank); }},
                {"topk-reduce-scatter", reshard_topk_shard_state}};
    return t;
  }();
  return f;
}

const Family& randomk_family() {
  static const Family f = [] {
    Family r;
    r.name = "randomk";
    r.stateful = true;
    r.uses_shapes = true;  // dense_below reads the tensors' sizes
    r.defaults = randomk_defaults;
    r.build = randomk_plan;
    r.states = {{"randomk", [](const RankStateList& s, int world, int rank) {
                   return reshard_sparsify_state(s, "randomk", world, rank);
                 }}};
    return r;
  }();
  return f;
}

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// make_plan(): every family's options (names, defaults, parsing) in one table each.
#include "gradcomp/make_plan.hpp"

#include <algorithm>
#include <limits>
#include <set>
#include <type_traits>
#include <utility>
#include <variant>

#include "core/state_io.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/topk.hpp"
#include "plans/options_hash.hpp"

namespace gradcomp {

namespace {

// ---- the option tables (defaults from the configuration structs) ----
PlanOptions sparsify_defaults(const SparsifyConfig& d) {
  return {{"ratio", d.ratio},
          {"momentum", d.momentum},
          {"nesterov", d.nesterov},
          {"momentum_masking", d.momentum_masking},
          {"clip_norm", d.clip_norm},
          {"clip_scaling", std::string(enum_name(d.clip_scaling))},
          {"warmup_ratios", d.warmup_ratios},
          {"warmup_steps", d.warmup_steps},
          {"value_dtype", std::string(enum_name(d.value_dtype))},
          {"error_feedback", d.error_feedback},
          {"check_finite", d.check_finite},
          {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))},
          {"seed", static_cast<int64_t>(d.seed)}};
}

PlanOptions defaults_of(const std::string& name) {
  if (name == "allreduce") return {};
  if (name == "fp16" || name == "bf16") return {{"route", std::string("auto")}};
  if (name == "topk") {
    const TopKConfig d;
    const TopKPlanOptions p;
    PlanOptions o = sparsify_defaults(d);
    o["method"] = std::string(enum_name(d.select.method));
    o["sample_rate"] = d.select.sample_rate;
    o["route"] = std::string(enum_name(p.route));
    o["exchange"] = std::string(enum_name(p.exchange));
    o["latency_s"] = p.cost.latency_s;
    o["bandwidth_Bps"] = p.cost.bandwidth_Bps;
    return o;
  }
  if (name == "randomk") {
    const RandomKConfig d;
    PlanOptions o = sparsify_defaults(d);
    o["dense_below"] = d.dense_below;
    return o;
  }
  if (name == "onebit") {
    const OneBitConfig d;
    // The recommended plan settings (see plan_defaults() in the header): not OneBitConfig{}'s.
    return {{"scaling", std::string("sign_l2")},
            {"block_size", int64_t{128}},
            {"rotate", true},
            {"error_feedback", d.error_feedback},
            {"check_finite", d.check_finite},
            {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))},
            {"momentum", d.momentum}};
  }
  if (name == "quant") {
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
            {"seed", static_cast<int64_t>(d.seed)}};
  }
  if (name == "powersgd") {
    const PowerSGDConfig d;
    return {{"rank", int64_t{d.rank}},
            {"min_compression_rate", d.min_compression_rate},
            {"use_error_feedback", d.error_feedback},
            {"warm_start", d.warm_start},
            {"orthogonalization_epsilon", static_cast<double>(d.orthogonalization_epsilon)},
            {"seed", static_cast<int64_t>(d.seed)},
            {"orthogonalization", std::string(enum_name(d.orthogonalization))},
            {"check_finite", d.check_finite},
            {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))}};
  }
  std::string known;
  for (const auto& n : plan_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("unknown compressor '" + name + "'; choose one of " + known);
}

const char* type_name(const PlanOption& v) {
  switch (v.index()) {
    case 0:
      return "a flag (bool)";
    case 1:
      return "an integer";
    case 2:
      return "a number";
    case 3:
      return "a name (str)";
    default:
      return "a list of numbers";
  }
}

/// The given options over the family's defaults, read with the type each default has.
class Options {
 public:
  Options(const std::string& family, const PlanOptions& given)
      : Options(family, defaults_of(family), given) {}
  Options(const std::string& family, PlanOptions defaults, const PlanOptions& given)
      : family_(family), values_(std::move(defaults)) {
    std::vector<std::string> unknown;
    for (const auto& [k, v] : given) {
      auto it = values_.find(k);
      if (it == values_.end()) {
        unknown.push_back(k);
        continue;
      }
      const bool same = it->second.index() == v.index();
      const bool int_for_real = it->second.index() == 2 && v.index() == 1;
      GC_CHECK_ARG(same || int_for_real, "invalid option for compressor '", family, "': ", k,
                   " must be ", type_name(it->second), ", got ", type_name(v));
      it->second = int_for_real ? PlanOption(static_cast<double>(std::get<int64_t>(v))) : v;
    }
    if (!unknown.empty()) {
      std::string u, known;
      for (const auto& k : unknown) u += (u.empty() ? "'" : ", '") + k + "'";
      for (const auto& [k, v] : values_) known += (known.empty() ? "'" : ", '") + k + "'";
      throw InvalidArgument(detail::cat("unknown option(s) [", u, "] for compressor '", family,
                                        "'; known: [", known, "]"));
    }
  }
  bool has(const char* k) const { return values_.count(k) != 0; }
  bool flag(const char* k) const { return std::get<bool>(values_.at(k)); }
  int64_t integer(const char* k) const { return std::get<int64_t>(values_.at(k)); }
  double real(const char* k) const { return std::get<double>(values_.at(k)); }
  const std::string& name(const char* k) const { return std::get<std::string>(values_.at(k)); }
  /// A named option parsed as enum E; an unknown name is refused naming the option and the
  /// compressor (parse_enum's own message names only the kind: "unknown dtype 'int8'").
  template <class E>
  E pick(const char* k) const {
    try {
      return parse_enum<E>(name(k));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          detail::cat("invalid option for compressor '", family_, "': ", k, ": ", e.what()));
    }
  }
  const std::vector<double>& list(const char* k) const {
    return std::get<std::vector<double>>(values_.at(k));
  }
  /// A non-negative integer option (a seed).
  uint64_t seed(const char* k) const {
    const int64_t v = integer(k);
    GC_CHECK_ARG(v >= 0, "invalid option for compressor '", family_, "': ", k,
                 " must be >= 0, got ", v);
    return static_cast<uint64_t>(v);
  }

 private:
  std::string family_;
  PlanOptions values_;
};

template <class C>
C sparsify_config(const Options& o, uint32_t tensor_id) {
  C c;
  c.ratio = o.real("ratio");
  c.momentum = o.real("momentum");
  c.nesterov = o.flag("nesterov");
  c.momentum_masking = o.flag("momentum_masking");
  c.clip_norm = o.real("clip_norm");
  c.clip_scaling = o.pick<SparsifyConfig::ClipScaling>("clip_scaling");
  c.warmup_ratios = o.list("warmup_ratios");
  c.warmup_steps = o.integer("warmup_steps");
  c.value_dtype = o.pick<DType>("value_dtype");
  c.error_feedback = o.flag("error_feedback");
  c.check_finite = o.flag("check_finite");
  c.seed = o.seed("seed");
  c.tensor_id = tensor_id;
  return c;
}

TopKConfig topk_config_of(const Options& o, uint32_t tensor_id) {
  auto c = sparsify_config<TopKConfig>(o, tensor_id);
  c.select.method = o.pick<SelectMethod>("method");
  c.select.sample_rate = o.real("sample_rate");
  c.validate();
  return c;
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

/// A per-tensor codec has no world size and no exchange: the options of the plan alone are refused.
void refuse_plan_only(const char* family, const PlanOptions& given) {
  for (const char* k :
       {"route", "exchange", "latency_s", "bandwidth_Bps", "clip_scaling", "on_nonfinite"})
    GC_CHECK_ARG(given.count(k) == 0, "option '", k, "' belongs to the ", family,
                 " plan (the bucket allreduce), not to the per-tensor codec");
}

}  // namespace

TopKConfig topk_config(const PlanOptions& options, uint32_t tensor_id) {
  refuse_plan_only("topk", options);
  return topk_config_of(Options("topk", options), tensor_id);
}

RandomKConfig randomk_config(const PlanOptions& options, uint32_t tensor_id) {
  refuse_plan_only("randomk", options);
  GC_CHECK_ARG(options.count("dense_below") == 0,
               "option 'dense_below' belongs to the randomk plan (it needs the bucket's tensor "
               "shapes), not to the per-tensor codec (set RandomKConfig::segments in C++)");
  auto c = sparsify_config<RandomKConfig>(Options("randomk", options), tensor_id);
  c.validate();
  return c;
}

std::vector<std::string> plan_names() {
  return {"allreduce", "fp16", "bf16", "topk", "randomk", "onebit", "quant", "powersgd"};
}

PlanOptions plan_defaults(const std::string& name) { return defaults_of(name); }

bool plan_is_stateful(const std::string& name) {
  // the plans say it themselves (BucketPlan::stateful): ask an empty one
  return make_plan(name, BucketSpec{})->stateful();
}

namespace {
std::unique_ptr<BucketPlan> build_plan(const std::string& name, const BucketSpec& b,
                                       const Options& o);

/// A hash of the family and every option as given (a default left out and the same default
/// spelled out hash differently: ranks must build their plans the same way, which the hooks do).
uint64_t hash_of(const std::string& name, const PlanOptions& options) {
  detail::OptionsHash h;
  h.add_all(name).add(uint8_t{0});
  for (const auto& [key, value] : options) {
    h.add_all(key).add(uint8_t{0}).add(static_cast<uint8_t>(value.index()));
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<double>>)
            h.add(v.size()).add_all(v);
          else
            h.add(v);
        },
        value);
  }
  return h.value();
}
}  // namespace

std::unique_ptr<BucketPlan> make_hierarchical_plan(const std::string& name, const BucketSpec& b,
                                                   int per_node, const PlanOptions& options) {
  GC_CHECK_ARG(per_node >= 1 && b.world >= 1 && b.world % per_node == 0,
               "hierarchical plan: ", b.world, " ranks do not split into nodes of ", per_node,
               " ranks (per_node must divide the world size)");
  GC_CHECK_ARG(b.rank >= 0 && b.rank < b.world, "hierarchical plan: rank ", b.rank, " outside [0, ",
               b.world, ")");
  const int nodes = b.world / per_node, local = b.rank % per_node;
  const int64_t shard = HierarchicalPlan::shard_elems(b.numel, per_node);
  BucketSpec inner = b;
  inner.numel = shard;
  inner.world = nodes;
  inner.rank = b.rank / per_node;
  if (!b.shapes.empty() || per_node > 1)
    inner.shapes = HierarchicalPlan::shard_shapes(b.shapes, b.numel, per_node, local);
  // each shard draws its own random numbers (top-k sampling, random-k, PowerSGD's first Q):
  // bucket b's shard i is bucket b L + i to its family (one to one for a given layout)
  GC_CHECK_ARG(b.bucket_id <= (UINT32_MAX - static_cast<uint32_t>(per_node)) / per_node,
               "hierarchical plan: bucket_id ", b.bucket_id, " too large for ", per_node,
               " shards per bucket");
  inner.bucket_id = b.bucket_id * static_cast<uint32_t>(per_node) + static_cast<uint32_t>(local);
  // the inner plan checks the options (and is built even with one node, so that bad options
  // fail the same way on every layout)
  std::unique_ptr<BucketPlan> plan = make_plan(name, inner, options);
  if (nodes == 1) plan.reset();
  detail::OptionsHash h;  // what the ranks of a node must agree on to sum their shards
  h.add(hash_of(name, options)).add(b.numel).add(b.world).add(per_node).add(b.dtype);
  h.add(b.bucket_id).add(b.shapes.size());
  for (const auto& shape : b.shapes) h.add(shape.size()).add_all(shape);
  return std::make_unique<HierarchicalPlan>(std::move(plan), b.numel, b.dtype, b.world, b.rank,
                                            per_node, h.value(), b.device, b.device_index,
                                            b.stream);
}

std::unique_ptr<BucketPlan> make_plan(const std::string& name, const BucketSpec& b,
                                      const PlanOptions& options) {
  const Options o(name, options);
  const OnNonFinite policy =
      o.has("on_nonfinite") ? o.pick<OnNonFinite>("on_nonfinite") : OnNonFinite::kSkip;
  auto plan = build_plan(name, b, o);
  plan->set_on_nonfinite(policy);
  return plan;
}

namespace {
std::unique_ptr<BucketPlan> build_plan(const std::string& name, const BucketSpec& b,
                                       const Options& o) {
  if (name == "allreduce")
    return std::make_unique<DenseAllreducePlan>(b.numel, b.dtype, b.world, b.device, b.device_index,
                                                b.stream);
  if (name == "fp16" || name == "bf16") {
    const std::string& r = o.name("route");
    CastRoute route;
    if (r == "auto") {
      // on gloo (which sums half precision slowly) the backend only moves bytes; on 2 ranks one
      // allgather of the whole buffer moves the same bytes as the reduce-scatter route in one
      // message round instead of two
      const bool gloo = b.backend == "gloo" || (b.backend.empty() && b.device == Device::kCPU);
      route = !gloo ? CastRoute::kAllreduce
                    : b.world == 2 ? CastRoute::kGather : CastRoute::kReduceScatter;
    }
    else
      route = o.pick<CastRoute>("route");
    return std::make_unique<CastAllreducePlan>(b.numel, b.dtype,
                                               name == "fp16" ? DType::kFloat16 : DType::kBFloat16,
                                               b.world, b.device, b.device_index, b.stream, route);
  }
  if (name == "topk") {
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
  if (name == "randomk") {
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
  if (name == "onebit") {
    OneBitConfig c;
    c.scaling = o.pick<OneBitScaling>("scaling");
    c.chunk_size = o.integer("block_size");
    c.rotate = o.flag("rotate");
    c.error_feedback = o.flag("error_feedback");
    c.check_finite = o.flag("check_finite");
    c.momentum = o.real("momentum");
    c.tensor_id = b.bucket_id;
    return std::make_unique<OneBitAllreducePlan>(c, b.numel, b.world, b.rank, b.device,
                                                 b.device_index, b.stream);
  }
  if (name == "quant")
    return std::make_unique<QuantAllreducePlan>(quant_config_of(o, b.bucket_id), b.numel, b.world,
                                                b.rank, b.dtype, b.device, b.device_index,
                                                b.stream);
  // powersgd
  PowerSGDConfig c;
  c.rank = static_cast<int>(std::min<int64_t>(o.integer("rank"), int64_t{1} << 30));
  c.min_compression_rate = o.real("min_compression_rate");
  c.error_feedback = o.flag("use_error_feedback");
  c.warm_start = o.flag("warm_start");
  c.orthogonalization_epsilon = static_cast<float>(o.real("orthogonalization_epsilon"));
  c.seed = o.seed("seed");
  c.orthogonalization = o.pick<Orthogonalization>("orthogonalization");
  c.check_finite = o.flag("check_finite");
  GC_CHECK_ARG(b.bucket_id < 65536, "powersgd: bucket_id must be < 65536 (tensor ids ",
               "bucket_id * 65536 + i), got ", b.bucket_id);
  c.first_tensor_id = b.bucket_id * 65536u;
  std::vector<std::vector<int64_t>> shapes = b.shapes;
  if (shapes.empty()) shapes.push_back({b.numel});
  // the state checks every shape (dimensions, bounds) and the plan that they fill the bucket
  auto st = std::make_unique<PowerSGDState>(c, shapes, b.dtype, b.device, b.device_index, b.stream);
  GC_CHECK_ARG(st->compressed_numel() + st->uncompressed_numel() == b.numel,
               "powersgd: the shapes hold ", st->compressed_numel() + st->uncompressed_numel(),
               " elements but the bucket has ", b.numel);
  return std::make_unique<PowerSGDPlan>(std::move(st), b.world);
}
}  // namespace

std::vector<std::string> shard_plan_names() {
  return {"allreduce", "fp16", "bf16", "topk", "quant"};
}

PlanOptions shard_plan_defaults(const std::string& name, PlanForm form) {
  GC_CHECK_ARG(form == PlanForm::kReduceScatter || form == PlanForm::kAllgather,
               "shard plans are reduce_scatter or allgather, not ", enum_name(form));
  const auto names = shard_plan_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    throw InvalidArgument("compressor '" + name + "' has no " + std::string(enum_name(form)) +
                          " form; choose one of " + known);
  }
  if (name == "topk") {
    GC_CHECK_ARG(form == PlanForm::kReduceScatter,
                 "compressor 'topk' has no allgather form (parameters are not sparse); choose "
                 "one of allreduce, fp16, bf16, quant for parameters");
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
  PlanOptions o = defaults_of(name);
  o.erase("route");   // the shard forms have one route: all-to-all or allgather of the chunks
  o.erase("rotate");  // the caller's chunks need not hold whole rotation blocks
  if (form == PlanForm::kReduceScatter) {
    o["average"] = true;
  } else if (name == "quant") {
    // parameters are gathered, not summed: nothing to feed back, no step to skip; 8 bits as
    // ZeRO++'s quantized weights
    o.erase("error_feedback");
    o.erase("check_finite");
    o.erase("on_nonfinite");
    o["bits"] = int64_t{8};
  }
  return o;
}

std::unique_ptr<BucketPlan> make_shard_plan(const std::string& name, const BucketSpec& b,
                                            PlanForm form, const PlanOptions& options) {
  const Options o(name, shard_plan_defaults(name, form), options);
  const bool average = form == PlanForm::kReduceScatter ? o.flag("average") : true;
  if (name == "topk") {
    TopKReduceScatterPlan::Options t;
    t.ratio = o.real("ratio");
    t.select.method = o.pick<SelectMethod>("method");
    t.select.sample_rate = o.real("sample_rate");
    t.error_feedback = o.flag("error_feedback");
    t.check_finite = o.flag("check_finite");
    t.average = average;
    t.seed = o.seed("seed");
    t.tensor_id = b.bucket_id;
    auto plan = std::make_unique<TopKReduceScatterPlan>(t, b.numel, b.dtype, b.world, b.rank,
                                                        b.device, b.device_index, b.stream);
    plan->set_on_nonfinite(o.pick<OnNonFinite>("on_nonfinite"));
    return plan;
  }
  if (name != "quant") {
    const DType wire = name == "fp16"   ? DType::kFloat16
                       : name == "bf16" ? DType::kBFloat16
                                        : b.dtype;
    return std::make_unique<ShardCastPlan>(b.numel, b.dtype, wire, b.world, b.rank, form, average,
                                           b.device, b.device_index, b.stream);
  }
  auto plan = std::make_unique<QuantAllreducePlan>(quant_config_of(o, b.bucket_id), b.numel,
                                                   b.world, b.rank, b.dtype, b.device,
                                                   b.device_index, b.stream, form, average);
  if (o.has("on_nonfinite")) plan->set_on_nonfinite(o.pick<OnNonFinite>("on_nonfinite"));
  return plan;
}

namespace {
/// A sharded job's reduce-scatter states (quant, top-k), checked whole: on as many ranks they are
/// handed back as they are, so nothing a plan would refuse may pass here.
void check_shard_states(const std::vector<std::vector<uint8_t>>& states, const std::string& kind) {
  detail::RankStates rs(states, kind);
  const auto P = static_cast<int64_t>(rs.size());
  const auto numel = rs.same<int64_t>("numel");
  const auto world = rs.same<int32_t>("world");
  GC_CHECK_ARG(world == P, "state_dict: the states were saved by a job of ", world, " ranks, ", P,
               " were given (one per rank, in rank order)");
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40) && numel % P == 0, "state_dict: numel ",
               numel, " is not a bucket of ", P, " equal chunks");
  for (int64_t r = 0; r < P; ++r) {
    const auto got = rs[static_cast<size_t>(r)].get<int32_t>("rank");
    GC_CHECK_ARG(got == r, "state_dict: state ", r, " was saved by rank ", got,
                 " (give one state per rank, in rank order)");
  }
  const char* array = "residual";
  if (kind == "quant-reduce-scatter") {
    QuantConfig c;
    c.bits = rs.same<uint8_t>("bits");
    c.block_size = rs.same<int64_t>("block_size");
    c.rounding = static_cast<QuantRounding>(rs.same<uint8_t>("rounding"));
    c.scale = static_cast<QuantScale>(rs.same<uint8_t>("scale"));
    c.scale_dtype = static_cast<DType>(rs.same<uint8_t>("scale_dtype"));
    c.validate();
    (void)rs.same<uint8_t>("error_feedback");
    GC_CHECK_ARG(rs.same<uint8_t>("rotate") == 0, "state_dict: a reduce-scatter state with rotate");
    (void)rs.same<uint64_t>("seed");
    array = "worker_error";
  } else {
    const auto k = rs.same<int64_t>("k");
    GC_CHECK_ARG(k >= 0 && k <= numel / P, "state_dict: k ", k, " out of range");
    (void)rs.same<uint8_t>("error_feedback");
    (void)rs.same<uint64_t>("seed");
  }
  const auto step = rs.same<int64_t>("step");
  GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ", step,
               " out of range");
  (void)rs.arrays(array, static_cast<uint64_t>(numel) * sizeof(float));
  rs.finish();
}
}  // namespace

std::vector<uint8_t> reshard_state(const std::vector<std::vector<uint8_t>>& states, int world,
                                   int rank) {
  GC_CHECK_ARG(!states.empty(), "reshard_state: no states given (one per rank of the saved job)");
  GC_CHECK_ARG(world >= 1 && rank >= 0 && rank < world, "reshard_state: rank ", rank, " of world ",
               world, " is not a rank (0 <= rank < world)");
  std::string kind;
  try {
    kind = detail::StateReader(states[0].data(), states[0].size()).kind();
  } catch (const InvalidArgument& e) {
    GC_CHECK_ARG(false, "rank 0's ", e.what());
  }
  std::vector<uint8_t> out;
  if (kind == "topk" || kind == "randomk")
    out = detail::reshard_sparsify_state(states, kind);
  else if (kind == "onebit-allreduce")
    out = detail::reshard_onebit_state(states, world, rank);
  else if (kind == "quant-allreduce")
    out = detail::reshard_quant_state(states, world, rank);
  else if (kind == "powersgd")
    out = detail::reshard_powersgd_state(states);
  else if (kind == "quant-reduce-scatter" || kind == "topk-reduce-scatter") {
    check_shard_states(states, kind);
    // a sharded job's bucket is padded to its world size (FSDP pads every parameter to P rows'
    // worth): its worker error has no place in a bucket of another size
    GC_CHECK_ARG(static_cast<size_t>(world) == states.size(),
                 "reshard_state: a reduce-scatter state (sharded training) belongs ",
                 "to its world size (", states.size(), " ranks) and cannot be resharded to ", world,
                 "; resume on as many ranks, or start the error feedback afresh");
  } else if (kind == "hierarchical") {
    // each rank holds the cross-node state of its own shard, whose bounds move with the layout:
    // the states must be one job's (same bucket, layout, options, step; rank r at local rank
    // r % per_node), and only go on unchanged on as many ranks
    int64_t numel0 = 0, step0 = 0;
    int32_t world0 = 0, per_node0 = 0;
    uint64_t hash0 = 0;
    for (size_t r = 0; r < states.size(); ++r) {
      try {
        detail::StateReader rd(states[r].data(), states[r].size(), "hierarchical");
        const auto numel = rd.get<int64_t>("numel");
        const auto w = rd.get<int32_t>("world");
        const auto per_node = rd.get<int32_t>("per_node");
        const auto local = rd.get<int32_t>("local_rank");
        const auto hash = rd.get<uint64_t>("options_hash");
        const int64_t step = rd.get_step();
        (void)rd.blob("inner state");
        rd.finish();
        if (r == 0) {
          numel0 = numel, world0 = w, per_node0 = per_node, hash0 = hash, step0 = step;
        }
        GC_CHECK_ARG(numel == numel0 && w == world0 && per_node == per_node0 && hash == hash0,
                     "state of another bucket, layout or options than rank 0's");
        GC_CHECK_ARG(step == step0, "state at step ", step, ", rank 0's at ", step0);
        GC_CHECK_ARG(w == static_cast<int32_t>(states.size()) && per_node > 0 &&
                         local == static_cast<int32_t>(r) % per_node,
                     "state of local rank ", local, " of a job of ", w, " ranks in nodes of ",
                     per_node, " (expected rank ", r, " of ", states.size(), ")");
      } catch (const InvalidArgument& e) {
        GC_CHECK_ARG(false, "reshard_state: rank ", r, "'s ", e.what());
      }
    }
    GC_CHECK_ARG(static_cast<size_t>(world) == states.size(),
                 "reshard_state: a hierarchical plan's state (each rank's shard of the bucket) ",
                 "belongs to its layout (", states.size(), " ranks) and cannot be resharded to ",
                 world,
                 "; resume on the same nodes x ranks per node, or start the error "
                 "feedback afresh");
  } else
    GC_CHECK_ARG(false, "reshard_state: a '", kind, "' state is not a bucket plan's (topk, ",
                 "randomk, onebit-allreduce, quant-allreduce, powersgd)");
  // every state was checked on the way: on as many ranks, the rank's own state goes on exactly
  if (static_cast<size_t>(world) == states.size()) return states[static_cast<size_t>(rank)];
  return out;
}

}  // namespace gradcomp

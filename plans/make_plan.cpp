// SPDX-License-Identifier: Apache-2.0
// make_plan() and its kin: every family is looked up in the registry (plans/family.hpp), which
// holds its option table, its plans and its state kinds. Only the per-tensor codec configurations
// (topk_config, randomk_config, onebit_config) name their family here.
#include "gradcomp/make_plan.hpp"

#include <algorithm>
#include <type_traits>
#include <utility>
#include <variant>

#include "core/state_io.hpp"
#include "gradcomp/error.hpp"
#include "plans/family.hpp"
#include "plans/hierarchical_plan.hpp"
#include "plans/options.hpp"
#include "plans/options_hash.hpp"

namespace gradcomp {

namespace {

/// A per-tensor codec has no world size and no exchange: the options of the plan alone are refused.
void refuse_plan_only(const char* family, const PlanOptions& given) {
  for (const char* k :
       {"route", "exchange", "latency_s", "bandwidth_Bps", "clip_scaling", "on_nonfinite"})
    GC_CHECK_ARG(given.count(k) == 0, "option '", k, "' belongs to the ", family,
                 " plan (the bucket allreduce), not to the per-tensor codec");
}

detail::Options options_of(const std::string& name, const PlanOptions& given) {
  const detail::Family& f = detail::family(name);
  return detail::Options(name, f.defaults(), given, f.aliases);
}

}  // namespace

TopKConfig topk_config(const PlanOptions& options, uint32_t tensor_id) {
  refuse_plan_only("topk", options);
  return detail::topk_config_of(options_of("topk", options), tensor_id);
}

RandomKConfig randomk_config(const PlanOptions& options, uint32_t tensor_id) {
  refuse_plan_only("randomk", options);
  GC_CHECK_ARG(options.count("dense_below") == 0,
               "option 'dense_below' belongs to the randomk plan (it needs the bucket's tensor "
               "shapes), not to the per-tensor codec (set RandomKConfig::segments in C++)");
  auto c = detail::sparsify_config<RandomKConfig>(options_of("randomk", options), tensor_id);
  c.validate();
  return c;
}

OneBitConfig onebit_config(const PlanOptions& options, uint32_t tensor_id) {
  refuse_plan_only("onebit", options);
  const detail::Options o = options_of("onebit", options);
  // The plan's rotation and momentum live in its two-phase buffers; a codec has neither.
  GC_CHECK_ARG(options.count("rotate") == 0 || !o.flag("rotate"),
               "option 'rotate' belongs to the onebit plan (the bucket "
               "allreduce), not to the per-tensor codec (pass rotate=False or leave it out)");
  GC_CHECK_ARG(o.real("momentum") == 0.0,
               "option 'momentum' belongs to the onebit plan (the "
               "bucket allreduce), not to the per-tensor codec (apply the optimizer's momentum)");
  OneBitConfig c;
  c.scaling = o.pick<OneBitScaling>("scaling");
  const bool block_given = options.count("block_size") != 0 || options.count("chunk_size") != 0;
  c.block_size =
      c.scaling == OneBitScaling::kColumnMeans && !block_given ? 0 : o.integer("block_size");
  c.error_feedback = o.flag("error_feedback");
  c.check_finite = o.flag("check_finite");
  c.tensor_id = tensor_id;
  c.validate();
  return c;
}

namespace {
/// A hash of the family and every option as given (a default left out and the same default
/// spelled out hash differently: ranks must build their plans the same way, which the hooks do).
/// Another accepted spelling of an option hashes as the option (the saved state of a plan built
/// with chunk_size=64 loads into one built with block_size=64).
uint64_t hash_of(const std::string& name, const PlanOptions& given) {
  PlanOptions options;
  const detail::Family& f = detail::family(name);
  for (const auto& [key, value] : given) {
    std::string k = key;
    for (const auto& [spelling, option] : f.aliases)
      if (key == spelling) k = option;
    options[k] = value;  // (both spellings at once were refused when the plan was built)
  }
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
  const detail::Family& f = detail::family(name);
  const detail::Options o(name, f.defaults(), options, f.aliases);
  const OnNonFinite policy = o.on_nonfinite();
  auto plan = f.build(b, o);
  plan->set_on_nonfinite(policy);
  return plan;
}

namespace {
const detail::Family& family_with_form(const std::string& name, PlanForm form) {
  GC_CHECK_ARG(form == PlanForm::kReduceScatter || form == PlanForm::kAllgather,
               "shard plans are reduce_scatter or allgather, not ", enum_name(form));
  const detail::Family* found = nullptr;
  const char* reason = nullptr;
  std::string known;
  for (const detail::Family* f : detail::families()) {
    if (std::find(f->shard_forms.begin(), f->shard_forms.end(), form) == f->shard_forms.end()) {
      if (name == f->name) reason = f->missing_form_reason;
      continue;
    }
    if (name == f->name) found = f;
    known += (known.empty() ? "" : ", ") + std::string(f->name);
  }
  if (found == nullptr)
    throw InvalidArgument("compressor '" + name + "' has no " + std::string(enum_name(form)) +
                          " form" + (reason ? std::string(" (") + reason + ")" : std::string()) +
                          "; choose one of " + known);
  return *found;
}
}  // namespace

PlanOptions shard_plan_defaults(const std::string& name, PlanForm form) {
  return family_with_form(name, form).shard_defaults(form);
}

std::unique_ptr<BucketPlan> make_shard_plan(const std::string& name, const BucketSpec& b,
                                            PlanForm form, const PlanOptions& options) {
  const detail::Family& f = family_with_form(name, form);
  const detail::Options o(name, f.shard_defaults(form), options, f.aliases);
  auto plan = f.build_shard(b, form, o);
  if (o.has("on_nonfinite")) plan->set_on_nonfinite(o.on_nonfinite());
  return plan;
}

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
  if (const detail::StateKind* sk = detail::state_kind(kind)) {
    out = sk->reshard(states, world, rank);
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
  } else {
    std::string known;
    for (const detail::Family* f : detail::families())
      for (const auto& s : f->states) known += (known.empty() ? "" : ", ") + std::string(s.kind);
    GC_CHECK_ARG(false, "reshard_state: a '", kind, "' state is not a bucket plan's (", known,
                 ", hierarchical)");
  }
  // every state was checked on the way: on as many ranks, the rank's own state goes on exactly
  if (static_cast<size_t>(world) == states.size()) return states[static_cast<size_t>(rank)];
  return out;
}

}  // namespace gradcomp

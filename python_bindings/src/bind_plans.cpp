// SPDX-License-Identifier: Apache-2.0
// The bucket plans (make_plan.hpp and the plan classes of plans/), for the Python driver
// (gradcomp.torch).
#include <nanobind/stl/unique_ptr.h>

#include <random>
#include <variant>

#include "common.hpp"
#include "plans/cast_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gradcomp::py {
namespace {

nb::object from_option(const PlanOption& v) {
  return std::visit([](const auto& x) -> nb::object { return nb::cast(x); }, v);
}

/// The bucket make_plan / make_shard_plan build for, from the bindings' arguments.
BucketSpec bucket_spec(int64_t numel, const std::string& dtype, int world, int rank,
                       const std::string& device, int device_index, uintptr_t stream,
                       uint32_t bucket_id) {
  BucketSpec b;
  b.numel = numel;
  b.dtype = parse_enum<DType>(dtype);
  b.world = world;
  b.rank = rank;
  b.device = parse_enum<Device>(device);
  b.device_index = device_index;
  b.stream = reinterpret_cast<void*>(stream);
  b.bucket_id = bucket_id;
  return b;
}

/// Binds an enum with its canonical option names (EnumNames, gradcomp/types.hpp) as members, marked
/// (with the enum's `what`) so that make_plan and the hooks take a member wherever its enum's name
/// is taken.
template <class E>
void option_enum(nb::module_& m, const char* py_name, const char* doc) {
  nb::enum_<E> e(m, py_name, doc);
  for (std::size_t i = 0; i < EnumNames<E>::members; ++i)
    e.value(EnumNames<E>::table[i].name, EnumNames<E>::table[i].value);
  e.attr("__gradcomp_option__") = EnumNames<E>::what;
}

void bind_plans(nb::module_& m) {
  option_enum<DType>(m, "DType", "Gradient / value dtypes (options: value_dtype).");
  option_enum<SelectMethod>(m, "SelectMethod", "Top-k selection (option: method).");
  option_enum<TopKRoute>(m, "TopKRoute", "Top-k exchange (option: route).");
  option_enum<TopKExchange>(m, "TopKExchange",
                            "How a top-k step learns the payload sizes (option: exchange).");
  option_enum<CastRoute>(m, "CastRoute", "fp16/bf16 summation route (option: route).");
  option_enum<OneBitScaling>(m, "OneBitScaling", "1-bit scales (option: scaling).");
  option_enum<QuantRounding>(m, "QuantRounding", "Multi-bit rounding (option: rounding).");
  option_enum<QuantScale>(m, "QuantScale", "Multi-bit block scales (option: scale).");
  option_enum<Orthogonalization>(m, "Orthogonalization",
                                 "PowerSGD orthogonalization (option: orthogonalization).");
  option_enum<OnNonFinite>(m, "OnNonFinite",
                           "What a stateful plan does when some rank's gradient holds NaN/Inf "
                           "(option: on_nonfinite).");
  nb::class_<BucketPlan, Plan> bucket(
      m, "BucketPlan",
      "A plan over one gradient bucket (every family; built by make_plan). Every step: "
      "begin(bucket), then a driver runs next() until it returns None; the average is then in "
      "the bucket.");
  bucket
      .def(
          "begin",
          [](nb::pointer_and_handle<BucketPlan> self, nb::handle grad, uintptr_t stream) {
            const AnyArray a = take_array(grad, Access::kWrite, "grad");
            const TensorView g = to_view(a, stream, "grad");
            // GIL released: a stateful begin may read the whole gradient
            begin_holding(self.h, nb::make_tuple(a), [&] { self.p->begin(g); });
          },
          nb::arg("grad"), nb::arg("stream") = 0,
          "Binds this step's gradient bucket (flat, numel elements); the average is written back "
          "into it when next() returns None. The plan holds grad until then." GC_ARRAY_RULE)
      .def_prop_ro("numel", &BucketPlan::numel)
      .def_prop_rw(
          "on_nonfinite",
          [](const BucketPlan& p) { return std::string(enum_name(p.on_nonfinite())); },
          [](BucketPlan& p, nb::handle v) {
            p.set_on_nonfinite(nb::isinstance<nb::str>(v)
                                   ? parse_enum<OnNonFinite>(nb::cast<std::string>(v))
                                   : nb::cast<OnNonFinite>(v));
          },
          "'skip' (default) or 'raise' (an OnNonFinite member or its name): what a stateful "
          "plan does when some rank's gradient holds NaN or Inf; every rank must use the same.")
      .def_prop_ro("skipped", &BucketPlan::skipped,
                   "Whether the last finished step was skipped because some rank's bucket held "
                   "NaN or Inf (the average is then NaN on every rank and no state changed).")
      .def_prop_ro("skipped_steps", &BucketPlan::skipped_steps,
                   "Steps this plan skipped so far (NaN/Inf on some rank).")
      .def("undo_step", &BucketPlan::undo_step,
           "Takes back the last finished step that was kept: the state returns bitwise to what "
           "it was before it (the average already written stays). For a training step in which "
           "another bucket was skipped. Once, before the next begin() or load_state_dict(), "
           "with check_finite on; a ValueError otherwise, nothing changed. A no-op for a "
           "stateless plan.")
      .def_prop_ro("can_undo", &BucketPlan::can_undo,
                   "Whether undo_step() would take a step back now.")
      .def_prop_ro("stateful", &BucketPlan::stateful,
                   "Whether state_dict() carries state between steps (checkpoint it).")
      .def("state_dict", [](const BucketPlan& p) { return to_bytes(p.state_dict()); })
      .def(
          "load_state_dict",
          [](BucketPlan& p, nb::bytes b) {
            p.load_state_dict(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
          },
          "Restores state_dict(); a mismatch is a ValueError and changes nothing.");

  m.def(
      "make_plan",
      [](const std::string& name, int64_t numel, const std::string& dtype, int world, int rank,
         const std::string& device, int device_index, uintptr_t stream,
         std::vector<std::vector<int64_t>> shapes, uint32_t bucket_id, const std::string& backend,
         nb::dict options, int per_node) {
        BucketSpec b =
            bucket_spec(numel, dtype, world, rank, device, device_index, stream, bucket_id);
        b.shapes = std::move(shapes);
        b.backend = backend;
        if (per_node > 0)
          return make_hierarchical_plan(name, b, per_node, to_options(name, options));
        GC_CHECK_ARG(per_node == 0, "per_node must be >= 0 (0: a flat plan), got ", per_node);
        return make_plan(name, b, to_options(name, options));
      },
      nb::arg("name"), nb::arg("numel"), nb::arg("dtype"), nb::arg("world"), nb::kw_only(),
      nb::arg("rank") = 0, nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      nb::arg("stream") = 0, nb::arg("shapes") = std::vector<std::vector<int64_t>>{},
      nb::arg("bucket_id") = 0, nb::arg("backend") = "", nb::arg("options") = nb::dict(),
      nb::arg("per_node") = 0,
      "The plan of compressor `name` (plan_names()) for a bucket of numel elements of `dtype` "
      "on `device`, for rank `rank` of `world`. options: the family's options (plan_defaults"
      "(name) lists them with their defaults); an unknown option, a wrong type or a bad value is "
      "a ValueError. shapes: the bucket's tensor shapes (PowerSGD). bucket_id keys the RNG per "
      "bucket; backend ('gloo', 'nccl', ...) picks the cast plans' route='auto'. per_node > 0: the "
      "two-level plan (make_hierarchical_plan) for nodes of per_node ranks, node-major: its "
      "collectives' `scope` says which group runs them ('node' or 'cross').");
  m.def(
      "settle_step", [](const std::vector<BucketPlan*>& plans) { return settle_step(plans); },
      nb::arg("plans"),
      "Ends a training step over several buckets (each plan finished): if some plan skipped "
      "the step (NaN/Inf on some rank), every other plan's step is taken back with undo_step(), "
      "so the step leaves no trace as the optimizer skips it. Returns whether it was skipped; "
      "a plan that cannot take its step back is a ValueError raised before any changes.");
  m.def(
      "reshard_state",
      [](const nb::list& states, int world, int rank) {
        std::vector<std::vector<uint8_t>> in;
        for (nb::handle h : states) {
          if (!nb::isinstance<nb::bytes>(h))
            throw nb::type_error("reshard_state: states must be a list of bytes (state_dict())");
          nb::bytes b = nb::borrow<nb::bytes>(h);
          const auto* p = reinterpret_cast<const uint8_t*>(b.c_str());
          in.emplace_back(p, p + b.size());  // copied: the states are read while unlocked
        }
        std::vector<uint8_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = reshard_state(in, world, rank);
        }
        return to_bytes(out);
      },
      nb::arg("states"), nb::arg("world"), nb::arg("rank"),
      "Resumes a checkpoint on another world size: states holds one bucket's plan state_dict() "
      "from every rank of the saved job, in rank order; returns the state to load into rank "
      "`rank` of a job of `world` ranks (the same family, options and bucket). Every rank of the "
      "new job gets the mean over the old ranks of residuals, errors and momenta (their sum / "
      "world size is kept), 1-bit's server errors re-chunked, PowerSGD's Q and the step kept; "
      "with world equal to the old world size, the rank's own bytes. ValueError for corrupt "
      "states or states that are not one job's checkpoint of one step.");
  option_enum<PlanForm>(m, "PlanForm",
                        "What a plan computes: allreduce, reduce_scatter or allgather (the shard "
                        "plans of sharded training, make_shard_plan).");
  m.def(
      "make_shard_plan",
      [](const std::string& name, int64_t numel, const std::string& dtype, int world,
         const std::string& form, int rank, const std::string& device, int device_index,
         uintptr_t stream, uint32_t bucket_id, nb::dict options) {
        const BucketSpec b =
            bucket_spec(numel, dtype, world, rank, device, device_index, stream, bucket_id);
        return make_shard_plan(name, b, parse_enum<PlanForm>(form), to_options(name, options));
      },
      nb::arg("name"), nb::arg("numel"), nb::arg("dtype"), nb::arg("world"), nb::arg("form"),
      nb::kw_only(), nb::arg("rank") = 0, nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      nb::arg("stream") = 0, nb::arg("bucket_id") = 0, nb::arg("options") = nb::dict(),
      "The reduce-scatter or allgather form (form: 'reduce_scatter' / 'allgather') of compressor "
      "`name` (shard_plan_names()) for a bucket of numel elements (P equal chunks, one per rank) "
      "of `dtype` on `device`, for rank `rank` of `world`. Reduce-scatter: at the end chunk "
      "`rank` of the bucket holds the chunk's average (option average=False: its sum); "
      "allgather: chunk `rank` is the input and every chunk the output. options as make_plan "
      "(shard_plan_defaults(name, form) lists them); a bad one is a ValueError.");
  m.def("shard_plan_names", &shard_plan_names,
        "The compressors with reduce-scatter and allgather forms (make_shard_plan).");
  m.def(
      "shard_plan_defaults",
      [](const std::string& name, const std::string& form) {
        nb::dict d;
        for (const auto& [k, v] : shard_plan_defaults(name, parse_enum<PlanForm>(form)))
          d[k.c_str()] = from_option(v);
        return d;
      },
      nb::arg("name"), nb::arg("form"),
      "Every option of a compressor's shard plan of `form` with its default.");
  m.def("plan_names", &plan_names, "The compressor names make_plan() knows.");
  m.def(
      "families",
      [] {
        nb::list out;
        for (const FamilyTraits& t : family_traits()) {
          nb::dict d;
          d["name"] = t.name;
          d["stateful"] = t.stateful;
          d["uses_shapes"] = t.uses_shapes;
          nb::list forms, kinds;
          for (PlanForm f : t.shard_forms) forms.append(enum_name(f));
          for (const auto& k : t.state_kinds) kinds.append(k);
          d["shard_forms"] = forms;
          d["state_kinds"] = kinds;
          d["summary"] = t.summary;
          nb::dict aliases;
          for (const auto& [spelling, option] : t.aliases) aliases[spelling.c_str()] = option;
          d["aliases"] = aliases;
          nb::list docs;
          for (const auto& o : t.option_docs) {
            nb::dict od;
            od["option"] = o.option;
            od["form"] = o.form;
            od["meaning"] = o.meaning;
            nb::list values;
            for (const auto& v : o.values) values.append(v);
            od["values"] = values;
            docs.append(od);
          }
          d["option_docs"] = docs;
          out.append(d);
        }
        return out;
      },
      "Every compressor family's traits, in plan_names() order, as dicts: name, stateful, "
      "uses_shapes (its plans read the bucket's tensor shapes), shard_forms ('reduce_scatter', "
      "'allgather': make_shard_plan), state_kinds (the kinds of state_dict() its plans write), "
      "aliases (other accepted spellings of its options: {spelling: option}), summary and "
      "option_docs (the family's own lines for the options reference). "
      "Read from the one registry make_plan builds from.");
  m.def(
      "plan_defaults",
      [](const std::string& name) {
        nb::dict d;
        for (const auto& [k, v] : plan_defaults(name)) d[k.c_str()] = from_option(v);
        return d;
      },
      nb::arg("name"), "Every option of a compressor with its default.");
  m.def(
      "dry_run",
      [](const std::string& name, int64_t numel, int world, nb::dict options, int steps,
         uint64_t seed, const std::string& backend) {
        GC_CHECK_ARG(world >= 1 && world <= 4096, "dry_run: world must be in [1, 4096], got ",
                     world);
        GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 26) / world,
                     "dry_run: numel x world must stay below 2^26 elements, got ", numel, " x ",
                     world);
        GC_CHECK_ARG(steps >= 1 && steps <= 100, "dry_run: steps must be in [1, 100], got ", steps);
        const PlanOptions opts = to_options(name, options);
        std::vector<Collective> last;
        {
          nb::gil_scoped_release unlocked;
          std::vector<std::unique_ptr<BucketPlan>> plans;
          std::vector<Plan*> ranks;
          for (int r = 0; r < world; ++r) {
            BucketSpec b = bucket_spec(numel, "float32", world, r, "cpu", 0, 0, 0);
            b.backend = backend;
            plans.push_back(make_plan(name, b, opts));
            ranks.push_back(plans.back().get());
          }
          // every rank its own normal gradient (what the payload sizes of the sparsifiers and
          // the cost model's choices depend on), the same on every call with the same seed
          std::mt19937_64 rng(seed);
          std::normal_distribution<float> normal(0.0f, 1.0f);
          std::vector<std::vector<float>> grads(static_cast<size_t>(world),
                                                std::vector<float>(static_cast<size_t>(numel)));
          for (int s = 0; s < steps; ++s) {
            for (int r = 0; r < world; ++r) {
              for (float& v : grads[r]) v = normal(rng);
              plans[r]->begin(TensorView::cpu(grads[r].data(), numel));
            }
            last = run_plans_in_process(ranks);
          }
        }
        nb::list out;  // (the collectives' buffers died with the plans: only their sizes leave)
        for (const Collective& c : last)
          out.append(dict_of("kind", std::string(collective_name(c.kind)), "type",
                             std::string(elem_type_name(c.type)), "count", c.count, "send_bytes",
                             c.send_bytes(), "scope", std::string(scope_name(c.scope)), "tag",
                             c.tag));
        return out;
      },
      nb::arg("name"), nb::arg("numel"), nb::arg("world"), nb::kw_only(),
      nb::arg("options") = nb::dict(), nb::arg("steps") = 3, nb::arg("seed") = 0,
      nb::arg("backend") = "",
      "Runs `steps` steps of compressor `name`'s plan on `world` simulated ranks in this process "
      "(float32 CPU buckets of numel elements, every rank a normal gradient of its own) and "
      "returns the collectives of the last step as rank 0 issued them: dicts of kind, type, "
      "count, send_bytes (what one rank sends into the collective: the whole buffer of an "
      "allreduce, its own part of an allgather, all P parts of an all-to-all), scope and tag. "
      "backend: as make_plan's (the cast plans' route='auto' follows it). What the scale model "
      "reads a family's traffic from. numel x world < 2^26.");
  m.def("plan_is_stateful", &plan_is_stateful, nb::arg("name"),
        "Whether the compressor's plans carry state between steps.");

  // The families' plan classes: built by make_plan(); each adds what only it reports.
  nb::class_<ShardCastPlan, BucketPlan>(
      m, "ShardCastPlan",
      "The reduce-scatter or allgather of plain, fp16 or bf16 chunks (fp32 sums in rank order).")
      .def_prop_ro("form", [](const ShardCastPlan& p) { return enum_name(p.form()); });
  nb::class_<DenseAllreducePlan, BucketPlan>(m, "DenseAllreducePlan",
                                             "Plain allreduce (rank-ordered sum, then / world).");
  nb::class_<CastAllreducePlan, BucketPlan>(
      m, "CastAllreducePlan",
      "fp16/bf16 cast allreduce. route 'allreduce': one allreduce in the wire type (fast where "
      "the backend sums half precision, NCCL); 'reduce_scatter': all-to-all of wire-type chunks, "
      "a rank-ordered fp32 sum, an allgather (the same bytes on the wire; the backend only moves "
      "bytes, for gloo).")
      .def_prop_ro("route", [](const CastAllreducePlan& p) { return enum_name(p.route()); });
  nb::class_<TopKAllreducePlan, BucketPlan>(
      m, "TopKAllreducePlan",
      "Top-k / DGC allreduce: sparse allgather or densify-then-allreduce, chosen per step by a "
      "cost model (identical decision on every rank); the payload sizes are exchanged first or "
      "every payload is padded to the step's bound (option exchange: auto, bound, sizes).")
      .def_prop_ro("compressor_stats",
                   [](TopKAllreducePlan& p) { return stats_dict(p.compressor().last_stats()); })
      .def_prop_ro("route_stats", [](TopKAllreducePlan& p) {
        const TopKPlanStats& s = p.stats();
        return dict_of(
            "steps", s.steps, "sparse_steps", s.sparse_steps, "dense_steps", s.dense_steps,
            "bound_steps", s.bound_steps, "last_route", std::string(enum_name(s.last_route)),
            "last_exchange", std::string(enum_name(s.last_exchange)), "last_stride", s.last_stride,
            "last_max_payload", s.last_max_payload, "last_total_payload", s.last_total_payload,
            "last_sparse_cost_s", s.last_sparse_cost_s, "last_dense_cost_s", s.last_dense_cost_s);
      });
  nb::class_<RandomKAllreducePlan, BucketPlan>(m, "RandomKAllreducePlan",
                                               "Random-k allreduce: values only, shared indices.")
      .def_prop_ro(
          "dense_numel", [](RandomKAllreducePlan& p) { return p.compressor().dense_numel(); },
          "Elements sent whole every step (the tensors below dense_below); numel when the whole "
          "bucket is.");
}

Register reg(20, bind_plans);

}  // namespace
}  // namespace gradcomp::py

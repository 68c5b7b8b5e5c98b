// SPDX-License-Identifier: Apache-2.0
// The compressed-allreduce plans of plans.hpp, for the Python driver (gradcomp.torch).
#include "common.hpp"

namespace gradcomp::py {
namespace {

nb::bytes to_bytes(const std::vector<uint8_t>& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

TopKRoute parse_route(const std::string& s) {
  if (s == "auto") return TopKRoute::kAuto;
  if (s == "sparse") return TopKRoute::kSparse;
  if (s == "dense") return TopKRoute::kDense;
  throw InvalidArgument("unknown top-k route '" + s + "' (expected auto, sparse or dense)");
}

const char* route_name(TopKRoute r) {
  switch (r) {
    case TopKRoute::kAuto: return "auto";
    case TopKRoute::kSparse: return "sparse";
    case TopKRoute::kDense: return "dense";
  }
  return "?";
}

CastRoute parse_cast_route(const std::string& s) {
  if (s == "allreduce") return CastRoute::kAllreduce;
  if (s == "reduce_scatter") return CastRoute::kReduceScatter;
  throw InvalidArgument("unknown cast route '" + s + "' (expected allreduce or reduce_scatter)");
}

template <class P>
void bind_begin(nb::class_<P, Plan>& c) {
  c.def(
      "begin",
      [](nb::pointer_and_handle<P> self, nb::handle grad, uintptr_t stream) {
        const AnyArray a = take_array(grad, Access::kWrite, "grad");
        const TensorView g = to_view(a, stream, "grad");
        // GIL released: a stateful begin may read the whole gradient
        begin_holding(self.h, nb::make_tuple(a), [&] { self.p->begin(g); });
      },
      nb::arg("grad"), nb::arg("stream") = 0,
      "Binds this step's gradient bucket; the average is written back into it when next() "
      "returns None. The plan holds grad until then." GC_ARRAY_RULE);
  c.def_prop_ro("numel", &P::numel);
}

void bind_plans(nb::module_& m) {
  nb::class_<DenseAllreducePlan, Plan> dense(m, "DenseAllreducePlan",
                                             "Plain allreduce (rank-ordered sum, then / world).");
  dense.def(
      "__init__",
      [](DenseAllreducePlan* self, int64_t numel, const std::string& dtype, int world,
         const std::string& device, int device_index, uintptr_t stream) {
        new (self) DenseAllreducePlan(numel, parse_dtype(dtype), world, parse_device(device),
                                      device_index, reinterpret_cast<void*>(stream));
      },
      nb::arg("numel"), nb::arg("dtype"), nb::arg("world"), nb::kw_only(),
      nb::arg("device") = "cpu", nb::arg("device_index") = 0, nb::arg("stream") = 0);
  bind_begin(dense);

  nb::class_<CastAllreducePlan, Plan> cast(
      m, "CastAllreducePlan",
      "fp16/bf16 cast allreduce. route='allreduce': one allreduce in the wire type (fast where the "
      "backend sums half precision, NCCL); route='reduce_scatter': all-to-all of wire-type "
      "chunks, a rank-ordered fp32 sum, an allgather (the same bytes on the wire; the backend "
      "only moves bytes, for gloo).");
  cast.def(
      "__init__",
      [](CastAllreducePlan* self, int64_t numel, const std::string& dtype, const std::string& wire,
         int world, const std::string& device, int device_index, uintptr_t stream,
         const std::string& route) {
        new (self) CastAllreducePlan(numel, parse_dtype(dtype), parse_dtype(wire), world,
                                     parse_device(device), device_index,
                                     reinterpret_cast<void*>(stream), parse_cast_route(route));
      },
      nb::arg("numel"), nb::arg("dtype"), nb::arg("wire_dtype"), nb::arg("world"), nb::kw_only(),
      nb::arg("device") = "cpu", nb::arg("device_index") = 0, nb::arg("stream") = 0,
      nb::arg("route") = "allreduce");
  cast.def_prop_ro("route", [](const CastAllreducePlan& p) {
    return p.route() == CastRoute::kAllreduce ? "allreduce" : "reduce_scatter";
  });
  bind_begin(cast);

  nb::class_<TopKAllreducePlan, Plan> topk(
      m, "TopKAllreducePlan",
      "Top-k / DGC allreduce: sparse allgather or densify-then-allreduce, chosen per step by a "
      "cost model (identical decision on every rank).");
  topk.def(
      "__init__",
      [](TopKAllreducePlan* self, int64_t numel, int world, double ratio,
         const std::string& method, double momentum, bool nesterov, bool momentum_masking,
         double clip_norm, std::vector<double> warmup_ratios, int64_t warmup_steps,
         const std::string& value_dtype, bool error_feedback, bool check_finite, uint64_t seed,
         uint32_t tensor_id, double sample_rate, const std::string& route, double latency_s,
         double bandwidth_Bps, const std::string& clip_scaling,
         const std::string& grad_dtype, const std::string& device, int device_index,
         uintptr_t stream) {
        TopKConfig c = topk_config(ratio, method, sample_rate, momentum, nesterov,
                                         momentum_masking, clip_norm, std::move(warmup_ratios),
                                         warmup_steps, value_dtype, error_feedback, check_finite,
                                         seed, tensor_id);
        c.clip_scaling = parse_clip_scaling(clip_scaling);
        TopKPlanOptions o;
        o.route = parse_route(route);
        GC_CHECK_ARG(latency_s >= 0 && bandwidth_Bps > 0, "cost model needs latency_s >= 0 and "
                     "bandwidth_Bps > 0, got ", latency_s, ", ", bandwidth_Bps);
        o.cost.latency_s = latency_s;
        o.cost.bandwidth_Bps = bandwidth_Bps;
        new (self) TopKAllreducePlan(c, numel, world, o, parse_dtype(grad_dtype),
                                     parse_device(device), device_index,
                                     reinterpret_cast<void*>(stream));
      },
      nb::arg("numel"), nb::arg("world"), nb::kw_only(), nb::arg("ratio") = 0.001,
      nb::arg("method") = "sampled", nb::arg("momentum") = 0.0, nb::arg("nesterov") = false,
      nb::arg("momentum_masking") = true, nb::arg("clip_norm") = 0.0,
      nb::arg("warmup_ratios") = std::vector<double>{}, nb::arg("warmup_steps") = 0,
      nb::arg("value_dtype") = "float32", nb::arg("error_feedback") = true,
      nb::arg("check_finite") = true, nb::arg("seed") = 0, nb::arg("tensor_id") = 0,
      nb::arg("sample_rate") = 0.01, nb::arg("route") = "auto", nb::arg("latency_s") = 20e-6,
      nb::arg("bandwidth_Bps") = 5e9, nb::arg("clip_scaling") = "sqrt_world",
      nb::arg("grad_dtype") = "float32", nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      nb::arg("stream") = 0);
  bind_begin(topk);
  topk.def("state_dict", [](TopKAllreducePlan& p) { return to_bytes(p.compressor().state_dict()); })
      .def("load_state_dict",
           [](TopKAllreducePlan& p, nb::bytes b) {
             p.compressor().load_state_dict(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
           })
      .def_prop_ro("compressor_stats",
                   [](TopKAllreducePlan& p) { return stats_dict(p.compressor().last_stats()); })
      .def_prop_ro("route_stats", [](TopKAllreducePlan& p) {
        const TopKPlanStats& s = p.stats();
        nb::dict d;
        d["steps"] = s.steps;
        d["sparse_steps"] = s.sparse_steps;
        d["dense_steps"] = s.dense_steps;
        d["last_route"] = std::string(route_name(s.last_route));
        d["last_max_payload"] = s.last_max_payload;
        d["last_total_payload"] = s.last_total_payload;
        d["last_sparse_cost_s"] = s.last_sparse_cost_s;
        d["last_dense_cost_s"] = s.last_dense_cost_s;
        return d;
      });

  nb::class_<RandomKAllreducePlan, Plan> rk(m, "RandomKAllreducePlan",
                                            "Random-k allreduce: values only, shared indices.");
  rk.def(
      "__init__",
      [](RandomKAllreducePlan* self, int64_t numel, int world, double ratio, double momentum,
         bool nesterov, bool momentum_masking, double clip_norm,
         std::vector<double> warmup_ratios, int64_t warmup_steps, const std::string& value_dtype,
         bool error_feedback, bool check_finite, uint64_t seed, uint32_t tensor_id,
         const std::string& clip_scaling, const std::string& grad_dtype,
         const std::string& device, int device_index, uintptr_t stream) {
        auto c = sparsify_config<RandomKConfig>(
            ratio, momentum, nesterov, momentum_masking, clip_norm, std::move(warmup_ratios),
            warmup_steps, value_dtype, error_feedback, check_finite, seed, tensor_id);
        c.clip_scaling = parse_clip_scaling(clip_scaling);
        new (self) RandomKAllreducePlan(c, numel, world, parse_dtype(grad_dtype),
                                        parse_device(device), device_index,
                                        reinterpret_cast<void*>(stream));
      },
      nb::arg("numel"), nb::arg("world"), nb::kw_only(), nb::arg("ratio") = 0.01,
      nb::arg("momentum") = 0.0, nb::arg("nesterov") = false, nb::arg("momentum_masking") = true,
      nb::arg("clip_norm") = 0.0, nb::arg("warmup_ratios") = std::vector<double>{},
      nb::arg("warmup_steps") = 0, nb::arg("value_dtype") = "float32", nb::arg("error_feedback") = true,
      nb::arg("check_finite") = true, nb::arg("seed") = 0, nb::arg("tensor_id") = 0,
      nb::arg("clip_scaling") = "sqrt_world",
      nb::arg("grad_dtype") = "float32", nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      nb::arg("stream") = 0);
  bind_begin(rk);
  rk.def("state_dict", [](RandomKAllreducePlan& p) { return to_bytes(p.compressor().state_dict()); })
      .def("load_state_dict", [](RandomKAllreducePlan& p, nb::bytes b) {
        p.compressor().load_state_dict(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
      });
}

Register reg(20, bind_plans);

}  // namespace
}  // namespace gradcomp::py

// SPDX-License-Identifier: Apache-2.0
// The 1-bit family and PowerSGD, for standalone use and for the Python driver's hooks.
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/powersgd_plan.hpp"

namespace gradcomp::py {
namespace {

void bind(nb::module_& m) {
  nb::class_<OneBitCompressor> onebit(
      m, "OneBitCompressor",
      "1-bit SGD / scaled sign with error feedback for one tensor viewed as rows x cols. Keyword "
      "options: the onebit plan's (gradcomp.plan_defaults('onebit')), with the same names, "
      "types and defaults: scaling 'sign_l2' with block_size 128 (chunk_size is accepted for "
      "block_size), error_feedback, check_finite. scaling='column_means' (1-bit SGD's per-column "
      "means; the plan refuses it) takes block_size 0, its default then. The plan's rotate and "
      "momentum, and its route options, are refused.");
  onebit.def(
      "__init__",
      [](OneBitCompressor* self, int64_t rows, int64_t cols, uint32_t tensor_id,
         const std::string& grad_dtype, const std::string& device, int device_index,
         uintptr_t stream, const nb::kwargs& kw) {
        const OneBitConfig c = onebit_config(to_options("onebit", kw), tensor_id);
        new (self) OneBitCompressor(c, rows, cols, parse_enum<DType>(grad_dtype),
                                    parse_enum<Device>(device), device_index,
                                    reinterpret_cast<void*>(stream));
      },
      nb::arg("rows"), nb::arg("cols") = 1, nb::kw_only(), nb::arg("tensor_id") = 0,
      nb::arg("grad_dtype") = "float32", nb::arg("device") = "cpu", nb::arg("device_index") = 0,
      nb::arg("stream") = 0, nb::arg("kwargs"));
  def_compressor_methods(onebit);

  nb::class_<OneBitAllreducePlan, BucketPlan>(
      m, "OneBitAllreducePlan",
      "1-bit Adam's two-phase compressed allreduce (one rank); built by make_plan('onebit', ...).")
      .def(
          "begin",
          [](nb::pointer_and_handle<OneBitAllreducePlan> self, nb::handle grad, uintptr_t stream,
             nb::handle out) {
            if (out.is_none()) {  // in place, like every other bucket plan
              const AnyArray ga = take_array(grad, Access::kWrite, "grad");
              const TensorView g = to_view(ga, stream, "grad");
              begin_holding(self.h, nb::make_tuple(ga), [&] { self.p->begin(g); });
              return;
            }
            const AnyArray ga = take_array(grad, Access::kRead, "grad");
            const AnyArray oa = take_array(out, Access::kWrite, "out");
            const TensorView g = to_view(ga, stream, "grad"), o = to_view(oa, stream, "out");
            begin_holding(self.h, nb::make_tuple(ga, oa), [&] { self.p->begin(g, o); });
          },
          nb::arg("grad"), nb::arg("stream") = 0, nb::kw_only(), nb::arg("out") = nb::none(),
          "Starts a step. Without `out` the average replaces grad (in its dtype) when next() "
          "returns None; with `out` (fp32, not aliasing grad) it goes there and grad is left as "
          "it was. The plan holds the arrays until next() returns None." GC_ARRAY_RULE)
      .def_prop_ro("step", &OneBitAllreducePlan::step)
      .def_prop_ro("bytes_sent", &OneBitAllreducePlan::bytes_sent)
      .def_prop_ro("block_size", &OneBitAllreducePlan::scale_block)
      .def_prop_ro("rotate", [](const OneBitAllreducePlan& p) { return p.config().rotate; })
      .def(
          "worker_error",
          [](const OneBitAllreducePlan& p) {
            return host_copy(p.worker_error(), p.numel(), p.device());
          },
          "A copy (NumPy, fp32) of the worker error-feedback memory, for diagnostics.")
      .def(
          "server_error",
          [](const OneBitAllreducePlan& p) {
            return host_copy(p.server_error(), p.chunk_elems(), p.device());
          },
          "A copy (NumPy, fp32) of this rank's server error (chunk_elems floats).");

  nb::class_<PowerSGDState>(m, "PowerSGDState", "PowerSGD state of one bucket on one rank.")
      .def(
          "__init__",
          [](PowerSGDState* self, const std::vector<std::vector<int64_t>>& shapes, int rank,
             int64_t start_iter, double min_compression_rate, bool use_error_feedback,
             bool warm_start, float orthogonalization_epsilon, uint64_t seed,
             const std::string& orthogonalization, bool check_finite, uint32_t first_tensor_id,
             const std::string& grad_dtype, const std::string& device, int device_index,
             uintptr_t stream) {
            PowerSGDConfig c;
            c.rank = rank;
            c.start_iter = start_iter;
            c.min_compression_rate = min_compression_rate;
            c.error_feedback = use_error_feedback;
            c.warm_start = warm_start;
            c.orthogonalization_epsilon = orthogonalization_epsilon;
            c.seed = seed;
            c.orthogonalization = parse_enum<Orthogonalization>(orthogonalization);
            c.check_finite = check_finite;
            c.first_tensor_id = first_tensor_id;
            new (self)
                PowerSGDState(c, shapes, parse_enum<DType>(grad_dtype), parse_enum<Device>(device),
                              device_index, reinterpret_cast<void*>(stream));
          },
          nb::arg("shapes"), nb::kw_only(), nb::arg("rank") = 1, nb::arg("start_iter") = 0,
          nb::arg("min_compression_rate") = 2.0, nb::arg("use_error_feedback") = true,
          nb::arg("warm_start") = true, nb::arg("orthogonalization_epsilon") = 0.0f,
          nb::arg("seed") = 0, nb::arg("orthogonalization") = "auto",
          nb::arg("check_finite") = true, nb::arg("first_tensor_id") = 0,
          nb::arg("grad_dtype") = "float32", nb::arg("device") = "cpu", nb::arg("device_index") = 0,
          nb::arg("stream") = 0)
      .def_prop_ro("step", &PowerSGDState::step)
      .def("state_dict", [](const PowerSGDState& s) { return to_bytes(s.state_dict()); })
      .def("load_state_dict",
           [](PowerSGDState& s, nb::bytes b) {
             s.load_state_dict(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
           })
      .def_prop_ro("last_stats", [](const PowerSGDState& s) {
        const PowerSGDStats& st = s.last_stats();
        return dict_of("step", st.step, "compressed", st.compressed, "dense_bytes", st.dense_bytes,
                       "sent_bytes", st.sent_bytes, "collectives", st.collectives, "rank_used",
                       st.rank_used, "compression_ratio", st.compression_ratio());
      });

  nb::class_<PowerSGDPlan, BucketPlan>(
      m, "PowerSGDPlan",
      "One PowerSGD step on a bucket, as a plan: make_plan('powersgd', ..., shapes=...), or "
      "PowerSGDPlan(state, world) over a PowerSGDState you keep.")
      .def(nb::init<PowerSGDState&, int>(), nb::arg("state"), nb::arg("world"),
           nb::keep_alive<1, 2>())
      .def(
          "begin",
          [](nb::pointer_and_handle<PowerSGDPlan> self, nb::handle grads, uintptr_t stream) {
            if (!nb::isinstance<nb::list>(grads) && !nb::isinstance<nb::tuple>(grads)) {
              const AnyArray a = take_array(grads, Access::kWrite, "bucket");
              const TensorView g = to_view(a, stream, "bucket");
              begin_holding(self.h, nb::make_tuple(a), [&] { self.p->begin(g); });
              return;
            }
            std::vector<TensorView> v;
            nb::list held;
            for (nb::handle g : grads) {
              const std::string what = detail::cat("grads[", v.size(), "]");
              const AnyArray a = take_array(g, Access::kWrite, what.c_str());
              v.push_back(to_view(a, stream, what.c_str()));
              held.append(a);
            }
            // GIL released: begin() reads every gradient (finite check)
            begin_holding(self.h, nb::tuple(held), [&] { self.p->begin(v); });
          },
          nb::arg("grads"), nb::arg("stream") = 0,
          "Binds the bucket: the flat bucket (its tensors back to back in the state's order), or "
          "a list/tuple of the bucket's gradients in that order; written in place. The plan "
          "holds them until next() returns None." GC_ARRAY_RULE)
      .def_prop_ro(
          "state", [](PowerSGDPlan& p) -> PowerSGDState& { return p.state(); },
          nb::rv_policy::reference_internal, "The PowerSGDState this plan steps.");
}

Register reg(30, bind);

}  // namespace
}  // namespace gradcomp::py

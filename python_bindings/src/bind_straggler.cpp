// SPDX-License-Identifier: Apache-2.0
// Straggler mitigation (gradcomp/straggler.hpp) for Python: DropCompute's analytics, latency traces
// and the deterministic tau* search, the per-step threshold controller, the gradient
// normalisation, the delay simulator and the QSR sync-period rule. Plain floats, strings for the
// enumerations, NumPy float64 arrays for latencies. Long calls release the GIL.
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "common.hpp"
#include "gradcomp/straggler.hpp"

namespace gradcomp::py {
namespace {

using namespace gradcomp::straggler;

using F64Array = nb::ndarray<const double, nb::c_contig, nb::device::cpu>;

TauOptions tau_options(double serial_time, const std::string& model, double min_gain) {
  TauOptions o;
  o.serial_time = serial_time;
  o.model = parse_enum<StopModel>(model);
  o.min_gain = min_gain;
  o.validate();
  return o;
}

/// A NumPy float64 copy of a vector (owned by the array).
nb::object to_numpy(std::vector<double> v, std::vector<size_t> shape = {}) {
  auto* owned = new std::vector<double>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  if (shape.empty()) shape.push_back(owned->size());
  return nb::cast(nb::ndarray<nb::numpy, double>(owned->data(), shape.size(), shape.data(), owner),
                  nb::rv_policy::move);
}

LatencyTrace make_trace(int64_t workers, int64_t steps, int64_t micro_batches,
                        std::vector<double> latency) {
  LatencyTrace t{workers, steps, micro_batches, std::move(latency)};
  t.validate();
  return t;
}

// -- result structs as dicts (for CSV rows) -------------------------------------------------------
// (each in its struct's field order: the order Python sees the keys in)
nb::dict tau_eval_dict(const TauEval& e) {
  return dict_of("tau", e.tau, "completed", e.completed, "completion_rate", e.completion_rate,
                 "drop_rate", e.drop_rate, "step_time", e.step_time, "step_time_with_tau",
                 e.step_time_with_tau, "speedup", e.speedup, "step_speedup", e.step_speedup);
}
nb::dict analytic_point_dict(const AnalyticPoint& e) {
  return dict_of("tau", e.tau, "step_time", e.step_time, "completed", e.completed,
                 "completion_rate", e.completion_rate, "drop_rate", e.drop_rate,
                 "step_time_with_tau", e.step_time_with_tau, "speedup", e.speedup, "step_speedup",
                 e.step_speedup);
}

void bind_analytics(nb::module_& m) {
  m.attr("EULER_GAMMA") = kEulerGamma;
  m.def("normal_cdf", &normal_cdf, nb::arg("x"), "Standard normal CDF Phi(x).");
  m.def("normal_quantile", &normal_quantile, nb::arg("p"),
        "Phi^-1(p) for p in (0, 1); ValueError outside.");
  m.def("expected_max_normal", &expected_max_normal, nb::arg("n"), nb::arg("mu") = 0.0,
        nb::arg("sigma") = 1.0,
        "E[max of n iid N(mu, sigma^2)] by the DropCompute paper's Eq. 4 (within ~2% for n >= "
        "16).\n\nExample: gradcomp.dropcompute.expected_max_normal(64)  # ~2.369 (exact: 2.344)");
  m.def(
      "expected_completed_microbatches", &expected_completed_microbatches, nb::arg("tau"),
      nb::arg("micro_batches"), nb::arg("mu"), nb::arg("sigma"),
      "E[M~(tau)] by Eq. 5: sum_m Phi((tau - m mu) / sqrt(m sigma^2)).\n\n"
      "Example: gradcomp.dropcompute.expected_completed_microbatches(12.0, 12, 1.0, 0.1)  # ~11.5");
  m.def("effective_speedup", &effective_speedup, nb::arg("m_tilde"), nb::arg("micro_batches"),
        nb::arg("tau"), nb::arg("step_time"), nb::arg("serial_time"),
        "S_eff by Eq. 6: m_tilde (T + Tc) / (M (min(tau, T) + Tc)).");
  m.def("compensation_factor", &compensation_factor, nb::arg("m_tilde"), nb::arg("micro_batches"),
        "R = M / M~ - 1: the extra steps (or batch increase) that restore the dropped samples.");

  nb::class_<AnalyticModel>(
      m, "AnalyticModel",
      "N workers, M micro-batches of mu +- sigma each, serial time Tc.\n\n"
      "Example: gradcomp.dropcompute.AnalyticModel(workers=64, micro_batches=12, mu=1.0, "
      "sigma=0.3, serial_time=0.5)")
      .def(
          "__init__",
          [](AnalyticModel* self, int64_t workers, int64_t micro_batches, double mu, double sigma,
             double serial_time) {
            AnalyticModel a{workers, micro_batches, mu, sigma, serial_time};
            a.validate();
            new (self) AnalyticModel(a);
          },
          nb::kw_only(), nb::arg("workers") = 1, nb::arg("micro_batches") = 1, nb::arg("mu") = 1.0,
          nb::arg("sigma") = 0.0, nb::arg("serial_time") = 0.0)
      .def_ro("workers", &AnalyticModel::workers)
      .def_ro("micro_batches", &AnalyticModel::micro_batches)
      .def_ro("mu", &AnalyticModel::mu)
      .def_ro("sigma", &AnalyticModel::sigma)
      .def_ro("serial_time", &AnalyticModel::serial_time);

  nb::class_<AnalyticPoint>(m, "AnalyticPoint", "The analytic prediction (Eq. 4-6) at one tau.")
      .def_ro("tau", &AnalyticPoint::tau)
      .def_ro("step_time", &AnalyticPoint::step_time)
      .def_ro("completed", &AnalyticPoint::completed)
      .def_ro("completion_rate", &AnalyticPoint::completion_rate)
      .def_ro("drop_rate", &AnalyticPoint::drop_rate)
      .def_ro("step_time_with_tau", &AnalyticPoint::step_time_with_tau)
      .def_ro("speedup", &AnalyticPoint::speedup)
      .def_ro("step_speedup", &AnalyticPoint::step_speedup)
      .def("as_dict", &analytic_point_dict)
      .def("__repr__", [](const AnalyticPoint& p) {
        return "AnalyticPoint(tau=" + std::to_string(p.tau) +
               ", completion_rate=" + std::to_string(p.completion_rate) +
               ", speedup=" + std::to_string(p.speedup) + ")";
      });

  m.def("analytic_point", &analytic_point, nb::arg("model"), nb::arg("tau"),
        nb::arg("step_time") = 0.0,
        "Eq. 4-6 at tau (step_time > 0 replaces Eq. 4's E[T]).\n\n"
        "Example: gradcomp.dropcompute.analytic_point(model, 12.5).speedup");
  m.def(
      "analytic_optimal_tau",
      [](const AnalyticModel& a, int64_t grid) {
        nb::gil_scoped_release nogil;
        return analytic_optimal_tau(a, grid);
      },
      nb::arg("model"), nb::arg("grid") = 2048, "The tau maximising the analytic S_eff.");
}

void bind_trace(nb::module_& m) {
  nb::class_<LatencyStats>(m, "LatencyStats", "Mean and standard deviation of latencies.")
      .def_ro("mean", &LatencyStats::mean)
      .def_ro("stddev", &LatencyStats::stddev)
      .def("__repr__", [](const LatencyStats& s) {
        return "LatencyStats(mean=" + std::to_string(s.mean) +
               ", stddev=" + std::to_string(s.stddev) + ")";
      });

  nb::class_<LatencyTrace>(
      m, "LatencyTrace",
      "Per-micro-batch latencies [worker][step][micro_batch] (seconds), e.g. the all-gathered\n"
      "ThresholdController.history of every rank in rank order. Validated on construction:\n"
      "ValueError for a zero dimension, a size mismatch, or a negative/NaN/Inf latency.\n\n"
      "Example: t = gradcomp.dropcompute.LatencyTrace(4, 5, 12, gathered)  # 4 * 5 * 12 float64 "
      "values")
      .def(
          "__init__",
          [](LatencyTrace* self, int64_t workers, int64_t steps, int64_t micro_batches,
             const F64Array& latency) {
            if (latency.ndim() == 3)
              GC_CHECK_ARG(static_cast<int64_t>(latency.shape(0)) == workers &&
                               static_cast<int64_t>(latency.shape(1)) == steps &&
                               static_cast<int64_t>(latency.shape(2)) == micro_batches,
                           "LatencyTrace: a 3-d latency array must have shape (workers, steps, "
                           "micro_batches) = (",
                           workers, ", ", steps, ", ", micro_batches, "), got (", latency.shape(0),
                           ", ", latency.shape(1), ", ", latency.shape(2), ")");
            const double* p = latency.data();
            new (self) LatencyTrace(make_trace(workers, steps, micro_batches,
                                               std::vector<double>(p, p + latency.size())));
          },
          nb::arg("workers"), nb::arg("steps"), nb::arg("micro_batches"), nb::arg("latency"))
      .def(
          "__init__",
          [](LatencyTrace* self, int64_t workers, int64_t steps, int64_t micro_batches,
             std::vector<double> latency) {
            new (self) LatencyTrace(make_trace(workers, steps, micro_batches, std::move(latency)));
          },
          nb::arg("workers"), nb::arg("steps"), nb::arg("micro_batches"), nb::arg("latency"))
      .def_ro("workers", &LatencyTrace::workers)
      .def_ro("steps", &LatencyTrace::steps)
      .def_ro("micro_batches", &LatencyTrace::micro_batches)
      .def_prop_ro(
          "latency",
          [](const LatencyTrace& t) {
            return to_numpy(t.latency,
                            {static_cast<size_t>(t.workers), static_cast<size_t>(t.steps),
                             static_cast<size_t>(t.micro_batches)});
          },
          "A (workers, steps, micro_batches) float64 copy.")
      .def("at",
           [](const LatencyTrace& t, int64_t n, int64_t s, int64_t mb) {
             GC_CHECK_ARG(n >= 0 && n < t.workers && s >= 0 && s < t.steps && mb >= 0 &&
                              mb < t.micro_batches,
                          "LatencyTrace.at: index (", n, ", ", s, ", ", mb, ") out of range (",
                          t.workers, ", ", t.steps, ", ", t.micro_batches, ")");
             return t.at(n, s, mb);
           })
      .def("validate", &LatencyTrace::validate);

  nb::class_<TauEval>(m, "TauEval",
                      "Empirical S_eff and friends of a trace at one tau (means over steps).")
      .def_ro("tau", &TauEval::tau)
      .def_ro("completed", &TauEval::completed)
      .def_ro("completion_rate", &TauEval::completion_rate)
      .def_ro("drop_rate", &TauEval::drop_rate)
      .def_ro("step_time", &TauEval::step_time)
      .def_ro("step_time_with_tau", &TauEval::step_time_with_tau)
      .def_ro("speedup", &TauEval::speedup)
      .def_ro("step_speedup", &TauEval::step_speedup)
      .def("as_dict", &tau_eval_dict)
      .def("__repr__", [](const TauEval& e) {
        return "TauEval(tau=" + std::to_string(e.tau) +
               ", drop_rate=" + std::to_string(e.drop_rate) +
               ", speedup=" + std::to_string(e.speedup) + ")";
      });

  m.def(
      "evaluate_tau",
      [](const LatencyTrace& t, double tau, double serial_time, const std::string& model,
         double min_gain) {
        const TauOptions o = tau_options(serial_time, model, min_gain);
        nb::gil_scoped_release nogil;
        return evaluate_tau(t, tau, o);
      },
      nb::arg("trace"), nb::arg("tau"), nb::kw_only(), nb::arg("serial_time") = 0.0,
      nb::arg("stop_model") = "preemptive", nb::arg("min_gain") = 1e-9,
      "S_eff etc. of the trace at tau > 0. model: 'preemptive' (the paper) or 'boundary' (a\n"
      "check between micro-batches).\n\nExample: gradcomp.dropcompute.evaluate_tau(trace, 11.5, "
      "serial_time=0.3).speedup");
  m.def(
      "find_optimal_tau",
      [](const LatencyTrace& t, double serial_time, const std::string& model, double min_gain) {
        const TauOptions o = tau_options(serial_time, model, min_gain);
        nb::gil_scoped_release nogil;
        return find_optimal_tau(t, o);
      },
      nb::arg("trace"), nb::kw_only(), nb::arg("serial_time") = 0.0,
      nb::arg("stop_model") = "preemptive", nb::arg("min_gain") = 1e-9,
      "The tau* maximising the empirical S_eff; deterministic (bitwise the same on every rank\n"
      "for the same trace); tau* = the largest step time (no drop) when nothing gains.\n\n"
      "Example: tau = gradcomp.dropcompute.find_optimal_tau(trace, serial_time=0.2).tau");
  m.def("latency_stats", &latency_stats, nb::arg("trace"),
        "Mean and population standard deviation of all latencies.");
}

/// The controller plus the Python clock it calls; the clock is visible to Python's cycle
/// collector (a clock closing over its controller must not leak).
struct PyController {
  nb::object clock;
  ThresholdController ctl;
  PyController(const ThresholdConfig& cfg, nb::object clk)
      : clock(std::move(clk)), ctl(cfg, make_clock()) {}

 private:
  ClockFn make_clock() {
    if (clock.is_none()) return {};
    // Called only from methods invoked by Python, so the GIL is held.
    return [this]() -> double {
      if (!clock.is_valid() || clock.is_none())
        throw Error("ThresholdController: the clock was cleared by the garbage collector");
      return nb::cast<double>(clock());
    };
  }
};

int controller_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT(nb::inst_ptr<PyController>(self)->clock.ptr());
  return 0;
}
int controller_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<PyController>(self)->clock = nb::none();
  return 0;
}
PyType_Slot kControllerSlots[] = {{Py_tp_traverse, reinterpret_cast<void*>(controller_traverse)},
                                  {Py_tp_clear, reinterpret_cast<void*>(controller_clear)},
                                  {0, nullptr}};

void bind_controller(nb::module_& m) {
  using SR = ThresholdController::StepRecord;
  nb::class_<SR>(m, "StepRecord", "One step of a ThresholdController.")
      .def_ro("completed", &SR::completed)
      .def_ro("dropped", &SR::dropped)
      .def_ro("elapsed", &SR::elapsed)
      .def("__repr__", [](const SR& r) {
        return "StepRecord(completed=" + std::to_string(r.completed) +
               ", dropped=" + (r.dropped ? "True" : "False") +
               ", elapsed=" + std::to_string(r.elapsed) + ")";
      });

  nb::class_<PyController>(
      m, "ThresholdController",
      "The per-step DropCompute decision of one worker.\n\n"
      "clock: None (a monotonic clock in C++) or a callable returning seconds (e.g. a CUDA-event\n"
      "timer); drop_point: 'before_forward', 'between_forward_backward' or 'after_backward'.\n\n"
      "Example:\n"
      "    c = gradcomp.dropcompute.ThresholdController(12, tau=0.8)\n"
      "    c.begin_step()\n"
      "    while c.proceed('before_forward'):\n"
      "        forward_backward(); c.micro_batch_done()\n"
      "    rec = c.end_step()",
      nb::type_slots(kControllerSlots))
      .def(
          "__init__",
          [](PyController* self, int64_t micro_batches, double tau, const std::string& drop_point,
             int64_t history_steps, nb::object clock) {
            ThresholdConfig c;
            c.micro_batches = micro_batches;
            c.tau = tau;
            c.drop_point = parse_enum<DropPoint>(drop_point);
            c.history_steps = history_steps;
            GC_CHECK_ARG(clock.is_none() || PyCallable_Check(clock.ptr()),
                         "ThresholdController: clock must be None or a callable returning seconds");
            new (self) PyController(c, std::move(clock));
          },
          nb::arg("micro_batches"), nb::kw_only(),
          nb::arg("tau") = std::numeric_limits<double>::infinity(),
          nb::arg("drop_point") = "before_forward", nb::arg("history_steps") = 0,
          nb::arg("clock") = nb::none())
      .def("begin_step", [](PyController& w) { w.ctl.begin_step(); })
      .def(
          "proceed",
          [](PyController& w, const std::string& p) {
            return w.ctl.proceed(parse_enum<DropPoint>(p));
          },
          nb::arg("point"), "Whether to go on past this point of the current micro-batch.")
      .def(
          "proceed_elapsed",
          [](PyController& w, const std::string& p, double elapsed) {
            return w.ctl.proceed_elapsed(parse_enum<DropPoint>(p), elapsed);
          },
          nb::arg("point"), nb::arg("elapsed"),
          "proceed() judged on an elapsed time measured by the caller (seconds).")
      .def("micro_batch_done", [](PyController& w) { w.ctl.micro_batch_done(); })
      .def("end_step", [](PyController& w) { return w.ctl.end_step(); })
      .def("elapsed", [](const PyController& w) { return w.ctl.elapsed(); })
      .def_prop_ro("completed", [](const PyController& w) { return w.ctl.completed(); })
      .def_prop_ro("in_step", [](const PyController& w) { return w.ctl.in_step(); })
      .def_prop_ro("tau", [](const PyController& w) { return w.ctl.tau(); })
      .def(
          "set_tau", [](PyController& w, double tau) { w.ctl.set_tau(tau); }, nb::arg("tau"),
          "New threshold from the next begin_step(); ValueError for tau <= 0 or NaN.")
      .def_prop_ro("micro_batches",
                   [](const PyController& w) { return w.ctl.config().micro_batches; })
      .def_prop_ro(
          "drop_point",
          [](const PyController& w) { return std::string(enum_name(w.ctl.config().drop_point)); })
      .def_prop_ro(
          "history",
          [](const PyController& w) {
            return to_numpy(w.ctl.history(), {static_cast<size_t>(w.ctl.history_steps()),
                                              static_cast<size_t>(w.ctl.config().micro_batches)});
          },
          "Recorded latencies of complete steps, a (steps, M) float64 copy.")
      .def_prop_ro("history_steps", [](const PyController& w) { return w.ctl.history_steps(); })
      .def("clear_history", [](PyController& w) { w.ctl.clear_history(); });

  m.def("monotonic_seconds", &monotonic_seconds, "std::chrono::steady_clock in seconds.");
  m.def(
      "gradient_scale",
      [](const std::string& norm, int64_t workers, int64_t micro_batches, int64_t total) {
        return gradient_scale(parse_enum<Normalization>(norm), workers, micro_batches, total);
      },
      nb::arg("normalization"), nb::arg("workers"), nb::arg("micro_batches"),
      nb::arg("total_completed"),
      "The factor for the cross-worker SUM of micro-batch gradients: 1/(N M) ('nominal') or\n"
      "1/total_completed ('actual'; 0 when nothing was computed).\n\n"
      "Example: gradcomp.dropcompute.gradient_scale('actual', 4, 12, 45) == 1 / 45");
}

void bind_simulator(nb::module_& m) {
  nb::class_<DelayModel>(
      m, "DelayModel",
      "Per-micro-batch latency: 'normal' N(mean, stddev^2) clamped at 0, or\n"
      "'lognormal' = that plus min(exp(N(log_mu, log_sigma^2)), cap).\n\n"
      "Example: gradcomp.dropcompute.DelayModel('lognormal', mean=1.0, stddev=0.05, "
      "log_mu=-2.0, log_sigma=1.5, cap=3.0)")
      .def(
          "__init__",
          [](DelayModel* self, const std::string& kind, double mean, double stddev, double log_mu,
             double log_sigma, double cap) {
            DelayModel d{parse_enum<DelayKind>(kind), mean, stddev, log_mu, log_sigma, cap};
            d.validate();
            new (self) DelayModel(d);
          },
          nb::arg("kind") = "normal", nb::kw_only(), nb::arg("mean") = 1.0, nb::arg("stddev") = 0.0,
          nb::arg("log_mu") = 0.0, nb::arg("log_sigma") = 1.0, nb::arg("cap") = 1.0)
      .def_prop_ro("kind", [](const DelayModel& d) { return std::string(enum_name(d.kind)); })
      .def_ro("mean", &DelayModel::mean)
      .def_ro("stddev", &DelayModel::stddev)
      .def_ro("log_mu", &DelayModel::log_mu)
      .def_ro("log_sigma", &DelayModel::log_sigma)
      .def_ro("cap", &DelayModel::cap);

  m.def("latency_moments", &latency_moments, nb::arg("model"),
        "Exact mean and stddev of one micro-batch latency under the model.");
  m.def(
      "simulate_latencies",
      [](const DelayModel& d, int64_t workers, int64_t steps, int64_t micro_batches,
         uint64_t seed) {
        nb::gil_scoped_release nogil;
        return simulate_latencies(d, workers, steps, micro_batches, seed);
      },
      nb::arg("model"), nb::arg("workers"), nb::arg("steps"), nb::arg("micro_batches"),
      nb::arg("seed") = 0,
      "A LatencyTrace drawn from the model, deterministic given the seed.\n\n"
      "Example: t = "
      "gradcomp.dropcompute.simulate_latencies(gradcomp.dropcompute.DelayModel('normal', mean=1, "
      "stddev=0.2), 2048, 10, 12, seed=42)");

  nb::class_<TauCurvePoint>(m, "TauCurvePoint", "One point of the paper's Fig. 3.")
      .def_ro("simulated", &TauCurvePoint::simulated)
      .def_ro("analytic", &TauCurvePoint::analytic)
      .def_ro("analytic_given_t", &TauCurvePoint::analytic_given_t);
  m.def(
      "tau_curve",
      [](const LatencyTrace& t, double lo, double hi, int64_t points, double serial_time,
         const std::string& model, double min_gain) {
        const TauOptions o = tau_options(serial_time, model, min_gain);
        nb::gil_scoped_release nogil;
        return tau_curve(t, lo, hi, points, o);
      },
      nb::arg("trace"), nb::arg("tau_lo"), nb::arg("tau_hi"), nb::arg("points"), nb::kw_only(),
      nb::arg("serial_time") = 0.0, nb::arg("stop_model") = "preemptive",
      nb::arg("min_gain") = 1e-9,
      "S_eff (simulated, analytic, analytic given E[T]) at evenly spaced taus.");

  nb::class_<ScalePoint>(m, "ScalePoint", "One point of the paper's Fig. 1.")
      .def_ro("workers", &ScalePoint::workers)
      .def_ro("linear", &ScalePoint::linear)
      .def_ro("baseline", &ScalePoint::baseline)
      .def_ro("dropcompute", &ScalePoint::dropcompute)
      .def_ro("baseline_analytic", &ScalePoint::baseline_analytic)
      .def_ro("dropcompute_analytic", &ScalePoint::dropcompute_analytic)
      .def_ro("simulated", &ScalePoint::simulated)
      .def_ro("analytic", &ScalePoint::analytic);
  m.def(
      "scale_curve",
      [](const DelayModel& d, std::vector<int64_t> workers, int64_t steps, int64_t micro_batches,
         uint64_t seed, double serial_time, const std::string& model, double min_gain) {
        const TauOptions o = tau_options(serial_time, model, min_gain);
        nb::gil_scoped_release nogil;
        return scale_curve(d, workers, steps, micro_batches, seed, o);
      },
      nb::arg("model"), nb::arg("workers"), nb::arg("steps"), nb::arg("micro_batches"),
      nb::arg("seed") = 0, nb::kw_only(), nb::arg("serial_time") = 0.0,
      nb::arg("stop_model") = "preemptive", nb::arg("min_gain") = 1e-9,
      "Throughput vs worker count: baseline, DropCompute, analytic and linear.");
}

void bind_qsr(nb::module_& m) {
  m.def("qsr_period", &qsr_period, nb::arg("lr"), nb::arg("alpha"), nb::arg("h_base"),
        "H = max(h_base, floor((alpha / lr)^2)).\n\nExample: "
        "gradcomp.dropcompute.qsr_period(0.001, 0.0175, "
        "4) == 306");

  nb::class_<QsrConfig>(m, "QsrConfig", "Quadratic Synchronization Rule settings.")
      .def(
          "__init__",
          [](QsrConfig* self, double alpha, int64_t h_base, int64_t total_steps,
             int64_t warmup_steps) {
            QsrConfig c{alpha, h_base, total_steps, warmup_steps};
            c.validate();
            new (self) QsrConfig(c);
          },
          nb::kw_only(), nb::arg("alpha"), nb::arg("h_base"), nb::arg("total_steps"),
          nb::arg("warmup_steps") = 0)
      .def_ro("alpha", &QsrConfig::alpha)
      .def_ro("h_base", &QsrConfig::h_base)
      .def_ro("total_steps", &QsrConfig::total_steps)
      .def_ro("warmup_steps", &QsrConfig::warmup_steps);

  nb::class_<QsrScheduler>(
      m, "QsrScheduler",
      "When Local SGD averages next (see gradcomp/straggler.hpp).\n\n"
      "Example:\n"
      "    q = gradcomp.dropcompute.QsrScheduler(gradcomp.dropcompute.QsrConfig(alpha=0.0175, "
      "h_base=4, total_steps=T), lr0)\n"
      "    if q.after_step(s + 1, next_lr): average()")
      .def(nb::init<const QsrConfig&, double>(), nb::arg("config"), nb::arg("initial_lr"))
      .def("on_average", &QsrScheduler::on_average, nb::arg("step"), nb::arg("lr"),
           "Records an averaging after `step` steps; returns the step of the next one.")
      .def("after_step", &QsrScheduler::after_step, nb::arg("step"), nb::arg("next_lr"),
           "True when the parameters must be averaged now (after `step` local steps).")
      .def_prop_ro("next_sync", &QsrScheduler::next_sync)
      .def_prop_ro("period", &QsrScheduler::period)
      .def_prop_ro("config", &QsrScheduler::config);
}

void bind_straggler(nb::module_& m) {
  bind_analytics(m);
  bind_trace(m);
  bind_controller(m);
  bind_simulator(m);
  bind_qsr(m);
}

Register reg(40, bind_straggler);

}  // namespace
}  // namespace gradcomp::py

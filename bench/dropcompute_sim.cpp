// SPDX-License-Identifier: Apache-2.0
// dropcompute_sim: the DropCompute delay environment as a CSV generator for the paper's figures.
//
//   dropcompute_sim scale [options]   Fig. 1: throughput vs number of workers (baseline,
//                                     DropCompute at tau*, simulated and analytic, linear)
//   dropcompute_sim tau [options]     Fig. 3: S_eff, completion rate and step speedup vs tau
//                                     (simulated, analytic Eq. 4-6, analytic given E[T])
// Options (defaults in brackets):
//   --dist normal|lognormal [lognormal]  micro-batch latency: N(mean, stddev^2) [+ bounded
//                                        log-normal noise min(exp(N(log-mu, log-sigma^2)), cap)]
//   --mean X [1.0]  --stddev X [0.05]  --log-mu X [-2.0]  --log-sigma X [1.5]  --cap X [3.0]
//   --micro-batches M [12]  --steps S [20]  --serial Tc [0.5]  --seed K [0]
//   --workers LIST  scale: comma list [1,2,4,...,2048]; tau: one count [64]
//   --stop preemptive|boundary [preemptive]  the stop model of the tau* search (StopModel)
//   --tau-lo X --tau-hi X --points P [200]   tau: the grid (default 0.5 M mean .. max step time)
//   --out FILE [stdout]
// Deterministic given the options (Philox keyed by the seed).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "gradcomp/error.hpp"
#include "gradcomp/straggler.hpp"

using namespace gradcomp::straggler;

namespace {

struct Args {
  std::string mode;
  DelayModel model{.kind = DelayKind::kBoundedLogNormal,
                   .mean = 1.0,
                   .stddev = 0.05,
                   .log_mu = -2.0,
                   .log_sigma = 1.5,
                   .cap = 3.0};
  int64_t micro_batches = 12, steps = 20, points = 200;
  uint64_t seed = 0;
  TauOptions opt{.serial_time = 0.5};
  std::vector<int64_t> workers;
  double tau_lo = 0.0, tau_hi = 0.0;
  std::string out;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "error: %s\nusage: dropcompute_sim scale|tau [--dist normal|lognormal] [--mean X] "
               "[--stddev X] [--log-mu X] [--log-sigma X] [--cap X] [--micro-batches M] "
               "[--steps S] [--serial Tc] [--seed K] [--workers LIST|N] "
               "[--stop preemptive|boundary] [--tau-lo X] [--tau-hi X] [--points P] "
               "[--out FILE]\n",
               msg);
  std::exit(2);
}

double to_double(const char* s) {
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || *end != '\0') usage((std::string("not a number: ") + s).c_str());
  return v;
}

int64_t to_int(const char* s) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0') usage((std::string("not an integer: ") + s).c_str());
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) usage("missing mode");
  a.mode = argv[1];
  if (a.mode != "scale" && a.mode != "tau") usage("mode must be scale or tau");
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + k).c_str());
    const char* v = argv[++i];
    if (k == "--dist") {
      if (std::strcmp(v, "normal") == 0)
        a.model.kind = DelayKind::kNormal;
      else if (std::strcmp(v, "lognormal") == 0)
        a.model.kind = DelayKind::kBoundedLogNormal;
      else
        usage("--dist must be normal or lognormal");
    } else if (k == "--mean")
      a.model.mean = to_double(v);
    else if (k == "--stddev")
      a.model.stddev = to_double(v);
    else if (k == "--log-mu")
      a.model.log_mu = to_double(v);
    else if (k == "--log-sigma")
      a.model.log_sigma = to_double(v);
    else if (k == "--cap")
      a.model.cap = to_double(v);
    else if (k == "--micro-batches")
      a.micro_batches = to_int(v);
    else if (k == "--steps")
      a.steps = to_int(v);
    else if (k == "--serial")
      a.opt.serial_time = to_double(v);
    else if (k == "--seed")
      a.seed = static_cast<uint64_t>(to_int(v));
    else if (k == "--points")
      a.points = to_int(v);
    else if (k == "--tau-lo")
      a.tau_lo = to_double(v);
    else if (k == "--tau-hi")
      a.tau_hi = to_double(v);
    else if (k == "--out")
      a.out = v;
    else if (k == "--stop") {
      if (std::strcmp(v, "preemptive") == 0)
        a.opt.model = StopModel::kPreemptive;
      else if (std::strcmp(v, "boundary") == 0)
        a.opt.model = StopModel::kMicroBatchBoundary;
      else
        usage("--stop must be preemptive or boundary");
    } else if (k == "--workers") {
      a.workers.clear();
      std::string s = v;
      size_t pos = 0;
      while (pos <= s.size()) {
        const size_t comma = s.find(',', pos);
        const std::string item =
            s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        a.workers.push_back(to_int(item.c_str()));
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else {
      usage(("unknown option " + k).c_str());
    }
  }
  if (a.workers.empty()) {
    if (a.mode == "scale")
      for (int64_t n = 1; n <= 2048; n *= 2) a.workers.push_back(n);
    else
      a.workers.push_back(64);
  }
  if (a.mode == "tau" && a.workers.size() != 1) usage("tau mode takes one --workers count");
  return a;
}

void run_scale(const Args& a, FILE* f) {
  const auto pts = scale_curve(a.model, a.workers, a.steps, a.micro_batches, a.seed, a.opt);
  std::fprintf(f,
               "workers,linear,baseline_sim,dropcompute_sim,baseline_analytic,"
               "dropcompute_analytic,tau_sim,drop_rate_sim,speedup_sim,tau_analytic,"
               "drop_rate_analytic,speedup_analytic,step_time_sim,step_time_analytic\n");
  for (const ScalePoint& p : pts)
    std::fprintf(
        f, "%lld,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g\n",
        static_cast<long long>(p.workers), p.linear, p.baseline, p.dropcompute, p.baseline_analytic,
        p.dropcompute_analytic, p.simulated.tau, p.simulated.drop_rate, p.simulated.speedup,
        p.analytic.tau, p.analytic.drop_rate, p.analytic.speedup, p.simulated.step_time,
        p.analytic.step_time);
}

void run_tau(const Args& a, FILE* f) {
  const LatencyTrace t =
      simulate_latencies(a.model, a.workers[0], a.steps, a.micro_batches, a.seed);
  const TauEval best = find_optimal_tau(t, a.opt);
  double lo = a.tau_lo, hi = a.tau_hi;
  if (lo <= 0.0) lo = 0.5 * static_cast<double>(a.micro_batches) * latency_stats(t).mean;
  if (hi <= 0.0) {
    // the largest step time of the trace: beyond it nothing is dropped
    hi = 0.0;
    for (int64_t n = 0; n < t.workers; ++n)
      for (int64_t s = 0; s < t.steps; ++s) {
        double c = 0.0;
        for (int64_t m = 0; m < t.micro_batches; ++m) c += t.at(n, s, m);
        hi = std::max(hi, c);
      }
  }
  if (hi < lo) hi = lo;
  std::vector<double> taus;
  auto curve = tau_curve(t, lo, hi, a.points, a.opt);
  auto opt_row = tau_curve(t, best.tau, best.tau, 1, a.opt).front();
  std::fprintf(f,
               "tau,optimal,speedup_sim,speedup_analytic,speedup_analytic_given_t,"
               "completion_rate_sim,completion_rate_analytic,drop_rate_sim,drop_rate_analytic,"
               "step_speedup_sim,step_speedup_analytic,step_time_sim,step_time_with_tau_sim,"
               "step_time_analytic\n");
  bool opt_written = false;
  auto row = [f](const TauCurvePoint& p, int optimal) {
    std::fprintf(
        f, "%.17g,%d,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g\n",
        p.simulated.tau, optimal, p.simulated.speedup, p.analytic.speedup,
        p.analytic_given_t.speedup, p.simulated.completion_rate, p.analytic.completion_rate,
        p.simulated.drop_rate, p.analytic.drop_rate, p.simulated.step_speedup,
        p.analytic.step_speedup, p.simulated.step_time, p.simulated.step_time_with_tau,
        p.analytic.step_time);
  };
  for (const auto& p : curve) {
    if (!opt_written && best.tau <= p.simulated.tau) {
      row(opt_row, 1);
      opt_written = true;
    }
    row(p, 0);
  }
  if (!opt_written) row(opt_row, 1);
  std::fprintf(stderr, "tau* = %.6g  S_eff = %.4f  drop rate = %.4f  (N = %lld, M = %lld)\n",
               best.tau, best.speedup, best.drop_rate, static_cast<long long>(a.workers[0]),
               static_cast<long long>(a.micro_batches));
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  FILE* f = stdout;
  if (!a.out.empty()) {
    f = std::fopen(a.out.c_str(), "w");
    if (!f) {
      std::perror(a.out.c_str());
      return 1;
    }
  }
  try {
    if (a.mode == "scale")
      run_scale(a, f);
    else
      run_tau(a, f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    if (f != stdout) std::fclose(f);
    return 1;
  }
  if (f != stdout) std::fclose(f);
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// DropCompute costs: the tau* search on a gathered trace (run once per re-estimation on every
// rank), the delay simulator, and the per-micro-batch controller decision. Baseline: std::sort of
// the same number of doubles (the search is sort-dominated).
//   args: workers N (steps 10, M 12: N * 120 latencies)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "gradcomp/straggler.hpp"

using namespace gradcomp::straggler;

namespace {

const DelayModel kModel{.kind = DelayKind::kBoundedLogNormal,
                        .mean = 1.0,
                        .stddev = 0.05,
                        .log_mu = -2.0,
                        .log_sigma = 1.5,
                        .cap = 3.0};

LatencyTrace trace_for(const benchmark::State& st) {
  return simulate_latencies(kModel, st.range(0), 10, 12, 7);
}

void set_rate(benchmark::State& st, const LatencyTrace& t) {
  const int64_t n = static_cast<int64_t>(t.latency.size());
  st.SetItemsProcessed(st.iterations() * n);
  st.SetBytesProcessed(st.iterations() * n * static_cast<int64_t>(sizeof(double)));
  st.counters["latencies"] = static_cast<double>(n);
}

void tau_bench(benchmark::State& st, StopModel model) {
  const LatencyTrace t = trace_for(st);
  TauEval r;
  for (auto _ : st) {
    r = find_optimal_tau(t, {.serial_time = 0.5, .model = model});
    benchmark::DoNotOptimize(r);
  }
  set_rate(st, t);
  st.counters["speedup"] = r.speedup;
  st.counters["drop_rate"] = r.drop_rate;
}

void BM_straggler_find_tau(benchmark::State& st) { tau_bench(st, StopModel::kPreemptive); }
void BM_straggler_find_tau_boundary(benchmark::State& st) {
  tau_bench(st, StopModel::kMicroBatchBoundary);
}

void BM_straggler_baseline_sort(benchmark::State& st) {
  const LatencyTrace t = trace_for(st);
  std::vector<double> work;
  for (auto _ : st) {
    work = t.latency;
    std::sort(work.begin(), work.end());
    benchmark::DoNotOptimize(work.data());
  }
  set_rate(st, t);
}

void BM_straggler_simulate(benchmark::State& st) {
  LatencyTrace t;
  uint64_t seed = 0;
  for (auto _ : st) {
    t = simulate_latencies(kModel, st.range(0), 10, 12, seed++);
    benchmark::DoNotOptimize(t.latency.data());
  }
  set_rate(st, t);
}

void BM_straggler_controller_step(benchmark::State& st) {
  ManualClock clk;
  ThresholdController c({.tau = 11.5, .micro_batches = 12}, clk.fn());
  int64_t done = 0;
  for (auto _ : st) {
    clk.now_s = 0.0;
    c.begin_step();
    while (c.proceed(DropPoint::kBeforeForward)) {
      clk.advance(1.0);
      c.micro_batch_done();
    }
    done += c.end_step().completed;
  }
  benchmark::DoNotOptimize(done);
  st.SetItemsProcessed(st.iterations() * 12);
}

}  // namespace

BENCHMARK(BM_straggler_find_tau)->Arg(64)->Arg(2048)->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_straggler_find_tau_boundary)
    ->Arg(64)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
BENCHMARK(BM_straggler_baseline_sort)
    ->Arg(64)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
BENCHMARK(BM_straggler_simulate)->Arg(2048)->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_straggler_controller_step)->MinTime(0.2);

BENCHMARK_MAIN();

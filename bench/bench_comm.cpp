// SPDX-License-Identifier: Apache-2.0
// Compressed allreduce over MPI: time per step of each plan (encode + collectives + decode +
// average) for one gradient bucket, bytes this rank sent, and speedup over the plain allreduce.
// Run under mpirun (every rank runs the same cases with the same fixed iteration counts; rank 0
// reports; a step's time is the slowest rank's):
//   OMP_NUM_THREADS=1 mpirun -np 4 --oversubscribe --allow-run-as-root build/bench/bench_comm
// Environment: GC_BENCH_NUMEL (default 25,000,000), GC_BENCH_ITERS (default 5).
// bench/netem/run.sh runs it with the ranks in network namespaces joined by 1 Gbit/s links.
//
// Hook for more plans (1-bit, PowerSGD r=4): add a line to cases() below, e.g.
//   {"onebit", [](int64_t n, int P, const gc::CostModel&) { return make_onebit_plan(n, P); }},
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "gradcomp/comm.hpp"
#include "gradcomp/plans.hpp"

namespace gc = gradcomp;

namespace {

int64_t env_int(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}

struct Ctx {
  std::unique_ptr<gc::MpiCommunicator> comm;
  gc::CostModel cost;
  int64_t numel = 25'000'000;
  int64_t iters = 5;
  std::vector<float> grad, work;
  double plain_s = 0.0;
  double copy_Bps = 0.0;
};
Ctx& ctx() {
  static Ctx c;
  return c;
}

using Factory = std::function<std::unique_ptr<gc::GradientPlan>(int64_t n, int P, const gc::CostModel&)>;
struct Case {
  const char* name;
  Factory make;
};

std::vector<Case> cases() {
  return {
      {"baseline_dense",
       [](int64_t n, int P, const gc::CostModel&) {
         return std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P);
       }},
      {"cast_fp16",
       [](int64_t n, int P, const gc::CostModel&) {
         return std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, gc::DType::kFloat16, P);
       }},
      {"topk_1pct",
       [](int64_t n, int P, const gc::CostModel& cm) {
         gc::TopKConfig cfg;
         cfg.ratio = 0.01;
         return std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, gc::TopKPlanOptions{.cost = cm});
       }},
      {"topk_0.1pct",
       [](int64_t n, int P, const gc::CostModel& cm) {
         gc::TopKConfig cfg;
         cfg.ratio = 0.001;
         return std::make_unique<gc::TopKAllreducePlan>(cfg, n, P, gc::TopKPlanOptions{.cost = cm});
       }},
      {"randomk_1pct",
       [](int64_t n, int P, const gc::CostModel&) {
         gc::RandomKConfig cfg;
         cfg.ratio = 0.01;
         return std::make_unique<gc::RandomKAllreducePlan>(cfg, n, P);
       }},
      // the lead adds 1-bit (two-phase plan) and PowerSGD r=4 here
  };
}

/// Slowest rank's value.
double max_over_ranks(gc::Communicator& comm, double v) {
  std::vector<double> all(static_cast<size_t>(comm.size()));
  comm.allgather(&v, all.data(), 1, gc::ElemType::kI64);  // 8-byte payload, bit-copied
  return *std::max_element(all.begin(), all.end());
}

void run_case(benchmark::State& state, const Case& c) {
  Ctx& x = ctx();
  gc::MpiCommunicator& comm = *x.comm;
  const int P = comm.size();
  auto plan = c.make(x.numel, P, x.cost);
  gc::PlanRunner runner(comm);
  auto reset = [&] {  // a fresh gradient each step (not timed)
    std::memcpy(x.work.data(), x.grad.data(), x.grad.size() * sizeof(float));
  };
  auto step = [&] {
    plan->begin(gc::TensorView::cpu(x.work.data(), x.numel));
    runner.run(*plan, 0);
  };
  reset();
  step();  // warm-up: handshake, workspaces, connections
  comm.reset_stats();
  double total = 0.0;
  for (auto _ : state) {
    reset();
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    const double s = max_over_ranks(
        comm, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    state.SetIterationTime(s);
    total += s;
  }
  const double per_step = total / static_cast<double>(state.iterations());
  // bytes sent per step by this rank's plan, without the barrier/timing traffic
  const double sent = static_cast<double>(comm.stats().bytes_sent) / state.iterations() -
                      8.0 * (P - 1);
  if (std::string(c.name) == "baseline_dense") x.plain_s = per_step;
  const double grad_bytes = static_cast<double>(x.numel) * sizeof(float);
  state.counters["bytes_sent_per_rank"] = sent;
  state.counters["compression_ratio"] = sent > 0 ? 2.0 * grad_bytes * (P - 1) / P / sent : 0.0;
  state.counters["bytes_per_second"] = grad_bytes / per_step;
  state.counters["frac_of_copy"] = x.copy_Bps > 0 ? grad_bytes / per_step / x.copy_Bps : 0.0;
  state.counters["speedup_vs_plain"] = x.plain_s > 0 ? x.plain_s / per_step : 0.0;
  if (auto* tp = dynamic_cast<gc::TopKAllreducePlan*>(plan.get()))
    state.counters["dense_route"] = tp->stats().last_route == gc::TopKRoute::kDense ? 1 : 0;
}

double memcpy_bandwidth(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes);
  std::memcpy(b.data(), a.data(), bytes);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) std::memcpy(b.data(), a.data(), bytes);
  benchmark::DoNotOptimize(b.data());
  return 3.0 * static_cast<double>(bytes) /
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  gc::mpi_init(&argc, &argv);
  {
    Ctx& x = ctx();
    x.comm = std::make_unique<gc::MpiCommunicator>(gc::MpiOptions{.timeout_s = 600});
    x.numel = env_int("GC_BENCH_NUMEL", x.numel);
    x.iters = env_int("GC_BENCH_ITERS", x.iters);
    x.grad.resize(static_cast<size_t>(x.numel));
    std::mt19937 rng(1234 + x.comm->rank());
    std::normal_distribution<float> nd;
    for (auto& v : x.grad) v = nd(rng);
    x.work = x.grad;
    x.cost = gc::measure_cost_model(*x.comm);
    x.copy_Bps = memcpy_bandwidth(static_cast<size_t>(x.numel) * sizeof(float));
    if (x.comm->rank() == 0)
      std::printf("ranks %d, numel %lld, cost model: latency %.1f us, bandwidth %.2f GB/s\n",
                  x.comm->size(), static_cast<long long>(x.numel), x.cost.latency_s * 1e6,
                  x.cost.bandwidth_Bps / 1e9);
    for (const Case& c : cases())
      benchmark::RegisterBenchmark((std::string("BM_comm_") + c.name).c_str(),
                                   [c](benchmark::State& s) { run_case(s, c); })
          ->Iterations(x.iters)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    benchmark::Initialize(&argc, argv);
    if (x.comm->rank() == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      NullReporter quiet;
      benchmark::RunSpecifiedBenchmarks(&quiet);
    }
    x.comm.reset();
  }
  gc::mpi_finalize();
  return 0;
}

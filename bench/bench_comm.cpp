// SPDX-License-Identifier: Apache-2.0
// Compressed allreduce over MPI: time per step of each plan (encode + collectives + decode +
// average) for one gradient bucket, bytes this rank sent, and speedup over the plain allreduce.
// Run under mpirun (every rank runs the same cases with the same fixed iteration counts; rank 0
// reports; a step's time is the slowest rank's):
//   OMP_NUM_THREADS=1 mpirun -np 4 --oversubscribe --allow-run-as-root build/bench/bench_comm
// Environment: GC_BENCH_NUMEL (default 25,000,000), GC_BENCH_ITERS (default 5).
// bench/netem/run.sh runs it with the ranks in network namespaces joined by 1 Gbit/s links.
//
// Cases: plain (baseline), fp16 cast, top-k 1% / 0.1% (route chosen by the measured cost model),
// random-k 1%, 1-bit (two-phase plan, L2 sign scaling, worker + server error feedback) and
// PowerSGD rank 4. PowerSGD needs matrices: the gradient is laid out as ResNet-50's parameter
// tensors (torchvision order: conv weights with their BatchNorm weight and bias, then fc) cut at
// GC_BENCH_NUMEL; see powersgd_layout(). Counters besides time: bytes_sent_per_rank,
// compression_ratio, speedup_vs_plain, and collective_ms / local_ms (time inside the
// communicator's collectives / the rest of the step: compression and decoding).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/comm.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/powersgd.hpp"
#include "model_shapes.hpp"
#include "plans/cast_plan.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/powersgd_plan.hpp"
#include "plans/quant_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

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

/// One rank's plan behind a uniform begin(gradient): every family's plan runs the same loop.
struct BenchPlan {
  virtual ~BenchPlan() = default;
  virtual gc::Plan& plan() = 0;
  /// Binds this step's gradient (n fp32 elements on the CPU).
  virtual void begin(float* g, int64_t n) = 0;
};

/// A bucket plan (in place).
struct GradientBench : BenchPlan {
  explicit GradientBench(std::unique_ptr<gc::GradientPlan> p) : p_(std::move(p)) {}
  gc::Plan& plan() override { return *p_; }
  void begin(float* g, int64_t n) override { p_->begin(gc::TensorView::cpu(g, n)); }
  std::unique_ptr<gc::GradientPlan> p_;
};
template <class T, class... A>
std::unique_ptr<BenchPlan> gradient_plan(A&&... a) {
  return std::make_unique<GradientBench>(std::make_unique<T>(std::forward<A>(a)...));
}

/// The 1-bit two-phase plan (writes the average into its own output buffer).
struct OneBitBench : BenchPlan {
  OneBitBench(const gc::OneBitConfig& cfg, int64_t n, int P, int rank)
      : p_(cfg, n, P, rank), out_(static_cast<size_t>(n)) {}
  gc::Plan& plan() override { return p_; }
  void begin(float* g, int64_t n) override {
    p_.begin(gc::TensorView::cpu(g, n), gc::TensorView::cpu(out_.data(), n));
  }
  gc::OneBitAllreducePlan p_;
  std::vector<float> out_;
};

using gradcomp::bench::resnet50;
using gradcomp::bench::Shapes;

/// n elements laid out as ResNet-50's tensors (repeated if n is larger): every tensor that fits
/// whole, then the rest R as an R / 2048 x 2048 matrix (a shortened fc layer) and a 1-D tail of
/// R % 2048 elements. For n = 25,000,000: all of ResNet-50 but fc (23,508,032 elements, 159
/// tensors), a 728 x 2048 matrix and a tail of 1,024.
Shapes powersgd_layout(int64_t n) {
  const Shapes net = resnet50();
  Shapes out;
  int64_t left = n;
  for (size_t i = 0;; i = (i + 1) % net.size()) {
    int64_t numel = 1;
    for (int64_t d : net[i]) numel *= d;
    if (numel > left) break;
    out.push_back(net[i]);
    left -= numel;
  }
  if (left >= 2048) out.push_back({left / 2048, 2048});
  if (left % 2048) out.push_back({left % 2048});
  return out;
}

/// The multi-bit two-phase plan (in place; a BucketPlan, not a GradientPlan).
struct QuantBench : BenchPlan {
  QuantBench(const gc::QuantConfig& cfg, int64_t n, int P, int rank) : p_(cfg, n, P, rank) {}
  gc::Plan& plan() override { return p_; }
  void begin(float* g, int64_t n) override { p_.begin(gc::TensorView::cpu(g, n)); }
  gc::QuantPlan p_;
};

/// PowerSGD over the layout above, in place.
struct PowerSGDBench : BenchPlan {
  PowerSGDBench(const gc::PowerSGDConfig& cfg, const Shapes& shapes, int P)
      : shapes_(shapes), st_(cfg, shapes), p_(st_, P) {}
  gc::Plan& plan() override { return p_; }
  void begin(float* g, int64_t) override {
    views_.clear();
    int64_t off = 0;
    for (const auto& s : shapes_) {
      views_.emplace_back(g + off, s.data(), static_cast<int>(s.size()), gc::DType::kFloat32,
                          gc::Device::kCPU);
      off += views_.back().numel;
    }
    p_.begin(views_);
  }
  Shapes shapes_;
  gc::PowerSGDState st_;
  gc::PowerSGDPlan p_;
  std::vector<gc::TensorView> views_;
};

using Factory =
    std::function<std::unique_ptr<BenchPlan>(int64_t n, int P, int rank, const gc::CostModel&)>;
struct Case {
  const char* name;
  Factory make;
};

std::vector<Case> cases() {
  return {
      {"baseline_dense",
       [](int64_t n, int P, int, const gc::CostModel&) {
         return gradient_plan<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P);
       }},
      {"cast_fp16",
       [](int64_t n, int P, int, const gc::CostModel&) {
         return gradient_plan<gc::CastAllreducePlan>(n, gc::DType::kFloat32, gc::DType::kFloat16,
                                                     P);
       }},
      {"topk_1pct",
       [](int64_t n, int P, int, const gc::CostModel& cm) {
         gc::TopKConfig cfg;
         cfg.ratio = 0.01;
         return gradient_plan<gc::TopKAllreducePlan>(cfg, n, P, gc::TopKPlanOptions{.cost = cm});
       }},
      {"topk_0.1pct",
       [](int64_t n, int P, int, const gc::CostModel& cm) {
         gc::TopKConfig cfg;
         cfg.ratio = 0.001;
         return gradient_plan<gc::TopKAllreducePlan>(cfg, n, P, gc::TopKPlanOptions{.cost = cm});
       }},
      {"randomk_1pct",
       [](int64_t n, int P, int, const gc::CostModel&) {
         gc::RandomKConfig cfg;
         cfg.ratio = 0.01;
         return gradient_plan<gc::RandomKAllreducePlan>(cfg, n, P);
       }},
      {"onebit",
       [](int64_t n, int P, int rank, const gc::CostModel&) -> std::unique_ptr<BenchPlan> {
         gc::OneBitConfig cfg;
         cfg.scaling = gc::OneBitScaling::kSignL2;
         return std::make_unique<OneBitBench>(cfg, n, P, rank);
       }},
      {"quant_4bit",
       [](int64_t n, int P, int rank, const gc::CostModel&) -> std::unique_ptr<BenchPlan> {
         gc::QuantConfig cfg;  // the hook's defaults: blocks of 128, rotated, error feedback
         cfg.bits = 4;
         return std::make_unique<QuantBench>(cfg, n, P, rank);
       }},
      {"powersgd_r4",
       [](int64_t n, int P, int, const gc::CostModel&) -> std::unique_ptr<BenchPlan> {
         gc::PowerSGDConfig cfg;
         cfg.rank = 4;
         return std::make_unique<PowerSGDBench>(cfg, powersgd_layout(n), P);
       }},
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
  auto plan = c.make(x.numel, P, comm.rank(), x.cost);
  gc::PlanRunner runner(comm);
  auto reset = [&] {  // a fresh gradient each step (not timed)
    std::memcpy(x.work.data(), x.grad.data(), x.grad.size() * sizeof(float));
  };
  auto step = [&] {
    plan->begin(x.work.data(), x.numel);
    runner.run(plan->plan(), 0);
  };
  reset();
  step();  // warm-up: handshake, workspaces, connections
  comm.reset_stats();
  double total = 0.0, in_collectives = 0.0;
  for (auto _ : state) {
    reset();
    comm.barrier();
    const double coll0 = comm.stats().seconds;
    const auto t0 = std::chrono::steady_clock::now();
    step();
    const double mine =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    in_collectives += comm.stats().seconds - coll0;
    const double s = max_over_ranks(comm, mine);
    state.SetIterationTime(s);
    total += s;
  }
  const double per_step = total / static_cast<double>(state.iterations());
  // bytes sent per step by this rank's plan, without the barrier/timing traffic
  const double sent =
      static_cast<double>(comm.stats().bytes_sent) / state.iterations() - 8.0 * (P - 1);
  if (std::string(c.name) == "baseline_dense") x.plain_s = per_step;
  const double grad_bytes = static_cast<double>(x.numel) * sizeof(float);
  state.counters["bytes_sent_per_rank"] = sent;
  state.counters["compression_ratio"] = sent > 0 ? 2.0 * grad_bytes * (P - 1) / P / sent : 0.0;
  state.counters["bytes_per_second"] = grad_bytes / per_step;
  state.counters["frac_of_copy"] = x.copy_Bps > 0 ? grad_bytes / per_step / x.copy_Bps : 0.0;
  state.counters["speedup_vs_plain"] = x.plain_s > 0 ? x.plain_s / per_step : 0.0;
  // rank 0's split of its own step: inside collectives (transfer + waiting for peers) / local
  const double coll = in_collectives / static_cast<double>(state.iterations());
  state.counters["collective_ms"] = 1e3 * coll;
  state.counters["local_ms"] = 1e3 * std::max(0.0, per_step - coll);
  if (auto* gp = dynamic_cast<GradientBench*>(plan.get()))
    if (auto* tp = dynamic_cast<gc::TopKAllreducePlan*>(gp->p_.get()))
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
    if (x.comm->rank() == 0 && x.comm->size() == 1)
      std::printf(
          "ONE rank: nothing is communicated, so these times are local work only and "
          "speedup_vs_plain compares local work with a no-op allreduce; run under mpirun -np 4 "
          "for real speedups.\n");
    benchmark::AddCustomContext("comm_ranks", std::to_string(x.comm->size()));
    benchmark::AddCustomContext("comm_numel", std::to_string(x.numel));
    for (const Case& c : cases())
      benchmark::RegisterBenchmark((std::string("BM_comm_") + c.name).c_str(),
                                   [c](benchmark::State& s) { run_case(s, c); })
          ->Iterations(x.iters)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    // Only rank 0 reports: the others drop --benchmark_out*, or every rank would open (and
    // truncate) the same output file while rank 0 writes it.
    std::vector<char*> args(argv, argv + argc);
    if (x.comm->rank() != 0)
      args.erase(
          std::remove_if(args.begin() + 1, args.end(),
                         [](const char* a) { return std::strncmp(a, "--benchmark_out", 15) == 0; }),
          args.end());
    int nargs = static_cast<int>(args.size());
    args.push_back(nullptr);
    benchmark::Initialize(&nargs, args.data());
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

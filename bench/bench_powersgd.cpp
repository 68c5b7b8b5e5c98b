// SPDX-License-Identifier: Apache-2.0
// PowerSGD microbenchmarks on the CPU, on the layer shapes of ResNet-50 and BERT-base.
//
//   BM_powersgd_step/<model>/<r>           one full local step of the whole model (world-1 plan:
//                                          M = g + e, P = M Q, orth, Q = M^T P, P Q^T, error)
//   BM_powersgd_baseline_step/<model>/<r>  the same step with PyTorch-style unfused Gram-Schmidt
//   BM_powersgd_orth/<model>/<r>           orthogonalization of all P blocks of the model only
//   BM_powersgd_baseline_orth/<model>/<r>  the same with the unfused column-by-column baseline
//   BM_powersgd_copy/<model>               memcpy of the model's gradient (frac_of_copy reference)
// Counters: bytes_per_second (gradient bytes per second), compression_ratio (dense bytes / bytes
// sent per step), frac_of_copy (bytes_per_second / memcpy bandwidth of the same binary).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/powersgd.hpp"
#include "kernels/powersgd.hpp"

namespace {

using gradcomp::Orthogonalization;
using Shapes = std::vector<std::vector<int64_t>>;

// ResNet-50 (torchvision): conv weights, BatchNorm weight + bias, fc.
Shapes resnet50() {
  Shapes s;
  auto conv_bn = [&](int64_t out, int64_t in, int64_t k) {
    s.push_back({out, in, k, k});
    s.push_back({out});
    s.push_back({out});
  };
  conv_bn(64, 3, 7);
  int64_t in = 64;
  const int blocks[4] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t w = 64 << stage;
    for (int b = 0; b < blocks[stage]; ++b) {
      conv_bn(w, in, 1);
      conv_bn(w, w, 3);
      conv_bn(4 * w, w, 1);
      if (b == 0) conv_bn(4 * w, in, 1);  // downsample
      in = 4 * w;
    }
  }
  s.push_back({1000, 2048});
  s.push_back({1000});
  return s;
}

// BERT-base (uncased): embeddings, 12 encoder layers, pooler.
Shapes bert_base() {
  const int64_t h = 768, f = 3072;
  Shapes s = {{30522, h}, {512, h}, {2, h}, {h}, {h}};
  for (int l = 0; l < 12; ++l) {
    for (int k = 0; k < 4; ++k) {  // query, key, value, attention output
      s.push_back({h, h});
      s.push_back({h});
    }
    s.push_back({h});
    s.push_back({h});  // attention LayerNorm
    s.push_back({f, h});
    s.push_back({f});
    s.push_back({h, f});
    s.push_back({h});
    s.push_back({h});
    s.push_back({h});  // output LayerNorm
  }
  s.push_back({h, h});
  s.push_back({h});
  return s;
}

const Shapes& model(int id) {
  static const Shapes r = resnet50(), b = bert_base();
  return id == 0 ? r : b;
}
const char* model_name(int id) { return id == 0 ? "resnet50" : "bert_base"; }

struct Grads {
  std::vector<std::vector<float>> data;
  std::vector<gradcomp::TensorView> views;
  int64_t numel = 0;
};

Grads& grads(int id) {
  static std::map<int, std::unique_ptr<Grads>> cache;
  auto& g = cache[id];
  if (!g) {
    g = std::make_unique<Grads>();
    std::mt19937 rng(id + 1);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (const auto& s : model(id)) {
      int64_t n = 1;
      for (auto x : s) n *= x;
      g->numel += n;
      g->data.emplace_back(static_cast<size_t>(n));
      for (auto& x : g->data.back()) x = d(rng);
      g->views.emplace_back(g->data.back().data(), s.data(), static_cast<int>(s.size()),
                            gradcomp::DType::kFloat32, gradcomp::Device::kCPU);
    }
  }
  return *g;
}

// memcpy bandwidth (bytes/s, read + write counted once as the copied size) of the model's size.
double copy_bandwidth(int id) {
  static std::map<int, double> bw;
  if (bw.count(id)) return bw[id];
  const Grads& g = grads(id);
  std::vector<float> dst(static_cast<size_t>(g.numel)), src(static_cast<size_t>(g.numel), 1.0f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), src.size() * 4);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(src.size() * 4) / s);
  }
  benchmark::DoNotOptimize(dst.data());
  return bw[id] = best;
}

void run_step(benchmark::State& state, Orthogonalization how) {
  const int id = static_cast<int>(state.range(0));
  gradcomp::PowerSGDConfig cfg;
  cfg.rank = static_cast<int>(state.range(1));
  cfg.orthogonalization = how;
  cfg.check_finite = false;  // timed separately; PyTorch's hook does not check either
  Grads& g = grads(id);
  gradcomp::PowerSGDState st(cfg, model(id));
  gradcomp::PowerSGDPlan plan(st, 1);
  auto step = [&] {
    plan.begin(g.views);
    while (plan.next()) {
    }  // world 1: each allreduce is the identity
  };
  step();  // warm-up: Q drawn, pages touched
  for (auto _ : state) step();
  const double bytes = static_cast<double>(g.numel) * 4;
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["compression_ratio"] = st.last_stats().compression_ratio();
  state.counters["frac_of_copy"] =
      benchmark::Counter(bytes / copy_bandwidth(id), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(model_name(id)) + " r=" + std::to_string(cfg.rank));
}

void BM_powersgd_step(benchmark::State& s) { run_step(s, Orthogonalization::kGramSchmidt); }
void BM_powersgd_baseline_step(benchmark::State& s) {
  run_step(s, Orthogonalization::kGramSchmidtUnfused);
}

// Orthogonalization of every P block of the model (one batch group per distinct shape).
void run_orth(benchmark::State& state, Orthogonalization how) {
  const int id = static_cast<int>(state.range(0));
  gradcomp::PowerSGDConfig cfg;
  cfg.rank = static_cast<int>(state.range(1));
  gradcomp::PowerSGDState st(cfg, model(id));
  std::map<std::pair<int64_t, int>, int64_t> groups;  // (n, r) -> batch
  for (size_t i = 0; i < st.num_tensors(); ++i)
    if (st.tensor(i).rank > 0) ++groups[{st.tensor(i).n, st.tensor(i).rank}];
  std::vector<float> src(static_cast<size_t>(st.p_numel())), p;
  std::mt19937 rng(7);
  std::normal_distribution<float> d;
  for (auto& x : src) x = d(rng);
  gradcomp::kernels::PsgdContext ctx(gradcomp::Device::kCPU);
  for (auto _ : state) {
    state.PauseTiming();
    p = src;
    state.ResumeTiming();
    float* at = p.data();
    for (const auto& [key, batch] : groups) {
      gradcomp::kernels::cpu::orthogonalize(at, batch, key.first, key.second, 0.0f, how, ctx);
      at += batch * key.first * key.second;
    }
    benchmark::DoNotOptimize(p.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(src.size() * 4) * state.iterations());
  state.SetLabel(std::string(model_name(id)) + " P blocks: " + std::to_string(src.size()) +
                 " floats");
}

void BM_powersgd_orth(benchmark::State& s) { run_orth(s, Orthogonalization::kGramSchmidt); }
void BM_powersgd_baseline_orth(benchmark::State& s) {
  run_orth(s, Orthogonalization::kGramSchmidtUnfused);
}

void BM_powersgd_copy(benchmark::State& state) {
  const int id = static_cast<int>(state.range(0));
  const Grads& g = grads(id);
  std::vector<float> dst(static_cast<size_t>(g.numel)), src(static_cast<size_t>(g.numel), 1.0f);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size() * 4);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(src.size() * 4) * state.iterations());
  state.SetLabel(model_name(id));
}

void step_args(benchmark::internal::Benchmark* b) {
  for (int id : {0, 1})
    for (int r : {1, 2, 4, 8}) b->Args({id, r});
  b->ArgNames({"model", "r"})->Unit(benchmark::kMillisecond)->MinTime(0.3)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_powersgd_step)->Apply(step_args);
BENCHMARK(BM_powersgd_baseline_step)->Apply(step_args);
BENCHMARK(BM_powersgd_orth)->Apply(step_args);
BENCHMARK(BM_powersgd_baseline_orth)->Apply(step_args);
BENCHMARK(BM_powersgd_copy)
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1)
    ->UseRealTime();

BENCHMARK_MAIN();

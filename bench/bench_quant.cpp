// SPDX-License-Identifier: Apache-2.0
// Microbenchmarks of the multi-bit family (CPU): the fused compress with error feedback (what a
// worker does per chunk: read g and e, write the other error copy and the codes), the averaging
// decode of P payloads (what a server does: read P payloads, write the fp32 average), and the
// whole plan for P = 4 in one process.
//
// Counters (bench/bench_common.hpp): bytes_per_second counts the bytes a kernel must move;
// frac_of_copy = that bandwidth (fastest iteration) / the bandwidth of a plain memory copy of n
// floats measured by this binary in the same run; compression_ratio = fp32 bytes / wire bytes.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/quant_kernels.hpp"
#include "plans/quant_plan.hpp"

using namespace gradcomp;
using gradcomp::bench::IterTimer;
using gradcomp::bench::LoopTimer;
using gradcomp::bench::set_counters;

namespace {

kernels::QuantGeom geom(int64_t n, int bits) {
  kernels::QuantGeom g;
  g.n = n;
  g.bits = bits;
  g.block = 128;
  return g;
}

/// Fused compress with error feedback into the other error copy (the plan's double buffer).
/// Arg 0: n, arg 1: bits. Bytes: read g, read e, write e (12 n) + the body.
void BM_quant_compress(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int bits = static_cast<int>(st.range(1));
  const auto geo = geom(n, bits);
  const std::vector<float>& g = gradcomp::bench::normal_data(n);
  std::vector<float> e0(n, 0.0f), e1(n, 0.0f);
  std::vector<uint8_t> body(static_cast<size_t>(geo.body_bytes()));
  kernels::QuantRng rng;
  kernels::cpu::quant_compress(g.data(), DType::kFloat32, e0.data(), e1.data(), geo, rng, true,
                               body.data());  // warm-up: pages touched
  LoopTimer timer;
  IterTimer it;
  bool flip = false;
  for (auto _ : st) {
    it.start();
    float* in = flip ? e1.data() : e0.data();
    float* out = flip ? e0.data() : e1.data();
    kernels::cpu::quant_compress(g.data(), DType::kFloat32, in, out, geo, rng, true, body.data());
    benchmark::DoNotOptimize(body.data());
    it.stop();
    flip = !flip;
  }
  const double secs = timer.seconds();
  st.SetLabel(std::to_string(bits) + " bits, block 128, fp32 scales");
  set_counters(st, 12.0 * n + static_cast<double>(geo.body_bytes()), n, secs, it,
               4.0 * n / static_cast<double>(geo.body_bytes()));
}

/// Averaging decode of P payloads into fp32. Arg 0: n, arg 1: bits, arg 2: P. Bytes: read P
/// bodies, write 4 n.
void BM_quant_decode_average(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int bits = static_cast<int>(st.range(1));
  const int P = static_cast<int>(st.range(2));
  const auto geo = geom(n, bits);
  const std::vector<float>& g = gradcomp::bench::normal_data(n);
  std::vector<std::vector<uint8_t>> bodies(P, std::vector<uint8_t>(geo.body_bytes()));
  std::vector<const uint8_t*> ptrs;
  for (auto& b : bodies) {
    kernels::cpu::quant_compress(g.data(), DType::kFloat32, nullptr, nullptr, geo, {}, false,
                                 b.data());
    ptrs.push_back(b.data());
  }
  std::vector<float> dense(n);
  kernels::cpu::quant_decode_average(ptrs.data(), P, geo, 1.0f / P, dense.data());
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    kernels::cpu::quant_decode_average(ptrs.data(), P, geo, 1.0f / P, dense.data());
    benchmark::DoNotOptimize(dense.data());
    it.stop();
  }
  const double secs = timer.seconds();
  st.SetLabel(std::to_string(bits) + " bits, P = " + std::to_string(P));
  set_counters(st, 4.0 * n + static_cast<double>(P) * geo.body_bytes(), n, secs, it, 0);
}

/// The whole plan, 4 ranks in one process (all-to-all and allgather are copies here): the local
/// work of a step times 4. Arg 0: n, arg 1: bits.
void BM_quant_plan_p4(benchmark::State& st) {
  const int64_t n = st.range(0);
  QuantConfig c;
  c.bits = static_cast<int>(st.range(1));
  const int P = 4;
  std::vector<std::unique_ptr<QuantPlan>> plans;
  std::vector<Plan*> ps;
  for (int r = 0; r < P; ++r) {
    plans.push_back(std::make_unique<QuantPlan>(c, n, P, r));
    ps.push_back(plans.back().get());
  }
  std::vector<std::vector<float>> g(P, gradcomp::bench::normal_data(n));
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    for (int r = 0; r < P; ++r) plans[r]->begin(TensorView::cpu(g[r].data(), n));
    run_plans_in_process(ps);
    it.stop();
  }
  const double secs = timer.seconds();
  st.SetLabel(std::to_string(c.bits) + " bits, rotate, P = 4");
  set_counters(st, 4.0 * 12.0 * n, n, secs, it,
               4.0 * n / static_cast<double>(plans[0]->block_bytes() * P));
}

}  // namespace

BENCHMARK(BM_quant_compress)
    ->ArgsProduct({{1 << 20, 25000000}, {2, 4, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_quant_decode_average)
    ->ArgsProduct({{1 << 20, 25000000}, {4}, {1, 4, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_quant_plan_p4)
    ->ArgsProduct({{1 << 20}, {2, 4, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();

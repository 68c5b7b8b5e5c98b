// SPDX-License-Identifier: Apache-2.0
// Microbenchmarks of the 1-bit family (CPU): fused compress per scaling mode, decompress-
// accumulate, the averaging decode of 8 payloads, the simulated two-phase allreduce for P = 8,
// and the unfused baseline (separate passes: add error, scale, sign, pack, error update; the way
// 1-bit Adam does it with tensor ops and packbits).
//
// Counters: bytes_per_second counts the bytes a kernel must move (compress: read g and e, write
// e and bits = 12.125 bytes per fp32 element; the lazy one-pass state moves exactly these);
// frac_of_copy = that bandwidth / the bandwidth of a plain memory copy of n floats (read + write
// bytes per second, one memcpy per OpenMP thread, best of 5) measured by this binary before the
// timed loop (bench/bench_common.hpp); compression_ratio = dense bytes / payload bytes (header and
// scales included).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/onebit_kernels.hpp"
#include "plans/onebit_plan.hpp"

using namespace gradcomp;
using gradcomp::bench::IterTimer;
using gradcomp::bench::LoopTimer;
using gradcomp::bench::set_counters;

namespace {

std::vector<float> data(int64_t n, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t m = std::min<int64_t>(n, 1 << 16);  // tile a random block (fast setup)
  for (int64_t i = 0; i < m; ++i) v[i] = d(rng);
  for (int64_t i = m; i < n; ++i) v[i] = v[i % m] * (1.0f + 1e-3f * static_cast<float>(i / m % 7));
  return v;
}

OneBitConfig cfg_of(int mode) {
  OneBitConfig c;
  c.scaling = static_cast<OneBitScaling>(mode);
  return c;
}

/// Matrix shape used for a size: column-means gets a [n / 1024, 1024] weight; sign modes 1-D.
void shape_of(int mode, int64_t n, int64_t* R, int64_t* C) {
  if (mode == 0 && n % 1024 == 0) {
    *R = n / 1024;
    *C = 1024;
  } else {
    *R = n;
    *C = 1;
  }
}

void BM_onebit_memcpy(benchmark::State& st) {
  const int64_t n = st.range(0);
  std::vector<float> a = data(n, 1), b(n);
  gradcomp::bench::copy_bandwidth(n);
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t lo = n * t / T, hi = n * (t + 1) / T;
      std::memcpy(b.data() + lo, a.data() + lo, (hi - lo) * sizeof(float));
    }
    benchmark::DoNotOptimize(b.data());
    it.stop();
  }
  set_counters(st, 8.0 * n, n, timer.seconds(), it, 0);
}

/// Fused compress: one pass over g and the (lazy) error state. Arg 0: n, arg 1: scaling mode,
/// arg 2: check_finite (1, the default: the state ping-pongs between two buffers so that a
/// rejected gradient leaves it unchanged; 0: in place).
void BM_onebit_compress(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int mode = static_cast<int>(st.range(1));
  int64_t R, C;
  shape_of(mode, n, &R, &C);
  OneBitConfig cfg = cfg_of(mode);
  cfg.check_finite = st.range(2) != 0;
  OneBitCompressor comp(cfg, R, C);
  std::vector<float> g = data(n, 2);
  Payload p;
  const TensorView gv(g.data(), {R, C}, DType::kFloat32, Device::kCPU);
  comp.encode(gv, p);  // warm-up: payload buffer allocated
  gradcomp::bench::copy_bandwidth(n);
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    comp.encode(gv, p);
    benchmark::DoNotOptimize(p.data());
    it.stop();
  }
  const double secs = timer.seconds();
  st.SetLabel(std::string(enum_name(static_cast<OneBitScaling>(mode))) +
              (cfg.check_finite ? "" : " in-place"));
  set_counters(st, 12.0 * n + n / 8.0, n, secs, it, comp.last_stats().compression_ratio());
}

/// The unfused baseline: x = g + e; scale = ||x||_2 / sqrt(n); signs = x >= 0 (one byte each);
/// pack 8 signs per byte; e = x - scale * (2 s - 1). Each pass is a plain OpenMP loop.
void BM_onebit_baseline_compress(benchmark::State& st) {
  const int64_t n = st.range(0);
  std::vector<float> g = data(n, 2), e(n, 0.0f), x(n);
  std::vector<uint8_t> signs(n), packed((n + 7) / 8);
  gradcomp::bench::copy_bandwidth(n);
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] = g[i] + e[i];
    double ss = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float scale = static_cast<float>(std::sqrt(ss / static_cast<double>(n)));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) signs[i] = x[i] >= 0.0f ? 1 : 0;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < (n + 7) / 8; ++j) {
      uint8_t b = 0;
      for (int k = 0; k < 8 && 8 * j + k < n; ++k) b |= static_cast<uint8_t>(signs[8 * j + k] << k);
      packed[j] = b;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) e[i] = x[i] - scale * (2.0f * signs[i] - 1.0f);
    benchmark::DoNotOptimize(packed.data());
    benchmark::DoNotOptimize(e.data());
    it.stop();
  }
  set_counters(st, 12.0 * n + n / 8.0, n, timer.seconds(), it, 4.0 * n / (64.0 + n / 8.0 + 8.0));
}

/// Decompress-accumulate: dense += decode(payload). Bytes: read bits, read and write dense.
void BM_onebit_decompress_accumulate(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int mode = static_cast<int>(st.range(1));
  int64_t R, C;
  shape_of(mode, n, &R, &C);
  OneBitCompressor comp(cfg_of(mode), R, C);
  std::vector<float> g = data(n, 3), dense(n, 0.0f);
  Payload p;
  comp.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), p);
  const TensorView dv(dense.data(), {R, C}, DType::kFloat32, Device::kCPU);
  gradcomp::bench::copy_bandwidth(n);
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    comp.decode_add(p.data(), p.size(), dv, 0.125f);
    benchmark::DoNotOptimize(dense.data());
    it.stop();
  }
  const double secs = timer.seconds();
  st.SetLabel(enum_name(static_cast<OneBitScaling>(mode)));
  set_counters(st, 8.0 * n + n / 8.0, n, secs, it, comp.last_stats().compression_ratio());
}

/// Averaging decode of 8 payloads in one pass over dense.
void BM_onebit_decode_average8(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int P = 8;
  OneBitConfig cfg = cfg_of(2);
  std::vector<Payload> ps(P);
  std::vector<const void*> ptr(P);
  std::vector<size_t> sz(P);
  OneBitCompressor comp(cfg, n, 1);
  for (int q = 0; q < P; ++q) {
    std::vector<float> g = data(n, 10 + q);
    OneBitCompressor c(cfg, n, 1);
    c.encode(TensorView::cpu(g.data(), n), ps[q]);
    ptr[q] = ps[q].data();
    sz[q] = ps[q].size();
  }
  std::vector<float> dense(n, 0.0f);
  gradcomp::bench::copy_bandwidth(n);
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    comp.decode_average(ptr.data(), sz.data(), P, TensorView::cpu(dense.data(), n), 1.0f / P);
    benchmark::DoNotOptimize(dense.data());
    it.stop();
  }
  set_counters(st, 8.0 * n + P * n / 8.0, n, timer.seconds(), it, 0);
}

/// The two-phase compressed allreduce for P = 8 simulated ranks in this process (all local work
/// of all ranks, plus in-memory collectives). The ranks share one input and one output buffer
/// (they write identical values) so that n = 110M fits in memory. bytes_per_second counts the
/// gradient bytes reduced per second (P * 4 n); compression_ratio = 4 n / bytes sent per rank.
void BM_onebit_plan_p8(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int P = 8;
  OneBitConfig cfg = cfg_of(2);
  std::vector<std::unique_ptr<OneBitAllreducePlan>> plans;
  for (int r = 0; r < P; ++r) plans.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r));
  std::vector<float> g = data(n, 4), out(n);
  std::vector<Plan*> ps;
  for (auto& p : plans) ps.push_back(p.get());
  gradcomp::bench::copy_bandwidth(n);
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    for (auto& p : plans) p->begin(TensorView::cpu(g.data(), n), TensorView::cpu(out.data(), n));
    run_plans_in_process(ps);
    benchmark::DoNotOptimize(out.data());
    it.stop();
  }
  set_counters(st, 4.0 * P * n, n, timer.seconds(), it,
               4.0 * n / static_cast<double>(plans[0]->bytes_sent()));
}

/// The 1-bit plan's block rotation (S = 128, forward) in place over n elements: arg 1 = 0 the
/// library's baseline build, 1 the dispatched one (AVX2 where the CPU has it; the label says);
/// the two in the same run give the ratio. bytes_per_second counts 4 n bytes per transform.
void BM_onebit_rotate(benchmark::State& st) {
  const int64_t n = st.range(0), S = 128;
  const bool dispatched = st.range(1) != 0;
  std::vector<float> x = data(n, 7);
  for (auto _ : st) {
    if (dispatched)
      kernels::cpu::hadamard_rotate(x.data(), n / S, S, 0, false);
    else
      kernels::cpu::hadamard_rotate_baseline(x.data(), n / S, S, 0, false);
    benchmark::DoNotOptimize(x.data());
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * 4 * n);
  st.SetLabel(!dispatched
                  ? "baseline"
                  : (kernels::cpu::hadamard_rotate_uses_avx2() ? "avx2" : "baseline (no avx2)"));
}

constexpr int64_t k1M = 1 << 20, k25M = 25'000'000, k110M = 110'000'000;

void sizes(benchmark::internal::Benchmark* b, bool modes) {
  for (int64_t n : {k1M, k25M, k110M})
    for (int m = 0; m < (modes ? 3 : 1); ++m) {
      if (modes)
        b->Args({n, m});
      else
        b->Args({n});
    }
}

}  // namespace

BENCHMARK(BM_onebit_memcpy)
    ->Arg(k1M)
    ->Arg(k25M)
    ->Arg(k110M)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3)
    ->UseRealTime();
BENCHMARK(BM_onebit_compress)
    ->Apply([](auto* b) {
      for (int64_t n : {k1M, k25M, k110M}) {
        for (int m = 0; m < 3; ++m) b->Args({n, m, 1});
        b->Args({n, 2, 0});  // in place (check_finite off)
      }
    }) -> Unit(benchmark::kMillisecond) -> MinTime(0.3) -> UseRealTime();
BENCHMARK(BM_onebit_baseline_compress)
    ->Apply([](auto* b) { sizes(b, false); }) -> Unit(benchmark::kMillisecond) -> MinTime(0.3)
        -> UseRealTime();
BENCHMARK(BM_onebit_decompress_accumulate)
    ->Apply([](auto* b) { sizes(b, true); }) -> Unit(benchmark::kMillisecond) -> MinTime(0.3)
        -> UseRealTime();
BENCHMARK(BM_onebit_decode_average8)
    ->Apply([](auto* b) { sizes(b, false); }) -> Unit(benchmark::kMillisecond) -> MinTime(0.3)
        -> UseRealTime();
BENCHMARK(BM_onebit_rotate)
    ->Args({6'460'000, 0})
    ->Args({6'460'000, 1})
    ->Args({k25M, 0})
    ->Args({k25M, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3)
    ->UseRealTime();
BENCHMARK(BM_onebit_plan_p8)
    ->Arg(k1M)
    ->Arg(k25M)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3)
    ->UseRealTime();
BENCHMARK(BM_onebit_plan_p8)
    ->Arg(k110M)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->UseRealTime();

BENCHMARK_MAIN();

// SPDX-License-Identifier: Apache-2.0
// Top-k family microbenchmarks: exact and sampled selection, DGC encode, decode, against
// std::nth_element and std::partial_sort on |g| (baselines in the same binary).
//   n in {1M, 25M (ResNet-50), 110M (BERT-base)}, density in {1%, 0.1%} (args: n, density * 1e4)
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "bench_common.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/scan_kernels.hpp"

using namespace gradcomp;
using gradcomp::bench::normal_data;
using gradcomp::bench::set_bandwidth;

namespace {

int64_t arg_n(const benchmark::State& st) { return st.range(0); }
double arg_density(const benchmark::State& st) { return st.range(1) * 1e-4; }

void select_bench(benchmark::State& st, SelectMethod m) {
  const int64_t n = arg_n(st);
  const int64_t k = topk_count(arg_density(st), n);
  std::vector<float> x = normal_data(n);
  std::vector<uint32_t> out(k);
  SelectOptions opt;
  opt.method = m;
  uint64_t step = 0;
  int64_t got = 0;
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) {
    got = topk_indices(TensorView::cpu(x.data(), n), k, opt, RngKey{1, step++, 0}, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  set_bandwidth(st, 4.0 * n, n, timer.seconds());  // one read of x
  st.counters["selected_over_k"] = static_cast<double>(got) / k;
}

void BM_topk_exact_select(benchmark::State& st) { select_bench(st, SelectMethod::kExact); }
void BM_topk_sampled_select(benchmark::State& st) { select_bench(st, SelectMethod::kSampled); }

/// Baseline: |g| into a work buffer, then `select(work, k)` to find the k largest magnitudes.
template <class Select>
void baseline_bench(benchmark::State& st, Select select) {
  const int64_t n = arg_n(st);
  const int64_t k = topk_count(arg_density(st), n);
  const std::vector<float>& x = normal_data(n);
  std::vector<float> work(n);
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) {
    for (int64_t i = 0; i < n; ++i) work[i] = std::fabs(x[i]);
    select(work, k);
    benchmark::DoNotOptimize(work[k - 1]);
  }
  set_bandwidth(st, 4.0 * n, n, timer.seconds());
}

/// std::nth_element for the k-th largest magnitude.
void BM_topk_baseline_nth_element(benchmark::State& st) {
  baseline_bench(st, [](std::vector<float>& w, int64_t k) {
    std::nth_element(w.begin(), w.begin() + (k - 1), w.end(), std::greater<float>());
  });
}

/// std::partial_sort of the k largest.
void BM_topk_baseline_partial_sort(benchmark::State& st) {
  baseline_bench(st, [](std::vector<float>& w, int64_t k) {
    std::partial_sort(w.begin(), w.begin() + k, w.end(), std::greater<float>());
  });
}

/// A DGC compressor of n elements at the benchmark's density (its other options the defaults).
TopKCompressor density_compressor(const benchmark::State& st, int64_t n) {
  TopKConfig cfg;
  cfg.ratio = arg_density(st);
  return TopKCompressor(cfg, n);
}

/// DGC encode (residual accumulation + sampled selection + gather + payload), no momentum.
void BM_topk_encode(benchmark::State& st) {
  const int64_t n = arg_n(st);
  TopKCompressor comp = density_compressor(st, n);
  const std::vector<float>& g = normal_data(n);
  Payload p;
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) comp.encode(TensorView::cpu(const_cast<float*>(g.data()), n), p);
  // finiteness check (read g), accumulate (read g, read+write v), select (read v)
  set_bandwidth(st, 4.0 * n * 5, n, timer.seconds());
  st.counters["compression_ratio"] = comp.last_stats().compression_ratio();
}

void BM_topk_decode(benchmark::State& st) {
  const int64_t n = arg_n(st);
  TopKCompressor comp = density_compressor(st, n);
  const std::vector<float>& g = normal_data(n);
  Payload p;
  comp.encode(TensorView::cpu(const_cast<float*>(g.data()), n), p);
  std::vector<float> dense(n, 0.0f);
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) {
    comp.decode_add(p.data(), p.size(), TensorView::cpu(dense.data(), n));
    benchmark::DoNotOptimize(dense.data());
  }
  const double k = static_cast<double>(comp.last_stats().count);
  st.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(p.size()) * st.iterations(), benchmark::Counter::kIsRate);
  st.counters["compression_ratio"] = comp.last_stats().compression_ratio();
  st.counters["elements"] = k;
}

/// The non-finite scan each compressor runs before it changes any state (check_finite), in
/// bytes read per second: the library's blocked scan (a branch-free OR per block of 2048, the
/// flagged block searched) on finite data, the common case.
void BM_finite_scan(benchmark::State& st) {
  const int64_t n = st.range(0);
  const std::vector<float>& x = normal_data(n);
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st)
    benchmark::DoNotOptimize(kernels::cpu::first_nonfinite(x.data(), DType::kFloat32, n));
  set_bandwidth(st, 4.0 * n, n, timer.seconds());
}

/// Baseline in the same binary: the scan it replaced (2026-11-25), element by element with a
/// stop at the first NaN/Inf, the same OpenMP split (threads of at least 64K elements).
void BM_finite_scan_baseline(benchmark::State& st) {
  const int64_t n = st.range(0);
  const std::vector<float>& x = normal_data(n);
  const int T = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), n / (int64_t{1} << 16))));
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) {
    int64_t best = n;
#pragma omp parallel num_threads(T) reduction(min : best)
    {
      const int t = omp_get_thread_num();
      const int64_t b = n * t / T, e = n * (t + 1) / T;
      for (int64_t i = b; i < e; ++i)
        if (!is_finite_bits(x[i])) {
          best = i;
          break;
        }
    }
    benchmark::DoNotOptimize(best);
  }
  set_bandwidth(st, 4.0 * n, n, timer.seconds());
}

void scan_sizes(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{6'297'600}, int64_t{25'000'000}}) b->Args({n});
  b->ArgNames({"n"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.3);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{25'000'000}, int64_t{110'000'000}})
    for (int64_t d : {100, 10}) b->Args({n, d});  // density 1%, 0.1%
  b->ArgNames({"n", "density_e4"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

void quick(benchmark::internal::Benchmark* b) {
  sizes(b);
  b->MinTime(0.3);
}

}  // namespace

BENCHMARK(BM_topk_baseline_nth_element)->Apply(quick);
BENCHMARK(BM_topk_baseline_partial_sort)->Apply(sizes)->Iterations(1);
BENCHMARK(BM_topk_exact_select)->Apply(quick);
BENCHMARK(BM_topk_sampled_select)->Apply(quick);
BENCHMARK(BM_topk_encode)->Apply(quick);
BENCHMARK(BM_topk_decode)->Apply(quick);
BENCHMARK(BM_finite_scan_baseline)->Apply(scan_sizes);
BENCHMARK(BM_finite_scan)->Apply(scan_sizes);

BENCHMARK_MAIN();

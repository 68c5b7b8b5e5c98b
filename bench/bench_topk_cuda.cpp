// SPDX-License-Identifier: Apache-2.0
// Top-k family on CUDA: exact (radix) and sampled selection, DGC encode and decode on the GPU.
// frac_of_copy is measured against a device-to-device copy of the same size in the same binary.
// Without a GPU every case reports "no GPU".
//   n in {1M, 25M (ResNet-50), 110M (BERT-base)}, density in {1%, 0.1%} (args: n, density * 1e4)
#include <map>

#include "bench_common.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/topk_kernels.hpp"

using namespace gradcomp;

namespace {

bool no_gpu(benchmark::State& st) {
  if (cuda_device_count() > 0) return false;
  st.SkipWithError("no GPU");
  return true;
}

/// Normal(0, 1) data on the GPU, uploaded once per size (kept until the process ends).
float* device_normal(int64_t n) {
  static std::map<int64_t, void*> cache;
  if (auto it = cache.find(n); it != cache.end()) return static_cast<float*>(it->second);
  const std::vector<float>& h = gradcomp::bench::normal_data(n);
  void* d = gradcomp::cuda::malloc_async(4 * static_cast<size_t>(n), nullptr);
  device_copy(d, Device::kCUDA, h.data(), Device::kCPU, 4 * static_cast<size_t>(n), nullptr);
  gradcomp::cuda::stream_synchronize(nullptr);
  return static_cast<float*>(cache[n] = d);
}

/// Bytes per second (read + write) of a device-to-device copy of n floats: best of 5.
double gpu_copy_bandwidth(int64_t n) {
  static std::map<int64_t, double> cache;
  if (auto it = cache.find(n); it != cache.end()) return it->second;
  const size_t bytes = 4 * static_cast<size_t>(n);
  void* a = gradcomp::cuda::malloc_async(bytes, nullptr);
  void* b = gradcomp::cuda::malloc_async(bytes, nullptr);
  gradcomp::cuda::memset_async(a, 0, bytes, nullptr);
  double best = 1e30;
  for (int r = 0; r < 6; ++r) {
    gradcomp::cuda::stream_synchronize(nullptr);
    gradcomp::bench::LoopTimer t;
    gradcomp::cuda::memcpy_async(b, a, bytes, nullptr);
    gradcomp::cuda::stream_synchronize(nullptr);
    if (r > 0) best = std::min(best, t.seconds());  // the first one warms up
  }
  gradcomp::cuda::free_async(a, nullptr);
  gradcomp::cuda::free_async(b, nullptr);
  return cache[n] = 2.0 * static_cast<double>(bytes) / best;
}

void set_gpu_bandwidth(benchmark::State& st, double bytes, int64_t n, double seconds) {
  const double it = static_cast<double>(st.iterations());
  st.counters["bytes_per_second"] = benchmark::Counter(bytes * it, benchmark::Counter::kIsRate);
  st.counters["frac_of_copy"] = bytes * it / seconds / gpu_copy_bandwidth(n);
}

double arg_density(const benchmark::State& st) { return st.range(1) * 1e-4; }

void select_bench(benchmark::State& st, SelectMethod m) {
  if (no_gpu(st)) return;
  const int64_t n = st.range(0);
  const int64_t k = topk_count(arg_density(st), n);
  const float* x = device_normal(n);
  gpu_copy_bandwidth(n);
  auto* out =
      static_cast<uint32_t*>(gradcomp::cuda::malloc_async(4 * static_cast<size_t>(k), nullptr));
  kernels::SelectWorkspace ws(Device::kCUDA);
  SelectOptions opt;
  opt.method = m;
  uint64_t step = 0;
  int64_t got = 0;
  const kernels::Exec gpu{Device::kCUDA, nullptr};
  got = kernels::select(gpu, x, n, k, opt, RngKey{1, step++, 0}, out, ws);  // warm-up
  gradcomp::cuda::stream_synchronize(nullptr);
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) {
    got = kernels::select(gpu, x, n, k, opt, RngKey{1, step++, 0}, out, ws);
    gradcomp::cuda::stream_synchronize(nullptr);
  }
  set_gpu_bandwidth(st, 4.0 * static_cast<double>(n), n, timer.seconds());  // one read of x
  st.counters["selected_over_k"] = static_cast<double>(got) / static_cast<double>(k);
  gradcomp::cuda::free_async(out, nullptr);
}

void BM_topk_cuda_exact_select(benchmark::State& st) { select_bench(st, SelectMethod::kExact); }
void BM_topk_cuda_sampled_select(benchmark::State& st) { select_bench(st, SelectMethod::kSampled); }

/// DGC encode on the GPU (finiteness check, accumulation, sampled selection, gather, payload).
void BM_topk_cuda_encode(benchmark::State& st) {
  if (no_gpu(st)) return;
  const int64_t n = st.range(0);
  const float* g = device_normal(n);
  gpu_copy_bandwidth(n);
  TopKConfig cfg;
  cfg.ratio = arg_density(st);
  TopKCompressor comp(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
  Payload p(Device::kCUDA);
  const TensorView gv(const_cast<float*>(g), {n}, DType::kFloat32, Device::kCUDA);
  comp.encode(gv, p);  // warm-up: grows the workspaces
  gradcomp::cuda::stream_synchronize(nullptr);
  gradcomp::bench::LoopTimer timer;
  for (auto _ : st) {
    comp.encode(gv, p);
    gradcomp::cuda::stream_synchronize(nullptr);
  }
  // finiteness check (read g), accumulate (read g, read+write v), select (read v)
  set_gpu_bandwidth(st, 4.0 * static_cast<double>(n) * 5, n, timer.seconds());
  st.counters["compression_ratio"] = comp.last_stats().compression_ratio();
}

void BM_topk_cuda_decode(benchmark::State& st) {
  if (no_gpu(st)) return;
  const int64_t n = st.range(0);
  const float* g = device_normal(n);
  TopKConfig cfg;
  cfg.ratio = arg_density(st);
  TopKCompressor comp(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
  Payload p(Device::kCUDA);
  comp.encode(TensorView(const_cast<float*>(g), {n}, DType::kFloat32, Device::kCUDA), p);
  auto* dense =
      static_cast<float*>(gradcomp::cuda::malloc_async(4 * static_cast<size_t>(n), nullptr));
  gradcomp::cuda::memset_async(dense, 0, 4 * static_cast<size_t>(n), nullptr);
  const TensorView dv(dense, {n}, DType::kFloat32, Device::kCUDA);
  comp.decode_add(p.data(), p.size(), dv);  // warm-up
  gradcomp::cuda::stream_synchronize(nullptr);
  for (auto _ : st) {
    comp.decode_add(p.data(), p.size(), dv);
    gradcomp::cuda::stream_synchronize(nullptr);
  }
  st.counters["bytes_per_second"] =
      benchmark::Counter(static_cast<double>(p.size()) * static_cast<double>(st.iterations()),
                         benchmark::Counter::kIsRate);
  st.counters["compression_ratio"] = comp.last_stats().compression_ratio();
  gradcomp::cuda::free_async(dense, nullptr);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{25'000'000}, int64_t{110'000'000}})
    for (int64_t d : {100, 10}) b->Args({n, d});  // density 1%, 0.1%
  b->ArgNames({"n", "density_e4"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.2);
}

}  // namespace

BENCHMARK(BM_topk_cuda_exact_select)->Apply(sizes);
BENCHMARK(BM_topk_cuda_sampled_select)->Apply(sizes);
BENCHMARK(BM_topk_cuda_encode)->Apply(sizes);
BENCHMARK(BM_topk_cuda_decode)->Apply(sizes);

BENCHMARK_MAIN();

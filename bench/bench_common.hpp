// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the microbenchmarks: data, the memory-copy bandwidth that frac_of_copy is
// measured against (same binary, same run), and counter helpers.
#pragma once

#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <vector>

namespace gradcomp::bench {

/// Normal(0, 1) data of size n, made once per size and reused by all benchmarks of a binary.
inline const std::vector<float>& normal_data(int64_t n) {
  static std::map<int64_t, std::vector<float>> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937_64 rng(n);
  std::normal_distribution<float> d;
  for (auto& x : v) x = d(rng);
  return cache.emplace(n, std::move(v)).first->second;
}

/// Bytes per second of a plain memory copy (counting read + write) of n floats, split over the
/// Bytes per second of a plain memory copy (counting read + write) of n floats, split over the
/// same OpenMP threads the kernels use, measured now: best of `reps` runs (default: 5, or more for
/// small n, up to 64 and about 256 MiB copied in all, so that a delayed thread wake-up does not
/// pass for the bandwidth of a sub-millisecond copy). Call it right after a benchmark's timed
/// loop: the ratio then compares two measurements taken under the same machine load.
inline double copy_bandwidth(int64_t n, int64_t reps = 0) {
  static std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>> buffers;
  auto& ab = buffers[n];
  if (ab.first.empty()) {
    ab.first.assign(static_cast<size_t>(n), 1.0f);
    ab.second.assign(static_cast<size_t>(n), 0.0f);
  }
  const float* a = ab.first.data();
  float* b = ab.second.data();
  if (reps <= 0) reps = std::clamp<int64_t>((int64_t{1} << 26) / std::max<int64_t>(n, 1), 5, 64);
  double best = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t lo = n * t / T, hi = n * (t + 1) / T;
      std::memcpy(b + lo, a + lo, (hi - lo) * sizeof(float));
    }
    benchmark::DoNotOptimize(b);
    benchmark::ClobberMemory();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return 2.0 * n * sizeof(float) / best;
}

/// Wall-clock seconds of the timed loop, for counters that need the elapsed time itself.
class LoopTimer {
 public:
  LoopTimer() : t0_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  std::chrono::steady_clock::time_point t0_;
};

/// Times every iteration of a loop. frac_of_copy uses the fastest iteration, as
/// copy_bandwidth() keeps the fastest of its 5 copies: on a shared machine load only ever slows a
/// run down, so best against best compares the kernels rather than the scheduler (mean-based
/// values: bytes_per_second and frac_of_copy_mean).
class IterTimer {
 public:
  void start() { t0_ = std::chrono::steady_clock::now(); }
  void stop() {
    best_ = std::min(best_,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
  }
  double best() const { return best_; }

 private:
  std::chrono::steady_clock::time_point t0_;
  double best_ = 1e30;
};

/// Sets bytes_per_second and frac_of_copy (achieved bandwidth / memory-copy bandwidth) for
/// `bytes` that one iteration must move, given the loop's elapsed seconds.
inline void set_bandwidth(benchmark::State& st, double bytes, int64_t n, double seconds) {
  const double it = static_cast<double>(st.iterations());
  st.counters["bytes_per_second"] = benchmark::Counter(bytes * it, benchmark::Counter::kIsRate);
  st.counters["frac_of_copy"] = bytes * it / seconds / copy_bandwidth(n);
}

/// bytes_per_second and frac_of_copy_mean for `bytes` per iteration over the loop's `seconds`;
/// frac_of_copy from the fastest iteration.
inline void set_counters(benchmark::State& st, double bytes_per_iter, int64_t n, double seconds,
                         const IterTimer& it, double ratio) {
  set_bandwidth(st, bytes_per_iter, n, seconds);
  st.counters["frac_of_copy_mean"] = st.counters["frac_of_copy"];
  st.counters["frac_of_copy"] = bytes_per_iter / it.best() / copy_bandwidth(n);
  st.counters["best_ms"] = 1e3 * it.best();
  if (ratio > 0) st.counters["compression_ratio"] = ratio;
}

}  // namespace gradcomp::bench

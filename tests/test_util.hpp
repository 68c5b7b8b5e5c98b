// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the C++ test suites: deterministic data and GPU presence.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "gradcomp/runtime.hpp"

namespace gradcomp::test {

/// Test data remembered by what determines it: `draw()` runs once per `key` (a tuple of the
/// draw's arguments), later calls get a copy (a caller may write to its data). The suites draw
/// the same data again for each setting they sweep, and under the sanitizers (clang -O1) drawing
/// was a third of test_topk's time and 40% of the longest tests of test_make_plan and
/// test_onebit, because libstdc++'s generate_canonical calls logl per sample, which clang does
/// not fold. One cache per kind of draw (each `Draw` type), emptied past 64 MiB (`bytes_of`
/// says what a value holds); safe from several threads.
template <class Key, class Draw, class BytesOf>
auto remembered(const Key& key, Draw draw, BytesOf bytes_of) -> decltype(draw()) {
  using Value = decltype(draw());
  static std::mutex mu;
  static std::map<Key, Value> cache;
  static size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  Value v = draw();
  std::lock_guard<std::mutex> lock(mu);
  bytes += bytes_of(v);
  if (bytes > (size_t{64} << 20)) {
    cache.clear();
    bytes = bytes_of(v);
  }
  cache.emplace(key, v);
  return v;
}

inline size_t float_bytes(const std::vector<float>& v) { return 4 * v.size(); }

inline std::vector<float> normal(int64_t n, uint64_t seed, float sigma = 1.0f) {
  return remembered(
      std::tuple{n, seed, sigma},
      [&] {
        std::mt19937_64 rng(seed);
        std::normal_distribution<float> d(0.0f, sigma);
        std::vector<float> v(static_cast<size_t>(n));
        for (auto& x : v) x = d(rng);
        return v;
      },
      float_bytes);
}

/// Heavy-tailed (Student-t with 2 degrees of freedom).
inline std::vector<float> heavy_tailed(int64_t n, uint64_t seed) {
  return remembered(
      std::tuple{n, seed},
      [&] {
        std::mt19937_64 rng(seed);
        std::student_t_distribution<float> d(2.0f);
        std::vector<float> v(static_cast<size_t>(n));
        for (auto& x : v) x = d(rng);
        return v;
      },
      float_bytes);
}

/// Bitwise equality of n bytes; n == 0 is equal whatever the pointers (memcmp(nullptr, ...) is
/// undefined even for 0 bytes, and an empty vector's data() may be null).
inline bool same_bytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

inline bool have_gpu() { return cuda_device_count() > 0; }

/// Reference exact top-k, independent of the library's selection: sort by (|x| desc, index asc),
/// take k, return the indices ascending (the CPU and CUDA selection tests compare against it).
inline std::vector<uint32_t> reference_topk(const std::vector<float>& x, int64_t k) {
  std::vector<uint32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), [&](uint32_t a, uint32_t b) {
    const float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa > fb || (fa == fb && a < b);
  });
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace gradcomp::test

/// Skips a CUDA test with a message when no GPU is usable.
#define GC_REQUIRE_GPU()                                                               \
  do {                                                                                 \
    if (!::gradcomp::test::have_gpu())                                                 \
      GTEST_SKIP() << (::gradcomp::built_with_cuda() ? "no CUDA device present"        \
                                                     : "gradcomp built without CUDA"); \
  } while (0)

// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the C++ test suites: deterministic data and GPU presence.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gradcomp/runtime.hpp"

namespace gradcomp::test {

inline std::vector<float> normal(int64_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

/// Heavy-tailed (Student-t with 2 degrees of freedom).
inline std::vector<float> heavy_tailed(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::student_t_distribution<float> d(2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

/// Bitwise equality of n bytes; n == 0 is equal whatever the pointers (memcmp(nullptr, ...) is
/// undefined even for 0 bytes, and an empty vector's data() may be null).
inline bool same_bytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

inline bool have_gpu() { return cuda_device_count() > 0; }

}  // namespace gradcomp::test

/// Skips a CUDA test with a message when no GPU is usable.
#define GC_REQUIRE_GPU()                                                               \
  do {                                                                                 \
    if (!::gradcomp::test::have_gpu())                                                 \
      GTEST_SKIP() << (::gradcomp::built_with_cuda() ? "no CUDA device present"       \
                                                     : "gradcomp built without CUDA"); \
  } while (0)

// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the PowerSGD tests: an independent scalar reference of Algorithm 1 (double,
// classical Gram-Schmidt), bucket data and drivers.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gradcomp/powersgd.hpp"
#include "gradcomp/rng.hpp"
#include "kernels/powersgd_math.h"
#include "plans/powersgd_plan.hpp"
#include "test_util.hpp"

namespace gradcomp::test {

using Shapes = std::vector<std::vector<int64_t>>;

inline int64_t numel_of(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

/// The initial Q of tensor `id` at `step` (the RNG stream the library documents).
inline std::vector<double> initial_q(uint64_t seed, uint64_t step, uint32_t id, int64_t m, int r) {
  std::vector<double> q(static_cast<size_t>(m * r));
  const RngKey key{seed, step, id};
  for (int64_t i = 0; i < m * r; ++i) q[i] = kernels::psgd_q_value(key, static_cast<uint64_t>(i));
  return q;
}

/// Orthonormalizes the columns of row-major n x r `p` (double, classical Gram-Schmidt applied
/// twice); columns that vanish become zero.
inline void ref_orth(std::vector<double>& p, int64_t n, int r) {
  for (int j = 0; j < r; ++j) {
    double n0 = 0;
    for (int64_t i = 0; i < n; ++i) n0 += p[i * r + j] * p[i * r + j];
    for (int pass = 0; pass < 2; ++pass)
      for (int k = 0; k < j; ++k) {
        double d = 0;
        for (int64_t i = 0; i < n; ++i) d += p[i * r + k] * p[i * r + j];
        for (int64_t i = 0; i < n; ++i) p[i * r + j] -= d * p[i * r + k];
      }
    double nn = 0;
    for (int64_t i = 0; i < n; ++i) nn += p[i * r + j] * p[i * r + j];
    const bool zero = !(std::sqrt(nn) > 1e-4 * std::sqrt(n0));
    for (int64_t i = 0; i < n; ++i) p[i * r + j] = zero ? 0.0 : p[i * r + j] / std::sqrt(nn);
  }
}

/// One step of Algorithm 1 on a single matrix M (n x m) with Q (m x r): returns P_hat Q'^T and
/// replaces q by Q' = M^T P_hat.
inline std::vector<double> ref_step(const std::vector<double>& M, int64_t n, int64_t m,
                                    std::vector<double>& q, int r) {
  std::vector<double> p(static_cast<size_t>(n * r), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int c = 0; c < r; ++c) p[i * r + c] += M[i * m + j] * q[j * r + c];
  ref_orth(p, n, r);
  std::vector<double> q2(static_cast<size_t>(m * r), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int c = 0; c < r; ++c) q2[j * r + c] += M[i * m + j] * p[i * r + c];
  q = q2;
  std::vector<double> out(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int c = 0; c < r; ++c) out[i * m + j] += p[i * r + c] * q2[j * r + c];
  return out;
}

/// Host gradients of a bucket (fp32) and their views.
struct Bucket {
  Shapes shapes;
  std::vector<std::vector<float>> data;
  Bucket(const Shapes& s, uint64_t seed) : shapes(s) {
    for (size_t i = 0; i < s.size(); ++i) data.push_back(normal(numel_of(s[i]), seed * 131 + i));
  }
  std::vector<TensorView> views() {
    std::vector<TensorView> v;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int nd = static_cast<int>(shapes[i].size());
      const int64_t one = 1;
      v.emplace_back(data[i].data(), nd ? shapes[i].data() : &one, nd ? nd : 1, DType::kFloat32,
                     Device::kCPU);
    }
    return v;
  }
};

/// Runs one step on P simulated ranks; returns the collectives.
inline std::vector<Collective> step_ranks(std::vector<PowerSGDState*> states,
                                          std::vector<Bucket*> buckets) {
  const int P = static_cast<int>(states.size());
  std::vector<std::unique_ptr<PowerSGDPlan>> plans;
  std::vector<Plan*> raw;
  for (int r = 0; r < P; ++r) {
    plans.push_back(std::make_unique<PowerSGDPlan>(*states[r], P));
    plans.back()->begin(buckets[r]->views());
    raw.push_back(plans.back().get());
  }
  return run_plans_in_process(raw);
}

inline double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

}  // namespace gradcomp::test

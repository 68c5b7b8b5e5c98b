// SPDX-License-Identifier: Apache-2.0
// A bucket plan family with options, as the suites that run every stateful family take them
// (tests/comm: test_nonfinite, test_reshard), and its label for failure messages; the bucket that
// those suites (and test_range) hand make_plan for each rank.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "gradcomp/make_plan.hpp"

namespace gradcomp::test {

struct PlanVariant {
  const char* family;
  PlanOptions options;
};

/// "topk ratio=0.050000 route=sparse" (every option given, in key order).
inline std::string describe(const PlanVariant& v) {
  std::string s = v.family;
  for (const auto& [k, o] : v.options) {
    s += " " + k + "=";
    if (auto* d = std::get_if<double>(&o)) s += std::to_string(*d);
    if (auto* i = std::get_if<int64_t>(&o)) s += std::to_string(*i);
    if (auto* b = std::get_if<bool>(&o)) s += *b ? "true" : "false";
    if (auto* n = std::get_if<std::string>(&o)) s += *n;
  }
  return s;
}

/// Rank r's bucket of n elements of dt on P ranks, of these tensor shapes ({}: one vector).
inline BucketSpec rank_bucket(int64_t n, DType dt, int P, int r,
                              std::vector<std::vector<int64_t>> shapes = {}) {
  BucketSpec b;
  b.numel = n;
  b.dtype = dt;
  b.world = P;
  b.rank = r;
  b.shapes = std::move(shapes);
  return b;
}

}  // namespace gradcomp::test

// SPDX-License-Identifier: Apache-2.0
// Builds an fp16 plan by name and runs it on one in-process rank, through gradcomp taken in with
// add_subdirectory(); the average of one rank is its gradient rounded to fp16.
#include <cmath>
#include <cstdio>
#include <gradcomp/gradcomp.hpp>
#include <vector>

int main() {
  const int64_t n = 10000;
  std::vector<float> g(n), avg(n);
  for (int64_t i = 0; i < n; ++i) g[i] = std::sin(0.01f * static_cast<float>(i)) * 50.0f;
  avg = g;
  gradcomp::InProcessGroup group(1);
  gradcomp::Communicator& comm = group.comm(0);
  gradcomp::BucketSpec bucket;
  bucket.numel = n;
  bucket.world = comm.size();
  bucket.rank = comm.rank();
  auto plan = gradcomp::make_plan("fp16", bucket);
  plan->begin(gradcomp::TensorView::cpu(avg.data(), n));
  gradcomp::run_plan(*plan, comm);
  for (int64_t i = 0; i < n; ++i) {
    // fp16 keeps 11 significant bits: half an ulp relative, and fp16's subnormal step near zero
    const float bound = std::ldexp(std::fabs(g[i]), -11) + std::ldexp(1.0f, -24);
    if (!(std::fabs(avg[i] - g[i]) <= bound)) {
      std::printf("element %lld: %g, expected %g\n", static_cast<long long>(i), avg[i], g[i]);
      return 1;
    }
  }
  std::printf("gradcomp subdirectory consumer: ok (fp16 plan, %lld values)\n",
              static_cast<long long>(n));
  return 0;
}

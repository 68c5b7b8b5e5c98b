// SPDX-License-Identifier: Apache-2.0
// A compressed allreduce of a gradient bucket across ranks with a plan: README.md's C++ example
// (readme_example.cpp, over MPI) on four ranks that run on threads of this process
// (InProcessGroup); the loop body is the same with group.comm(r) in place of the MpiCommunicator.
#include <gradcomp/gradcomp.hpp>

#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

int main() {
  const int P = 4;
  const int64_t n = 1 << 16;
  gradcomp::InProcessGroup group(P);
  std::vector<std::vector<float>> avg(P);
  std::vector<std::thread> ranks;
  for (int r = 0; r < P; ++r)
    ranks.emplace_back([&, r] {
      gradcomp::Communicator& comm = group.comm(r);
      gradcomp::BucketSpec bucket;
      bucket.numel = n;
      bucket.world = comm.size();
      bucket.rank = comm.rank();
      auto plan = gradcomp::make_plan("onebit", bucket, {{"momentum", 0.9}});
      std::vector<float> grad(n);
      for (int step = 0; step < 5; ++step) {
        for (int64_t i = 0; i < n; ++i) grad[i] = std::sin(0.001f * i + r + step);
        plan->begin(gradcomp::TensorView::cpu(grad.data(), n));
        gradcomp::run_plan(*plan, comm);  // grad now holds the average, the same on every rank
      }
      avg[r] = grad;
    });
  for (auto& t : ranks) t.join();
  for (int r = 1; r < P; ++r)
    if (avg[r] != avg[0]) {
      std::printf("rank %d's average differs from rank 0's\n", r);
      return 1;
    }
  std::printf("4 ranks, 5 steps of 1-bit compressed allreduce: the same average on every rank\n");
  return 0;
}

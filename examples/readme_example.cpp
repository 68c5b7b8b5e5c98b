// A compressed allreduce of a gradient over MPI; run: mpirun -np 2 ./app
// (examples/readme_example.cpp: ctest fails when README.md does not print it unchanged)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <gradcomp/gradcomp.hpp>
#include <vector>

int main(int argc, char** argv) {
  gradcomp::mpi_init(&argc, &argv);  // or MPI_Init
  bool same = false;
  {
    gradcomp::MpiCommunicator comm;  // or NCCL, or ranks on threads: InProcessGroup
    const int64_t n = 1 << 16;
    gradcomp::BucketSpec bucket;
    bucket.numel = n;
    bucket.world = comm.size();
    bucket.rank = comm.rank();
    auto plan = gradcomp::make_plan("onebit", bucket, {{"momentum", 0.9}});  // any family by name
    std::vector<float> grad(n), first(n);
    for (int step = 0; step < 5; ++step) {
      for (int64_t i = 0; i < n; ++i)  // a stand-in for the gradient of a real model
        grad[i] = std::sin(0.001f * i + comm.rank() + step);
      plan->begin(gradcomp::TensorView::cpu(grad.data(), n));
      gradcomp::run_plan(*plan, comm);  // grad now holds the average, bitwise equal on every rank
    }
    comm.broadcast(grad.data(), first.data(), n, gradcomp::ElemType::kF32, 0);  // rank 0's average
    same = std::memcmp(first.data(), grad.data(), n * sizeof(float)) == 0;
    std::printf("rank %d of %d: %s\n", comm.rank(), comm.size(), same ? "ok" : "differs");
  }  // comm is freed here, before MPI is finalised
  gradcomp::mpi_finalize();
  return same ? 0 : 1;
}

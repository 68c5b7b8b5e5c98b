// SPDX-License-Identifier: Apache-2.0
// A rank that leaves early makes the others raise BackendError within the timeout instead of
// hanging. The last rank leaves by _exit(0) without MPI_Finalize, or with argument `kill` dies by
// SIGKILL (as under the OOM killer). Run by run_mpi_fail.cmake under mpirun -np 2 and 4 with the
// flags that include/gradcomp/comm.hpp documents; without them mpirun kills the survivors (or, with
// only some, never returns). Not a GoogleTest: the job's processes leave through _exit (a broken
// MPI communicator cannot be finalised safely); each survivor prints "ok" or "FAIL" and exits 0
// when it raised in time, and the script counts the "ok" lines.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "plans/cast_plan.hpp"

namespace gc = gradcomp;

int main(int argc, char** argv) {
  gc::mpi_init(&argc, &argv);
  const double timeout = 2.0;
  gc::MpiCommunicator comm(gc::MpiOptions{.timeout_s = timeout});
  const int P = comm.size(), me = comm.rank();
  if (P < 2) {
    std::printf("needs at least 2 ranks\n");
    _exit(1);
  }
  const int64_t n = 1 << 16;
  std::vector<float> g(n, 1.0f);
  gc::DenseAllreducePlan plan(n, gc::DType::kFloat32, P);
  // one good step first: the connections are up
  plan.begin(gc::TensorView::cpu(g.data(), n));
  gc::run_plan(plan, comm);
  comm.barrier();
  if (me == P - 1) {
    std::fflush(stdout);
    if (argc > 1 && std::strcmp(argv[1], "kill") == 0) kill(getpid(), SIGKILL);
    _exit(0);  // leaves without a word: no finalize, no further collectives
  }
  usleep(200 * 1000);
  const auto t0 = std::chrono::steady_clock::now();
  int verdict = 1;
  try {
    plan.begin(gc::TensorView::cpu(g.data(), n));
    gc::run_plan(plan, comm);
    std::printf("rank %d: FAIL - the collective completed although rank %d left\n", me, P - 1);
  } catch (const gc::BackendError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const bool in_time = s < timeout + 5.0;
    std::printf("rank %d: %s - BackendError after %.2f s (timeout %.1f s): %s\n", me,
                in_time ? "ok" : "FAIL (too late)", s, timeout, e.what());
    // the communicator is now broken: every call throws
    bool rethrows = false;
    try {
      comm.barrier();
    } catch (const gc::BackendError&) {
      rethrows = true;
    }
    if (!rethrows) std::printf("rank %d: FAIL - broken communicator accepted a call\n", me);
    verdict = in_time && rethrows ? 0 : 1;
  }
  std::fflush(stdout);
  _exit(verdict);
}

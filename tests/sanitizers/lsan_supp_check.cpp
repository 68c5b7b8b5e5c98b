// SPDX-License-Identifier: Apache-2.0
// Checks scripts/sanitizers/lsan.supp in the ASan build (see CMakeLists.txt here):
//   lsan_supp_check free  MPI init, a duplicated communicator freed, finalize: OpenMPI's own
//                         allocations are all suppressed, so LeakSanitizer reports nothing;
//   lsan_supp_check leak  the same without MPI_Comm_free: a leak made by the caller through an
//                         OpenMPI call, which the file must NOT hide. A suppression by library
//                         name (leak:libmpi.so) would hide it, because libmpi frames are on its
//                         stack; the file's entries are OpenMPI functions that only its own
//                         one-time setup and teardown run through (ompi_mpi_init, ...).
#include <mpi.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const bool leak = argc == 2 && std::strcmp(argv[1], "leak") == 0;
  MPI_Init(&argc, &argv);
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  if (!leak) MPI_Comm_free(&dup);
  MPI_Finalize();
  std::printf("lsan_supp_check %s: finalized\n", leak ? "leak" : "free");
  return 0;
}

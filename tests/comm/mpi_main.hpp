// SPDX-License-Identifier: Apache-2.0
// main() of the multi-rank tests: MPI is initialised around GoogleTest; every rank runs every
// test (the bodies use the Communicator interface only) and prints its own results.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "gradcomp/comm.hpp"

namespace gradcomp::test {

/// Holder of the tests' communicator on MPI_COMM_WORLD. GC_MPI_TEST_MAIN destroys it before
/// MPI_Finalize: one still alive then (a function-local static) cannot free its duplicated
/// MPI_Comm any more, and OpenMPI's finalize does not free it either (a leak in the ASan build).
inline std::unique_ptr<MpiCommunicator>& world_holder() {
  static std::unique_ptr<MpiCommunicator> comm;
  return comm;
}

/// The communicator the test bodies use, made on first use (timeout 60 s).
inline MpiCommunicator& world() {
  auto& comm = world_holder();
  if (!comm) comm = std::make_unique<MpiCommunicator>(MpiOptions{.timeout_s = 60});
  return *comm;
}

}  // namespace gradcomp::test

// Exit code 77 (ctest SKIP_RETURN_CODE) only when every test of the binary skipped (no GPU).
#define GC_MPI_TEST_MAIN()                                                       \
  int main(int argc, char** argv) {                                              \
    ::gradcomp::mpi_init(&argc, &argv);                                          \
    ::testing::InitGoogleTest(&argc, argv);                                      \
    const int rc = RUN_ALL_TESTS();                                              \
    const auto* u = ::testing::UnitTest::GetInstance();                          \
    const bool all_skipped = u->skipped_test_count() > 0 &&                      \
                             u->skipped_test_count() == u->test_to_run_count();  \
    ::gradcomp::test::world_holder().reset();                                    \
    ::gradcomp::mpi_finalize();                                                  \
    return rc == 0 && all_skipped ? 77 : rc;                                     \
  }

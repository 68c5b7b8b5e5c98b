// SPDX-License-Identifier: Apache-2.0
// main() of the multi-rank tests: MPI is initialised around GoogleTest; every rank runs every
// test (the bodies use the Communicator interface only) and prints its own results.
#pragma once

#include <gtest/gtest.h>

#include "gradcomp/comm.hpp"

// Exit code 77 (ctest SKIP_RETURN_CODE) only when every test of the binary skipped (no GPU).
#define GC_MPI_TEST_MAIN()                                                       \
  int main(int argc, char** argv) {                                              \
    ::gradcomp::mpi_init(&argc, &argv);                                          \
    ::testing::InitGoogleTest(&argc, argv);                                      \
    const int rc = RUN_ALL_TESTS();                                              \
    const auto* u = ::testing::UnitTest::GetInstance();                          \
    const bool all_skipped = u->skipped_test_count() > 0 &&                      \
                             u->skipped_test_count() == u->test_to_run_count();  \
    ::gradcomp::mpi_finalize();                                                  \
    return rc == 0 && all_skipped ? 77 : rc;                                     \
  }

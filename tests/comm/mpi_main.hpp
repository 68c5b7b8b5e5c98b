// SPDX-License-Identifier: Apache-2.0
// main() of the multi-rank tests: MPI is initialised around GoogleTest; every rank runs every
// test (the bodies use the Communicator interface only) and prints its own results.
#pragma once

#include <gtest/gtest.h>

#include "gradcomp/comm.hpp"

#define GC_MPI_TEST_MAIN()                                                 \
  int main(int argc, char** argv) {                                        \
    ::gradcomp::mpi_init(&argc, &argv);                                    \
    ::testing::InitGoogleTest(&argc, argv);                                \
    const int rc = RUN_ALL_TESTS();                                        \
    ::gradcomp::mpi_finalize();                                            \
    return rc;                                                             \
  }

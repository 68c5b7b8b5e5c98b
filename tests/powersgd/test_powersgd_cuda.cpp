// SPDX-License-Identifier: Apache-2.0
#include "psgd_test_util.hpp"
TEST(PowerSGDCuda, Placeholder) { GC_REQUIRE_GPU(); }

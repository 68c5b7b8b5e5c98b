// SPDX-License-Identifier: Apache-2.0
// What the 1-bit codec (compressors/onebit_codec.cpp) and the 1-bit allreduce plan
// (plans/onebit_plan.cpp) share: the kernel's norm code of a scaling and the sign-mode geometry.
#pragma once

#include <algorithm>
#include <cstdint>

#include "compressors/checks.hpp"  // check_grad, check_dense: shared with the other codecs
#include "gradcomp/onebit.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"

namespace gradcomp::detail {

namespace k = kernels;

inline int norm_of(OneBitScaling s) {
  return s == OneBitScaling::kColumnMeans ? k::onebit::kColumnMeans
         : s == OneBitScaling::kSignL1    ? k::onebit::kL1
                                          : k::onebit::kL2;
}

/// Sign-mode geometry of n elements with a given chunk (the plan's server chunks).
inline k::OneBitGeom sign_geom(int64_t n, int64_t chunk) {
  k::OneBitGeom g;
  g.n = n;
  g.columns = false;
  g.cols = 1;
  g.chunk = std::max<int64_t>(32, chunk);
  return g;
}

}  // namespace gradcomp::detail

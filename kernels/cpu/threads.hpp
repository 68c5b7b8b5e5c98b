// SPDX-License-Identifier: Apache-2.0
// How many OpenMP threads an element-wise CPU kernel uses for `work` elements, shared by the
// kernels whose results do not depend on the thread count (each thread takes whole blocks).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace gradcomp::kernels::cpu {

inline int threads_for(int64_t work) {
  const int64_t per = int64_t{1} << 15;  // below ~32K elements per thread, threads do not pay
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), work / per)));
}

}  // namespace gradcomp::kernels::cpu

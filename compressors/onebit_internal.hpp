// SPDX-License-Identifier: Apache-2.0
// What the 1-bit codec (compressors/onebit.cpp) and the 1-bit allreduce plan (plans/onebit.cpp)
// share: the kernel's norm code of a scaling and the sign-mode geometry.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gradcomp/error.hpp"
#include "gradcomp/onebit.hpp"
#include "kernels/onebit.hpp"
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

/// Checks of a gradient (codec and plan) and of a decode output (codec).
inline void check_grad(const TensorView& g, int64_t numel, Device dev, int dev_index, uint32_t tid,
                const char* who) {
  GC_CHECK_ARG(g.numel == numel, who, " tensor ", tid, ": gradient has ", g.numel,
               " elements but the state was built for ", numel, " (", g.describe(), ")");
  GC_CHECK_ARG(g.device == dev && (dev == Device::kCPU || g.device_index == dev_index), who,
               " tensor ", tid, ": gradient is on ", device_name(g.device), ":", g.device_index,
               " but the state is on ", device_name(dev), ":", dev_index);
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(g.dtype)), who, " tensor ", tid,
               ": unsupported gradient dtype code ", int(g.dtype), " (expected fp32, fp16, bf16)");
  GC_CHECK_ARG(g.numel == 0 || g.data != nullptr, who, " tensor ", tid, ": null gradient data");
}

inline void check_dense(const TensorView& d, int64_t numel, Device dev, const char* who) {
  GC_CHECK_ARG(d.dtype == DType::kFloat32, who, " decode: the output must be fp32, got ",
               d.describe());
  GC_CHECK_ARG(d.numel == numel, who, " decode: output has ", d.numel, " elements, expected ",
               numel);
  GC_CHECK_ARG(d.device == dev, who, " decode: output is on ", device_name(d.device),
               ", the state on ", device_name(dev));
  GC_CHECK_ARG(d.numel == 0 || d.data != nullptr, who, " decode: null output data");
}

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// The argument checks every per-tensor codec (top-k, random-k, 1-bit) and the 1-bit plan share.
#pragma once

#include <cstdint>

#include "gradcomp/error.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp::detail {

/// A gradient for a state of `numel` elements on (dev, dev_index): size, device, dtype, data.
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

/// A decode output: fp32, `numel` elements, on the state's device, with data.
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

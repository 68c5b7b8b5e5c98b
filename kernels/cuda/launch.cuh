// SPDX-License-Identifier: Apache-2.0
// The one launch convention of the CUDA kernels: 256 threads per block, and a grid sized for a
// grid-stride loop (enough blocks for `per_block` items each, at least 1, at most `cap`).
#pragma once

#include <algorithm>
#include <cstdint>

namespace gradcomp::kernels::cuda {

inline constexpr int kThreads = 256;          ///< threads per block of every kernel
inline constexpr int64_t kMaxGrid = 1 << 16;  ///< cap for element-wise grid-stride kernels

/// Blocks for `items` work items, `per_block` per block, clamped to [1, cap].
inline unsigned grid_for(int64_t items, int64_t per_block, int64_t cap = kMaxGrid) {
  const int64_t g = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::clamp<int64_t>(g, 1, cap));
}

}  // namespace gradcomp::kernels::cuda

// SPDX-License-Identifier: Apache-2.0
// The pinned host slot that the CUDA backends keep in a kernel workspace (SelectWorkspace,
// OneBitWorkspace): one release for every workspace's destructor.
#pragma once

#include "gradcomp/runtime.hpp"

namespace gradcomp::kernels {

/// Frees a workspace's pinned slot (nullptr: nothing to free). Called from destructors, which
/// must not throw: a failure there (the CUDA context already gone at exit) is ignored.
inline void free_pinned_slot(void* p) noexcept {
  if (!p) return;
  try {
    gradcomp::cuda::free_host(p);
  } catch (...) {
  }
}

}  // namespace gradcomp::kernels

// SPDX-License-Identifier: Apache-2.0
// What the CUDA tests share: device buffers (DevBuf) and a driver that executes one plan per
// simulated rank whose buffers are on the device, each collective by device-to-device copies
// (all-to-all and allgather only: what the two-phase plans ask for; nothing is summed).
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "gradcomp/plan.hpp"
#include "gradcomp/runtime.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp::test {

/// Device memory for a test (stream-ordered on the legacy stream).
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) { p = gradcomp::cuda::malloc_async(b ? b : 16, nullptr); }
  ~DevBuf() { gradcomp::cuda::free_async(p, nullptr); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const void* h, size_t b, size_t off = 0) {
    device_copy(static_cast<char*>(p) + off, Device::kCUDA, h, Device::kCPU, b, nullptr);
  }
  void download(void* h, size_t b) const {
    device_copy(h, Device::kCPU, p, Device::kCUDA, b, nullptr);
  }
  template <class T>
  T* as(size_t off_bytes = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(p) + off_bytes);
  }
};

template <class PlanT>
void run_device_plans(const std::vector<PlanT*>& ps) {
  const size_t P = ps.size();
  for (;;) {
    std::vector<std::optional<Collective>> cs(P);
    for (size_t r = 0; r < P; ++r) cs[r] = ps[r]->next();
    if (!cs[0]) {
      for (size_t r = 1; r < P; ++r) ASSERT_FALSE(cs[r].has_value());
      return;
    }
    const size_t bytes = cs[0]->count * elem_size(cs[0]->type);
    for (size_t dst = 0; dst < P; ++dst)
      for (size_t src = 0; src < P; ++src) {
        ASSERT_EQ(cs[src]->kind, cs[0]->kind);
        ASSERT_EQ(cs[src]->count, cs[0]->count);
        ASSERT_TRUE(cs[0]->kind == CollectiveKind::kAllToAll ||
                    cs[0]->kind == CollectiveKind::kAllgather);
        const char* from = static_cast<const char*>(cs[src]->send);
        if (cs[0]->kind == CollectiveKind::kAllToAll) from += dst * bytes;
        gradcomp::cuda::memcpy_async(static_cast<char*>(cs[dst]->recv) + src * bytes, from, bytes,
                                     nullptr);
      }
    gradcomp::cuda::stream_synchronize(nullptr);
  }
}

}  // namespace gradcomp::test

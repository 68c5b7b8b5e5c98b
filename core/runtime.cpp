// SPDX-License-Identifier: Apache-2.0
// Device dispatch for memory and the CPU thread count. The CUDA half lives in core/cuda (real) or
// core/nocuda (throws), chosen by CMake.
#include "gradcomp/runtime.hpp"

#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace gradcomp {

void throw_not_built_with_cuda(const char* what) {
  throw NotBuiltWithCuda(detail::cat(
      what, ": gradcomp was built without CUDA (no nvcc at build time); rebuild with "
            "GRADCOMP_CUDA=ON, or pass CPU tensors"));
}

void throw_not_built_with_nccl(const char* what, bool cuda_built) {
  if (!cuda_built) throw_not_built_with_cuda(detail::cat(what, " (NCCL)").c_str());
  throw NotBuiltWithCuda(detail::cat(
      what, ": gradcomp was built with CUDA but without NCCL (nccl.h or libnccl.so not found at "
            "configure time); install NCCL into the CUDA toolkit and rebuild"));
}

void* device_malloc(Device dev, size_t bytes, void* stream) {
  if (dev == Device::kCUDA) return cuda::malloc_async(bytes, stream);
  if (bytes == 0) bytes = 1;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) throw std::bad_alloc();
  return p;
}

void device_free(Device dev, void* p, void* stream) noexcept {
  if (!p) return;
  if (dev == Device::kCUDA) {
    try {
      cuda::free_async(p, stream);
    } catch (...) {  // destructors never throw; a failed free at teardown is not actionable
    }
    return;
  }
  std::free(p);
}

void device_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes,
                 void* stream) {
  if (bytes == 0) return;
  if (dst_dev == Device::kCPU && src_dev == Device::kCPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::memcpy_async(dst, src, bytes, stream);
  if (dst_dev == Device::kCPU) cuda::stream_synchronize(stream);
}

void device_zero(Device dev, void* p, size_t bytes, void* stream) {
  if (bytes == 0) return;
  if (dev == Device::kCPU) {
    std::memset(p, 0, bytes);
    return;
  }
  cuda::memset_async(p, 0, bytes, stream);
}

void device_fill_nan(Device dev, void* p, size_t bytes, void* stream) {
  if (bytes == 0) return;
  if (dev == Device::kCPU) {
    std::memset(p, 0xFF, bytes);
    return;
  }
  cuda::memset_async(p, 0xFF, bytes, stream);
}

bool device_first_is_nan(Device dev, const void* p, DType t, void* stream) {
  uint8_t b[4] = {0, 0, 0, 0};
  const size_t es = dtype_size(t);
  device_copy(b, Device::kCPU, p, dev, es, stream);
  if (t == DType::kFloat32) {
    uint32_t u;
    std::memcpy(&u, b, 4);
    return (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0;
  }
  uint16_t h;
  std::memcpy(&h, b, 2);
  if (t == DType::kFloat16) return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0;
  return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0;  // bf16
}

void set_cpu_threads(int n) {
  GC_CHECK_ARG(n >= 0, "thread count must be >= 0, got ", n);
  omp_set_num_threads(n > 0 ? n : omp_get_num_procs());
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace gradcomp

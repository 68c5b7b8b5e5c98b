// SPDX-License-Identifier: Apache-2.0
#include "core/cuda/check.cuh"
#include "gradcomp/runtime.hpp"

namespace gradcomp {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: report zero, clear the sticky error
    return 0;
  }
  return n;
}

namespace cuda {
using cuda_detail::as_stream;

void* malloc_async(size_t bytes, void* stream) {
  void* p = nullptr;
  GC_CUDA_CHECK(cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, as_stream(stream)));
  return p;
}
void free_async(void* p, void* stream) { GC_CUDA_CHECK(cudaFreeAsync(p, as_stream(stream))); }
void memcpy_async(void* dst, const void* src, size_t bytes, void* stream) {
  GC_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
}
void memset_async(void* dst, int value, size_t bytes, void* stream) {
  GC_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)));
}
void stream_synchronize(void* stream) { GC_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream))); }
void* malloc_host(size_t bytes) {
  void* p = nullptr;
  GC_CUDA_CHECK(cudaMallocHost(&p, bytes == 0 ? 1 : bytes));
  return p;
}
void free_host(void* p) { GC_CUDA_CHECK(cudaFreeHost(p)); }
int current_device() {
  int d = 0;
  GC_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
}  // namespace cuda

}  // namespace gradcomp

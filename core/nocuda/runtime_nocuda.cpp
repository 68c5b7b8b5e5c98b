// SPDX-License-Identifier: Apache-2.0
// CPU-only build: the CUDA runtime entry points exist and throw a clear error.
#include "gradcomp/runtime.hpp"

namespace gradcomp {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }

namespace cuda {
void* malloc_async(size_t, void*) { throw_not_built_with_cuda("CUDA memory allocation"); }
void free_async(void*, void*) { throw_not_built_with_cuda("CUDA memory free"); }
void memcpy_async(void*, const void*, size_t, void*) { throw_not_built_with_cuda("CUDA copy"); }
void memset_async(void*, int, size_t, void*) { throw_not_built_with_cuda("CUDA memset"); }
void stream_synchronize(void*) { throw_not_built_with_cuda("CUDA stream synchronize"); }
void* malloc_host(size_t) { throw_not_built_with_cuda("pinned host allocation"); }
void free_host(void*) { throw_not_built_with_cuda("pinned host free"); }
int current_device() { throw_not_built_with_cuda("CUDA current device"); }
}  // namespace cuda

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The thin device runtime every layer uses: memory, copies, streams. In a CPU-only build the CUDA
// functions throw gradcomp::NotBuiltWithCuda and cuda_device_count() returns 0.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/tensor.hpp"

namespace gradcomp {

/// True when this library was built with the CUDA backend.
bool built_with_cuda();
/// Number of visible CUDA devices (0 in a CPU-only build or on a machine without a GPU).
int cuda_device_count();

/// Throws NotBuiltWithCuda naming `what` (e.g. "top-k selection on a CUDA tensor").
[[noreturn]] void throw_not_built_with_cuda(const char* what);
/// The same for an NCCL entry point of a build without NCCL: "built without NCCL" when CUDA was
/// built (NCCL was not found at configure time), else "built without CUDA".
[[noreturn]] void throw_not_built_with_nccl(const char* what, bool cuda_built);

namespace cuda {
/// Stream-ordered allocation on the current device (cudaMallocAsync).
void* malloc_async(size_t bytes, void* stream);
void free_async(void* p, void* stream);
void memcpy_async(void* dst, const void* src, size_t bytes, void* stream);  // any direction
void memset_async(void* dst, int value, size_t bytes, void* stream);
void stream_synchronize(void* stream);
/// Pinned host memory for device-to-host counts.
void* malloc_host(size_t bytes);
void free_host(void* p);
int current_device();
}  // namespace cuda

/// Allocates on the view's device; for the CPU, plain aligned memory.
void* device_malloc(Device dev, size_t bytes, void* stream);
void device_free(Device dev, void* p, void* stream) noexcept;
/// Copies bytes between any two locations (host<->device); synchronous w.r.t. the host for CPU.
void device_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes,
                 void* stream);
void device_zero(Device dev, void* p, size_t bytes, void* stream);
/// Sets every byte to 0xFF: a NaN in fp32, fp16 and bf16 alike (what a skipped step's output and
/// its "some rank was bad" signal are made of; a NaN survives every sum it enters).
void device_fill_nan(Device dev, void* p, size_t bytes, void* stream);
/// Whether the first element of a float array (fp32, fp16 or bf16, on any device) is NaN. Reads
/// one element (synchronises the stream for a device array).
bool device_first_is_nan(Device dev, const void* p, DType t, void* stream);

/// Number of CPU threads the CPU kernels use (OpenMP). 0 = OpenMP's default.
void set_cpu_threads(int n);
int cpu_threads();

}  // namespace gradcomp

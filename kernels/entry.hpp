// SPDX-License-Identifier: Apache-2.0
// One declaration per kernel entry point. GC_KERNEL_ENTRY(name, what, (params), (args)) declares
// the CPU twin `cpu::name(params)`, the CUDA twin `cuda::name(params, void* stream)` and the
// dispatch `name(Device, params, void* stream)` that the plans call. In a build without CUDA the
// CUDA twin is not declared at all and the dispatch throws "built without CUDA" naming `what`,
// so a new entry point needs no no-CUDA stub and no hand-written dispatch: its kernels file
// (kernels/cpu, kernels/cuda) defines the twins, and nothing else names it.
//
// Example:
//   GC_KERNEL_ENTRY(scale, "scaling of a CUDA buffer", (float* x, int64_t n, float s), (x, n, s))
//   kernels::scale(device, x, n, 2.0f, stream);  // cpu::scale(x, n, 2) or cuda::scale(..., stream)
#pragma once

#include "gradcomp/runtime.hpp"  // throw_not_built_with_cuda
#include "gradcomp/tensor.hpp"   // Device

#ifndef GRADCOMP_HAS_CUDA
#error "GRADCOMP_HAS_CUDA is set by the gradcomp target (CMakeLists.txt) for every user of it"
#endif

#define GC_ENTRY_UNPAREN(...) __VA_ARGS__

#if GRADCOMP_HAS_CUDA
#define GC_ENTRY_CUDA_DECLARE(name, params)         \
  namespace cuda {                                  \
  void name(GC_ENTRY_UNPAREN params, void* stream); \
  }
#define GC_ENTRY_CUDA_CALL(name, what, args) cuda::name(GC_ENTRY_UNPAREN args, stream);
#else
#define GC_ENTRY_CUDA_DECLARE(name, params)
#define GC_ENTRY_CUDA_CALL(name, what, args) \
  (void)stream;                              \
  throw_not_built_with_cuda(what);
#endif

#define GC_KERNEL_ENTRY(name, what, params, args)                          \
  namespace cpu {                                                          \
  void name params;                                                        \
  }                                                                        \
  GC_ENTRY_CUDA_DECLARE(name, params)                                      \
  inline void name(Device device, GC_ENTRY_UNPAREN params, void* stream) { \
    if (device == Device::kCUDA) {                                         \
      GC_ENTRY_CUDA_CALL(name, what, args)                                 \
    } else {                                                               \
      cpu::name args;                                                      \
    }                                                                      \
  }

// SPDX-License-Identifier: Apache-2.0
// One declaration per kernel entry point. Each form declares the CPU twin `cpu::name`, the CUDA
// twin `cuda::name(..., void* stream)` and the dispatch `name(const Exec&, ...)` that the
// algorithms above (compressors/, plans/) call: it runs the CPU twin or, on a CUDA context, the
// CUDA twin on the context's stream. In a build without CUDA the CUDA twin is not declared at
// all and the dispatch throws "built without CUDA" naming `what`, so an entry point needs no
// no-CUDA stub and no hand-written dispatch: its kernels file (kernels/cpu, kernels/cuda) defines
// the twins, and nothing else names it. `params` and `args` are parenthesized lists: the
// parameters (no default arguments: the CUDA twin's stream comes after them) and their names.
//
//   GC_KERNEL_ENTRY(name, what, (params), (args))
//       void cpu::name(params);  void cuda::name(params, void* stream);
//       void name(const Exec&, params);
//   GC_KERNEL_ENTRY_R(ret, name, what, (params), (args))
//       the same, returning ret (the dispatch returns what the twin it ran returned).
//   GC_KERNEL_ENTRY_CUDA_EXTRA(ret, name, what, (params), (args), (extra), (extra_args))
//       parameters that only the CUDA twin takes (a workspace for its scratch and read-backs):
//       ret cpu::name(params);  ret cuda::name(params, extra, void* stream);
//       ret name(const Exec&, params, extra), which does not pass `extra` to the CPU twin.
//   GC_CUDA_ONLY_ENTRY(ret, name, what, (params), (args))
//       a CUDA kernel with no CPU twin, called by code that runs it on CUDA data only:
//       ret cuda::name(params, void* stream); in a build without CUDA an inline cuda::name that
//       throws "built without CUDA" (its callers compile in both builds).
//
// Example:
//   GC_KERNEL_ENTRY(scale, "scaling of a CUDA buffer", (float* x, int64_t n, float s), (x, n, s))
//   kernels::scale({device, stream}, x, n, 2.0f);  // cpu::scale(x, n, 2.0f) on the CPU,
//                                                  // else cuda::scale(x, n, 2.0f, stream)
#pragma once

#include "gradcomp/runtime.hpp"  // throw_not_built_with_cuda
#include "gradcomp/tensor.hpp"   // Device

#ifndef GRADCOMP_HAS_CUDA
#error "GRADCOMP_HAS_CUDA is set by the gradcomp target (CMakeLists.txt) for every user of it"
#endif

namespace gradcomp::kernels {

/// Where a kernel runs: the data's device and, on CUDA, the stream (cudaStream_t).
struct Exec {
  Device device = Device::kCPU;
  void* stream = nullptr;
  bool cuda() const { return device == Device::kCUDA; }
};

namespace entry_detail {
/// Marks the arguments a build without CUDA does not use (the dispatch's CUDA-only ones).
template <class... T>
inline void unused(const T&...) {}
}  // namespace entry_detail

}  // namespace gradcomp::kernels

#define GC_ENTRY_UNPAREN(...) __VA_ARGS__

// The common expansion: the CPU twin takes cpu_params, the CUDA twin and the dispatch all_params
// (cpu_params, then the CUDA-only ones, whose names are extra_args).
#if GRADCOMP_HAS_CUDA
#define GC_ENTRY_DEFINE(ret, name, what, cpu_params, cpu_args, all_params, all_args, extra_args) \
  namespace cpu {                                                                                \
  ret name cpu_params;                                                                           \
  }                                                                                              \
  namespace cuda {                                                                               \
  ret name(GC_ENTRY_UNPAREN all_params, void* stream);                                           \
  }                                                                                              \
  inline ret name(const ::gradcomp::kernels::Exec& gc_exec, GC_ENTRY_UNPAREN all_params) {       \
    if (gc_exec.cuda()) return cuda::name(GC_ENTRY_UNPAREN all_args, gc_exec.stream);            \
    return cpu::name cpu_args;                                                                   \
  }
#else
#define GC_ENTRY_DEFINE(ret, name, what, cpu_params, cpu_args, all_params, all_args, extra_args) \
  namespace cpu {                                                                                \
  ret name cpu_params;                                                                           \
  }                                                                                              \
  inline ret name(const ::gradcomp::kernels::Exec& gc_exec, GC_ENTRY_UNPAREN all_params) {       \
    ::gradcomp::kernels::entry_detail::unused extra_args;                                        \
    if (gc_exec.cuda()) ::gradcomp::throw_not_built_with_cuda(what);                             \
    return cpu::name cpu_args;                                                                   \
  }
#endif

#define GC_KERNEL_ENTRY(name, what, params, args) \
  GC_ENTRY_DEFINE(void, name, what, params, args, params, args, ())
#define GC_KERNEL_ENTRY_R(ret, name, what, params, args) \
  GC_ENTRY_DEFINE(ret, name, what, params, args, params, args, ())
#define GC_KERNEL_ENTRY_CUDA_EXTRA(ret, name, what, params, args, extra, extra_args) \
  GC_ENTRY_DEFINE(ret, name, what, params, args,                                     \
                  (GC_ENTRY_UNPAREN params, GC_ENTRY_UNPAREN extra),                 \
                  (GC_ENTRY_UNPAREN args, GC_ENTRY_UNPAREN extra_args), extra_args)

#if GRADCOMP_HAS_CUDA
#define GC_CUDA_ONLY_ENTRY(ret, name, what, params, args) \
  namespace cuda {                                        \
  ret name(GC_ENTRY_UNPAREN params, void* stream);        \
  }
#else
#define GC_CUDA_ONLY_ENTRY(ret, name, what, params, args)                     \
  namespace cuda {                                                            \
  [[noreturn]] inline ret name(GC_ENTRY_UNPAREN params, void* stream) {       \
    ::gradcomp::kernels::entry_detail::unused(GC_ENTRY_UNPAREN args, stream); \
    ::gradcomp::throw_not_built_with_cuda(what);                              \
  }                                                                           \
  }
#endif

// SPDX-License-Identifier: Apache-2.0
// A small device-tagged, non-owning tensor view: what every gradcomp entry point takes.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "gradcomp/error.hpp"
#include "gradcomp/types.hpp"  // DType, Device

namespace gradcomp {

/// A non-owning view of a dense, contiguous tensor.
///
/// Example:
///   std::vector<float> g(1000);
///   auto v = gradcomp::TensorView::cpu(g.data(), {10, 100});
struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_index = 0;
  void* stream = nullptr;  ///< cudaStream_t for CUDA tensors (nullptr = legacy default stream)
  int ndim = 1;
  std::array<int64_t, kMaxDims> shape{};

  TensorView() = default;
  /// Full constructor; shape must multiply to numel (checked).
  TensorView(void* d, std::initializer_list<int64_t> dims, DType t, Device dev, int dev_index = 0,
             void* s = nullptr);
  TensorView(void* d, const int64_t* dims, int nd, DType t, Device dev, int dev_index = 0,
             void* s = nullptr);

  /// A 1-D fp32 CPU view.
  static TensorView cpu(float* p, int64_t n) {
    return TensorView(p, {n}, DType::kFloat32, Device::kCPU);
  }
  static TensorView cpu(float* p, std::initializer_list<int64_t> dims) {
    return TensorView(p, dims, DType::kFloat32, Device::kCPU);
  }

  bool is_cuda() const { return device == Device::kCUDA; }
  int64_t nbytes() const { return numel * dtype_size(dtype); }
  /// Matrix view used by column-wise / low-rank compressors: shape[0] x (numel / shape[0]).
  int64_t rows() const { return ndim >= 1 && numel > 0 ? shape[0] : (numel > 0 ? 1 : 0); }
  int64_t cols() const { return rows() > 0 ? numel / rows() : 0; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  /// "float32[10, 100] on cpu" (for messages).
  std::string describe() const;
};

}  // namespace gradcomp

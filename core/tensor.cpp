// SPDX-License-Identifier: Apache-2.0
#include "gradcomp/tensor.hpp"

namespace gradcomp {

TensorView::TensorView(void* d, const int64_t* dims, int nd, DType t, Device dev, int dev_index,
                       void* s)
    : data(d), dtype(t), device(dev), device_index(dev_index), stream(s), ndim(nd) {
  GC_CHECK_ARG(nd >= 0 && nd <= kMaxDims, "tensor rank must be in [0, ", kMaxDims, "], got ", nd);
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(t)), "unsupported dtype code ", static_cast<int>(t),
               " (expected fp32, fp16 or bf16)");
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) {
    GC_CHECK_ARG(dims[i] >= 0, "tensor dimension ", i, " is negative (", dims[i], ")");
    shape[i] = dims[i];
    GC_CHECK_ARG(!__builtin_mul_overflow(n, dims[i], &n),
                 "tensor shape overflows int64 at dimension ", i, " (", dims[i], ")");
  }
  if (nd == 0) {
    ndim = 1;
    shape[0] = 1;
  }
  numel = n;
  GC_CHECK_ARG(numel == 0 || data != nullptr, "tensor data pointer is null for ", numel,
               " elements");
}

TensorView::TensorView(void* d, std::initializer_list<int64_t> dims, DType t, Device dev,
                       int dev_index, void* s)
    : TensorView(d, dims.begin(), static_cast<int>(dims.size()), t, dev, dev_index, s) {}

std::string TensorView::describe() const {
  std::string s = detail::cat(dtype_name(dtype), "[");
  for (int i = 0; i < ndim; ++i) s += detail::cat(i ? ", " : "", shape[i]);
  s += detail::cat("] on ", device_name(device));
  if (device == Device::kCUDA) s += detail::cat(":", device_index);
  return s;
}

}  // namespace gradcomp

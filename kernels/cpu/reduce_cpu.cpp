// SPDX-License-Identifier: Apache-2.0
// CPU backend of the communication layer's local work (OpenMP over elements; every element is
// summed in rank order, so the result does not depend on the thread count).
#include <cstring>

#include "kernels/reduce.hpp"
#include "kernels/reduce_math.h"

namespace gradcomp::kernels::cpu {
namespace {

template <class T, class Add>
void reduce_t(const void* blocks, size_t nb, size_t count, size_t stride, void* dst, Add add) {
  const T* b = static_cast<const T*>(blocks);
  T* d = static_cast<T*>(dst);
  const auto n = static_cast<int64_t>(count);
#pragma omp parallel for schedule(static) if (n > (1 << 15))
  for (int64_t i = 0; i < n; ++i) {
    T acc = b[i];
    for (size_t r = 1; r < nb; ++r) acc = add(acc, b[r * stride + i]);
    d[i] = acc;
  }
}

template <class Load>
void convert_from(const void* src, void* dst, DType dt, int64_t n, float div) {
  switch (dt) {
    case DType::kFloat32: {
      auto* d = static_cast<float*>(dst);
#pragma omp parallel for schedule(static) if (n > (1 << 15))
      for (int64_t i = 0; i < n; ++i) d[i] = scaled(Load::load(src, i), div);
      return;
    }
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static) if (n > (1 << 15))
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(scaled(Load::load(src, i), div));
      return;
    }
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static) if (n > (1 << 15))
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(scaled(Load::load(src, i), div));
      return;
    }
  }
}

}  // namespace

void reduce_blocks(const void* blocks, size_t nb, size_t count, size_t stride, ElemType t,
                   void* dst) {
  if (count == 0 || nb == 0) return;
  switch (t) {
    case ElemType::kF32: return reduce_t<float>(blocks, nb, count, stride, dst, add_f32);
    case ElemType::kF16: return reduce_t<uint16_t>(blocks, nb, count, stride, dst, add_f16);
    case ElemType::kBF16: return reduce_t<uint16_t>(blocks, nb, count, stride, dst, add_bf16);
    case ElemType::kU8:
      return reduce_t<uint8_t>(blocks, nb, count, stride, dst,
                               [](uint8_t a, uint8_t b) { return static_cast<uint8_t>(a + b); });
    case ElemType::kU32:
      return reduce_t<uint32_t>(blocks, nb, count, stride, dst,
                                [](uint32_t a, uint32_t b) { return a + b; });
    case ElemType::kI64:
      return reduce_t<int64_t>(blocks, nb, count, stride, dst, [](int64_t a, int64_t b) {
        return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
      });
  }
}

void convert(const void* src, DType st, void* dst, DType dt, int64_t n, float divisor) {
  if (n <= 0) return;
  if (st == dt && divisor == 1.0f) {
    if (src != dst) std::memmove(dst, src, static_cast<size_t>(n) * dtype_size(st));
    return;
  }
  switch (st) {
    case DType::kFloat32: return convert_from<F32Load>(src, dst, dt, n, divisor);
    case DType::kFloat16: return convert_from<F16Load>(src, dst, dt, n, divisor);
    case DType::kBFloat16: return convert_from<BF16Load>(src, dst, dt, n, divisor);
  }
}

}  // namespace gradcomp::kernels::cpu

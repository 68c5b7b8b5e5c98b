// SPDX-License-Identifier: Apache-2.0
// CPU backend of the communication layer's local work (OpenMP over elements; every element is
// summed in rank order, so the result does not depend on the thread count).
#include <algorithm>
#include <cstring>

#include "kernels/reduce_kernels.hpp"
#include "kernels/reduce_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define GC_HAVE_F16C_PATH 1
#endif

namespace gradcomp::kernels::cpu {
namespace {

#ifdef GC_HAVE_F16C_PATH
// fp16 fast paths (the baseline ISA, x86-64-v2, has no F16C; chosen at run time). They give the
// bits of the scalar twins: the hardware conversions round to nearest even like float_to_half /
// half_to_float, fp32 division and addition are the same IEEE operations, and NaNs widen quiet
// with their payload in both. Narrowing keeps NaN payloads in hardware but not in float_to_half,
// so there a group of 8 that holds a NaN is redone by the scalar code.
// F16C read from CPUID leaf 1 (ECX bit 29): clang before 16 does not know "f16c" as a
// __builtin_cpu_supports feature; "avx" also checks that the OS saves the AVX registers.
bool have_f16c() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return ok;
}

// The AVX work sits in target("avx,f16c") functions over a range of 8-element groups, called from
// the OpenMP loop in for_groups_of_8: clang does not give the function it outlines for an omp
// region the target attribute of the function around it, so no intrinsic may sit inside the
// pragma. Each range ends at a multiple of 8; the tail (< 8 elements) is done by the scalar twin.
template <class Range>
void for_groups_of_8(int64_t n8, const Range& range) {
  constexpr int64_t kBlock = int64_t{1} << 13;  // elements per loop iteration, a multiple of 8
  const int64_t blocks = (n8 + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n8 > (1 << 15))
  for (int64_t b = 0; b < blocks; ++b) range(b * kBlock, std::min(n8, (b + 1) * kBlock));
}

/// d[i] = float_to_half(scaled(load(src, i), div)) for i in [lo, hi), src fp32 or fp16.
__attribute__((target("avx,f16c"))) void to_half_f16c_range(const void* src, bool src_half,
                                                            uint16_t* d, int64_t lo, int64_t hi,
                                                            float div) {
  const __m256 vdiv = _mm256_set1_ps(div);
  const bool divide = div != 1.0f;
  for (int64_t i = lo; i < hi; i += 8) {
    __m256 x = src_half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                              static_cast<const uint16_t*>(src) + i)))
                        : _mm256_loadu_ps(static_cast<const float*>(src) + i);
    if (divide) x = _mm256_div_ps(x, vdiv);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
      for (int64_t j = i; j < i + 8; ++j)
        d[j] = float_to_half(scaled(src_half ? F16Load::load(src, j) : F32Load::load(src, j), div));
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

void to_half_f16c(const void* src, bool src_half, uint16_t* d, int64_t n, float div) {
  const int64_t n8 = n / 8 * 8;
  for_groups_of_8(
      n8, [&](int64_t lo, int64_t hi) { to_half_f16c_range(src, src_half, d, lo, hi, div); });
  for (int64_t j = n8; j < n; ++j)
    d[j] = float_to_half(scaled(src_half ? F16Load::load(src, j) : F32Load::load(src, j), div));
}

/// d[i] = scaled(half_to_float(src[i]), div) (fp16 -> fp32; exact conversion, then IEEE division).
/// NaNs need no scalar redo here: half_to_float makes them quiet with their payload, as the
/// instruction does.
__attribute__((target("avx,f16c"))) void from_half_f16c_range(const uint16_t* src, float* d,
                                                              int64_t lo, int64_t hi, float div) {
  const __m256 vdiv = _mm256_set1_ps(div);
  const bool divide = div != 1.0f;
  for (int64_t i = lo; i < hi; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    if (divide) x = _mm256_div_ps(x, vdiv);
    _mm256_storeu_ps(d + i, x);
  }
}

void from_half_f16c(const uint16_t* src, float* d, int64_t n, float div) {
  const int64_t n8 = n / 8 * 8;
  for_groups_of_8(n8, [&](int64_t lo, int64_t hi) { from_half_f16c_range(src, d, lo, hi, div); });
  for (int64_t j = n8; j < n; ++j) d[j] = scaled(half_to_float(src[j]), div);
}

/// Element i of the rank-ordered fp16 sum of reduce_blocks (rounded to fp16 after every addition).
void reduce_half_scalar(const uint16_t* b, size_t nb, size_t stride, uint16_t* d, int64_t i) {
  uint16_t acc = b[i];
  for (size_t r = 1; r < nb; ++r) acc = add_f16(acc, b[r * stride + i]);
  d[i] = acc;
}

__attribute__((target("avx,f16c"))) void reduce_half_f16c_range(const uint16_t* b, size_t nb,
                                                                size_t stride, uint16_t* d,
                                                                int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; i += 8) {
    __m128i acc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
    bool nan = false;
    for (size_t r = 1; r < nb; ++r) {
      const __m256 s = _mm256_add_ps(
          _mm256_cvtph_ps(acc),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + r * stride + i))));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q)) != 0;
      acc = _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if (nan) {
      for (int64_t j = i; j < i + 8; ++j) reduce_half_scalar(b, nb, stride, d, j);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), acc);
  }
}

void reduce_half_f16c(const uint16_t* b, size_t nb, int64_t n, size_t stride, uint16_t* d) {
  const int64_t n8 = n / 8 * 8;
  for_groups_of_8(
      n8, [&](int64_t lo, int64_t hi) { reduce_half_f16c_range(b, nb, stride, d, lo, hi); });
  for (int64_t j = n8; j < n; ++j) reduce_half_scalar(b, nb, stride, d, j);
}
#endif

/// Element i of sum_widened: the widened sum rounded once, to wire_out and (cast) to out.
inline void sum_widened_one(const uint16_t* b, bool bf, size_t nb, size_t stride,
                            uint16_t* wire_out, void* out, DType out_t, int64_t i) {
  const uint16_t w = sum_widened_at(b, bf, nb, stride, i);
  if (wire_out) wire_out[i] = w;
  if (out) store_widened(w, bf, out, out_t, i);
}

#ifdef GC_HAVE_F16C_PATH
/// sum_widened of fp16 blocks for i in [lo, hi) (a multiple of 8 apart), 8 lanes at a time: the
/// same IEEE fp32 additions in rank order and the same round to nearest even as the scalar twin;
/// a group whose sum is NaN is redone by the scalar code (the instruction and float_to_half keep
/// different NaN payloads), and bf16 outputs are narrowed by the scalar cast.
__attribute__((target("avx,f16c"))) void sum_widened_f16c_range(const uint16_t* b, size_t nb,
                                                                size_t stride, uint16_t* wire_out,
                                                                void* out, DType out_t, int64_t lo,
                                                                int64_t hi) {
  for (int64_t i = lo; i < hi; i += 8) {
    __m256 acc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    for (size_t r = 1; r < nb; ++r)
      acc = _mm256_add_ps(
          acc,
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + r * stride + i))));
    if (_mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) || out_t == DType::kBFloat16) {
      for (int64_t j = i; j < i + 8; ++j)
        sum_widened_one(b, false, nb, stride, wire_out, out, out_t, j);
      continue;
    }
    const __m128i h = _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (wire_out) _mm_storeu_si128(reinterpret_cast<__m128i*>(wire_out + i), h);
    if (out_t == DType::kFloat32 && out)
      _mm256_storeu_ps(static_cast<float*>(out) + i, _mm256_cvtph_ps(h));
    else if (out)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
  }
}
#endif

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

void sum_widened(const uint16_t* b, DType wire, size_t nb, size_t count, size_t stride,
                 uint16_t* wire_out, void* out, DType out_t) {
  if (count == 0 || nb == 0) return;
  const auto n = static_cast<int64_t>(count);
  const bool bf = wire == DType::kBFloat16;
  int64_t done = 0;
#ifdef GC_HAVE_F16C_PATH
  if (!bf && have_f16c()) {
    done = n / 8 * 8;
    for_groups_of_8(done, [&](int64_t lo, int64_t hi) {
      sum_widened_f16c_range(b, nb, stride, wire_out, out, out_t, lo, hi);
    });
  }
#endif
#pragma omp parallel for schedule(static) if (n - done > (1 << 15))
  for (int64_t i = done; i < n; ++i) sum_widened_one(b, bf, nb, stride, wire_out, out, out_t, i);
}

void reduce_blocks(const void* blocks, size_t nb, size_t count, size_t stride, ElemType t,
                   void* dst) {
  if (count == 0 || nb == 0) return;
  switch (t) {
    case ElemType::kF32:
      return reduce_t<float>(blocks, nb, count, stride, dst, add_f32);
    case ElemType::kF16:
#ifdef GC_HAVE_F16C_PATH
      if (have_f16c() && nb > 1)
        return reduce_half_f16c(static_cast<const uint16_t*>(blocks), nb,
                                static_cast<int64_t>(count), stride, static_cast<uint16_t*>(dst));
#endif
      return reduce_t<uint16_t>(blocks, nb, count, stride, dst, add_f16);
    case ElemType::kBF16:
      return reduce_t<uint16_t>(blocks, nb, count, stride, dst, add_bf16);
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
#ifdef GC_HAVE_F16C_PATH
  if (have_f16c() && dt == DType::kFloat16 && st != DType::kBFloat16)
    return to_half_f16c(src, st == DType::kFloat16, static_cast<uint16_t*>(dst), n, divisor);
  if (have_f16c() && st == DType::kFloat16 && dt == DType::kFloat32)
    return from_half_f16c(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n, divisor);
#endif
  switch (st) {
    case DType::kFloat32:
      return convert_from<F32Load>(src, dst, dt, n, divisor);
    case DType::kFloat16:
      return convert_from<F16Load>(src, dst, dt, n, divisor);
    case DType::kBFloat16:
      return convert_from<BF16Load>(src, dst, dt, n, divisor);
  }
}

void convert_saturating(const float* src, void* dst, DType dt, int64_t n) {
  if (n <= 0) return;
  if (dt == DType::kFloat32) {
    if (static_cast<const void*>(src) != dst)
      std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  const bool half = dt == DType::kFloat16;
#pragma omp parallel for schedule(static) if (n > (1 << 15))
  for (int64_t i = 0; i < n; ++i) {
    const float v = saturate_for(src[i], dt);
    d[i] = half ? float_to_half(v) : float_to_bf16(v);
  }
}

}  // namespace gradcomp::kernels::cpu

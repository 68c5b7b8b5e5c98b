// SPDX-License-Identifier: Apache-2.0
// CPU twin of the fp8 family's kernels (kernels/fp8_kernels.hpp; the CUDA twin is
// kernels/cuda/fp8_cuda.cu): one block at a time, blocks spread over OpenMP threads (each block's
// result depends on that block alone, so the thread count never changes a bit).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "kernels/fp8_kernels.hpp"

namespace gradcomp::kernels::cpu {
namespace {

int fp8_threads(int64_t work) {
  const int64_t per = int64_t{1} << 15;  // below ~32K elements a thread, threads do not pay
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), work / per)));
}

/// Writes the record of the `block` values v (scale, then codes).
void encode_record(const float* v, int block, bool e5m2, uint8_t* record) {
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < block; ++j) {
    if (!is_finite_bits(v[j])) {
      finite = false;
    } else {
      const float m = v[j] < 0.0f ? -v[j] : v[j];
      amax = m > amax ? m : amax;
    }
  }
  const float s = fp8_scale(amax, finite, e5m2);
  fp8_set_record_scale(record, s);
  uint8_t* codes = record + 4;
  for (int j = 0; j < block; ++j) codes[j] = fp8_code_of(v[j], s, e5m2);
}

}  // namespace

void fp8_encode_blocks(const void* x, DType t, int64_t n, int64_t nblocks, int block, bool e5m2,
                       uint8_t* records) {
  const size_t rb = fp8_record_bytes(block);
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
#pragma omp parallel num_threads(fp8_threads(nblocks* block))
    {
      std::vector<float> v(static_cast<size_t>(block));
#pragma omp for schedule(static)
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t first = b * block;
        for (int j = 0; j < block; ++j)
          v[static_cast<size_t>(j)] = first + j < n ? Load::load(x, first + j) : 0.0f;
        encode_record(v.data(), block, e5m2, records + static_cast<size_t>(b) * rb);
      }
    }
  });
}

void fp8_sum_blocks(const uint8_t* records, int nranks, size_t rank_stride, int64_t nblocks,
                    int block, bool e5m2, float divisor, uint8_t* records_out, void* out,
                    DType out_t, int64_t n_out) {
  const size_t rb = fp8_record_bytes(block);
#pragma omp parallel num_threads(fp8_threads(nblocks* block* nranks))
  {
    std::vector<float> v(static_cast<size_t>(block));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec0 = records + static_cast<size_t>(b) * rb;
      for (int j = 0; j < block; ++j) {
        float acc = fp8_value_of(rec0[4 + j], fp8_record_scale(rec0), e5m2);
        for (int r = 1; r < nranks; ++r) {
          const uint8_t* rec = rec0 + static_cast<size_t>(r) * rank_stride;
          acc = acc + fp8_value_of(rec[4 + j], fp8_record_scale(rec), e5m2);
        }
        v[static_cast<size_t>(j)] = acc / divisor;
      }
      if (records_out != nullptr)
        encode_record(v.data(), block, e5m2, records_out + static_cast<size_t>(b) * rb);
      if (out != nullptr) {
        const int64_t first = b * block;
        const int64_t m = std::min<int64_t>(block, n_out - first);
        for (int64_t j = 0; j < m; ++j) fp8_store(out, out_t, first + j, v[static_cast<size_t>(j)]);
      }
    }
  }
}

}  // namespace gradcomp::kernels::cpu

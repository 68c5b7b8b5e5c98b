// SPDX-License-Identifier: Apache-2.0
// CPU twin of the fp8 family's kernels (kernels/fp8_kernels.hpp; the CUDA twin is
// kernels/cuda/fp8_cuda.cu): one block at a time, blocks spread over OpenMP threads (each block's
// result depends on that block alone, so the thread count never changes a bit).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "kernels/cpu/threads.hpp"
#include "kernels/fp8_kernels.hpp"

namespace gradcomp::kernels::cpu {
namespace {

/// The 256 codes' values of a format, computed once by fp8_decode (exact: a table lookup gives
/// the bits the CUDA twin computes, without the decode's branches per value).
const float* decode_table(bool e5m2) {
  static const auto make = [](bool f) {
    std::vector<float> t(256);
    for (int c = 0; c < 256; ++c)
      t[static_cast<size_t>(c)] = fp8_decode(static_cast<uint8_t>(c), f);
    return t;
  };
  static const std::vector<float> e4m3 = make(false), e5m2_table = make(true);
  return e5m2 ? e5m2_table.data() : e4m3.data();
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
#pragma omp parallel num_threads(threads_for(nblocks* block))
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
  const float* table = decode_table(e5m2);
#pragma omp parallel num_threads(threads_for(nblocks* block* nranks))
  {
    std::vector<float> v(static_cast<size_t>(block));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec0 = records + static_cast<size_t>(b) * rb;
      // rank by rank over the block (the same rank order per value as the CUDA twin's)
      const float s0 = fp8_record_scale(rec0);
      for (int j = 0; j < block; ++j) v[static_cast<size_t>(j)] = table[rec0[4 + j]] * s0;
      for (int r = 1; r < nranks; ++r) {
        const uint8_t* rec = rec0 + static_cast<size_t>(r) * rank_stride;
        const float s = fp8_record_scale(rec);
        for (int j = 0; j < block; ++j)
          v[static_cast<size_t>(j)] = v[static_cast<size_t>(j)] + table[rec[4 + j]] * s;
      }
      for (int j = 0; j < block; ++j)
        v[static_cast<size_t>(j)] = v[static_cast<size_t>(j)] / divisor;
      if (records_out != nullptr)
        encode_record(v.data(), block, e5m2, records_out + static_cast<size_t>(b) * rb);
      if (out != nullptr) {
        const int64_t first = b * block;
        const int64_t m = std::min<int64_t>(block, n_out - first);
        for (int64_t j = 0; j < m; ++j)
          store_float(out, out_t, first + j, v[static_cast<size_t>(j)]);
      }
    }
  }
}

}  // namespace gradcomp::kernels::cpu

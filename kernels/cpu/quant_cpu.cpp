// SPDX-License-Identifier: Apache-2.0
// CPU backend of the multi-bit family. The compress is one pass over memory: each block of the
// chunk (at most 8192 elements: 32 KiB of fp32, in L1/L2) is formed once (x = g + e), its scale
// taken, and its codes, packed words and new error written while it is still in cache; so a step
// moves read g + read e + write e + write codes, nothing else. Blocks are independent (OpenMP
// over blocks): the result does not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/quant_kernels.hpp"
#include "kernels/quant_math.h"

namespace gradcomp::kernels::cpu {
namespace {

using namespace quant;

constexpr int64_t kMaxBlock = 8192;

inline int threads_for(int64_t work) {
  const int64_t per = int64_t{1} << 15;  // below ~32K elements per thread, threads do not pay
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), work / per)));
}

inline void store_scale(uint8_t* area, int64_t slot, uint32_t v, bool half) {
  if (half) {
    const auto h = static_cast<uint16_t>(v);
    std::memcpy(area + 2 * slot, &h, 2);
  } else {
    std::memcpy(area + 4 * slot, &v, 4);
  }
}
inline uint32_t load_scale(const uint8_t* area, int64_t slot, bool half) {
  if (half) {
    uint16_t h;
    std::memcpy(&h, area + 2 * slot, 2);
    return h;
  }
  uint32_t v;
  std::memcpy(&v, area + 4 * slot, 4);
  return v;
}

/// Packs len codes (len a multiple of codes_per_word, or the chunk's tail) into words.
inline void pack(const uint32_t* codes, int64_t len, int bits, uint32_t* words) {
  const int per = codes_per_word(bits);
  const int64_t full = len / per;
  for (int64_t w = 0; w < full; ++w) {
    uint32_t v = 0;
    for (int k = 0; k < per; ++k) v |= codes[w * per + k] << (k * bits);
    words[w] = v;
  }
  if (full * per < len) {
    uint32_t v = 0;
    for (int64_t k = 0; full * per + k < len; ++k)
      v |= codes[full * per + k] << (static_cast<int>(k) * bits);
    words[full] = v;
  }
}

/// Compresses block b; returns the first non-finite index in it (check) or -1.
template <class Load, bool HasE>
int64_t compress_block(const void* g, const float* e_in, float* e_out, const QuantGeom& geo,
                       const QuantRng& rng, bool check, uint8_t* body, int64_t b) {
  alignas(64) float x[kMaxBlock];
  alignas(64) uint32_t code[kMaxBlock];
  const int64_t i0 = b * geo.block, len = std::min(geo.block, geo.n - i0);
  float mx = -onebit::kMaxFinite, mn = onebit::kMaxFinite, amax = 0.0f;
  uint32_t nonfinite = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float gj = Load::load(g, i0 + j);
    const float v = HasE ? onebit::compensate(gj, e_in[i0 + j]) : gj;
    x[j] = v;
    nonfinite |= static_cast<uint32_t>(!is_finite_bits(v));
    mx = v > mx ? v : mx;
    mn = v < mn ? v : mn;
    const float a = std::fabs(v);
    amax = a > amax ? a : amax;
  }
  if (check && nonfinite) {
    for (int64_t j = 0; j < len; ++j)
      if (!is_finite_bits(x[j])) return i0 + j;
  }
  uint32_t stored[2];
  const Grid grid = geo.asym ? asym_grid(mn, mx, geo.bits, geo.half, stored)
                             : sym_grid(amax, geo.bits, geo.half, stored);
  for (int k = 0; k < geo.scales_per_block(); ++k)
    store_scale(body, b * geo.scales_per_block() + k, stored[k], geo.half);
  const bool stoch = rng.stochastic;
  if (stoch) {
    // four uniforms per Philox block; i0 and the chunk's first index are multiples of 4
    const uint64_t base = stream_index(rng.role, rng.first + static_cast<uint64_t>(i0));
    for (int64_t j = 0; j < len; j += 4) {
      const Philox4 r = rng.key.block((base + static_cast<uint64_t>(j)) >> 2);
      for (int k = 0; k < 4 && j + k < len; ++k)
        code[j + k] = encode(x[j + k], grid, geo.bits, geo.asym, true, uniform_of(r.v[k]));
    }
  } else {
    for (int64_t j = 0; j < len; ++j) code[j] = encode(x[j], grid, geo.bits, geo.asym, false, 0.0f);
  }
  if (e_out) {
    for (int64_t j = 0; j < len; ++j)
      e_out[i0 + j] = saturate_f32(sub_rn(x[j], decode(code[j], grid, geo.bits, geo.asym)));
  }
  auto* words = reinterpret_cast<uint32_t*>(body + geo.codes_offset());
  pack(code, len, geo.bits, words + i0 / codes_per_word(geo.bits));
  return -1;
}

template <class Load, bool HasE>
int64_t compress_all(const void* g, const float* e_in, float* e_out, const QuantGeom& geo,
                     const QuantRng& rng, bool check, uint8_t* body) {
  const int64_t nb = geo.num_blocks();
  int64_t first_bad = INT64_MAX;
  // a block after a bad one is still compressed (an OpenMP loop does not stop early): harmless,
  // the caller drops the step; the smallest bad index is returned
#pragma omp parallel for schedule(static) num_threads(threads_for(geo.n)) reduction(min : first_bad)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t bad = compress_block<Load, HasE>(g, e_in, e_out, geo, rng, check, body, b);
    if (bad >= 0) first_bad = std::min(first_bad, bad);
  }
  return first_bad == INT64_MAX ? -1 : first_bad;
}

}  // namespace

int64_t quant_compress(const void* g, DType t, const float* e_in, float* e_out,
                       const QuantGeom& geo, const QuantRng& rng, bool check_finite,
                       uint8_t* body) {
  if (geo.n <= 0) return -1;
  int64_t r = -1;
  with_loader(t, [&](auto L) {
    using Load = decltype(L);
    r = e_in ? compress_all<Load, true>(g, e_in, e_out, geo, rng, check_finite, body)
             : compress_all<Load, false>(g, e_in, e_out, geo, rng, check_finite, body);
  });
  return r;
}

void quant_decode_average(const uint8_t* const* bodies, int count, const QuantGeom& geo,
                          float scale, float* dense) {
  const int64_t nb = geo.num_blocks();
  const int spb = geo.scales_per_block();
  const int per = codes_per_word(geo.bits);
  const int per_log2 = per == 16 ? 4 : (per == 8 ? 3 : 2);  // bits 2, 4, 8
  const uint32_t mask = (1u << geo.bits) - 1u;
#pragma omp parallel for schedule(static) num_threads(threads_for(geo.n* count))
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) float acc[kMaxBlock];
    const int64_t i0 = b * geo.block, len = std::min(geo.block, geo.n - i0);
    std::fill(acc, acc + len, 0.0f);
    // the P payloads summed in rank order (every rank gets the same bits)
    for (int p = 0; p < count; ++p) {
      uint32_t stored[2] = {0, 0};
      for (int k = 0; k < spb; ++k) stored[k] = load_scale(bodies[p], b * spb + k, geo.half);
      const Grid grid = read_grid(stored, geo.asym, geo.half);
      const auto* words = reinterpret_cast<const uint32_t*>(bodies[p] + geo.codes_offset());
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = i0 + j;
        const uint32_t c = (words[i >> per_log2] >> ((i & (per - 1)) * geo.bits)) & mask;
        acc[j] = add_rn(acc[j], decode(c, grid, geo.bits, geo.asym));
      }
    }
    bool finite = true;
    for (int64_t j = 0; j < len; ++j) {
      const float v = mul_rn(scale, acc[j]);
      dense[i0 + j] = v;
      finite &= is_finite_bits(v);
    }
    if (finite) continue;
    // an fp32 sum of finite decodes overflowed: that element again in double, saturated (the
    // others keep their fp32 bits)
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = i0 + j;
      if (is_finite_bits(dense[i])) continue;
      double sum = 0.0;
      for (int p = 0; p < count; ++p) {
        uint32_t stored[2] = {0, 0};
        for (int k = 0; k < spb; ++k) stored[k] = load_scale(bodies[p], b * spb + k, geo.half);
        const Grid grid = read_grid(stored, geo.asym, geo.half);
        const auto* words = reinterpret_cast<const uint32_t*>(bodies[p] + geo.codes_offset());
        const uint32_t c = (words[i >> per_log2] >> ((i & (per - 1)) * geo.bits)) & mask;
        sum += static_cast<double>(decode(c, grid, geo.bits, geo.asym));
      }
      dense[i] = onebit::decode_wide(0.0f, scale, sum, false);
    }
  }
}

}  // namespace gradcomp::kernels::cpu

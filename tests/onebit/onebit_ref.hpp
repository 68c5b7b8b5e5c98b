// SPDX-License-Identifier: Apache-2.0
// Plain scalar references of the 1-bit family for the tests: written from the definitions
// (bit order, column means, L1 / L2 scales, error feedback), independent of kernels/.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gradcomp/onebit.hpp"

namespace gradcomp::test {

/// Scales of x (R x C row-major) for a configuration, computed in double.
inline std::vector<float> ref_scales(const std::vector<float>& x, int64_t R, int64_t C,
                                     const OneBitConfig& cfg) {
  const int64_t n = R * C;
  std::vector<float> s;
  if (cfg.scaling == OneBitScaling::kColumnMeans) {
    if (n == 0) return s;
    s.assign(static_cast<size_t>(2 * C), 0.0f);
    for (int64_t c = 0; c < C; ++c) {
      double sp = 0, sn = 0;
      int64_t cp = 0, cn = 0;
      for (int64_t r = 0; r < R; ++r) {
        const float v = x[r * C + c];
        if (v >= 0.0f) {
          sp += v;
          ++cp;
        } else {
          sn += v;
          ++cn;
        }
      }
      s[c] = cp ? static_cast<float>(sp / cp) : 0.0f;
      s[C + c] = cn ? static_cast<float>(sn / cn) : 0.0f;
    }
    return s;
  }
  const int64_t S = onebit_effective_chunk(cfg, n);
  for (int64_t b = 0; b < n; b += S) {
    const int64_t e = std::min(n, b + S);
    double acc = 0;
    for (int64_t i = b; i < e; ++i)
      acc += cfg.scaling == OneBitScaling::kSignL1 ? std::fabs(double(x[i]))
                                                   : double(x[i]) * double(x[i]);
    const double len = static_cast<double>(e - b);
    s.push_back(static_cast<float>(cfg.scaling == OneBitScaling::kSignL1 ? acc / len
                                                                         : std::sqrt(acc / len)));
  }
  return s;
}

/// Packed bits of x: element i -> word i / 32, bit i % 32, set when x >= 0.
inline std::vector<uint32_t> ref_bits(const std::vector<float>& x) {
  std::vector<uint32_t> b((x.size() + 31) / 32, 0u);
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] >= 0.0f) b[i / 32] |= 1u << (i % 32);
  return b;
}

/// Decoded value of element i from bits and (the implementation's) scales.
inline float ref_decoded(const uint32_t* bits, const float* scales, int64_t i, int64_t n, int64_t C,
                         const OneBitConfig& cfg) {
  const bool b = (bits[i / 32] >> (i % 32)) & 1u;
  if (cfg.scaling == OneBitScaling::kColumnMeans) return b ? scales[i % C] : scales[C + i % C];
  const int64_t S = onebit_effective_chunk(cfg, n);
  const float s = scales[i / S];
  return b ? s : -s;
}

/// Parsed view of a host payload.
struct View {
  PayloadHeader h;
  const uint32_t* bits;
  const float* scales;
};
inline View view_of(const uint8_t* p) {
  View v;
  std::memcpy(&v.h, p, sizeof v.h);
  v.bits = reinterpret_cast<const uint32_t*>(p + v.h.section_offset(1));
  v.scales = reinterpret_cast<const float*>(p + v.h.section_offset(2));
  return v;
}

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

}  // namespace gradcomp::test

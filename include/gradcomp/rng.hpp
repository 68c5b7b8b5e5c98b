// SPDX-License-Identifier: Apache-2.0
// Counter-based random numbers (Philox4x32-10, Salmon et al. SC'11), keyed by
// (seed, step, tensor id, index). Pure functions of their arguments: every rank, the CPU and the
// GPU draw the same numbers without sharing any state.
#pragma once

#include <cstdint>

#include "gradcomp/detail/macros.hpp"

namespace gradcomp {

struct Philox4 {
  uint32_t v[4];
};

namespace detail {
GC_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}
}  // namespace detail

/// Philox4x32 with 10 rounds on counter c and key k.
GC_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = detail::mulhilo32(0xD2511F53u, c.v[0], &hi0);
    const uint32_t lo1 = detail::mulhilo32(0xCD9E8D57u, c.v[2], &hi1);
    c = Philox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

/// The stream of random words for (seed, step, tensor_id): block b holds words 4b..4b+3.
///
/// Example:
///   gradcomp::RngKey key{seed, step, tensor_id};
///   uint32_t w = key.word(17);          // same value on every rank, CPU or CUDA
///   float u = key.uniform(17);          // in [0, 1)
struct RngKey {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t tensor_id = 0;

  GC_HD Philox4 block(uint64_t b) const {
    Philox4 c{{static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32),
               static_cast<uint32_t>(step) ^ (tensor_id * 0x85EBCA6Bu),
               static_cast<uint32_t>(step >> 32) ^ tensor_id}};
    return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }
  GC_HD uint32_t word(uint64_t i) const { return block(i >> 2).v[i & 3]; }
  /// Uniform float in [0, 1) with 24 random bits.
  GC_HD float uniform(uint64_t i) const { return (word(i) >> 8) * (1.0f / 16777216.0f); }
  /// Uniform integer in [0, n) (Lemire's multiply-shift on 64 random bits; bias < n / 2^64).
  GC_HD uint64_t below(uint64_t i, uint64_t n) const {
    const Philox4 b = block(i);
    const uint64_t r = (static_cast<uint64_t>(b.v[0]) << 32) | b.v[1];
    return GC_DEVICE_OR_HOST(__umul64hi(r, n),
                             static_cast<uint64_t>((static_cast<unsigned __int128>(r) * n) >> 64));
  }
};

}  // namespace gradcomp

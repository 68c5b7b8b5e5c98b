// SPDX-License-Identifier: Apache-2.0
// FNV-1a over the options a plan's collectives depend on. Ranks exchange it (top-k's size
// allgather) or sum its bits (random-k's consensus slots) to find a rank whose options differ,
// so that the mismatch is an error on every rank rather than an abort or a silent wrong average.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace gradcomp::detail {

class OptionsHash {
 public:
  /// Adds the bytes of a trivially copyable value (a number, a bool, an enum).
  template <class T>
  OptionsHash& add(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>, "OptionsHash::add takes plain values");
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    for (size_t i = 0; i < sizeof(T); ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
    return *this;
  }
  /// Adds every element of a range (warm-up ratios, segment sizes).
  template <class Range>
  OptionsHash& add_all(const Range& r) {
    for (const auto& v : r) add(v);
    return *this;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// Options of the top-k selection, without the compressors: what kernels/ and the top-k family
// (gradcomp/topk.hpp) share. Kernels depend on these types only, never on a compressor header.
#pragma once

#include <cstdint>

#include "gradcomp/types.hpp"

namespace gradcomp {

enum class SelectMethod : uint8_t {
  /// Exactly k elements: all with |x| above the k-th largest magnitude T, then the lowest-index
  /// elements with |x| == T (ties are broken by index). Radix select on the float bits.
  kExact = 0,
  /// DGC's sampled threshold: a strided sample (random offset from the shared RNG) estimates the
  /// threshold, one compaction pass keeps |x| >= threshold. Returns between
  /// ceil(min_fraction * k) and k elements: too many candidates are cut to exactly k by exact
  /// selection among them; too few lower the threshold and retry (max_retries), after which exact
  /// selection runs on the whole tensor.
  kSampled = 1,
};

struct SelectOptions {
  SelectMethod method = SelectMethod::kSampled;
  double sample_rate = 0.01;  ///< fraction of elements sampled, in (0, 1]
  double oversample = 1.25;   ///< candidates aimed for per wanted element, >= 1
  double min_fraction = 0.8;  ///< accept [min_fraction k, k] elements, in (0, 1]
  int max_retries = 2;        ///< threshold lowerings before falling back to exact selection
  void validate() const;
};

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<SelectMethod> {
  static constexpr const char* what = "selection method";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<SelectMethod> table[] = {{"exact", SelectMethod::kExact},
                                                     {"sampled", SelectMethod::kSampled}};
};

}  // namespace gradcomp

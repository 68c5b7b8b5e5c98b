// SPDX-License-Identifier: Apache-2.0
// How PowerSGD orthogonalizes P, without the compressor: what kernels/ and the PowerSGD family
// (gradcomp/powersgd.hpp) share. Kernels depend on these types only, never on a compressor header.
#pragma once

#include <cstdint>

#include "gradcomp/types.hpp"

namespace gradcomp {

/// How P is orthogonalized.
enum class Orthogonalization : uint8_t {
  /// Modified Gram-Schmidt fused into r + 1 passes over the n x r block (one kernel on the GPU).
  /// Supports rank <= kPowerSGDMaxGramSchmidtRank.
  kGramSchmidt = 0,
  /// Householder QR (LAPACK sgeqrf + sorgqr on the CPU, cuSOLVER geqrf + orgqr on the GPU).
  kHouseholder = 1,
  /// kGramSchmidt for rank <= 32, kHouseholder above.
  kAuto = 2,
  /// The unfused baseline: column by column, separate norm / scale / dot / axpy passes over the
  /// strided columns (how PyTorch's hook does it). CPU only; for benchmarks and cross-checks.
  kGramSchmidtUnfused = 3,
};

inline constexpr int kPowerSGDMaxGramSchmidtRank = 32;

}  // namespace gradcomp

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<Orthogonalization> {
  static constexpr const char* what = "orthogonalization";
  static constexpr std::size_t members = 4;
  static constexpr EnumName<Orthogonalization> table[] = {
      {"auto", Orthogonalization::kAuto},
      {"gram_schmidt", Orthogonalization::kGramSchmidt},
      {"householder", Orthogonalization::kHouseholder},
      {"gram_schmidt_unfused", Orthogonalization::kGramSchmidtUnfused}};
};

}  // namespace gradcomp

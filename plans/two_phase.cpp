// SPDX-License-Identifier: Apache-2.0
// The two-phase allreduce's shared machinery (plans/two_phase.hpp).
#include "plans/two_phase.hpp"

#include <cstring>

#include "gradcomp/error.hpp"
#include "kernels/reduce_kernels.hpp"

namespace gradcomp::detail {

int64_t two_phase_chunk_elems(int64_t numel, int world, int64_t unit) {
  const int64_t words = (numel + 31) / 32;
  const int64_t per = (words + world - 1) / world * 32;
  return (per + unit - 1) / unit * unit;
}

TwoPhaseSource two_phase_rotate(const kernels::Exec& ex, const TensorView& grad, bool in_place,
                                Buffer& scratch, int64_t S, bool check,
                                kernels::SelectWorkspace& ws) {
  namespace k = kernels;
  const int64_t n = grad.numel;
  float* r;
  if (in_place && grad.dtype == DType::kFloat32) {
    r = static_cast<float*>(grad.data);
  } else {
    r = scratch.get<float>(static_cast<size_t>(n));
    k::convert({ex.device, ex.stream}, grad.data, grad.dtype, r, DType::kFloat32, n, 1.0f);
  }
  k::hadamard_rotate(ex, r, n / S, S, 0, false);
  TwoPhaseSource s;
  s.data = r;
  if (check) {
    const int64_t big = k::first_nonfinite(ex, r, DType::kFloat32, n, ws);
    if (big >= 0) {
      s.bad = big;
      s.what = cat("gradient values too large to rotate (block ", big / S,
                   " overflows fp32; |g| must stay below about 3.4e38 / ", S, ")");
    }
  }
  return s;
}

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// The checkpoint layout top-k and random-k share, resharded for another world size.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "compressors/sparsify_state.hpp"
#include "core/state_io.hpp"

namespace gradcomp {

// Top-k and random-k keep the same state (TopKCompressor::state_dict above): numel, step, then
// SparsifyState::save. Every rank's residual and momentum add to the average with weight 1/P;
// giving every rank of the new job their mean keeps both sums over ranks / P (what the residuals
// will still send, the momenta's future contribution) as they were.
std::vector<uint8_t> detail::reshard_sparsify_state(const std::vector<std::vector<uint8_t>>& states,
                                                    const std::string& kind) {
  RankStates rs(states, kind);
  const auto numel = rs.same<int64_t>("numel");
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40), "state_dict: numel ", numel,
               " out of range");
  const auto step = rs.same<int64_t>("step");
  GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ", step,
               " out of range");
  const auto has_u = rs.same<uint8_t>("has_momentum");
  GC_CHECK_ARG(has_u <= 1, "state_dict: bad has_momentum flag ", int(has_u));
  const auto tensor_id = rs.same<uint32_t>("tensor_id");
  const std::vector<float> v = rs.mean("residual", numel);
  std::vector<float> u;
  if (has_u) u = rs.mean("momentum", numel);
  rs.finish();
  StateWriter w(kind);
  w.put<int64_t>(numel);
  w.put<int64_t>(step);
  w.put<uint8_t>(has_u);
  w.put<uint32_t>(tensor_id);
  w.put_floats(v);
  if (has_u) w.put_floats(u);
  return w.take();
}

}  // namespace gradcomp

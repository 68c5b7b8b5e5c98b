// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: what a multi-bit plan does with the chunks a peer sends it. Rank 0 of a
// 2-rank QuantPlan (fuzz_common.hpp, quant_config) takes a step whose peer chunks are
// the input: the worker chunk it receives in the all-to-all (first block_bytes() bytes) and the
// averaged chunk of the allgather (the next ones; short input is zero-padded, as a driver always
// delivers whole chunks). Properties: the step either fails with InvalidArgument and leaves the
// state byte for byte as it was, or ends skipped (a peer flagged a bad gradient: the average is
// all NaN, the state unchanged) or kept with a finite average and a state that loads again
// (finite errors).
#include <cmath>
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"
#include "plans/quant_plan.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t n = fuzz::kNumel;
  QuantPlan plan(fuzz::quant_config(), n, 2, 0);
  const std::vector<uint8_t> before = plan.state_dict();
  std::vector<float> g;
  try {
    fuzz::quant_step_with_peer(plan, data, size, g);
  } catch (const InvalidArgument&) {
    fuzz::require(plan.state_dict() == before, "a refused chunk changed the state");
    return 0;
  }
  if (plan.skipped()) {
    fuzz::require(plan.state_dict() == before, "a skipped step changed the state");
    for (float v : g) fuzz::require(std::isnan(v), "a skipped step left a non-NaN average");
    return 0;
  }
  for (float v : g) fuzz::require(std::isfinite(v), "an accepted step averaged to Inf / NaN");
  const std::vector<uint8_t> after = plan.state_dict();
  QuantPlan check(fuzz::quant_config(), n, 2, 0);
  try {
    check.load_state_dict(after.data(), after.size());
  } catch (const InvalidArgument&) {
    fuzz::fail("an accepted step left a state that does not load (non-finite errors)");
  }
  return 0;
}

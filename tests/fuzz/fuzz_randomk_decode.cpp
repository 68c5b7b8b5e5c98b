// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: RandomKCompressor::decode_add on arbitrary bytes. The step in the header
// (aux) selects the density through the warm-up schedule and seeds the index draw, so it is
// untrusted input too. Properties: rejected with InvalidArgument/CorruptPayload and the output
// untouched, or accepted with at most `count` output elements changed.
#include <cstdint>
#include <vector>

#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static RandomKCompressor comp(fuzz::randomk_config(), fuzz::kNumel);
  const fuzz::Aligned in(data, size);
  std::vector<float> dense(fuzz::kNumel, fuzz::kCanary);
  try {
    comp.decode_add(in.data(), in.size, TensorView::cpu(dense.data(), fuzz::kNumel), 1.0f);
  } catch (const InvalidArgument&) {
    fuzz::require(fuzz::changed(dense) == 0, "a rejected payload changed the output");
    return 0;
  }
  const PayloadHeader h = parse_header(in.data(), in.size);
  fuzz::require(h.kind == uint8_t(PayloadKind::kRandomK) && h.tensor_id == fuzz::kTensorId,
                "a payload of another kind or tensor was decoded");
  fuzz::require(fuzz::changed(dense) <= static_cast<int64_t>(h.count),
                "more output elements changed than the payload holds");
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: TopKCompressor::decode_add on arbitrary bytes (a payload from a peer).
// Properties: it throws InvalidArgument/CorruptPayload and leaves the output untouched, or it
// accepts a payload whose header parses and changes at most `count` output elements.
#include <cstdint>
#include <vector>

#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static TopKCompressor comp(fuzz::topk_config(), fuzz::kNumel);
  const fuzz::Aligned in(data, size);
  std::vector<float> dense(fuzz::kNumel, fuzz::kCanary);
  try {
    comp.decode_add(in.data(), in.size, TensorView::cpu(dense.data(), fuzz::kNumel), 1.0f);
  } catch (const InvalidArgument&) {
    fuzz::require(fuzz::changed(dense) == 0, "a rejected payload changed the output");
    return 0;
  }
  const PayloadHeader h = parse_header(in.data(), in.size);  // throws (a crash) if not valid
  fuzz::require(h.kind == uint8_t(PayloadKind::kSparse) && h.tensor_id == fuzz::kTensorId,
                "a payload of another kind or tensor was decoded");
  fuzz::require(fuzz::changed(dense) <= static_cast<int64_t>(h.count),
                "more output elements changed than the payload holds");
  return 0;
}

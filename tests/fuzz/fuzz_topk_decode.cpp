// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: TopKCompressor::decode_add on arbitrary bytes (a payload from a peer).
// Properties: it throws InvalidArgument/CorruptPayload and leaves the output untouched, or it
// accepts a payload whose header parses and changes at most `count` output elements.
#include <cstdint>

#include "fuzz_common.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static TopKCompressor comp(fuzz::topk_config(), fuzz::kNumel);
  return fuzz::sparse_decode_add(comp, PayloadKind::kSparse, data, size);
}

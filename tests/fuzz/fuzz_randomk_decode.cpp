// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: RandomKCompressor::decode_add on arbitrary bytes. The step in the header
// (aux) selects the density through the warm-up schedule and seeds the index draw, so it is
// untrusted input too. Properties: rejected with InvalidArgument/CorruptPayload and the output
// untouched, or accepted with at most `count` output elements changed.
#include <cstdint>

#include "fuzz_common.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static RandomKCompressor comp(fuzz::randomk_config(), fuzz::kNumel);
  return fuzz::sparse_decode_add(comp, PayloadKind::kRandomK, data, size);
}

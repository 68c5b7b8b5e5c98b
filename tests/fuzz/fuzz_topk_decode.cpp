// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: TopKCompressor::decode_add on arbitrary bytes (a payload from a peer).
// Properties: it throws InvalidArgument/CorruptPayload and leaves the output untouched, or it
// accepts a payload whose header parses and changes at most `count` output elements.
#include <cstdint>

#include "fuzz_common.hpp"

using namespace gradcomp;

// Built twice: fuzz_topk_decode (values as fp32/fp16/bf16) and, with GC_FUZZ_CODED,
// fuzz_topk_coded_decode (values coded by value_bits: the multi-bit codec's body as a section).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
#ifdef GC_FUZZ_CODED
  static TopKCompressor comp(fuzz::topk_coded_config(), fuzz::kNumel);
#else
  static TopKCompressor comp(fuzz::topk_config(), fuzz::kNumel);
#endif
  return fuzz::sparse_decode_add(comp, PayloadKind::kSparse, data, size);
}

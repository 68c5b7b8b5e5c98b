// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the wire format's own parser (core/wire.cpp), for any payload kind and size.
// parse_header() must accept exactly the byte counts its header describes; decode_indices() of an
// accepted header's index section must throw CorruptPayload or return strictly ascending
// indices below numel, exactly `count` of them.
#include <cstdint>
#include <vector>

#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/wire.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Aligned in(data, size);
  PayloadHeader h;
  try {
    h = parse_header(in.data(), in.size);
  } catch (const CorruptPayload&) {
    return 0;
  }
  fuzz::require(h.total_bytes() == size, "parse_header accepted a payload of another size");
  fuzz::require(h.header_bytes == 64 && h.magic == kPayloadMagic, "bad header accepted");
  fuzz::require(h.count <= h.numel || h.kind == uint8_t(PayloadKind::kLowRank),
                "count above numel accepted");
  // An index section describes at most 8 indices per byte (a bitmap): skip headers whose count
  // could not fit (decode_indices must reject them, but needs count slots to write into).
  const uint64_t sec = h.section_bytes[0];
  if (h.count > 8 * sec + 8) return 0;
  std::vector<uint32_t> idx(static_cast<size_t>(h.count) + 1, 0xFFFFFFFFu);
  try {
    decode_indices(in.data() + h.section_offset(0), sec, IndexCoding(h.index_coding), h.count,
                   h.numel, idx.data());
  } catch (const CorruptPayload&) {
    return 0;
  }
  for (uint64_t i = 0; i < h.count; ++i) {
    fuzz::require(idx[i] < h.numel, "decoded index out of range");
    fuzz::require(i == 0 || idx[i] > idx[i - 1], "decoded indices not strictly ascending");
  }
  fuzz::require(idx[h.count] == 0xFFFFFFFFu, "decode_indices wrote more than count indices");
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
// The self-describing wire format of every compressed payload.
//
// Layout (little-endian): a 64-byte PayloadHeader, then up to three sections, each starting at an
// 8-byte aligned offset: [0] indices, [1] values, [2] extra (scales, factors, ...).
// section_bytes[i] is the unpadded length. A payload is untrusted input: parse_header() checks
// every structural field against the byte count before anything reads a section.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/tensor.hpp"

namespace gradcomp {

inline constexpr uint32_t kPayloadMagic = 0x504D4347u;  // "GCMP"
inline constexpr uint16_t kPayloadVersion = 1;

/// What a payload encodes; decoders check it.
enum class PayloadKind : uint8_t {
  kSparse = 1,   ///< top-k family: indices + values
  kRandomK = 2,  ///< random-k: values only, indices regenerated from (seed, step, tensor id)
  kOneBit = 3,   ///< 1-bit family: scales + packed bits
  kLowRank = 4,  ///< PowerSGD factors
  kDense = 5,    ///< uncompressed or cast values
};

/// How a sparse payload stores its indices (ascending, distinct).
enum class IndexCoding : uint8_t {
  kNone = 0,         ///< no index section
  kRaw32 = 1,        ///< uint32 per index
  kDeltaVarint = 2,  ///< first index then gaps-1, each as LEB128 varint
  kBitmap = 3,       ///< ceil(numel / 8) bytes, bit i%8 of byte i/8 set when i is present
};

const char* payload_kind_name(PayloadKind k);

/// PayloadHeader::flags: the sender's gradient held NaN or Inf, so the payload carries no data of
/// it and the step is skipped on every rank (OnNonFinite, gradcomp/plan.hpp).
inline constexpr uint8_t kPayloadSkipped = 1;
/// PayloadHeader::flags, top-k's one-collective exchange only: the payload is longer than the
/// bound it was padded to, so only its header was sent (the plan gathers the payloads again).
inline constexpr uint8_t kPayloadOverflow = 2;

struct PayloadHeader {
  uint32_t magic = kPayloadMagic;
  uint16_t version = kPayloadVersion;
  uint16_t header_bytes = 64;
  uint8_t kind = 0;          ///< PayloadKind
  uint8_t value_dtype = 0;   ///< DType of the values section
  uint8_t index_coding = 0;  ///< IndexCoding
  uint8_t flags = 0;         ///< kPayloadSkipped, kPayloadOverflow or 0
  uint32_t tensor_id = 0;
  uint64_t numel = 0;  ///< dense element count of the tensor
  uint64_t count = 0;  ///< number of encoded elements (k for sparse)
  uint64_t section_bytes[3] = {0, 0, 0};
  uint64_t aux = 0;  ///< kind-specific (random-k: the step)

  static constexpr size_t align(size_t b) { return (b + 7) / 8 * 8; }
  size_t section_offset(int i) const {
    size_t off = 64;
    for (int j = 0; j < i; ++j) off += align(section_bytes[j]);
    return off;
  }
  size_t total_bytes() const { return section_offset(3); }
};
static_assert(sizeof(PayloadHeader) == 64, "the header is 64 bytes on the wire");

/// Reads and validates the structural fields of a payload held in host memory: magic, version,
/// header size, kind, value dtype, index coding, count <= numel, and that the sections add up to
/// exactly `nbytes`. Throws CorruptPayload saying which field is wrong.
PayloadHeader parse_header(const void* host_bytes, size_t nbytes);

/// Bytes of a LEB128 varint.
inline int varint_size(uint32_t v) {
  return v < (1u << 7) ? 1 : v < (1u << 14) ? 2 : v < (1u << 21) ? 3 : v < (1u << 28) ? 4 : 5;
}

/// Picks the smallest index coding for `count` ascending indices in [0, numel) and returns its
/// section size. `delta_bytes` is the varint size of the gaps (computed by the caller's pass).
IndexCoding choose_index_coding(uint64_t numel, uint64_t count, uint64_t delta_bytes,
                                uint64_t* section_bytes);

/// Encodes ascending, distinct indices with the given coding into `out` (section_bytes long).
void encode_indices(const uint32_t* idx, uint64_t count, uint64_t numel, IndexCoding coding,
                    uint8_t* out);
/// Size in bytes of the delta-varint coding of ascending indices.
uint64_t delta_varint_bytes(const uint32_t* idx, uint64_t count);
/// Decodes and validates an index section: strictly ascending, < numel, exactly `count` of them.
/// Throws CorruptPayload otherwise.
void decode_indices(const uint8_t* in, uint64_t in_bytes, IndexCoding coding, uint64_t count,
                    uint64_t numel, uint32_t* idx_out);

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
#include "gradcomp/wire.hpp"

#include <bit>
#include <cstdint>
#include <cstring>

namespace gradcomp {

const char* payload_kind_name(PayloadKind k) {
  switch (k) {
    case PayloadKind::kSparse:
      return "sparse";
    case PayloadKind::kRandomK:
      return "random-k";
    case PayloadKind::kOneBit:
      return "one-bit";
    case PayloadKind::kLowRank:
      return "low-rank";
    case PayloadKind::kDense:
      return "dense";
  }
  return "unknown";
}

PayloadHeader parse_header(const void* host_bytes, size_t nbytes) {
  GC_CHECK_PAYLOAD(host_bytes != nullptr || nbytes == 0, "null payload pointer");
  GC_CHECK_PAYLOAD(nbytes >= sizeof(PayloadHeader), "payload has ", nbytes,
                   " bytes, fewer than the 64-byte header");
  PayloadHeader h;
  std::memcpy(&h, host_bytes, sizeof h);
  GC_CHECK_PAYLOAD(h.magic == kPayloadMagic, "bad magic 0x", detail::hex(h.magic), " (expected 0x",
                   detail::hex(kPayloadMagic), ")");
  GC_CHECK_PAYLOAD(h.version == kPayloadVersion, "unsupported version ", h.version,
                   " (this build reads version ", kPayloadVersion, ")");
  GC_CHECK_PAYLOAD(h.header_bytes == 64, "header size field is ", h.header_bytes, ", expected 64");
  GC_CHECK_PAYLOAD(h.kind >= 1 && h.kind <= 5, "unknown payload kind ", int(h.kind));
  GC_CHECK_PAYLOAD(dtype_valid(h.value_dtype), "unknown value dtype code ", int(h.value_dtype));
  GC_CHECK_PAYLOAD(h.index_coding <= 3, "unknown index coding ", int(h.index_coding));
  GC_CHECK_PAYLOAD(h.numel < (uint64_t{1} << 40), "element count ", h.numel, " is implausible");
  GC_CHECK_PAYLOAD(h.count <= h.numel || h.kind == uint8_t(PayloadKind::kLowRank), "count ",
                   h.count, " exceeds element count ", h.numel);
  for (int i = 0; i < 3; ++i)
    GC_CHECK_PAYLOAD(h.section_bytes[i] <= nbytes, "section ", i, " claims ", h.section_bytes[i],
                     " bytes of a ", nbytes, "-byte payload");
  GC_CHECK_PAYLOAD(h.total_bytes() == nbytes, "sections add up to ", h.total_bytes(),
                   " bytes but the payload has ", nbytes, " (truncated or padded)");
  return h;
}

uint64_t delta_varint_bytes(const uint32_t* idx, uint64_t count) {
  uint64_t b = 0;
  uint32_t prev = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const uint32_t gap = i == 0 ? idx[0] : idx[i] - prev - 1;
    b += static_cast<uint64_t>(varint_size(gap));
    prev = idx[i];
  }
  return b;
}

IndexCoding choose_index_coding(uint64_t numel, uint64_t count, uint64_t delta_bytes,
                                uint64_t* section_bytes) {
  const uint64_t raw = 4 * count, bitmap = (numel + 7) / 8;
  if (count == 0) {
    *section_bytes = 0;
    return IndexCoding::kRaw32;
  }
  if (bitmap <= raw && bitmap <= delta_bytes) {
    *section_bytes = bitmap;
    return IndexCoding::kBitmap;
  }
  if (delta_bytes < raw) {
    *section_bytes = delta_bytes;
    return IndexCoding::kDeltaVarint;
  }
  *section_bytes = raw;
  return IndexCoding::kRaw32;
}

void encode_indices(const uint32_t* idx, uint64_t count, uint64_t numel, IndexCoding coding,
                    uint8_t* out) {
  switch (coding) {
    case IndexCoding::kNone:
      return;
    case IndexCoding::kRaw32:
      if (count > 0) std::memcpy(out, idx, 4 * count);  // empty: out and idx may be null
      return;
    case IndexCoding::kBitmap:
      std::memset(out, 0, (numel + 7) / 8);
      for (uint64_t i = 0; i < count; ++i) out[idx[i] >> 3] |= uint8_t(1u << (idx[i] & 7));
      return;
    case IndexCoding::kDeltaVarint: {
      uint32_t prev = 0;
      for (uint64_t i = 0; i < count; ++i) {
        uint32_t gap = i == 0 ? idx[0] : idx[i] - prev - 1;
        prev = idx[i];
        while (gap >= 0x80u) {
          *out++ = uint8_t(gap | 0x80u);
          gap >>= 7;
        }
        *out++ = uint8_t(gap);
      }
      return;
    }
  }
}

void decode_indices(const uint8_t* in, uint64_t in_bytes, IndexCoding coding, uint64_t count,
                    uint64_t numel, uint32_t* idx_out) {
  switch (coding) {
    case IndexCoding::kNone:
      GC_CHECK_PAYLOAD(count == 0, "no index section for ", count, " values");
      return;
    case IndexCoding::kRaw32: {
      GC_CHECK_PAYLOAD(in_bytes == 4 * count, "raw index section has ", in_bytes,
                       " bytes, expected 4 * ", count);
      if (count > 0) std::memcpy(idx_out, in, 4 * count);
      for (uint64_t i = 0; i < count; ++i) {
        GC_CHECK_PAYLOAD(idx_out[i] < numel, "index ", idx_out[i], " at position ", i,
                         " is out of range [0, ", numel, ")");
        GC_CHECK_PAYLOAD(i == 0 || idx_out[i] > idx_out[i - 1],
                         "indices not strictly ascending at position ", i);
      }
      return;
    }
    case IndexCoding::kBitmap: {
      GC_CHECK_PAYLOAD(in_bytes == (numel + 7) / 8, "bitmap section has ", in_bytes,
                       " bytes, expected ", (numel + 7) / 8);
      uint64_t c = 0;
      for (uint64_t byte = 0; byte < in_bytes; ++byte) {
        uint32_t bits = in[byte];
        while (bits) {
          const int b = std::countr_zero(bits);
          bits &= bits - 1;
          const uint64_t i = byte * 8 + static_cast<uint64_t>(b);
          GC_CHECK_PAYLOAD(i < numel, "bitmap sets bit ", i, " beyond element count ", numel);
          GC_CHECK_PAYLOAD(c < count, "bitmap has more than the ", count, " indices announced");
          idx_out[c++] = static_cast<uint32_t>(i);
        }
      }
      GC_CHECK_PAYLOAD(c == count, "bitmap has ", c, " indices, header announces ", count);
      return;
    }
    case IndexCoding::kDeltaVarint: {
      uint64_t pos = 0;
      uint64_t prev = 0;
      for (uint64_t i = 0; i < count; ++i) {
        uint64_t gap = 0;
        int shift = 0;
        for (;;) {
          GC_CHECK_PAYLOAD(pos < in_bytes, "delta index section ends inside index ", i);
          GC_CHECK_PAYLOAD(shift <= 28, "varint too long at index ", i);
          const uint8_t b = in[pos++];
          gap |= uint64_t(b & 0x7fu) << shift;
          shift += 7;
          if (!(b & 0x80u)) break;
        }
        const uint64_t v = i == 0 ? gap : prev + 1 + gap;
        GC_CHECK_PAYLOAD(v < numel, "index ", v, " at position ", i, " is out of range [0, ", numel,
                         ")");
        // indices are 32-bit: a header claiming more elements must not let one wrap around
        GC_CHECK_PAYLOAD(v <= UINT32_MAX, "index ", v, " at position ", i,
                         " does not fit the 32-bit index type");
        idx_out[i] = static_cast<uint32_t>(v);
        prev = v;
      }
      GC_CHECK_PAYLOAD(pos == in_bytes, "delta index section has ", in_bytes - pos,
                       " trailing bytes");
      return;
    }
  }
  GC_CHECK_PAYLOAD(false, "unknown index coding ", int(coding));
}

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// CRC-32C (Castagnoli): the checksum of saved compressor state (core/state_io.hpp).
//
// Parameters (the "CRC-32/ISCSI" of the CRC catalogue, RFC 3720 B.4): polynomial 0x1EDC6F41
// (reflected 0x82F63B78), initial value 0xFFFFFFFF, input and output reflected, final XOR
// 0xFFFFFFFF. Check value: crc32c("123456789") = 0xE3069283.
//
// A CRC of degree 32 detects every error burst of at most 32 bits, so every single-byte change of
// a checkpoint is caught, whatever the byte and the value it takes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradcomp::detail {

/// CRC-32C of n bytes, continuing `crc` (the value of the bytes before; 0 to start), so that
/// crc32c(b, n2, crc32c(a, n1)) == crc32c of a then b. Uses the SSE4.2 crc32 instruction when the
/// library is compiled for it (x86-64-v2, the default), else crc32c_portable.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// The same function without special instructions (slicing-by-8 tables), for other targets and
/// for testing the fast path against.
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// The interface of single-payload compressors (top-k family, random-k, 1-bit) and their payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gradcomp/tensor.hpp"
#include "gradcomp/wire.hpp"
#include "gradcomp/workspace.hpp"

namespace gradcomp {

/// One encoded tensor: the wire bytes (header + sections) on the device of the gradient, and a
/// host copy of the header. Reused across steps: encode() grows it only when needed.
struct Payload {
  explicit Payload(Device dev = Device::kCPU) : bytes(dev) {}
  Buffer bytes;
  PayloadHeader header;
  size_t size() const { return header.total_bytes(); }
  const uint8_t* data() const { return static_cast<const uint8_t*>(bytes.data()); }
  Device device() const { return bytes.device(); }
};

/// What one encode() did; dense_bytes / payload_bytes is the exact compression ratio.
struct CompressionStats {
  int64_t step = 0;            ///< step index of the encode (0-based)
  int64_t numel = 0;           ///< elements of the tensor
  int64_t count = 0;           ///< elements sent (k for sparse)
  uint64_t dense_bytes = 0;    ///< numel * sizeof(gradient dtype)
  uint64_t payload_bytes = 0;  ///< header + all sections
  double compression_ratio() const {
    return payload_bytes ? static_cast<double>(dense_bytes) / static_cast<double>(payload_bytes)
                         : 0.0;
  }
  /// Records one encode of a `grad_dtype` tensor of `n` elements that sent `sent` of them.
  void record(int64_t at_step, int64_t n, int64_t sent, DType grad_dtype, uint64_t payload) {
    step = at_step;
    numel = n;
    count = sent;
    dense_bytes = static_cast<uint64_t>(n) * static_cast<uint64_t>(dtype_size(grad_dtype));
    payload_bytes = payload;
  }
};

/// Every compressor must:
///  - check its input (device, dtype, size, finiteness per its policy) before it changes state,
///    and throw InvalidArgument naming what was expected and what was got;
///  - write a self-describing payload (wire.hpp) that decode_add() of any compressor built with
///    the same configuration (on any rank, CPU or CUDA) turns back into the same values;
///  - validate a payload completely before decode_add() writes to `dense`;
///  - keep all its memory (residuals, momenta, step counters) in the object, saved and restored
///    exactly by state_dict() / load_state_dict().
class Compressor {
 public:
  virtual ~Compressor() = default;
  virtual std::string name() const = 0;
  /// Compresses `grad` (numel and device fixed at construction; fp32/fp16/bf16) into `out`,
  /// updating the error-feedback state and advancing the step.
  virtual void encode(const TensorView& grad, Payload& out) = 0;
  /// dense += scale * decode(payload). `payload` is on the device of `dense`; dense is fp32.
  virtual void decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                          float scale = 1.0f) = 0;
  /// Serialised state (configuration fingerprint, step, residuals, momenta).
  virtual std::vector<uint8_t> state_dict() const = 0;
  /// Restores state_dict(); throws InvalidArgument on a layout mismatch and then changes nothing.
  virtual void load_state_dict(const uint8_t* data, size_t nbytes) = 0;
  virtual int64_t step() const = 0;
  virtual int64_t numel() const = 0;
  virtual Device device() const = 0;
  virtual const CompressionStats& last_stats() const = 0;
};

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// What the top-k and random-k codecs share: DGC's state around the selection (SparsifyState:
// residual, momentum, their accumulation and the taking of the chosen values) and the payload
// helpers. Internal to the library; the codecs are in topk_codec.cpp and randomk_codec.cpp, the
// state's declared layout (core/state_schema.hpp) in sparsify_state.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "compressors/checks.hpp"
#include "core/state_io.hpp"
#include "gradcomp/topk.hpp"
#include "gradcomp/wire.hpp"
#include "kernels/topk_kernels.hpp"
#include "kernels/topk_math.h"

namespace gradcomp::detail {

namespace k = kernels;

inline void check_finite(const TensorView& g, uint32_t tid, const char* who,
                         k::SelectWorkspace& ws) {
  const int64_t bad = k::first_nonfinite({g.device, g.stream}, g.data, g.dtype, g.numel, ws);
  GC_CHECK_ARG(bad < 0, who, " tensor ", tid,
               ": gradient has a non-finite value (NaN or Inf) at "
               "index ",
               bad, "; nothing was changed (disable check_finite to skip this test)");
}

/// Reads the header of a payload on any device into host memory and validates its structure.
inline PayloadHeader read_header(const void* payload, size_t nbytes, Device dev, void* stream) {
  GC_CHECK_PAYLOAD(nbytes >= sizeof(PayloadHeader), "payload has ", nbytes,
                   " bytes, fewer than the 64-byte header");
  GC_CHECK_PAYLOAD(payload != nullptr, "null payload pointer");
  if (dev == Device::kCPU) return parse_header(payload, nbytes);
  uint8_t host[sizeof(PayloadHeader)];
  device_copy(host, Device::kCPU, payload, dev, sizeof host, stream);
  // parse_header only reads the 64 header bytes, and checks the sizes against nbytes
  return parse_header(host, nbytes);
}

/// What decode_add of either family checks first: the output (check_dense), then the payload's
/// header: its structure (read_header), its kind (`kind_what`: how the message names it) and its
/// numel. Returns the header.
inline PayloadHeader read_decode_header(const void* payload, size_t nbytes, const TensorView& dense,
                                        int64_t numel, PayloadKind kind, const char* kind_what,
                                        const char* who, Device dev, void* stream) {
  check_dense(dense, numel, dev, who);
  const PayloadHeader h = read_header(payload, nbytes, dev, stream);
  GC_CHECK_PAYLOAD(h.kind == uint8_t(kind), "expected ", kind_what, " payload, got ",
                   payload_kind_name(PayloadKind(h.kind)));
  GC_CHECK_PAYLOAD(h.numel == static_cast<uint64_t>(numel), "payload is for ", h.numel,
                   " elements, the output has ", numel);
  return h;
}

inline void write_header(Payload& out, Device dev, void* stream) {
  // the alignment padding after each section is zeroed, so equal payloads are equal bytes
  const PayloadHeader& h = out.header;
  auto* base = static_cast<uint8_t*>(out.bytes.data());
  for (int i = 0; i < 3; ++i) {
    const size_t end = h.section_offset(i) + h.section_bytes[i];
    const size_t pad = PayloadHeader::align(h.section_bytes[i]) - h.section_bytes[i];
    if (pad) device_zero(dev, base + end, pad, stream);
  }
  if (dev == Device::kCPU) {
    std::memcpy(out.bytes.data(), &out.header, sizeof(PayloadHeader));
  } else {
    device_copy(out.bytes.data(), dev, &out.header, Device::kCPU, sizeof(PayloadHeader), stream);
  }
}

inline void prepare_payload(Payload& out, Device dev, void* stream) {
  if (out.bytes.device() != dev) out.bytes = Buffer(dev, stream);
  out.bytes.set_stream(stream);
}

/// The header (and the room) of a payload of `count` values of the value dtype (left for the
/// caller to fill) and no index section; the step's number in aux. Random-k's payloads are all
/// of this form (its indices follow from the step); a skipped payload of either family too.
inline void start_values_payload(Payload& out, PayloadKind kind, IndexCoding coding, uint8_t flags,
                                 const SparsifyConfig& cfg, int64_t numel, int64_t count,
                                 int64_t step, Device dev, void* stream) {
  prepare_payload(out, dev, stream);
  PayloadHeader& h = out.header;
  h = PayloadHeader{};
  h.kind = static_cast<uint8_t>(kind);
  h.value_dtype = static_cast<uint8_t>(cfg.value_dtype);
  h.index_coding = static_cast<uint8_t>(coding);
  h.flags = flags;
  h.tensor_id = cfg.tensor_id;
  h.numel = static_cast<uint64_t>(numel);
  h.count = static_cast<uint64_t>(count);
  h.aux = static_cast<uint64_t>(step);
  h.section_bytes[1] = static_cast<uint64_t>(count) * dtype_size(cfg.value_dtype);
  out.bytes.resize(h.total_bytes(), false);
}

/// The same, flagged kPayloadSkipped.
inline void start_skipped_payload(Payload& out, PayloadKind kind, IndexCoding coding,
                                  const SparsifyConfig& cfg, int64_t numel, int64_t count,
                                  int64_t step, Device dev, void* stream) {
  start_values_payload(out, kind, coding, kPayloadSkipped, cfg, numel, count, step, dev, stream);
}

/// DGC's state around the selection, shared by top-k and random-k: the residual v and the
/// corrected momentum u (allocated only with momentum), and the two steps that surround choosing
/// the indices: accumulate (clip, momentum correction, residual) and take (gather the chosen
/// values, clear them from v, and from u with masking).
class SparsifyState {
 public:
  SparsifyState(const SparsifyConfig& cfg, int64_t n, Device dev, void* stream)
      : cfg_(cfg),
        n_(n),
        dev_(dev),
        stream_(stream),
        u_{Buffer(dev, stream), Buffer(dev, stream)},
        v_{Buffer(dev, stream), Buffer(dev, stream)} {
    device_zero(dev, v_[0].get<float>(static_cast<size_t>(n)), n * sizeof(float), stream);
    if (cfg_.momentum > 0.0)
      device_zero(dev, u_[0].get<float>(static_cast<size_t>(n)), n * sizeof(float), stream);
  }
  /// The committed state.
  float* v() { return static_cast<float*>(v_[cur_].data()); }
  const float* v() const { return static_cast<const float*>(v_[cur_].data()); }
  float* u() { return cfg_.momentum > 0.0 ? static_cast<float*>(u_[cur_].data()) : nullptr; }
  const float* u() const {
    return cfg_.momentum > 0.0 ? static_cast<const float*>(u_[cur_].data()) : nullptr;
  }

  /// Staged: a step writes its new state into the second buffers (read the committed ones,
  /// write the others: the same traffic as in place) and commit() swaps them in; a step not
  /// committed leaves the state as it was.
  /// The second buffers start at zero: a step that writes no residual (top-k's direct path,
  /// without error feedback) commits them as they are, and a checkpoint then holds them.
  void set_staged(bool on) {
    const bool starts = on && !staged_;  // (again while staged: a staged step stays as it is)
    staged_ = on;
    if (!starts) return;
    const size_t bytes = static_cast<size_t>(n_) * sizeof(float);
    device_zero(dev_, v_[1 - cur_].get<float>(static_cast<size_t>(n_)), bytes, stream_);
    if (cfg_.momentum > 0.0)
      device_zero(dev_, u_[1 - cur_].get<float>(static_cast<size_t>(n_)), bytes, stream_);
  }
  bool staged() const { return staged_; }
  void commit() {
    if (staged_) cur_ = 1 - cur_;
  }
  void uncommit() { commit(); }  // (a swap back)
  /// A codec's commit() / uncommit() in staged mode: the state and the codec's step counter move
  /// together (commit outside staged mode is a no-op; uncommit needs staged mode).
  void commit_step(int64_t& step) {
    if (!staged_) return;
    commit();
    ++step;
  }
  void uncommit_step(int64_t& step, const char* who) {
    GC_CHECK_ARG(staged_, who, ": uncommit() needs staged mode");
    uncommit();
    --step;
  }

  /// v += (momentum-corrected) coef * g, coef from local clipping; v zeroed first without EF.
  void accumulate(const TensorView& g, k::SelectWorkspace& ws) {
    const k::Exec ex{dev_, stream_};
    float coef = 1.0f;
    if (cfg_.clip_norm > 0.0 && n_ > 0) {
      const double ss = k::sum_squares(ex, g.data, g.dtype, n_, ws);
      coef = k::clip_coefficient(std::sqrt(ss), cfg_.clip_norm);
    }
    float* vo = work_v();
    const float* vs = v();
    if (!cfg_.error_feedback) {
      device_zero(dev_, vo, n_ * sizeof(float), stream_);
      vs = vo;
    }
    if (n_ == 0) return;
    const float m = static_cast<float>(cfg_.momentum);
    k::dgc_accumulate(ex, g.data, g.dtype, n_, coef, m, cfg_.nesterov, work_u(), vo, u(), vs);
  }
  /// The residual the step being encoded works on (the committed one unless staged).
  float* work_v() { return static_cast<float*>(v_[staged_ ? 1 - cur_ : cur_].data()); }
  float* work_u() {
    return cfg_.momentum > 0.0 ? static_cast<float*>(u_[staged_ ? 1 - cur_ : cur_].data())
                               : nullptr;
  }

  /// values[j] = v[idx[j]] in the value dtype; v[idx] = 0 and, with masking (and `mask`),
  /// u[idx] = 0 (on the step's working state). With a share, values[j] is v's share of a sum
  /// over share->divisor ranks and v keeps what it did not carry (kernels' gather_and_clear).
  void take(const uint32_t* idx, int64_t c, void* values, bool mask = true,
            const k::ValueShare* share = nullptr) {
    float* mask_u = cfg_.momentum_masking && mask ? work_u() : nullptr;
    k::gather_and_clear({dev_, stream_}, work_v(), mask_u, idx, c, values, cfg_.value_dtype, share);
  }

  /// A codec's checkpoint (top-k and random-k alike, `kind` "topk" / "randomk"): the fields
  /// declared once in sparsify_state.cpp's schema (numel, step, has_momentum, tensor_id, the
  /// residual and, with momentum, the momentum), which reshard_sparsify_state reads as well.
  std::vector<uint8_t> state_dict(const char* kind, int64_t numel, int64_t step) const;
  /// Restores state_dict() whole or, with InvalidArgument, not at all; returns the saved step.
  int64_t load_state_dict(const char* kind, int64_t numel, const uint8_t* data, size_t nbytes);

 private:
  const SparsifyConfig cfg_;  // a copy: the base part of the owner's config
  int64_t n_;
  Device dev_;
  void* stream_;
  Buffer u_[2], v_[2];
  int cur_ = 0;
  bool staged_ = false;
};

/// Resumes top-k's or random-k's states (`kind`: "topk" / "randomk", one per rank of the saved job)
/// on another world size: every new rank gets their mean (reshard_state, gradcomp/make_plan.hpp).
std::vector<uint8_t> reshard_sparsify_state(const std::vector<std::vector<uint8_t>>& states,
                                            const std::string& kind, int world, int rank);

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// The random-k codec (RandomKCompressor): indices drawn from Philox streams shared by every rank,
// so only values travel; the bucket's small tensors are sent whole (dense_below).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compressors/checks.hpp"
#include "compressors/sparsify_state.hpp"
#include "core/state_io.hpp"
#include "gradcomp/topk.hpp"
#include "kernels/topk_kernels.hpp"
#include "kernels/topk_math.h"

namespace gradcomp {

namespace k = kernels;
using detail::check_finite;
using detail::check_grad;
using detail::read_decode_header;
using detail::SparsifyState;
using detail::start_skipped_payload;
using detail::start_values_payload;
using detail::write_header;

void RandomKConfig::validate() const {
  SparsifyConfig::validate();
  GC_CHECK_ARG(dense_below >= 0, "dense_below must be >= 0, got ", dense_below);
  for (size_t i = 0; i < segments.size(); ++i)
    GC_CHECK_ARG(segments[i] >= 0, "segment ", i, " has ", segments[i], " elements (< 0)");
}

// ------------------------------------------------------------------------------------------------
struct RandomKCompressor::Impl {
  Impl(const SparsifyConfig& cfg, int64_t n, Device dev, void* s)
      : dgc(cfg, n, dev, s), idx(dev, s), ranges(dev, s), dense_idx(dev, s), ws(dev), stream(s) {}
  SparsifyState dgc;
  Buffer idx;
  Buffer ranges;     // the sampled ranges (kernels' range_position table), when some are dense
  Buffer dense_idx;  // positions sent every step, ascending
  int64_t nranges = 0, sampled_n = 0, dense_n = 0;
  k::SelectWorkspace ws;
  void* stream;
  int device_index = 0;
  bool shared = false;  // set_shares(): values sent as shares of a sum over share.divisor ranks
  k::ValueShare share;
};

namespace {

/// The sampled ranges (merged where adjacent) and the positions sent whole of a layout.
struct RandomKLayout {
  std::vector<uint32_t> range_starts, range_positions, dense;
  int64_t sampled = 0;
};

RandomKLayout randomk_layout(const RandomKConfig& cfg, int64_t numel) {
  RandomKLayout l;
  if (cfg.segments.empty() || cfg.dense_below == 0) {
    l.sampled = numel;
    return l;
  }
  int64_t total = 0;
  for (int64_t s : cfg.segments) total += s;  // each in [0, numel] (the constructor checked)
  GC_CHECK_ARG(total == numel, "randomk: the segments hold ", total,
               " elements but the buffer has ", numel);
  int64_t off = 0;
  for (int64_t s : cfg.segments) {
    if (s < cfg.dense_below) {
      for (int64_t i = 0; i < s; ++i) l.dense.push_back(static_cast<uint32_t>(off + i));
    } else if (s > 0) {
      // this range continues the previous one when no segment sent whole lies between them
      const bool adjacent =
          !l.range_starts.empty() &&
          int64_t{l.range_positions.back()} + l.sampled - int64_t{l.range_starts.back()} == off;
      if (!adjacent) {
        l.range_starts.push_back(static_cast<uint32_t>(l.sampled));
        l.range_positions.push_back(static_cast<uint32_t>(off));
      }
      l.sampled += s;
    }
    off += s;
  }
  return l;
}

}  // namespace

RandomKCompressor::RandomKCompressor(const RandomKConfig& cfg, int64_t numel, DType grad_dtype,
                                     Device device, int device_index, void* stream)
    : cfg_(cfg), numel_(numel), device_(device) {
  cfg_.validate();
  GC_CHECK_ARG(numel >= 0 && numel < (int64_t{1} << 32), "numel must be in [0, 2^32), got ", numel);
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(grad_dtype)), "unsupported gradient dtype");
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("RandomKCompressor on CUDA");
  for (int64_t s : cfg_.segments)
    GC_CHECK_ARG(s <= numel, "randomk: a segment of ", s, " elements in a buffer of ", numel);
  const RandomKLayout l = randomk_layout(cfg_, numel);
  impl_ = std::make_unique<Impl>(cfg_, numel, device, stream);
  Impl& s = *impl_;
  s.device_index = device_index;
  s.sampled_n = l.sampled;
  s.dense_n = static_cast<int64_t>(l.dense.size());
  if (s.dense_n > 0) {
    s.nranges = static_cast<int64_t>(l.range_starts.size());
    if (s.nranges > 0) {
      uint32_t* t = s.ranges.get<uint32_t>(2 * l.range_starts.size());
      const size_t half = l.range_starts.size() * sizeof(uint32_t);
      device_copy(t, device, l.range_starts.data(), Device::kCPU, half, stream);
      device_copy(t + s.nranges, device, l.range_positions.data(), Device::kCPU, half, stream);
    }
    device_copy(s.dense_idx.get<uint32_t>(l.dense.size()), device, l.dense.data(), Device::kCPU,
                l.dense.size() * sizeof(uint32_t), stream);
  }
  stats_.numel = numel;
}

RandomKCompressor::~RandomKCompressor() = default;

int64_t RandomKCompressor::dense_numel() const { return impl_->dense_n; }

int64_t RandomKCompressor::count_at(int64_t step) const {
  return topk_count(cfg_.ratio_at(step), impl_->sampled_n) + impl_->dense_n;
}

const float* RandomKCompressor::residual() const { return impl_->dgc.v(); }
const float* RandomKCompressor::momentum_buffer() const { return impl_->dgc.u(); }

int64_t RandomKCompressor::indices_at(int64_t step, uint32_t* out) const {
  const Impl& s = *impl_;
  const int64_t ks = topk_count(cfg_.ratio_at(step), s.sampled_n);
  const RngKey key{cfg_.seed, static_cast<uint64_t>(step), cfg_.tensor_id};
  k::randomk_indices({device_, s.stream}, s.sampled_n, ks, key, out,
                     static_cast<const uint32_t*>(s.ranges.data()), s.nranges);
  if (s.dense_n > 0)
    device_copy(out + ks, device_, s.dense_idx.data(), device_,
                static_cast<size_t>(s.dense_n) * sizeof(uint32_t), s.stream);
  return ks + s.dense_n;
}

void RandomKCompressor::encode(const TensorView& g, Payload& out) {
  Impl& s = *impl_;
  check_grad(g, numel_, device_, s.device_index, cfg_.tensor_id, "randomk");
  if (cfg_.check_finite && !s.dgc.staged()) check_finite(g, cfg_.tensor_id, "randomk", s.ws);
  const int64_t n = numel_;
  s.dgc.accumulate(g, s.ws);
  const int64_t kk = count_at(step_), ks = kk - s.dense_n;
  uint32_t* idx = s.idx.get<uint32_t>(static_cast<size_t>(kk) + 1);
  indices_at(step_, idx);

  start_values_payload(out, PayloadKind::kRandomK, IndexCoding::kNone, 0, cfg_, n, kk, step_,
                       device_, s.stream);
  const PayloadHeader& h = out.header;
  auto* values = static_cast<uint8_t*>(out.bytes.data()) + h.section_offset(1);
  const k::ValueShare* share = s.shared ? &s.share : nullptr;
  s.dgc.take(idx, ks, values, /*mask=*/true, share);
  // sent every step: the momentum stays (no masking), so these elements follow SGD with momentum
  s.dgc.take(idx + ks, s.dense_n, values + ks * dtype_size(cfg_.value_dtype), /*mask=*/false,
             share);
  write_header(out, device_, s.stream);
  stats_.record(step_, n, kk, g.dtype, h.total_bytes());
  if (!s.dgc.staged()) ++step_;
}

void RandomKCompressor::set_staged(bool on) { impl_->dgc.set_staged(on); }

void RandomKCompressor::set_shares(int ranks) {
  GC_CHECK_ARG(ranks >= 1, "randomk: set_shares needs ranks >= 1, got ", ranks);
  Impl& s = *impl_;
  s.shared = ranks > 1;
  s.share.divisor = static_cast<float>(ranks);
  s.share.limit = k::share_limit(cfg_.value_dtype, ranks);
}

void RandomKCompressor::commit() { impl_->dgc.commit_step(step_); }

void RandomKCompressor::uncommit() { impl_->dgc.uncommit_step(step_, name().c_str()); }

void RandomKCompressor::encode_skipped(Payload& out) {
  Impl& s = *impl_;
  const int64_t kk = count_at(step_);
  start_skipped_payload(out, PayloadKind::kRandomK, IndexCoding::kNone, cfg_, numel_, kk, step_,
                        device_, s.stream);
  const PayloadHeader& h = out.header;
  // NaN values: summed with the other ranks' values they make every sum NaN
  device_fill_nan(device_, static_cast<uint8_t*>(out.bytes.data()) + h.section_offset(1),
                  h.section_bytes[1], s.stream);
  write_header(out, device_, s.stream);
}

void RandomKCompressor::decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                                   float scale) {
  Impl& s = *impl_;
  const PayloadHeader h = read_decode_header(payload, nbytes, dense, numel_, PayloadKind::kRandomK,
                                             "a random-k", "randomk", device_, s.stream);
  // aux is the sender's step: it picks the density (warm-up) and seeds the indices
  GC_CHECK_PAYLOAD(h.aux <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                   "random-k payload claims step ", h.aux, " (not a step count)");
  const int64_t kk = count_at(static_cast<int64_t>(h.aux));
  GC_CHECK_PAYLOAD(h.count == static_cast<uint64_t>(kk), "payload has ", h.count,
                   " values, this configuration sends ", kk, " at step ", h.aux);
  GC_CHECK_PAYLOAD(h.tensor_id == cfg_.tensor_id, "payload is for tensor ", h.tensor_id,
                   ", this compressor is tensor ", cfg_.tensor_id);
  GC_CHECK_PAYLOAD(h.index_coding == uint8_t(IndexCoding::kNone) && h.section_bytes[0] == 0 &&
                       h.section_bytes[2] == 0,
                   "random-k payloads carry values only");
  GC_CHECK_PAYLOAD(h.section_bytes[1] == h.count * dtype_size(DType(h.value_dtype)),
                   "values section has ", h.section_bytes[1], " bytes, expected ", h.count, " x ",
                   dtype_size(DType(h.value_dtype)));
  if (kk == 0) return;
  uint32_t* idx = s.idx.get<uint32_t>(static_cast<size_t>(kk) + 1);
  indices_at(static_cast<int64_t>(h.aux), idx);
  const void* values = static_cast<const uint8_t*>(payload) + h.section_offset(1);
  k::scatter_add({device_, s.stream}, idx, values, DType(h.value_dtype), kk, scale,
                 dense.as<float>());
}

std::vector<uint8_t> RandomKCompressor::state_dict() const {
  return impl_->dgc.state_dict("randomk", numel_, step_);
}

void RandomKCompressor::load_state_dict(const uint8_t* data, size_t nbytes) {
  step_ = impl_->dgc.load_state_dict("randomk", numel_, data, nbytes);
}

}  // namespace gradcomp

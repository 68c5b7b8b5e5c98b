// SPDX-License-Identifier: Apache-2.0
// Top-k / DGC and random-k compressors: state, validation, payload building. The math lives in
// kernels/; this file picks the backend by the device of the data.
#include "gradcomp/topk.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compressors/checks.hpp"
#include "core/state_io.hpp"
#include "kernels/dispatch.hpp"
#include "kernels/topk_math.h"

namespace gradcomp {

namespace k = kernels;
using detail::check_dense;
using detail::check_grad;

void SelectOptions::validate() const {
  GC_CHECK_ARG(method == SelectMethod::kExact || method == SelectMethod::kSampled,
               "unknown selection method ", int(method));
  GC_CHECK_ARG(sample_rate > 0.0 && sample_rate <= 1.0, "sample_rate must be in (0, 1], got ",
               sample_rate);
  GC_CHECK_ARG(oversample >= 1.0 && oversample <= 16.0, "oversample must be in [1, 16], got ",
               oversample);
  GC_CHECK_ARG(min_fraction > 0.0 && min_fraction <= 1.0, "min_fraction must be in (0, 1], got ",
               min_fraction);
  GC_CHECK_ARG(max_retries >= 0 && max_retries <= 16, "max_retries must be in [0, 16], got ",
               max_retries);
}

static void check_ratio(double r, const char* what) {
  GC_CHECK_ARG(std::isfinite(r) && r > 0.0 && r <= 1.0, what, " must be in (0, 1], got ", r);
}

void SparsifyConfig::validate() const {
  check_ratio(ratio, "ratio");
  GC_CHECK_ARG(std::isfinite(momentum) && momentum >= 0.0 && momentum < 1.0,
               "momentum must be in [0, 1), got ", momentum);
  GC_CHECK_ARG(std::isfinite(clip_norm) && clip_norm >= 0.0, "clip_norm must be >= 0, got ",
               clip_norm);
  GC_CHECK_ARG(warmup_ratios.empty() || warmup_steps > 0,
               "warmup_steps must be > 0 when warmup_ratios are given, got ", warmup_steps);
  GC_CHECK_ARG(warmup_steps >= 0, "warmup_steps must be >= 0, got ", warmup_steps);
  for (double r : warmup_ratios) check_ratio(r, "each warm-up ratio");
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(value_dtype)), "unsupported value dtype");
  GC_CHECK_ARG(clip_scaling == ClipScaling::kSqrtWorld || clip_scaling == ClipScaling::kNone,
               "unknown clip_scaling code ", static_cast<int>(clip_scaling));
}

void RandomKConfig::validate() const {
  SparsifyConfig::validate();
  GC_CHECK_ARG(dense_below >= 0, "dense_below must be >= 0, got ", dense_below);
  for (size_t i = 0; i < segments.size(); ++i)
    GC_CHECK_ARG(segments[i] >= 0, "segment ", i, " has ", segments[i], " elements (< 0)");
}

void TopKConfig::validate() const {
  SparsifyConfig::validate();
  select.validate();
}

double SparsifyConfig::local_clip_norm(int world) const {
  GC_CHECK_ARG(world >= 1, "world must be >= 1, got ", world);
  if (clip_scaling == ClipScaling::kNone) return clip_norm;
  return clip_norm / std::sqrt(static_cast<double>(world));
}

double SparsifyConfig::ratio_at(int64_t step) const {
  // a negative step would index warmup_ratios below 0
  GC_CHECK_ARG(step >= 0, "step must be >= 0, got ", step);
  if (!warmup_ratios.empty() && warmup_steps > 0) {
    const int64_t stage = step / warmup_steps;
    if (stage < static_cast<int64_t>(warmup_ratios.size())) return warmup_ratios[stage];
  }
  return ratio;
}

int64_t topk_count(double ratio, int64_t n) {
  if (n <= 0) return 0;
  const double c = std::ceil(ratio * static_cast<double>(n) - 1e-9);
  return std::clamp<int64_t>(static_cast<int64_t>(c), 1, n);
}

uint64_t sparse_payload_bound(int64_t count, int64_t n, DType value_dtype) {
  GC_CHECK_ARG(count >= 0 && n >= 0 && count <= n,
               "sparse_payload_bound: need 0 <= count <= n, got ", count, " and ", n);
  const auto c = static_cast<uint64_t>(count);
  const uint64_t idx = std::min<uint64_t>(4 * c, (static_cast<uint64_t>(n) + 7) / 8);
  return sizeof(PayloadHeader) + PayloadHeader::align(idx) +
         PayloadHeader::align(c * dtype_size(value_dtype));
}

int64_t topk_indices(const TensorView& x, int64_t kk, const SelectOptions& opt, const RngKey& key,
                     uint32_t* out) {
  opt.validate();
  GC_CHECK_ARG(x.dtype == DType::kFloat32, "top-k selection takes fp32, got ", x.describe());
  GC_CHECK_ARG(kk >= 0 && kk <= x.numel, "k must be in [0, n] = [0, ", x.numel, "], got ", kk);
  GC_CHECK_ARG(x.numel < (int64_t{1} << 32), "tensor has ", x.numel,
               " elements; indices are uint32 (split the tensor)");
  GC_CHECK_ARG(kk == 0 || out != nullptr, "output index pointer is null");
  k::SelectWorkspace ws(x.device);
  return k::dispatch::select({x.device, x.stream}, x.as<float>(), x.numel, kk, opt, key, out, ws);
}

namespace {

void check_finite(const TensorView& g, uint32_t tid, const char* who, k::SelectWorkspace& ws) {
  const int64_t bad =
      k::dispatch::first_nonfinite({g.device, g.stream}, g.data, g.dtype, g.numel, ws);
  GC_CHECK_ARG(bad < 0, who, " tensor ", tid,
               ": gradient has a non-finite value (NaN or Inf) at "
               "index ",
               bad, "; nothing was changed (disable check_finite to skip this test)");
}

/// Reads the header of a payload on any device into host memory and validates its structure.
PayloadHeader read_header(const void* payload, size_t nbytes, Device dev, void* stream) {
  GC_CHECK_PAYLOAD(nbytes >= sizeof(PayloadHeader), "payload has ", nbytes,
                   " bytes, fewer than the 64-byte header");
  GC_CHECK_PAYLOAD(payload != nullptr, "null payload pointer");
  if (dev == Device::kCPU) return parse_header(payload, nbytes);
  uint8_t host[sizeof(PayloadHeader)];
  device_copy(host, Device::kCPU, payload, dev, sizeof host, stream);
  // parse_header only reads the 64 header bytes, and checks the sizes against nbytes
  return parse_header(host, nbytes);
}

void write_header(Payload& out, Device dev, void* stream) {
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

void prepare_payload(Payload& out, Device dev, void* stream) {
  if (out.bytes.device() != dev) out.bytes = Buffer(dev, stream);
  out.bytes.set_stream(stream);
}

/// The header (and the room) of a payload flagged kPayloadSkipped: `count` values of the value
/// dtype (left for the caller to fill), no indices; the step's number in aux.
void start_skipped_payload(Payload& out, PayloadKind kind, IndexCoding coding,
                           const SparsifyConfig& cfg, int64_t numel, int64_t count, int64_t step,
                           Device dev, void* stream) {
  prepare_payload(out, dev, stream);
  PayloadHeader& h = out.header;
  h = PayloadHeader{};
  h.kind = static_cast<uint8_t>(kind);
  h.value_dtype = static_cast<uint8_t>(cfg.value_dtype);
  h.index_coding = static_cast<uint8_t>(coding);
  h.flags = kPayloadSkipped;
  h.tensor_id = cfg.tensor_id;
  h.numel = static_cast<uint64_t>(numel);
  h.count = static_cast<uint64_t>(count);
  h.aux = static_cast<uint64_t>(step);
  h.section_bytes[1] = static_cast<uint64_t>(count) * dtype_size(cfg.value_dtype);
  out.bytes.resize(h.total_bytes(), false);
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
  void set_staged(bool on) {
    staged_ = on;
    if (!on) return;
    v_[1 - cur_].get<float>(static_cast<size_t>(n_));
    if (cfg_.momentum > 0.0) u_[1 - cur_].get<float>(static_cast<size_t>(n_));
  }
  bool staged() const { return staged_; }
  void commit() {
    if (staged_) cur_ = 1 - cur_;
  }
  void uncommit() { commit(); }  // (a swap back)

  /// v += (momentum-corrected) coef * g, coef from local clipping; v zeroed first without EF.
  void accumulate(const TensorView& g, k::SelectWorkspace& ws) {
    const k::Exec ex{dev_, stream_};
    float coef = 1.0f;
    if (cfg_.clip_norm > 0.0 && n_ > 0) {
      const double ss = k::dispatch::sum_squares(ex, g.data, g.dtype, n_, ws);
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
    k::dispatch::dgc_accumulate(ex, g.data, g.dtype, n_, coef, m, cfg_.nesterov, work_u(), vo, u(),
                                vs);
  }
  /// The residual the step being encoded works on (the committed one unless staged).
  float* work_v() { return static_cast<float*>(v_[staged_ ? 1 - cur_ : cur_].data()); }
  float* work_u() {
    return cfg_.momentum > 0.0 ? static_cast<float*>(u_[staged_ ? 1 - cur_ : cur_].data())
                               : nullptr;
  }

  /// values[j] = v[idx[j]] in the value dtype; v[idx] = 0 and, with masking (and `mask`),
  /// u[idx] = 0 (on the step's working state).
  void take(const uint32_t* idx, int64_t c, void* values, bool mask = true) {
    float* mask_u = cfg_.momentum_masking && mask ? work_u() : nullptr;
    k::dispatch::gather_and_clear({dev_, stream_}, work_v(), mask_u, idx, c, values,
                                  cfg_.value_dtype);
  }

  void save(detail::StateWriter& w) const {
    w.put<uint8_t>(cfg_.momentum > 0.0);
    w.put<uint32_t>(cfg_.tensor_id);
    w.put_array(v(), dev_, n_ * sizeof(float), stream_);
    if (u()) w.put_array(u(), dev_, n_ * sizeof(float), stream_);
  }
  /// Reads (and checks) what save() wrote; apply() the result once the whole state is checked.
  struct Saved {
    const uint8_t* v;
    const uint8_t* u;
  };
  Saved read(detail::StateReader& r) const {
    r.expect<uint8_t>("has_momentum", cfg_.momentum > 0.0);
    r.expect<uint32_t>("tensor_id", cfg_.tensor_id);
    Saved sv{r.finite_array("residual", n_ * sizeof(float)), nullptr};
    if (u()) sv.u = r.finite_array("momentum", n_ * sizeof(float));
    return sv;
  }
  void apply(const Saved& sv) {
    device_copy(v(), dev_, sv.v, Device::kCPU, n_ * sizeof(float), stream_);
    if (sv.u) device_copy(u(), dev_, sv.u, Device::kCPU, n_ * sizeof(float), stream_);
  }

 private:
  const SparsifyConfig cfg_;  // a copy: the base part of the owner's config
  int64_t n_;
  Device dev_;
  void* stream_;
  Buffer u_[2], v_[2];
  int cur_ = 0;
  bool staged_ = false;
};

}  // namespace

// ------------------------------------------------------------------------------------------------
struct TopKCompressor::Impl {
  Impl(const SparsifyConfig& cfg, int64_t n, Device dev, void* s)
      : dgc(cfg, n, dev, s), idx(dev, s), host_idx(Device::kCPU), ws(dev), stream(s) {}
  SparsifyState dgc;
  Buffer idx, host_idx;
  k::SelectWorkspace ws;
  void* stream;
  int device_index = 0;
};

TopKCompressor::TopKCompressor(const TopKConfig& cfg, int64_t numel, DType grad_dtype,
                               Device device, int device_index, void* stream)
    : cfg_(cfg), numel_(numel), device_(device) {
  cfg_.validate();
  GC_CHECK_ARG(numel >= 0, "numel must be >= 0, got ", numel);
  GC_CHECK_ARG(numel < (int64_t{1} << 32), "tensor has ", numel,
               " elements; indices are uint32 (split the tensor)");
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(grad_dtype)), "unsupported gradient dtype");
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("TopKCompressor on CUDA");
  impl_ = std::make_unique<Impl>(cfg_, numel, device, stream);
  impl_->device_index = device_index;
  stats_.numel = numel;
}

TopKCompressor::~TopKCompressor() = default;

const float* TopKCompressor::residual() const { return impl_->dgc.v(); }

uint64_t TopKCompressor::payload_bound(int64_t step) const {
  return sparse_payload_bound(topk_count(cfg_.ratio_at(step), numel_), numel_, cfg_.value_dtype);
}
const float* TopKCompressor::momentum_buffer() const { return impl_->dgc.u(); }

void TopKCompressor::encode(const TensorView& g, Payload& out) {
  Impl& s = *impl_;
  check_grad(g, numel_, device_, s.device_index, cfg_.tensor_id, "topk");
  // staged: the plan checked the gradient itself (and told the other ranks)
  if (cfg_.check_finite && !s.dgc.staged()) check_finite(g, cfg_.tensor_id, "topk", s.ws);
  // ---- from here on the state changes ----
  const bool cuda = device_ == Device::kCUDA;
  const int64_t n = numel_;
  s.dgc.accumulate(g, s.ws);
  float* v = s.dgc.work_v();  // the step's residual (staged: not yet the state)
  const int64_t kk = topk_count(cfg_.ratio_at(step_), n);
  const RngKey key{cfg_.seed, static_cast<uint64_t>(step_), cfg_.tensor_id};
  uint32_t* idx = s.idx.get<uint32_t>(static_cast<size_t>(kk) + 1);
  const int64_t c = k::dispatch::select({device_, s.stream}, v, n, kk, cfg_.select, key, idx, s.ws);

  // ---- payload: header | indices | values ----
  prepare_payload(out, device_, s.stream);
  PayloadHeader& h = out.header;
  h = PayloadHeader{};
  h.kind = static_cast<uint8_t>(PayloadKind::kSparse);
  h.value_dtype = static_cast<uint8_t>(cfg_.value_dtype);
  h.tensor_id = cfg_.tensor_id;
  h.numel = static_cast<uint64_t>(n);
  h.count = static_cast<uint64_t>(c);
  h.aux = static_cast<uint64_t>(step_);
  uint64_t ibytes = 0;
  IndexCoding coding;
  if (cuda) {  // the GPU writes raw or bitmap indices (no serial varint pass on the device)
    const uint64_t raw = 4 * static_cast<uint64_t>(c), bm = (static_cast<uint64_t>(n) + 7) / 8;
    coding = (c > 0 && bm < raw) ? IndexCoding::kBitmap : IndexCoding::kRaw32;
    ibytes = coding == IndexCoding::kBitmap ? bm : raw;
  } else {
    coding = choose_index_coding(h.numel, h.count, delta_varint_bytes(idx, h.count), &ibytes);
  }
  h.index_coding = static_cast<uint8_t>(coding);
  h.section_bytes[0] = ibytes;
  h.section_bytes[1] = static_cast<uint64_t>(c) * dtype_size(cfg_.value_dtype);
  out.bytes.resize(h.total_bytes(), false);
  uint8_t* base = static_cast<uint8_t*>(out.bytes.data());
  void* values = base + h.section_offset(1);
  s.dgc.take(idx, c, values);
  if (cuda) {
    if (coding == IndexCoding::kBitmap)
      k::cuda::indices_to_bitmap(idx, c, n, base + h.section_offset(0), s.stream);
    else
      device_copy(base + h.section_offset(0), device_, idx, device_, ibytes, s.stream);
  } else {
    encode_indices(idx, h.count, h.numel, coding, base + h.section_offset(0));
  }
  write_header(out, device_, s.stream);

  stats_.record(step_, n, c, g.dtype, h.total_bytes());
  if (!s.dgc.staged()) ++step_;
}

void TopKCompressor::set_staged(bool on) { impl_->dgc.set_staged(on); }

void TopKCompressor::commit() {
  if (!impl_->dgc.staged()) return;
  impl_->dgc.commit();
  ++step_;
}

void TopKCompressor::uncommit() {
  GC_CHECK_ARG(impl_->dgc.staged(), name(), ": uncommit() needs staged mode");
  impl_->dgc.uncommit();
  --step_;
}

void TopKCompressor::encode_skipped(Payload& out) {
  Impl& s = *impl_;
  start_skipped_payload(out, PayloadKind::kSparse, IndexCoding::kRaw32, cfg_, numel_, 0, step_,
                        device_, s.stream);
  write_header(out, device_, s.stream);
}

void TopKCompressor::decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                                float scale) {
  Impl& s = *impl_;
  check_dense(dense, numel_, device_, "topk");
  const PayloadHeader h = read_header(payload, nbytes, device_, s.stream);
  GC_CHECK_PAYLOAD(h.kind == uint8_t(PayloadKind::kSparse),
                   "expected a sparse (top-k) payload, got ",
                   payload_kind_name(PayloadKind(h.kind)));
  GC_CHECK_PAYLOAD(h.numel == static_cast<uint64_t>(numel_), "payload is for ", h.numel,
                   " elements, the output has ", numel_);
  GC_CHECK_PAYLOAD(h.tensor_id == cfg_.tensor_id, "payload is for tensor ", h.tensor_id,
                   ", this compressor is tensor ", cfg_.tensor_id);
  GC_CHECK_PAYLOAD(h.section_bytes[1] == h.count * dtype_size(DType(h.value_dtype)),
                   "values section has ", h.section_bytes[1], " bytes, expected ", h.count, " x ",
                   dtype_size(DType(h.value_dtype)));
  GC_CHECK_PAYLOAD(h.section_bytes[2] == 0, "unexpected extra section of ", h.section_bytes[2],
                   " bytes in a sparse payload");
  if (h.count == 0) return;
  const auto* base = static_cast<const uint8_t*>(payload);
  const uint8_t* isec = base + h.section_offset(0);
  const void* values = base + h.section_offset(1);
  const IndexCoding coding = IndexCoding(h.index_coding);
  const int64_t c = static_cast<int64_t>(h.count);
  if (device_ == Device::kCPU) {
    uint32_t* idx = s.idx.get<uint32_t>(h.count);
    decode_indices(isec, h.section_bytes[0], coding, h.count, h.numel, idx);  // validates
    k::cpu::scatter_add(idx, values, DType(h.value_dtype), c, scale, dense.as<float>());
    return;
  }
  uint32_t* idx = s.idx.get<uint32_t>(h.count);
  const uint32_t* use = idx;
  switch (coding) {
    case IndexCoding::kRaw32: {
      GC_CHECK_PAYLOAD(h.section_bytes[0] == 4 * h.count, "raw index section has ",
                       h.section_bytes[0], " bytes, expected 4 x ", h.count);
      use = reinterpret_cast<const uint32_t*>(isec);
      const int64_t bad = k::cuda::check_indices(use, c, numel_, s.ws, s.stream);
      GC_CHECK_PAYLOAD(bad < 0, "index at position ", bad, " is out of range or not ascending");
      break;
    }
    case IndexCoding::kBitmap: {
      GC_CHECK_PAYLOAD(h.section_bytes[0] == (h.numel + 7) / 8, "bitmap section has ",
                       h.section_bytes[0], " bytes, expected ", (h.numel + 7) / 8);
      const int64_t got = k::cuda::bitmap_to_indices(isec, numel_, idx, c, s.ws, s.stream);
      GC_CHECK_PAYLOAD(got == c, "bitmap has ", got, " indices, header announces ", c);
      break;
    }
    case IndexCoding::kDeltaVarint: {  // made on a CPU: decode on the host, then upload
      std::vector<uint8_t> sec(h.section_bytes[0]);
      device_copy(sec.data(), Device::kCPU, isec, device_, sec.size(), s.stream);
      uint32_t* hidx = s.host_idx.get<uint32_t>(h.count);
      decode_indices(sec.data(), sec.size(), coding, h.count, h.numel, hidx);
      device_copy(idx, device_, hidx, Device::kCPU, 4 * h.count, s.stream);
      break;
    }
    default:
      GC_CHECK_PAYLOAD(false, "index coding ", int(h.index_coding),
                       " is not valid for sparse payloads");
  }
  k::cuda::scatter_add(use, values, DType(h.value_dtype), c, scale, dense.as<float>(), s.stream);
}

std::vector<uint8_t> TopKCompressor::state_dict() const {
  detail::StateWriter w("topk");
  w.put<int64_t>(numel_);
  w.put<int64_t>(step_);
  impl_->dgc.save(w);
  return w.take();
}

void TopKCompressor::load_state_dict(const uint8_t* data, size_t nbytes) {
  detail::StateReader r(data, nbytes, "topk");
  r.expect<int64_t>("numel", numel_);
  const auto step = r.get_step();
  const auto saved = impl_->dgc.read(r);
  r.finish();
  impl_->dgc.apply(saved);  // all checks passed: now overwrite
  step_ = step;
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
  k::dispatch::randomk_indices({device_, s.stream}, s.sampled_n, ks, key, out,
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

  prepare_payload(out, device_, s.stream);
  PayloadHeader& h = out.header;
  h = PayloadHeader{};
  h.kind = static_cast<uint8_t>(PayloadKind::kRandomK);
  h.value_dtype = static_cast<uint8_t>(cfg_.value_dtype);
  h.index_coding = static_cast<uint8_t>(IndexCoding::kNone);
  h.tensor_id = cfg_.tensor_id;
  h.numel = static_cast<uint64_t>(n);
  h.count = static_cast<uint64_t>(kk);
  h.aux = static_cast<uint64_t>(step_);
  h.section_bytes[1] = static_cast<uint64_t>(kk) * dtype_size(cfg_.value_dtype);
  out.bytes.resize(h.total_bytes(), false);
  auto* values = static_cast<uint8_t*>(out.bytes.data()) + h.section_offset(1);
  s.dgc.take(idx, ks, values);
  // sent every step: the momentum stays (no masking), so these elements follow SGD with momentum
  s.dgc.take(idx + ks, s.dense_n, values + ks * dtype_size(cfg_.value_dtype), /*mask=*/false);
  write_header(out, device_, s.stream);
  stats_.record(step_, n, kk, g.dtype, h.total_bytes());
  if (!s.dgc.staged()) ++step_;
}

void RandomKCompressor::set_staged(bool on) { impl_->dgc.set_staged(on); }

void RandomKCompressor::commit() {
  if (!impl_->dgc.staged()) return;
  impl_->dgc.commit();
  ++step_;
}

void RandomKCompressor::uncommit() {
  GC_CHECK_ARG(impl_->dgc.staged(), name(), ": uncommit() needs staged mode");
  impl_->dgc.uncommit();
  --step_;
}

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
  check_dense(dense, numel_, device_, "randomk");
  const PayloadHeader h = read_header(payload, nbytes, device_, s.stream);
  GC_CHECK_PAYLOAD(h.kind == uint8_t(PayloadKind::kRandomK), "expected a random-k payload, got ",
                   payload_kind_name(PayloadKind(h.kind)));
  GC_CHECK_PAYLOAD(h.numel == static_cast<uint64_t>(numel_), "payload is for ", h.numel,
                   " elements, the output has ", numel_);
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
  k::dispatch::scatter_add({device_, s.stream}, idx, values, DType(h.value_dtype), kk, scale,
                           dense.as<float>());
}

std::vector<uint8_t> RandomKCompressor::state_dict() const {
  detail::StateWriter w("randomk");
  w.put<int64_t>(numel_);
  w.put<int64_t>(step_);
  impl_->dgc.save(w);
  return w.take();
}

void RandomKCompressor::load_state_dict(const uint8_t* data, size_t nbytes) {
  detail::StateReader r(data, nbytes, "randomk");
  r.expect<int64_t>("numel", numel_);
  const auto step = r.get_step();
  const auto saved = impl_->dgc.read(r);
  r.finish();
  impl_->dgc.apply(saved);
  step_ = step;
}

// Top-k and random-k keep the same state (TopKCompressor::state_dict above): numel, step, then
// SparsifyState::save. Every rank's residual and momentum add to the average with weight 1/P;
// giving every rank of the new job their mean keeps both sums over ranks / P (what the residuals
// will still send, the momenta's future contribution) as they were.
std::vector<uint8_t> detail::reshard_sparsify_state(const std::vector<std::vector<uint8_t>>& states,
                                                    const std::string& kind) {
  RankStates rs(states, kind);
  const auto numel = rs.same<int64_t>("numel");
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40), "state_dict: numel ", numel,
               " out of range");
  const auto step = rs.same<int64_t>("step");
  GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ", step,
               " out of range");
  const auto has_u = rs.same<uint8_t>("has_momentum");
  GC_CHECK_ARG(has_u <= 1, "state_dict: bad has_momentum flag ", int(has_u));
  const auto tensor_id = rs.same<uint32_t>("tensor_id");
  const std::vector<float> v = rs.mean("residual", numel);
  std::vector<float> u;
  if (has_u) u = rs.mean("momentum", numel);
  rs.finish();
  StateWriter w(kind);
  w.put<int64_t>(numel);
  w.put<int64_t>(step);
  w.put<uint8_t>(has_u);
  w.put<uint32_t>(tensor_id);
  w.put_floats(v);
  if (has_u) w.put_floats(u);
  return w.take();
}

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The top-k / DGC codec (TopKCompressor) and the selection options and sizes it shares with the
// plans: configuration checks, validation, payload building. The math lives in kernels/; the
// backend is picked by the device of the data.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compressors/checks.hpp"
#include "compressors/sparsify_state.hpp"
#include "core/state_io.hpp"
#include "gradcomp/topk.hpp"
#include "kernels/quant_kernels.hpp"
#include "kernels/topk_kernels.hpp"
#include "kernels/topk_math.h"

namespace gradcomp {

namespace k = kernels;
using detail::check_finite;
using detail::check_grad;
using detail::prepare_payload;
using detail::read_decode_header;
using detail::SparsifyState;
using detail::start_skipped_payload;
using detail::write_header;

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

/// The smallest ratio taken: below it k = ceil(ratio n) is 1 for every bucket of up to a million
/// elements, so the ratio would not say what is sent (a slip of the exponent, 1e-12 for 1e-2,
/// would silently send one element a bucket).
constexpr double kMinRatio = 1e-6;

static void check_ratio(double r, const char* what) {
  GC_CHECK_ARG(std::isfinite(r) && r >= kMinRatio && r <= 1.0, what, " must be in [", kMinRatio,
               ", 1], got ", r);
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
  for (double r : warmup_ratios) check_ratio(r, "each of warmup_ratios");
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(value_dtype)), "unsupported value dtype");
  GC_CHECK_ARG(clip_scaling == ClipScaling::kSqrtWorld || clip_scaling == ClipScaling::kNone,
               "unknown clip_scaling code ", static_cast<int>(clip_scaling));
}

void TopKConfig::validate() const {
  SparsifyConfig::validate();
  select.validate();
  GC_CHECK_ARG(value_bits == 0 || value_bits == 2 || value_bits == 4 || value_bits == 8,
               "value_bits must be 0 (values as value_dtype), 2, 4 or 8, got ", value_bits);
  GC_CHECK_ARG(value_block >= 32 && value_block <= 8192 && (value_block & (value_block - 1)) == 0,
               "value_block must be a power of two in [32, 8192], got ", value_block);
  GC_CHECK_ARG(value_bits == 0 || value_dtype == DType::kFloat32,
               "value_bits codes the values itself: value_dtype must stay float32 with it, got ",
               dtype_name(value_dtype));
}

namespace {
/// The coded values' layout (value_bits > 0): the multi-bit codec's chunk of `count` values,
/// asymmetric grid, fp32 scales (fp16 scales would saturate values beyond 65504, which scaled or
/// accumulated gradients reach).
k::QuantGeom value_geom(const TopKConfig& cfg, int64_t count) {
  k::QuantGeom g;
  g.n = count;
  g.bits = cfg.value_bits;
  g.block = cfg.value_block;
  g.asym = true;
  g.half = false;
  return g;
}
}  // namespace

double topk_coded_values_bound(const TopKConfig& cfg, const void* section, int64_t count) {
  GC_CHECK_ARG(cfg.value_bits > 0, "topk_coded_values_bound: value_bits is 0 (no coded values)");
  GC_CHECK_ARG(count >= 0, "topk_coded_values_bound: count must be >= 0, got ", count);
  const k::QuantGeom geo = value_geom(cfg, count);
  const int64_t levels = (int64_t{1} << cfg.value_bits) - 1;
  const auto* p = static_cast<const uint8_t*>(section);
  double most = 0.0;
  for (int64_t b = 0; b < geo.num_blocks(); ++b) {
    float lo, step;  // (stored as lo, step per block: kernels/quant_math.h, asym_grid)
    std::memcpy(&lo, p + 8 * b, 4);
    std::memcpy(&step, p + 8 * b + 4, 4);
    if (!std::isfinite(lo) || !std::isfinite(step) || step < 0.0f)
      return std::numeric_limits<double>::quiet_NaN();
    const double top = double(lo) + double(levels) * double(step);
    most = std::max({most, std::fabs(double(lo)), std::fabs(top)});
  }
  return most;
}

uint64_t topk_payload_bound(const TopKConfig& cfg, int64_t count, int64_t n) {
  cfg.validate();  // (a public function: value_bits and value_block size what follows)
  if (cfg.value_bits == 0) return sparse_payload_bound(count, n, cfg.value_dtype);
  const uint64_t no_values = sparse_payload_bound(count, n, DType::kFloat32) -
                             PayloadHeader::align(static_cast<uint64_t>(count) * 4);
  return no_values +
         PayloadHeader::align(static_cast<uint64_t>(value_geom(cfg, count).body_bytes()));
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
  return k::select({x.device, x.stream}, x.as<float>(), x.numel, kk, opt, key, out, ws);
}

// ------------------------------------------------------------------------------------------------
struct TopKCompressor::Impl {
  Impl(const SparsifyConfig& cfg, int64_t n, Device dev, void* s)
      : dgc(cfg, n, dev, s),
        idx(dev, s),
        host_idx(Device::kCPU),
        vals(dev, s),
        err(dev, s),
        qws(dev),
        ws(dev),
        stream(s) {}
  SparsifyState dgc;
  Buffer idx, host_idx;
  Buffer vals, err;  ///< value_bits: the k values before coding / after decoding, their error
  k::QuantWorkspace qws;
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
  return topk_payload_bound(cfg_, topk_count(cfg_.ratio_at(step), numel_), numel_);
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
  // Without error feedback, momentum or clipping the step's v would be 0 + g: the selection and
  // the gather read an fp32 gradient itself, and the residual pass (a zero write, a read of g and
  // a write of v: 12 bytes an element, most of such an encode's memory traffic) is skipped. The
  // residual is then not kept (it stays zero); the payload has the same bits.
  const bool direct = !cfg_.error_feedback && cfg_.momentum == 0.0 && cfg_.clip_norm == 0.0 &&
                      g.dtype == DType::kFloat32;
  const float* v;
  if (direct) {
    v = g.as<float>();
  } else {
    s.dgc.accumulate(g, s.ws);
    v = s.dgc.work_v();  // the step's residual (staged: not yet the state)
  }
  const int64_t kk = topk_count(cfg_.ratio_at(step_), n);
  const RngKey key{cfg_.seed, static_cast<uint64_t>(step_), cfg_.tensor_id};
  uint32_t* idx = s.idx.get<uint32_t>(static_cast<size_t>(kk) + 1);
  const int64_t c = k::select({device_, s.stream}, v, n, kk, cfg_.select, key, idx, s.ws);

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
  const bool coded = cfg_.value_bits > 0;
  const k::QuantGeom geo = value_geom(cfg_, c);
  // coded values: no values section, the codec's body (scales, codes) as the extra section
  h.section_bytes[1] = coded ? 0 : static_cast<uint64_t>(c) * dtype_size(cfg_.value_dtype);
  h.section_bytes[2] = coded ? static_cast<uint64_t>(geo.body_bytes()) : 0;
  out.bytes.resize(h.total_bytes(), false);
  uint8_t* base = static_cast<uint8_t*>(out.bytes.data());
  void* values = coded ? static_cast<void*>(s.vals.get<float>(static_cast<size_t>(c) + 1))
                       : static_cast<void*>(base + h.section_offset(1));
  if (direct)
    k::gather({device_, s.stream}, v, idx, c, values, cfg_.value_dtype);
  else
    s.dgc.take(idx, c, values);  // (fp32 values when coded: the residual there becomes 0)
  if (coded && c > 0) {
    // With error feedback what the codes lose goes back into the residual at its element:
    // v[idx[j]] = 0 + (x_j - decode(code_j)), exactly the residual of an fp32 send plus the
    // coding error.
    const bool keep = cfg_.error_feedback && !direct;
    float* e = keep ? s.err.get<float>(static_cast<size_t>(c)) : nullptr;
    k::quant_compress({device_, s.stream}, values, DType::kFloat32, nullptr, e, geo, k::QuantRng{},
                      /*check_finite=*/false, base + h.section_offset(2));
    if (keep) k::scatter_add({device_, s.stream}, idx, e, DType::kFloat32, c, 1.0f, s.dgc.work_v());
  }
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

void TopKCompressor::commit() { impl_->dgc.commit_step(step_); }

void TopKCompressor::uncommit() { impl_->dgc.uncommit_step(step_, name().c_str()); }

void TopKCompressor::encode_skipped(Payload& out) {
  Impl& s = *impl_;
  start_skipped_payload(out, PayloadKind::kSparse, IndexCoding::kRaw32, cfg_, numel_, 0, step_,
                        device_, s.stream);
  write_header(out, device_, s.stream);
}

void TopKCompressor::decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                                float scale) {
  Impl& s = *impl_;
  const PayloadHeader h = read_decode_header(payload, nbytes, dense, numel_, PayloadKind::kSparse,
                                             "a sparse (top-k)", "topk", device_, s.stream);
  GC_CHECK_PAYLOAD(h.tensor_id == cfg_.tensor_id, "payload is for tensor ", h.tensor_id,
                   ", this compressor is tensor ", cfg_.tensor_id);
  const bool coded = cfg_.value_bits > 0;
  const int64_t c = static_cast<int64_t>(h.count);
  const k::QuantGeom geo = value_geom(cfg_, c);
  if (coded) {
    // (the coding is this compressor's configuration, the same on every rank: a payload coded
    // otherwise has another body size, or fails the plan's options check first)
    GC_CHECK_PAYLOAD(h.value_dtype == uint8_t(DType::kFloat32),
                     "coded values (value_bits) decode to float32, the payload says ",
                     dtype_name(DType(h.value_dtype)));
    GC_CHECK_PAYLOAD(h.section_bytes[1] == 0, "this compressor codes its values (value_bits ",
                     cfg_.value_bits, "), the payload has plain values (", h.section_bytes[1],
                     " bytes): value_bits differs between sender and receiver");
    GC_CHECK_PAYLOAD(h.section_bytes[2] == static_cast<uint64_t>(geo.body_bytes()),
                     "coded values section has ", h.section_bytes[2], " bytes, expected ",
                     geo.body_bytes(), " for ", h.count, " values at ", cfg_.value_bits,
                     " bits in blocks of ", cfg_.value_block);
  } else {
    GC_CHECK_PAYLOAD(h.count == 0 || h.section_bytes[1] > 0 || h.section_bytes[2] == 0,
                     "the payload has coded values (value_bits); this compressor has value_bits "
                     "0: value_bits differs between sender and receiver");
    GC_CHECK_PAYLOAD(h.section_bytes[1] == h.count * dtype_size(DType(h.value_dtype)),
                     "values section has ", h.section_bytes[1], " bytes, expected ", h.count, " x ",
                     dtype_size(DType(h.value_dtype)));
    GC_CHECK_PAYLOAD(h.section_bytes[2] == 0, "unexpected extra section of ", h.section_bytes[2],
                     " bytes in a sparse payload");
  }
  if (h.count == 0) return;
  const auto* base = static_cast<const uint8_t*>(payload);
  const uint8_t* isec = base + h.section_offset(0);
  const void* values = base + h.section_offset(1);
  DType vt = DType(h.value_dtype);
  if (coded) {  // the k values decoded (fp32, in index order), then added as fp32 values
    float* vals = s.vals.get<float>(h.count);
    const uint8_t* body = base + h.section_offset(2);
    // A scale no encoder writes (NaN, Inf, a negative step) would put non-finite values into the
    // sum, which the plan would then skip as an overflow: it is a malformed payload instead.
    std::vector<uint8_t> scales;
    const void* host_scales = body;
    if (device_ != Device::kCPU) {
      scales.resize(static_cast<size_t>(geo.scale_area(geo.num_blocks())));
      device_copy(scales.data(), Device::kCPU, body, device_, scales.size(), s.stream);
      host_scales = scales.data();
    }
    const double most = topk_coded_values_bound(cfg_, host_scales, c);
    GC_CHECK_PAYLOAD(!std::isnan(most),
                     "coded values section has an invalid scale (not finite, "
                     "or a negative step): no encoder writes it");
    k::quant_decode_average({device_, s.stream}, &body, 1, geo, 1.0f, vals, s.qws);
    values = vals;
    vt = DType::kFloat32;
  }
  const IndexCoding coding = IndexCoding(h.index_coding);
  if (device_ == Device::kCPU) {
    uint32_t* idx = s.idx.get<uint32_t>(h.count);
    decode_indices(isec, h.section_bytes[0], coding, h.count, h.numel, idx);  // validates
    k::cpu::scatter_add(idx, values, vt, c, scale, dense.as<float>());
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
  k::scatter_add({device_, s.stream}, use, values, vt, c, scale, dense.as<float>());
}

std::vector<uint8_t> TopKCompressor::state_dict() const {
  return impl_->dgc.state_dict("topk", numel_, step_);
}

void TopKCompressor::load_state_dict(const uint8_t* data, size_t nbytes) {
  step_ = impl_->dgc.load_state_dict("topk", numel_, data, nbytes);
}

}  // namespace gradcomp

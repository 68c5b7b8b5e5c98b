// SPDX-License-Identifier: Apache-2.0
// The 1-bit family: configuration and the per-tensor compressor (state, validation, payload
// building). The two-phase allreduce plan is plans/onebit_plan.cpp; the math lives in kernels/,
// reached through the entry points of kernels/onebit_kernels.hpp (kernels/entry.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "compressors/onebit_internal.hpp"
#include "core/state_io.hpp"
#include "gradcomp/onebit.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"

namespace gradcomp {

namespace k = kernels;
using detail::check_dense;
using detail::check_grad;
using detail::norm_of;

OneBitConfig OneBitConfig::resolved() const {
  OneBitConfig r = *this;
  // The one place the library reads the deprecated name: C++ callers written against it keep
  // working, and everything downstream sees block_size only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  GC_CHECK_ARG(chunk_size >= -1, "chunk_size (block_size's earlier name) must be -1 (not set) or ",
               "a block size, got ", chunk_size);
  if (chunk_size != -1) {
    GC_CHECK_ARG(block_size == 0 || block_size == chunk_size,
                 "chunk_size is block_size's earlier name: set one of them (got block_size ",
                 block_size, " and chunk_size ", chunk_size, ")");
    r.block_size = chunk_size;
    r.chunk_size = -1;
  }
#pragma GCC diagnostic pop
  return r;
}

void OneBitConfig::validate() const {
  GC_CHECK_ARG(static_cast<uint8_t>(scaling) <= 2, "unknown 1-bit scaling ", int(scaling));
  const int64_t block = resolved().block_size;
  // (a block is also what a server chunk holds whole, so its buffers are sized by it: bounded,
  // since a larger block is one scale per chunk anyway)
  GC_CHECK_ARG(block >= 0 && block % 32 == 0 && block <= (int64_t{1} << 24),
               "block_size must be 0 (one scale per chunk or tensor) or a multiple of 32 up to "
               "2^24, got ",
               block);
  GC_CHECK_ARG(scaling != OneBitScaling::kColumnMeans || block == 0,
               "scaling 'column_means' groups by column, so block_size must be 0 with it: blocks "
               "apply to the sign modes only (got block_size ",
               block, ")");
  GC_CHECK_ARG(std::isfinite(momentum) && momentum >= 0.0 && momentum < 1.0,
               "momentum must be in [0, 1), got ", momentum);
  GC_CHECK_ARG(!rotate || (scaling != OneBitScaling::kColumnMeans && block >= 32 && block <= 8192 &&
                           (block & (block - 1)) == 0),
               "rotate needs a sign scaling and block_size a power of two in [32, 8192], got ",
               enum_name(scaling), " with block_size ", block,
               "; turn rotate off for other blocks");
}

int64_t onebit_effective_chunk(const OneBitConfig& cfg, int64_t n) {
  const int64_t block = cfg.resolved().block_size;
  if (block > 0) return block;
  return std::max<int64_t>(32, (n + 31) / 32 * 32);
}

namespace {

k::OneBitGeom geom_for(const OneBitConfig& cfg, int64_t rows, int64_t cols) {
  k::OneBitGeom g;
  g.n = rows * cols;
  g.columns = cfg.scaling == OneBitScaling::kColumnMeans;
  g.cols = g.columns ? (g.n > 0 ? cols : 0) : 1;
  g.chunk = g.columns ? 32 : onebit_effective_chunk(cfg, g.n);
  return g;
}

uint64_t bits_bytes(const k::OneBitGeom& g) { return 4 * static_cast<uint64_t>(g.num_words()); }
uint64_t scales_bytes(const k::OneBitGeom& g) { return 4 * static_cast<uint64_t>(g.num_scales()); }

void fill_header(PayloadHeader& h, const OneBitConfig& cfg, const k::OneBitGeom& g) {
  h = PayloadHeader{};
  h.kind = static_cast<uint8_t>(PayloadKind::kOneBit);
  h.value_dtype = static_cast<uint8_t>(DType::kFloat32);
  h.index_coding = static_cast<uint8_t>(IndexCoding::kNone);
  h.flags = static_cast<uint8_t>(cfg.scaling);
  h.tensor_id = cfg.tensor_id;
  h.numel = static_cast<uint64_t>(g.n);
  h.count = static_cast<uint64_t>(g.n);
  h.section_bytes[0] = 0;
  h.section_bytes[1] = bits_bytes(g);
  h.section_bytes[2] = scales_bytes(g);
  h.aux = static_cast<uint64_t>(g.columns ? g.cols : g.chunk);
}

/// Validates the 1-bit specific fields of a structurally valid header and returns its geometry.
k::OneBitGeom parse_onebit(const PayloadHeader& h, int64_t numel) {
  GC_CHECK_PAYLOAD(h.kind == uint8_t(PayloadKind::kOneBit), "expected a one-bit payload, got ",
                   payload_kind_name(PayloadKind(h.kind)));
  GC_CHECK_PAYLOAD(h.numel == static_cast<uint64_t>(numel), "payload is for ", h.numel,
                   " elements, the output has ", numel);
  GC_CHECK_PAYLOAD(h.count == h.numel, "one-bit payload encodes ", h.count, " of ", h.numel,
                   " elements (must be all)");
  GC_CHECK_PAYLOAD(h.value_dtype == uint8_t(DType::kFloat32), "one-bit scales must be fp32, got ",
                   dtype_name(DType(h.value_dtype)));
  GC_CHECK_PAYLOAD(h.index_coding == uint8_t(IndexCoding::kNone),
                   "one-bit payload has index coding ", int(h.index_coding), " (expected none)");
  GC_CHECK_PAYLOAD(h.section_bytes[0] == 0, "one-bit payload has a ", h.section_bytes[0],
                   "-byte index section (expected none)");
  GC_CHECK_PAYLOAD(h.flags <= 2, "unknown one-bit scaling ", int(h.flags));
  k::OneBitGeom g;
  g.n = static_cast<int64_t>(h.numel);
  g.columns = h.flags == uint8_t(OneBitScaling::kColumnMeans);
  if (g.columns) {
    const uint64_t c = h.aux;
    if (h.numel == 0) {
      GC_CHECK_PAYLOAD(c == 0, "empty column-means payload claims ", c, " columns");
    } else {
      GC_CHECK_PAYLOAD(c >= 1 && c <= h.numel && h.numel % c == 0, "column count ", c,
                       " does not divide the element count ", h.numel);
    }
    g.cols = static_cast<int64_t>(c);
  } else {
    GC_CHECK_PAYLOAD(h.aux >= 32 && h.aux % 32 == 0 && h.aux <= (uint64_t{1} << 41),
                     "elements per scale ", h.aux, " is not a positive multiple of 32");
    g.chunk = static_cast<int64_t>(h.aux);
  }
  GC_CHECK_PAYLOAD(h.section_bytes[1] == bits_bytes(g), "bits section has ", h.section_bytes[1],
                   " bytes, expected ", bits_bytes(g), " for ", h.numel, " elements (truncated?)");
  GC_CHECK_PAYLOAD(h.section_bytes[2] == scales_bytes(g), "scales section has ", h.section_bytes[2],
                   " bytes, expected ", scales_bytes(g));
  return g;
}

PayloadHeader read_header(const void* payload, size_t nbytes, Device dev, void* stream) {
  GC_CHECK_PAYLOAD(nbytes >= sizeof(PayloadHeader), "payload has ", nbytes,
                   " bytes, fewer than the 64-byte header");
  GC_CHECK_PAYLOAD(payload != nullptr, "null payload pointer");
  GC_CHECK_ARG(reinterpret_cast<uintptr_t>(payload) % 8 == 0,
               "one-bit payloads must start at an 8-byte aligned address");
  if (dev == Device::kCPU) return parse_header(payload, nbytes);
  uint8_t host[sizeof(PayloadHeader)];
  device_copy(host, Device::kCPU, payload, dev, sizeof host, stream);
  return parse_header(host, nbytes);
}

}  // namespace

uint64_t onebit_payload_bytes(const OneBitConfig& cfg, int64_t rows, int64_t cols) {
  PayloadHeader h;
  fill_header(h, cfg, geom_for(cfg, rows, cols));
  return h.total_bytes();
}

// ------------------------------------------------------------------------------------------------
// State of the compressor (see kernels/onebit_kernels.hpp, "one-pass compress"): e[cur] holds the
// error-feedback memory, either as e itself (lazy == false) or as the previous step's x with that
// step's scales in prev_scales (lazy == true; the error is x - decode(sign_bit(x))). error() and
// state_dict() materialize it in place, which changes the representation, not the value.
// Rejecting a non-finite gradient must leave the state as it was. The CPU pass is a single sweep
// that meets a NaN only when it gets there, after writing what came before; so on the CPU, with
// check_finite and error feedback on, the step writes x into the other buffer e[1 - cur] and only
// a successful step flips cur (one extra n-float buffer; no extra memory traffic: the stores are
// non-temporal). The CUDA backend checks between its two kernels and works in place.
struct OneBitCompressor::Impl {
  Impl(Device dev, void* s)
      : e{Buffer(dev, s), Buffer(dev, s)},
        scales(dev, s),
        prev_scales(dev, s),
        ws(dev),
        stream(s),
        ex{dev, s} {}
  Buffer e[2], scales, prev_scales;
  int cur = 0;
  bool lazy = false;
  bool two_buffers = false;
  k::OneBitWorkspace ws;
  void* stream;
  k::Exec ex;
  int device_index = 0;
  k::OneBitGeom geo;
  std::vector<const uint32_t*> bit_ptrs;
  std::vector<const float*> scale_ptrs;
  float* state() { return static_cast<float*>(e[cur].data()); }
  /// Turns a lazy state into e itself (one pass over e; nothing to do when not lazy).
  void materialize() {
    if (!lazy) return;
    if (geo.n > 0)
      k::onebit_finalize_error(ex, state(), geo, static_cast<const float*>(prev_scales.data()));
    lazy = false;
  }
};

OneBitCompressor::OneBitCompressor(const OneBitConfig& cfg, int64_t rows, int64_t cols,
                                   DType grad_dtype, Device device, int device_index, void* stream)
    : cfg_(cfg.resolved()), rows_(rows), cols_(cols), device_(device) {
  cfg_.validate();
  GC_CHECK_ARG(cfg_.momentum == 0.0,
               "OneBitCompressor: momentum applies to the allreduce plan "
               "only (apply the optimizer's momentum instead), got ",
               cfg_.momentum);
  GC_CHECK_ARG(!cfg_.rotate, "OneBitCompressor: rotate applies to the allreduce plan only");
  GC_CHECK_ARG(rows >= 0 && cols >= 0, "rows and cols must be >= 0, got ", rows, " x ", cols);
  GC_CHECK_ARG(rows == 0 || cols <= (int64_t{1} << 40) / rows, "tensor of ", rows, " x ", cols,
               " elements is too large");
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(grad_dtype)), "unsupported gradient dtype code ",
               int(grad_dtype));
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("OneBitCompressor on CUDA");
  impl_ = std::make_unique<Impl>(device, stream);
  impl_->device_index = device_index;
  impl_->geo = geom_for(cfg_, rows, cols);
  const int64_t n = rows * cols;
  float* e = impl_->e[0].get<float>(static_cast<size_t>(n));
  device_zero(device, e, n * sizeof(float), stream);
  impl_->two_buffers = device == Device::kCPU && cfg_.check_finite && cfg_.error_feedback;
  if (impl_->two_buffers) impl_->e[1].get<float>(static_cast<size_t>(n));
  impl_->scales.get<float>(static_cast<size_t>(impl_->geo.num_scales()) + 1);
  impl_->prev_scales.get<float>(static_cast<size_t>(impl_->geo.num_scales()) + 1);
  stats_.numel = n;
}

OneBitCompressor::OneBitCompressor(const OneBitConfig& cfg, const TensorView& like)
    : OneBitCompressor(cfg, like.rows(), like.cols(), like.dtype, like.device, like.device_index,
                       like.stream) {}

OneBitCompressor::~OneBitCompressor() = default;

const float* OneBitCompressor::error() const {
  impl_->materialize();
  return impl_->state();
}

void OneBitCompressor::encode(const TensorView& g, Payload& out) {
  Impl& s = *impl_;
  const int64_t n = rows_ * cols_;
  check_grad(g, n, device_, s.device_index, cfg_.tensor_id, "onebit");
  if (cfg_.scaling == OneBitScaling::kColumnMeans && n > 0)
    GC_CHECK_ARG(g.cols() == cols_, "onebit tensor ", cfg_.tensor_id, ": gradient ", g.describe(),
                 " is a ", g.rows(), " x ", g.cols(), " matrix but the state was built for ", rows_,
                 " x ", cols_, " (column-means groups by column)");
  const k::OneBitGeom& geo = s.geo;
  // The payload is prepared first: the pass writes the bits straight into it. On a rejected
  // gradient `out` may thus have been resized and partly written; the state is unchanged.
  if (out.bytes.device() != device_) out.bytes = Buffer(device_, s.stream);
  out.bytes.set_stream(s.stream);
  PayloadHeader h;
  fill_header(h, cfg_, geo);
  out.bytes.resize(h.total_bytes(), false);
  uint8_t* base = static_cast<uint8_t*>(out.bytes.data());
  auto* bits = reinterpret_cast<uint32_t*>(base + h.section_offset(1));
  const bool ef = cfg_.error_feedback;
  const float* in = ef ? s.state() : nullptr;
  float* st_out = ef ? static_cast<float*>(s.e[s.two_buffers ? 1 - s.cur : s.cur].data()) : nullptr;
  const float* prev = s.lazy ? static_cast<const float*>(s.prev_scales.data()) : nullptr;
  float* scales = static_cast<float*>(s.scales.data());
  const int64_t bad =
      k::onebit_compress(s.ex, g.data, g.dtype, in, prev, st_out, geo, norm_of(cfg_.scaling),
                         cfg_.check_finite, scales, bits, s.ws);
  GC_CHECK_ARG(bad < 0, "onebit tensor ", cfg_.tensor_id,
               ": gradient has a non-finite value (NaN or Inf) at index ", bad,
               "; nothing was changed (disable check_finite to skip this test)");
  // ---- from here on the state changes ----
  if (ef) {
    if (s.two_buffers) s.cur = 1 - s.cur;
    std::swap(s.scales, s.prev_scales);  // the scales just computed describe the stored x
    s.lazy = true;
  }
  const float* sent = static_cast<const float*>((ef ? s.prev_scales : s.scales).data());
  for (int sec = 1; sec <= 2; ++sec) {  // alignment padding: zero, so payloads are reproducible
    const uint64_t pad = PayloadHeader::align(h.section_bytes[sec]) - h.section_bytes[sec];
    if (pad)
      device_zero(device_, base + h.section_offset(sec) + h.section_bytes[sec], pad, s.stream);
  }
  device_copy(base + h.section_offset(2), device_, sent, device_, h.section_bytes[2], s.stream);
  out.header = h;
  device_copy(base, device_, &out.header, Device::kCPU, sizeof(PayloadHeader), s.stream);

  stats_.record(step_, n, n, g.dtype, h.total_bytes());
  ++step_;
}

void OneBitCompressor::decode_add(const void* payload, size_t nbytes, const TensorView& dense,
                                  float scale) {
  decode_average(&payload, &nbytes, 1, dense, scale);
}

void OneBitCompressor::decode_average(const void* const* payloads, const size_t* nbytes, int count,
                                      const TensorView& dense, float scale) {
  Impl& s = *impl_;
  const int64_t n = rows_ * cols_;
  check_dense(dense, n, device_, "onebit");
  GC_CHECK_ARG(count >= 1, "onebit decode: need at least one payload, got ", count);
  GC_CHECK_ARG(payloads != nullptr && nbytes != nullptr, "onebit decode: null payload list");
  s.bit_ptrs.resize(static_cast<size_t>(count));
  s.scale_ptrs.resize(static_cast<size_t>(count));
  k::OneBitGeom geo;
  for (int p = 0; p < count; ++p) {
    const PayloadHeader h = read_header(payloads[p], nbytes[p], device_, s.stream);
    const k::OneBitGeom gp = parse_onebit(h, n);
    GC_CHECK_PAYLOAD(h.tensor_id == cfg_.tensor_id, "payload ", p, " is for tensor ", h.tensor_id,
                     ", this compressor is tensor ", cfg_.tensor_id);
    if (p == 0) {
      geo = gp;
    } else {
      GC_CHECK_PAYLOAD(gp.columns == geo.columns && gp.cols == geo.cols && gp.chunk == geo.chunk,
                       "payload ", p, " groups its scales differently from payload 0 (scaling ",
                       int(h.flags), ", aux ", h.aux, ")");
    }
    const auto* base = static_cast<const uint8_t*>(payloads[p]);
    s.bit_ptrs[p] = reinterpret_cast<const uint32_t*>(base + h.section_offset(1));
    s.scale_ptrs[p] = reinterpret_cast<const float*>(base + h.section_offset(2));
  }
  if (n == 0) return;
  k::onebit_decode_average(s.ex, s.bit_ptrs.data(), s.scale_ptrs.data(), count, geo, scale, true,
                           dense.as<float>(), s.ws);
}

std::vector<uint8_t> OneBitCompressor::state_dict() const {
  detail::StateWriter w("onebit");
  w.put<int64_t>(rows_);
  w.put<int64_t>(cols_);
  w.put<uint8_t>(static_cast<uint8_t>(cfg_.scaling));
  w.put<uint8_t>(cfg_.error_feedback);
  w.put<int64_t>(cfg_.block_size);
  w.put<uint32_t>(cfg_.tensor_id);
  w.put<int64_t>(step_);
  impl_->materialize();
  w.put_array(impl_->state(), device_, rows_ * cols_ * sizeof(float), impl_->stream);
  return w.take();
}

void OneBitCompressor::load_state_dict(const uint8_t* data, size_t nbytes) {
  detail::StateReader r(data, nbytes, "onebit");
  r.expect<int64_t>("rows", rows_);
  r.expect<int64_t>("cols", cols_);
  r.expect<uint8_t>("scaling", static_cast<uint8_t>(cfg_.scaling));
  r.expect<uint8_t>("error_feedback", cfg_.error_feedback);
  r.expect<int64_t>("block_size", cfg_.block_size);
  r.expect<uint32_t>("tensor_id", cfg_.tensor_id);
  const auto step = r.get_step();
  const uint64_t eb = static_cast<uint64_t>(rows_ * cols_) * sizeof(float);
  const uint8_t* e = r.finite_array("error", eb);
  r.finish();
  device_copy(impl_->state(), device_, e, Device::kCPU, eb, impl_->stream);
  impl_->lazy = false;
  step_ = step;
}

}  // namespace gradcomp

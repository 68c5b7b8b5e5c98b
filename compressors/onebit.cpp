// SPDX-License-Identifier: Apache-2.0
// The 1-bit family: configuration, the per-tensor compressor (state, validation, payload
// building) and 1-bit Adam's two-phase compressed allreduce plan. The math lives in kernels/;
// this file picks the backend by the device of the data.
#include "gradcomp/onebit.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/state_io.hpp"
#include "kernels/onebit.hpp"
#include "kernels/onebit_math.h"
#include "kernels/reduce.hpp"  // convert: the in-place result in the gradient's dtype
#include "kernels/topk.hpp"    // dgc_accumulate and first_nonfinite: the plan's momentum

namespace gradcomp {

namespace k = kernels;

const char* onebit_scaling_name(OneBitScaling s) {
  switch (s) {
    case OneBitScaling::kColumnMeans:
      return "column-means";
    case OneBitScaling::kSignL1:
      return "sign-l1";
    case OneBitScaling::kSignL2:
      return "sign-l2";
  }
  return "unknown";
}

void OneBitConfig::validate() const {
  GC_CHECK_ARG(static_cast<uint8_t>(scaling) <= 2, "unknown 1-bit scaling ", int(scaling));
  GC_CHECK_ARG(chunk_size >= 0 && chunk_size % 32 == 0 && chunk_size <= (int64_t{1} << 40),
               "chunk_size must be 0 (one scale per tensor) or a positive multiple of 32, got ",
               chunk_size);
  GC_CHECK_ARG(scaling != OneBitScaling::kColumnMeans || chunk_size == 0,
               "chunk_size applies to the sign modes only; kColumnMeans groups by column (got "
               "chunk_size ",
               chunk_size, ")");
  GC_CHECK_ARG(std::isfinite(momentum) && momentum >= 0.0 && momentum < 1.0,
               "momentum must be in [0, 1), got ", momentum);
  GC_CHECK_ARG(!rotate || (scaling != OneBitScaling::kColumnMeans && chunk_size >= 32 &&
                           chunk_size <= 8192 && (chunk_size & (chunk_size - 1)) == 0),
               "rotate needs a sign scaling and chunk_size (block_size) a power of two in [32, "
               "8192], got ",
               onebit_scaling_name(scaling), " with chunk_size ", chunk_size,
               "; turn rotate off for other blocks");
}

int64_t onebit_effective_chunk(const OneBitConfig& cfg, int64_t n) {
  if (cfg.chunk_size > 0) return cfg.chunk_size;
  return std::max<int64_t>(32, (n + 31) / 32 * 32);
}

namespace {

int norm_of(OneBitScaling s) {
  return s == OneBitScaling::kColumnMeans ? k::onebit::kColumnMeans
         : s == OneBitScaling::kSignL1    ? k::onebit::kL1
                                          : k::onebit::kL2;
}

k::OneBitGeom geom_for(const OneBitConfig& cfg, int64_t rows, int64_t cols) {
  k::OneBitGeom g;
  g.n = rows * cols;
  g.columns = cfg.scaling == OneBitScaling::kColumnMeans;
  g.cols = g.columns ? (g.n > 0 ? cols : 0) : 1;
  g.chunk = g.columns ? 32 : onebit_effective_chunk(cfg, g.n);
  return g;
}

/// Sign-mode geometry of n elements with a given chunk (the plan's server chunks).
k::OneBitGeom sign_geom(int64_t n, int64_t chunk) {
  k::OneBitGeom g;
  g.n = n;
  g.columns = false;
  g.cols = 1;
  g.chunk = std::max<int64_t>(32, chunk);
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

void check_grad(const TensorView& g, int64_t numel, Device dev, int dev_index, uint32_t tid,
                const char* who) {
  GC_CHECK_ARG(g.numel == numel, who, " tensor ", tid, ": gradient has ", g.numel,
               " elements but the state was built for ", numel, " (", g.describe(), ")");
  GC_CHECK_ARG(g.device == dev && (dev == Device::kCPU || g.device_index == dev_index), who,
               " tensor ", tid, ": gradient is on ", device_name(g.device), ":", g.device_index,
               " but the state is on ", device_name(dev), ":", dev_index);
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(g.dtype)), who, " tensor ", tid,
               ": unsupported gradient dtype code ", int(g.dtype), " (expected fp32, fp16, bf16)");
  GC_CHECK_ARG(g.numel == 0 || g.data != nullptr, who, " tensor ", tid, ": null gradient data");
}

void check_dense(const TensorView& d, int64_t numel, Device dev, const char* who) {
  GC_CHECK_ARG(d.dtype == DType::kFloat32, who, " decode: the output must be fp32, got ",
               d.describe());
  GC_CHECK_ARG(d.numel == numel, who, " decode: output has ", d.numel, " elements, expected ",
               numel);
  GC_CHECK_ARG(d.device == dev, who, " decode: output is on ", device_name(d.device),
               ", the state on ", device_name(dev));
  GC_CHECK_ARG(d.numel == 0 || d.data != nullptr, who, " decode: null output data");
}

int64_t run_scales(Device dev, const void* g, DType t, const float* e, const k::OneBitGeom& geo,
                   int norm, bool check, float* scales, k::OneBitWorkspace& ws, void* stream) {
  return dev == Device::kCUDA
             ? k::cuda::onebit_scales(g, t, e, geo, norm, check, scales, ws, stream)
             : k::cpu::onebit_scales(g, t, e, geo, norm, check, scales, ws);
}
void run_quantize(Device dev, const void* g, DType t, const float* e_in, float* e_out,
                  const k::OneBitGeom& geo, const float* scales, uint32_t* bits, void* stream) {
  if (dev == Device::kCUDA)
    k::cuda::onebit_quantize(g, t, e_in, e_out, geo, scales, bits, stream);
  else
    k::cpu::onebit_quantize(g, t, e_in, e_out, geo, scales, bits);
}
void run_decode_average(Device dev, const uint32_t* const* bits, const float* const* scales,
                        int count, const k::OneBitGeom& geo, float scale, bool acc, float* dense,
                        k::OneBitWorkspace& ws, void* stream) {
  if (dev == Device::kCUDA)
    k::cuda::onebit_decode_average(bits, scales, count, geo, scale, acc, dense, ws, stream);
  else
    k::cpu::onebit_decode_average(bits, scales, count, geo, scale, acc, dense);
}
int64_t run_first_nonfinite(Device dev, const void* x, DType t, int64_t n, k::SelectWorkspace& ws,
                            void* stream) {
  return dev == Device::kCUDA ? k::cuda::first_nonfinite(x, t, n, ws, stream)
                              : k::cpu::first_nonfinite(x, t, n);
}
void run_rotate(Device dev, float* x, int64_t nblocks, int64_t S, int64_t first_block, bool inverse,
                void* stream) {
  if (dev == Device::kCUDA)
    k::cuda::hadamard_rotate(x, nblocks, S, first_block, inverse, stream);
  else
    k::cpu::hadamard_rotate(x, nblocks, S, first_block, inverse);
}

}  // namespace

uint64_t onebit_payload_bytes(const OneBitConfig& cfg, int64_t rows, int64_t cols) {
  PayloadHeader h;
  fill_header(h, cfg, geom_for(cfg, rows, cols));
  return h.total_bytes();
}

// ------------------------------------------------------------------------------------------------
// State of the compressor (see kernels/onebit.hpp, "one-pass compress"): e[cur] holds the
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
        stream(s) {}
  Buffer e[2], scales, prev_scales;
  int cur = 0;
  bool lazy = false;
  bool two_buffers = false;
  k::OneBitWorkspace ws;
  void* stream;
  int device_index = 0;
  k::OneBitGeom geo;
  std::vector<const uint32_t*> bit_ptrs;
  std::vector<const float*> scale_ptrs;
  float* state() { return static_cast<float*>(e[cur].data()); }
  /// Turns a lazy state into e itself (one pass over e; nothing to do when not lazy).
  void materialize(Device dev) {
    if (!lazy) return;
    if (geo.n > 0) {
      if (dev == Device::kCUDA)
        k::cuda::onebit_finalize_error(state(), geo, static_cast<const float*>(prev_scales.data()),
                                       stream);
      else
        k::cpu::onebit_finalize_error(state(), geo, static_cast<const float*>(prev_scales.data()));
    }
    lazy = false;
  }
};

OneBitCompressor::OneBitCompressor(const OneBitConfig& cfg, int64_t rows, int64_t cols,
                                   DType grad_dtype, Device device, int device_index, void* stream)
    : cfg_(cfg), rows_(rows), cols_(cols), device_(device) {
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
  impl_->materialize(device_);
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
      device_ == Device::kCUDA
          ? k::cuda::onebit_compress(g.data, g.dtype, in, prev, st_out, geo, norm_of(cfg_.scaling),
                                     cfg_.check_finite, scales, bits, s.ws, s.stream)
          : k::cpu::onebit_compress(g.data, g.dtype, in, prev, st_out, geo, norm_of(cfg_.scaling),
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
  run_decode_average(device_, s.bit_ptrs.data(), s.scale_ptrs.data(), count, geo, scale, true,
                     dense.as<float>(), s.ws, s.stream);
}

std::vector<uint8_t> OneBitCompressor::state_dict() const {
  detail::StateWriter w("onebit");
  w.put<int64_t>(rows_);
  w.put<int64_t>(cols_);
  w.put<uint8_t>(static_cast<uint8_t>(cfg_.scaling));
  w.put<uint8_t>(cfg_.error_feedback);
  w.put<int64_t>(cfg_.chunk_size);
  w.put<uint32_t>(cfg_.tensor_id);
  w.put<int64_t>(step_);
  impl_->materialize(device_);
  w.put_array(impl_->state(), device_, rows_ * cols_ * sizeof(float), impl_->stream);
  return w.take();
}

void OneBitCompressor::load_state_dict(const uint8_t* data, size_t nbytes) {
  detail::StateReader r(data, nbytes, "onebit");
  r.expect<int64_t>("rows", rows_);
  r.expect<int64_t>("cols", cols_);
  r.expect<uint8_t>("scaling", static_cast<uint8_t>(cfg_.scaling));
  r.expect<uint8_t>("error_feedback", cfg_.error_feedback);
  r.expect<int64_t>("chunk_size", cfg_.chunk_size);
  r.expect<uint32_t>("tensor_id", cfg_.tensor_id);
  const auto step = r.get_step();
  const uint64_t eb = static_cast<uint64_t>(rows_ * cols_) * sizeof(float);
  const uint8_t* e = r.finite_array("error", eb);
  r.finish();
  device_copy(impl_->state(), device_, e, Device::kCPU, eb, impl_->stream);
  impl_->lazy = false;
  step_ = step;
}

// ------------------------------------------------------------------------------------------------
struct OneBitAllreducePlan::Impl {
  Impl(Device dev, void* s)
      : we(dev, s),
        se(dev, s),
        scales(dev, s),
        bits(dev, s),
        send(dev, s),
        recv(dev, s),
        avg(dev, s),
        gsend(dev, s),
        grecv(dev, s),
        u(dev, s),
        rot(dev, s),
        ws(dev),
        sws(dev),
        stream(s) {}
  Buffer we, se, scales, bits, send, recv, avg, gsend, grecv, u;
  Buffer rot;  ///< cfg.rotate: the rotated gradient, unless it is rotated in place
  k::OneBitWorkspace ws;
  k::SelectWorkspace sws;
  void* stream;
  int device_index = 0;
  TensorView grad, out;       ///< out is grad itself when in place
  const void* src = nullptr;  ///< what phase 1 compresses: grad, or its rotation (fp32)
  DType src_t = DType::kFloat32;
  std::vector<const uint32_t*> bit_ptrs;
  std::vector<const float*> scale_ptrs;
};

OneBitAllreducePlan::OneBitAllreducePlan(const OneBitConfig& cfg, int64_t numel, int world,
                                         int rank, Device device, int device_index, void* stream)
    : cfg_(cfg), numel_(numel), world_(world), rank_(rank), device_(device) {
  cfg_.validate();
  GC_CHECK_ARG(cfg_.scaling != OneBitScaling::kColumnMeans,
               "the 1-bit allreduce plan uses a sign scaling (kSignL1 or kSignL2), got ",
               onebit_scaling_name(cfg_.scaling));
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40), "numel must be in [0, 2^40], got ",
               numel);
  GC_CHECK_ARG(world >= 1, "world size must be >= 1, got ", world);
  GC_CHECK_ARG(rank >= 0 && rank < world, "rank ", rank, " is outside [0, ", world, ")");
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("OneBitAllreducePlan on CUDA");
  const int64_t words = k::onebit::num_words(numel);
  words_per_chunk_ = (words + world - 1) / world;
  if (cfg_.chunk_size > 0) {  // chunks hold whole scale blocks
    const int64_t wb = cfg_.chunk_size / 32;
    words_per_chunk_ = (words_per_chunk_ + wb - 1) / wb * wb;
    scale_block_ = cfg_.chunk_size;
  } else {
    scale_block_ = std::max<int64_t>(32, chunk_elems());
  }
  scales_per_chunk_ = (chunk_elems() + scale_block_ - 1) / scale_block_;
  if (chunk_elems() == 0) scales_per_chunk_ = 1;
  impl_ = std::make_unique<Impl>(device, stream);
  impl_->device_index = device_index;
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world), B = block_bytes();
  const size_t ce = static_cast<size_t>(chunk_elems());
  device_zero(device, s.we.get<float>(static_cast<size_t>(numel)), numel * sizeof(float), stream);
  device_zero(device, s.se.get<float>(ce), ce * sizeof(float), stream);
  if (cfg_.momentum > 0.0)
    device_zero(device, s.u.get<float>(static_cast<size_t>(numel)), numel * sizeof(float), stream);
  s.scales.get<float>(P * static_cast<size_t>(scales_per_chunk_) + 1);
  s.bits.get<uint32_t>(static_cast<size_t>(words) + 1);
  s.send.get<uint8_t>(P * B);
  s.recv.get<uint8_t>(P * B);
  s.avg.get<float>(ce + 1);
  s.gsend.get<uint8_t>(B);
  s.grecv.get<uint8_t>(P * B);
  s.bit_ptrs.resize(P);
  s.scale_ptrs.resize(P);
}

OneBitAllreducePlan::~OneBitAllreducePlan() = default;

const float* OneBitAllreducePlan::worker_error() const {
  return static_cast<const float*>(impl_->we.data());
}
const float* OneBitAllreducePlan::momentum_buffer() const {
  return cfg_.momentum > 0.0 ? static_cast<const float*>(impl_->u.data()) : nullptr;
}
const float* OneBitAllreducePlan::server_error() const {
  return static_cast<const float*>(impl_->se.data());
}

void OneBitAllreducePlan::begin(const TensorView& grad) { start(grad, nullptr); }

void OneBitAllreducePlan::begin(const TensorView& grad, const TensorView& out) {
  start(grad, &out);
}

void OneBitAllreducePlan::start(const TensorView& grad, const TensorView* out) {
  Impl& s = *impl_;
  GC_CHECK_ARG(phase_ == 0, "onebit-allreduce rank ", rank_,
               ": begin() called while a step is in progress (run next() until it returns "
               "nullopt)");
  check_grad(grad, numel_, device_, s.device_index, cfg_.tensor_id, "onebit-allreduce");
  if (out) {
    check_dense(*out, numel_, device_, "onebit-allreduce");
    GC_CHECK_ARG(numel_ == 0 || out->data != grad.data,
                 "onebit-allreduce: out aliases grad; call begin(grad) to average in place");
  }
  const k::OneBitGeom geo = sign_geom(numel_, scale_block_);
  auto* scales = static_cast<float*>(s.scales.data());
  if (cfg_.check_finite && (cfg_.momentum > 0.0 || cfg_.rotate)) {
    // checked before anything is written (the scale pass's own check would see the momentum
    // sum or the rotated values, whose first bad index is not the gradient's): a rejected step
    // changes nothing
    const int64_t bad =
        run_first_nonfinite(device_, grad.data, grad.dtype, numel_, s.sws, s.stream);
    GC_CHECK_ARG(bad < 0, "onebit-allreduce tensor ", cfg_.tensor_id, " rank ", rank_,
                 ": gradient has a non-finite value (NaN or Inf) at index ", bad,
                 "; nothing was changed");
  }
  s.src = grad.data;
  s.src_t = grad.dtype;
  if (cfg_.rotate && numel_ > 0) {
    // in place on an fp32 gradient that receives the average anyway; else into a scratch copy
    float* r;
    if (!out && grad.dtype == DType::kFloat32) {
      r = static_cast<float*>(grad.data);
    } else {
      r = s.rot.get<float>(static_cast<size_t>(numel_));
      k::convert(device_, grad.data, grad.dtype, r, DType::kFloat32, numel_, 1.0f, s.stream);
    }
    run_rotate(device_, r, numel_ / scale_block_, scale_block_, 0, false, s.stream);
    if (cfg_.check_finite) {
      // finite values above about FLT_MAX / S overflow in the butterflies: refused before any
      // state changes (one more read pass, only with check_finite)
      const int64_t big = run_first_nonfinite(device_, r, DType::kFloat32, numel_, s.sws, s.stream);
      GC_CHECK_ARG(big < 0, "onebit-allreduce tensor ", cfg_.tensor_id, " rank ", rank_,
                   ": gradient values too large to rotate (block ", big / scale_block_,
                   " overflows fp32; |g| must stay below about 3.4e38 / ", scale_block_,
                   "); the plan's state was not changed",
                   r == grad.data ? ", the gradient (rotated in place) holds rotated values" : "");
    }
    s.src = r;
    s.src_t = DType::kFloat32;
  }
  if (cfg_.momentum > 0.0) {
    // u = m u + g and x = u + e, written into the worker-error buffer (x is compressed in
    // place by next())
    float* x = static_cast<float*>(s.we.data());
    float* u = static_cast<float*>(s.u.data());
    if (!cfg_.error_feedback) device_zero(device_, x, numel_ * sizeof(float), s.stream);
    const auto m = static_cast<float>(cfg_.momentum);
    if (numel_ > 0) {
      if (device_ == Device::kCUDA)
        k::cuda::dgc_accumulate(s.src, s.src_t, numel_, 1.0f, m, false, u, x, s.stream);
      else
        k::cpu::dgc_accumulate(s.src, s.src_t, numel_, 1.0f, m, false, u, x);
    }
    run_scales(device_, x, DType::kFloat32, nullptr, geo, norm_of(cfg_.scaling), false, scales,
               s.ws, s.stream);
  } else {
    const float* e_in = cfg_.error_feedback ? static_cast<const float*>(s.we.data()) : nullptr;
    const int64_t bad = run_scales(device_, s.src, s.src_t, e_in, geo, norm_of(cfg_.scaling),
                                   cfg_.check_finite && !cfg_.rotate, scales, s.ws, s.stream);
    GC_CHECK_ARG(bad < 0, "onebit-allreduce tensor ", cfg_.tensor_id, " rank ", rank_,
                 ": gradient has a non-finite value (NaN or Inf) at index ", bad,
                 "; nothing was changed");
  }
  s.grad = grad;
  s.out = out ? *out : grad;
  phase_ = 1;
}

std::optional<Collective> OneBitAllreducePlan::next() {
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world_), B = block_bytes();
  const int64_t W = words_per_chunk_, CE = chunk_elems(), words = k::onebit::num_words(numel_);
  const int64_t S = scale_block_, NB = scales_per_chunk_;
  auto chunk_len = [&](int64_t q) { return std::clamp<int64_t>(numel_ - q * CE, 0, CE); };
  Collective c;
  c.device = device_;
  c.stream = s.stream;
  c.world = world_;
  c.type = ElemType::kU8;
  c.count = B;
  switch (phase_) {
    case 1: {  // (1) worker compress (one scale per block of S) + split into P blocks
      const k::OneBitGeom geo = sign_geom(numel_, S);
      float* we = static_cast<float*>(s.we.data());
      const bool ef = cfg_.error_feedback;
      auto* bits = static_cast<uint32_t*>(s.bits.data());
      const auto* scales = static_cast<const float*>(s.scales.data());
      if (cfg_.momentum > 0.0)  // begin() formed x = u + e in `we`
        run_quantize(device_, we, DType::kFloat32, nullptr, ef ? we : nullptr, geo, scales, bits,
                     s.stream);
      else
        run_quantize(device_, s.src, s.src_t, ef ? we : nullptr, ef ? we : nullptr, geo, scales,
                     bits, s.stream);
      auto* send = static_cast<uint8_t*>(s.send.data());
      device_zero(device_, send, P * B, s.stream);
      const int64_t K = (numel_ + CE - 1) / std::max<int64_t>(1, CE);  // chunks holding elements
      const int64_t total_scales = geo.num_scales();
      for (int64_t q = 0; q < K; ++q) {
        uint8_t* blk = send + q * B;
        const int64_t s0 = q * NB, s1 = std::min(total_scales, s0 + NB);
        device_copy(blk, device_, scales + s0, device_, 4 * (s1 - s0), s.stream);
        const int64_t w0 = q * W, w1 = std::min(words, w0 + W);
        device_copy(blk + 4 * NB, device_, bits + w0, device_, 4 * (w1 - w0), s.stream);
      }
      c.kind = CollectiveKind::kAllToAll;
      c.send = send;
      c.recv = s.recv.data();
      c.tag = "onebit worker chunks";
      phase_ = 2;
      return c;
    }
    case 2: {  // (3) server: average chunk `rank` of every worker, add server error, recompress
      const int64_t L = chunk_len(rank_);
      auto* gsend = static_cast<uint8_t*>(s.gsend.data());
      device_zero(device_, gsend, B, s.stream);
      if (L > 0) {
        const auto* recv = static_cast<const uint8_t*>(s.recv.data());
        for (size_t q = 0; q < P; ++q) {
          s.scale_ptrs[q] = reinterpret_cast<const float*>(recv + q * B);
          s.bit_ptrs[q] = reinterpret_cast<const uint32_t*>(recv + q * B + 4 * NB);
        }
        const k::OneBitGeom geo = sign_geom(L, S);
        float* avg = static_cast<float*>(s.avg.data());
        run_decode_average(device_, s.bit_ptrs.data(), s.scale_ptrs.data(), world_, geo,
                           1.0f / static_cast<float>(world_), false, avg, s.ws, s.stream);
        float* se = cfg_.error_feedback ? static_cast<float*>(s.se.data()) : nullptr;
        auto* scale = reinterpret_cast<float*>(gsend);
        run_scales(device_, avg, DType::kFloat32, se, geo, norm_of(cfg_.scaling), false, scale,
                   s.ws, s.stream);
        run_quantize(device_, avg, DType::kFloat32, se, se, geo, scale,
                     reinterpret_cast<uint32_t*>(gsend + 4 * NB), s.stream);
      }
      c.kind = CollectiveKind::kAllgather;
      c.send = gsend;
      c.recv = s.grecv.data();
      c.tag = "onebit server chunks";
      phase_ = 3;
      return c;
    }
    case 3: {  // (5) decode every server chunk into the output (the gradient when in place)
      // grad was last read in phase 1, so writing the average over it is safe; an fp16/bf16
      // gradient gets each chunk decoded in fp32 (into `avg`, free since phase 2) and rounded
      const auto* grecv = static_cast<const uint8_t*>(s.grecv.data());
      const DType ot = s.out.dtype;
      const size_t es = dtype_size(ot);
      for (size_t q = 0; q < P; ++q) {
        const int64_t L = chunk_len(static_cast<int64_t>(q));
        if (L == 0) continue;
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(grecv + q * B + 4 * NB);
        const float* scale = reinterpret_cast<const float*>(grecv + q * B);
        void* dst = static_cast<uint8_t*>(s.out.data) + static_cast<size_t>(q * CE) * es;
        float* f =
            ot == DType::kFloat32 ? static_cast<float*>(dst) : static_cast<float*>(s.avg.data());
        run_decode_average(device_, &bits, &scale, 1, sign_geom(L, S), 1.0f, false, f, s.ws,
                           s.stream);
        if (cfg_.rotate)  // chunks hold whole blocks: chunk q starts at global block q CE / S
          run_rotate(device_, f, L / S, S, static_cast<int64_t>(q) * CE / S, true, s.stream);
        if (ot != DType::kFloat32)
          k::convert(device_, f, DType::kFloat32, dst, ot, L, 1.0f, s.stream);
      }
      phase_ = 0;
      ++step_;
      return std::nullopt;
    }
    default:
      GC_CHECK_ARG(false, "onebit-allreduce rank ", rank_,
                   ": next() called before begin() (no step in progress)");
  }
  return std::nullopt;
}

std::vector<uint8_t> OneBitAllreducePlan::state_dict() const {
  detail::StateWriter w("onebit-allreduce");
  w.put<int64_t>(numel_);
  w.put<int32_t>(world_);
  w.put<int32_t>(rank_);
  w.put<uint8_t>(static_cast<uint8_t>(cfg_.scaling));
  w.put<uint8_t>(cfg_.error_feedback);
  w.put<int64_t>(cfg_.chunk_size);
  w.put<uint8_t>(cfg_.momentum > 0.0);
  w.put<uint8_t>(cfg_.rotate);
  w.put<int64_t>(step_);
  w.put_array(impl_->we.data(), device_, numel_ * sizeof(float), impl_->stream);
  w.put_array(impl_->se.data(), device_, chunk_elems() * sizeof(float), impl_->stream);
  if (cfg_.momentum > 0.0)
    w.put_array(impl_->u.data(), device_, numel_ * sizeof(float), impl_->stream);
  return w.take();
}

void OneBitAllreducePlan::load_state_dict(const uint8_t* data, size_t nbytes) {
  GC_CHECK_ARG(phase_ == 0, "onebit-allreduce: load_state_dict() during a step");
  detail::StateReader r(data, nbytes, "onebit-allreduce");
  r.expect<int64_t>("numel", numel_);
  r.expect<int32_t>("world", world_);
  r.expect<int32_t>("rank", rank_);
  r.expect<uint8_t>("scaling", static_cast<uint8_t>(cfg_.scaling));
  r.expect<uint8_t>("error_feedback", cfg_.error_feedback);
  r.expect<int64_t>("chunk_size", cfg_.chunk_size);
  r.expect<uint8_t>("has_momentum", cfg_.momentum > 0.0);
  r.expect<uint8_t>("rotate", cfg_.rotate);
  const auto step = r.get_step();
  const uint64_t wb = static_cast<uint64_t>(numel_) * sizeof(float);
  const uint64_t sb = static_cast<uint64_t>(chunk_elems()) * sizeof(float);
  const uint8_t* we = r.finite_array("worker_error", wb);
  const uint8_t* se = r.finite_array("server_error", sb);
  const uint8_t* u = cfg_.momentum > 0.0 ? r.finite_array("momentum", wb) : nullptr;
  r.finish();
  if (u) device_copy(impl_->u.data(), device_, u, Device::kCPU, wb, impl_->stream);
  device_copy(impl_->we.data(), device_, we, Device::kCPU, wb, impl_->stream);
  device_copy(impl_->se.data(), device_, se, Device::kCPU, sb, impl_->stream);
  step_ = step;
}

}  // namespace gradcomp

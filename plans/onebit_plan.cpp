// SPDX-License-Identifier: Apache-2.0
// 1-bit Adam's two-phase compressed allreduce plan (OneBitAllreducePlan, gradcomp/onebit.hpp):
// worker compression and all-to-all of the chunks, server averaging and compression, allgather.
// Local work goes through the kernels' entry points (kernels/entry.hpp); the collectives are only
// asked for.
#include "plans/onebit_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compressors/onebit_internal.hpp"
#include "core/state_io.hpp"
#include "core/state_schema.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/onebit_math.h"
#include "kernels/reduce_kernels.hpp"  // convert: the in-place result in the gradient's dtype
#include "kernels/topk_kernels.hpp"
#include "plans/envelope.hpp"
#include "plans/family.hpp"
#include "plans/options_hash.hpp"
#include "plans/two_phase.hpp"

namespace gradcomp {

namespace k = kernels;
using detail::check_dense;
using detail::check_grad;
using detail::norm_of;
using detail::sign_geom;

struct OneBitAllreducePlan::Impl : detail::TwoPhaseState {
  Impl(Device dev, void* s)
      : TwoPhaseState(dev, s),
        scales(dev, s),
        bits(dev, s),
        u{Buffer(dev, s), Buffer(dev, s)},
        ws(dev) {}
  // Worker error, server error and momentum u: [cur] is the state; with check_finite a step
  // writes its new values into [1 - cur] and a step kept on every rank swaps them in (a skipped
  // one drops them; undo_step() swaps them back). Without it a step writes [cur] in place.
  // bad (TwoPhaseState) is 0 for an overflow in the rotation.
  Buffer scales, bits;
  Buffer u[2];
  bool staged = false;
  float* we_out() { return static_cast<float*>(we[staged ? 1 - cur : cur].data()); }
  float* u_in() { return static_cast<float*>(u[cur].data()); }
  float* se_out() { return static_cast<float*>(se[staged ? 1 - cur : cur].data()); }
  float* u_out() { return static_cast<float*>(u[staged ? 1 - cur : cur].data()); }
  k::OneBitWorkspace ws;
  TensorView out;  ///< grad itself when in place
  std::vector<const uint32_t*> bit_ptrs;
  std::vector<const float*> scale_ptrs;
};

namespace {
/// 32-bit words of a server chunk (plans/two_phase.hpp): whole scale blocks when blocks are set.
int64_t chunk_words(int64_t numel, int world, int64_t block_size) {
  return detail::two_phase_chunk_elems(numel, world, block_size > 0 ? block_size : 32) / 32;
}
}  // namespace

OneBitAllreducePlan::OneBitAllreducePlan(const OneBitConfig& cfg, int64_t numel, int world,
                                         int rank, Device device, int device_index, void* stream)
    : cfg_(cfg.resolved()), numel_(numel), world_(world), rank_(rank), device_(device) {
  cfg_.validate();
  GC_CHECK_ARG(cfg_.scaling != OneBitScaling::kColumnMeans,
               "the 1-bit allreduce plan uses a sign scaling (kSignL1 or kSignL2), got ",
               enum_name(cfg_.scaling));
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40), "numel must be in [0, 2^40], got ",
               numel);
  GC_CHECK_ARG(world >= 1, "world size must be >= 1, got ", world);
  GC_CHECK_ARG(rank >= 0 && rank < world, "rank ", rank, " is outside [0, ", world, ")");
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("OneBitAllreducePlan on CUDA");
  const int64_t words = k::onebit::num_words(numel);
  words_per_chunk_ = chunk_words(numel, world, cfg_.block_size);
  if (cfg_.block_size > 0) {
    scale_block_ = cfg_.block_size;
  } else {
    scale_block_ = std::max<int64_t>(32, chunk_elems());
  }
  scales_per_chunk_ = (chunk_elems() + scale_block_ - 1) / scale_block_;
  if (chunk_elems() == 0) scales_per_chunk_ = 1;
  impl_ = std::make_unique<Impl>(device, stream);
  impl_->device_index = device_index;
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world), B = block_bytes(), A = exchange_block_bytes();
  const size_t ce = static_cast<size_t>(chunk_elems());
  device_zero(device, s.we[0].get<float>(static_cast<size_t>(numel)), numel * sizeof(float),
              stream);
  for (Buffer& b : s.se) device_zero(device, b.get<float>(ce), ce * sizeof(float), stream);
  if (cfg_.momentum > 0.0)
    device_zero(device, s.u[0].get<float>(static_cast<size_t>(numel)), numel * sizeof(float),
                stream);
  s.staged = cfg_.check_finite;  // see OnNonFinite (gradcomp/plan.hpp)
  if (s.staged) {                // zeroed: without error feedback a step may leave them unwritten
    device_zero(device, s.we[1].get<float>(static_cast<size_t>(numel)), numel * sizeof(float),
                stream);
    if (cfg_.momentum > 0.0)
      device_zero(device, s.u[1].get<float>(static_cast<size_t>(numel)), numel * sizeof(float),
                  stream);
  }
  s.scales.get<float>(P * static_cast<size_t>(scales_per_chunk_) + 1);
  s.bits.get<uint32_t>(static_cast<size_t>(words) + 1);
  s.send.get<uint8_t>(P * A);
  s.recv.get<uint8_t>(P * A);
  s.avg.get<float>(ce + 1);
  s.gsend.get<uint8_t>(B);
  s.grecv.get<uint8_t>(P * B);
  s.bit_ptrs.resize(P);
  s.scale_ptrs.resize(P);
  // what the blocks of every rank must agree on (the step envelope's options)
  detail::OptionsHash h;
  h.add(numel).add(static_cast<int>(cfg_.scaling)).add(cfg_.error_feedback).add(scale_block_);
  h.add(cfg_.check_finite).add(cfg_.tensor_id).add(cfg_.momentum).add(cfg_.rotate);
  options_hash_ = static_cast<uint32_t>(h.value());
}

void OneBitAllreducePlan::check_envelopes() {
  Impl& s = *impl_;
  if (world_ == 1) return;
  const size_t P = static_cast<size_t>(world_), B = block_bytes(), A = exchange_block_bytes();
  const auto* recv = static_cast<const uint8_t*>(s.recv.data());
  std::vector<uint8_t> host(P * sizeof(detail::ByteEnvelope));
  for (size_t q = 0; q < P; ++q)
    device_copy(host.data() + q * sizeof(detail::ByteEnvelope), Device::kCPU, recv + q * A + B,
                device_, sizeof(detail::ByteEnvelope), s.stream);
  if (device_ == Device::kCUDA) cuda::stream_synchronize(s.stream);
  const detail::EnvelopeVerdict v =
      detail::read_byte_envelopes(host.data(), sizeof(detail::ByteEnvelope), world_);
  if (v.agreed()) return;
  phase_ = 0;  // the step is over on every rank: each received the same envelopes
  // with check_finite the step wrote only the other copy of the state; without it, the worker
  // error (and momentum) in place
  detail::throw_disagreement(v, "onebit-allreduce",
                             "scaling, block_size, error_feedback, momentum, rotate, check_finite "
                             "and the bucket's size",
                             step_, s.staged);
}

OneBitAllreducePlan::~OneBitAllreducePlan() = default;

const float* OneBitAllreducePlan::worker_error() const {
  return static_cast<const float*>(impl_->we[impl_->cur].data());
}
const float* OneBitAllreducePlan::momentum_buffer() const {
  return cfg_.momentum > 0.0 ? static_cast<const float*>(impl_->u[impl_->cur].data()) : nullptr;
}
const float* OneBitAllreducePlan::server_error() const {
  return static_cast<const float*>(impl_->se[impl_->cur].data());
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
  s.bad = -1;
  s.grad = grad;
  s.out = out ? *out : grad;
  phase_ = 1;
  start_step();
  // A bad gradient changes nothing here: phase 1 then sends NaN scales instead of its data, and
  // every rank learns of it from the step's own data (OnNonFinite, gradcomp/plan.hpp).
  auto found_bad = [&](int64_t index, std::string what) {
    s.bad = index;
    s.bad_what = std::move(what);
  };
  if (cfg_.check_finite && (cfg_.momentum > 0.0 || cfg_.rotate)) {
    // checked before anything is written (the scale pass's own check would see the momentum
    // sum or the rotated values, whose first bad index is not the gradient's)
    const int64_t bad = k::first_nonfinite(s.ex, grad.data, grad.dtype, numel_, s.sws);
    if (bad >= 0)
      return found_bad(bad,
                       detail::cat("gradient has a non-finite value (NaN or Inf) at index ", bad));
  }
  s.src = grad.data;
  s.src_t = grad.dtype;
  if (cfg_.rotate && numel_ > 0) {
    // in place on an fp32 gradient that receives the average anyway; else into a scratch copy
    const detail::TwoPhaseSource r =
        detail::two_phase_rotate(s.ex, grad, !out, s.rot, scale_block_, cfg_.check_finite, s.sws);
    if (r.bad >= 0) return found_bad(r.bad, r.what);
    s.src = r.data;
    s.src_t = DType::kFloat32;
  }
  if (cfg_.momentum > 0.0) {
    // u = m u + g and x = u + e, written into the (step's) worker-error buffer (x is compressed
    // in place by next())
    float* x = s.we_out();
    const float* e = s.we_in();
    if (!cfg_.error_feedback) {
      device_zero(device_, x, numel_ * sizeof(float), s.stream);
      e = x;
    }
    const auto m = static_cast<float>(cfg_.momentum);
    if (numel_ > 0) {
      k::dgc_accumulate(s.ex, s.src, s.src_t, numel_, 1.0f, m, false, s.u_out(), x, s.u_in(), e);
    }
    // the gradient was checked above: a non-finite x here is u or u + e overflowing fp32, which
    // would poison the state, so the step is dropped like a non-finite one (a loss scaler then
    // lowers its scale)
    const int64_t big = k::onebit_scales(s.ex, x, DType::kFloat32, nullptr, geo,
                                         norm_of(cfg_.scaling), cfg_.check_finite, scales, s.ws);
    if (big >= 0)
      return found_bad(big, detail::cat("the momentum (plus error) overflows fp32 at index ", big,
                                        " although the gradient is finite"));
  } else {
    const float* e_in = cfg_.error_feedback ? s.we_in() : nullptr;
    const int64_t bad = k::onebit_scales(s.ex, s.src, s.src_t, e_in, geo, norm_of(cfg_.scaling),
                                         cfg_.check_finite && !cfg_.rotate, scales, s.ws);
    if (bad >= 0)
      return found_bad(bad,
                       detail::cat("gradient has a non-finite value (NaN or Inf) at index ", bad));
  }
  s.grad = grad;
  s.out = out ? *out : grad;
  phase_ = 1;
}

std::optional<Collective> OneBitAllreducePlan::next() {
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world_), B = block_bytes(), A = exchange_block_bytes();
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
      auto* send = static_cast<uint8_t*>(s.send.data());
      device_zero(device_, send, P * A, s.stream);
      if (A > B) {  // every block ends with this rank's step envelope (the same in each)
        const detail::ByteEnvelope e = detail::byte_envelope({step_, options_hash_, false});
        for (size_t q = 0; q < P; ++q)
          device_copy(send + q * A + B, device_, &e, Device::kCPU, sizeof(e), s.stream);
      }
      const int64_t K = (numel_ + CE - 1) / std::max<int64_t>(1, CE);  // chunks holding elements
      c.count = A;
      c.kind = CollectiveKind::kAllToAll;
      c.send = send;
      c.recv = s.recv.data();
      c.tag = "onebit worker chunks";
      phase_ = 2;
      if (s.bad >= 0) {
        // NaN scales in every chunk: each server sees them, and so every rank (phase 2 and 3)
        for (int64_t q = 0; q < K; ++q) device_fill_nan(device_, send + q * A, 4 * NB, s.stream);
        return c;
      }
      float* we = s.we_out();
      const bool ef = cfg_.error_feedback;
      auto* bits = static_cast<uint32_t*>(s.bits.data());
      const auto* scales = static_cast<const float*>(s.scales.data());
      if (cfg_.momentum > 0.0)  // begin() formed x = u + e in the step's worker-error buffer
        k::onebit_quantize(s.ex, we, DType::kFloat32, nullptr, ef ? we : nullptr, geo, scales,
                           bits);
      else
        k::onebit_quantize(s.ex, s.src, s.src_t, ef ? s.we_in() : nullptr, ef ? we : nullptr, geo,
                           scales, bits);
      const int64_t total_scales = geo.num_scales();
      for (int64_t q = 0; q < K; ++q) {
        uint8_t* blk = send + q * A;
        const int64_t s0 = q * NB, s1 = std::min(total_scales, s0 + NB);
        device_copy(blk, device_, scales + s0, device_, 4 * (s1 - s0), s.stream);
        const int64_t w0 = q * W, w1 = std::min(words, w0 + W);
        device_copy(blk + 4 * NB, device_, bits + w0, device_, 4 * (w1 - w0), s.stream);
      }
      return c;
    }
    case 2: {  // (3) server: average chunk `rank` of every worker, add server error, recompress
      check_envelopes();  // (throws on every rank when the senders disagree)
      const int64_t L = chunk_len(rank_);
      auto* gsend = static_cast<uint8_t*>(s.gsend.data());
      device_zero(device_, gsend, B, s.stream);
      bool skip = false;
      if (L > 0 && cfg_.check_finite) {  // a bad worker sent NaN scales
        const auto* recv = static_cast<const uint8_t*>(s.recv.data());
        for (size_t q = 0; q < P && !skip; ++q)
          skip = device_first_is_nan(device_, recv + q * A, DType::kFloat32, s.stream);
        if (skip) device_fill_nan(device_, gsend, 4 * NB, s.stream);  // server error untouched
      }
      if (L > 0 && !skip) {
        const auto* recv = static_cast<const uint8_t*>(s.recv.data());
        for (size_t q = 0; q < P; ++q) {
          s.scale_ptrs[q] = reinterpret_cast<const float*>(recv + q * A);
          s.bit_ptrs[q] = reinterpret_cast<const uint32_t*>(recv + q * A + 4 * NB);
        }
        const k::OneBitGeom geo = sign_geom(L, S);
        float* avg = static_cast<float*>(s.avg.data());
        k::onebit_decode_average(s.ex, s.bit_ptrs.data(), s.scale_ptrs.data(), world_, geo,
                                 1.0f / static_cast<float>(world_), false, avg, s.ws);
        const bool ef = cfg_.error_feedback;
        const float* se = ef ? s.se_in() : nullptr;
        auto* scale = reinterpret_cast<float*>(gsend);
        k::onebit_scales(s.ex, avg, DType::kFloat32, se, geo, norm_of(cfg_.scaling), false, scale,
                         s.ws);
        k::onebit_quantize(s.ex, avg, DType::kFloat32, se, ef ? s.se_out() : nullptr, geo, scale,
                           reinterpret_cast<uint32_t*>(gsend + 4 * NB));
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
      // chunk 0 holds elements whenever the bucket does, and its server saw every worker's
      // chunk 0: a NaN scale there means some rank's gradient was bad
      if (cfg_.check_finite && numel_ > 0 &&
          device_first_is_nan(device_, grecv, DType::kFloat32, s.stream)) {
        device_fill_nan(device_, s.out.data, static_cast<size_t>(s.out.nbytes()), s.stream);
        phase_ = 0;
        set_skipped(true);
        if (on_nonfinite_ == OnNonFinite::kRaise) {
          GC_CHECK_ARG(s.bad < 0, "onebit-allreduce tensor ", cfg_.tensor_id, " rank ", rank_, ": ",
                       s.bad_what, "; the step was dropped on every rank and no state ",
                       "changed (on_nonfinite='raise')");
          GC_CHECK_ARG(false, "onebit-allreduce tensor ", cfg_.tensor_id, " rank ", rank_,
                       ": another rank's gradient held a non-finite value (NaN or Inf); the step ",
                       "was dropped on every rank and no state changed (on_nonfinite='raise')");
        }
        return std::nullopt;
      }
      for (size_t q = 0; q < P; ++q) {
        const int64_t L = chunk_len(static_cast<int64_t>(q));
        if (L == 0) continue;
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(grecv + q * B + 4 * NB);
        const float* scale = reinterpret_cast<const float*>(grecv + q * B);
        void* dst = static_cast<uint8_t*>(s.out.data) + static_cast<size_t>(q * CE) * es;
        float* f =
            ot == DType::kFloat32 ? static_cast<float*>(dst) : static_cast<float*>(s.avg.data());
        k::onebit_decode_average(s.ex, &bits, &scale, 1, sign_geom(L, S), 1.0f, false, f, s.ws);
        if (cfg_.rotate)  // chunks hold whole blocks: chunk q starts at global block q CE / S
          k::hadamard_rotate(s.ex, f, L / S, S, static_cast<int64_t>(q) * CE / S, true);
        if (ot != DType::kFloat32)
          k::convert_saturating({device_, s.stream}, f, dst, ot, L);  // finite stays finite
      }
      phase_ = 0;
      if (s.staged) s.cur = 1 - s.cur;  // the step's errors and momentum become the state
      ++step_;
      set_skipped(false, s.staged);
      return std::nullopt;
    }
    default:
      GC_CHECK_ARG(false, "onebit-allreduce rank ", rank_,
                   ": next() called before begin() (no step in progress)");
  }
  return std::nullopt;
}

void OneBitAllreducePlan::undo_state() {
  impl_->cur = 1 - impl_->cur;  // the buffers [1 - cur] still hold the state before the step
  --step_;
}

namespace {
// The 1-bit plan's state, declared once (core/state_schema.hpp). Worker errors and momenta add to
// the average with weight 1/P: every rank of a resharded job gets their mean (the sum over ranks
// / P is kept). The server errors are already in the average's units, one chunk per rank: laid
// end to end they are one vector over the bucket (rotated per global block, so the same
// coordinates for any world size), and the new job's rank q takes its chunk of it, exactly.
const detail::StateSchema& onebit_schema() {
  using detail::FieldRole;
  using detail::FieldType;
  static const detail::StateSchema s{
      "onebit-allreduce",
      {{"numel", FieldRole::kNumel},
       {"world", FieldRole::kWorld},
       {"rank", FieldRole::kRank},
       {"scaling", FieldRole::kOption, FieldType::kU8},
       {"error_feedback", FieldRole::kOption, FieldType::kU8},
       {"block_size", FieldRole::kOption, FieldType::kI64},
       {"has_momentum", FieldRole::kOption, FieldType::kU8},
       {"rotate", FieldRole::kOption, FieldType::kU8},
       {"step", FieldRole::kStep},
       {"worker_error", FieldRole::kMean},
       {"server_error", FieldRole::kChunk},
       {"momentum", FieldRole::kMean, FieldType::kI64,
        [](const detail::StateScalars& v) { return v.at("has_momentum") != 0; }}},
      [](const detail::StateScalars& v, int world) {
        return 32 * chunk_words(v.at("numel"), world, v.at("block_size"));
      },
      [](const detail::StateScalars& v) {
        const int64_t c = v.at("block_size");
        GC_CHECK_ARG(c >= 0 && c % 32 == 0 && c <= (int64_t{1} << 24),
                     "state_dict: bad block_size ", c);
      }};
  return s;
}
}  // namespace

std::map<std::string, int64_t> OneBitAllreducePlan::state_scalars() const {
  return {{"numel", numel_},
          {"world", world_},
          {"rank", rank_},
          {"scaling", static_cast<int64_t>(cfg_.scaling)},
          {"error_feedback", cfg_.error_feedback},
          {"block_size", cfg_.block_size},
          {"has_momentum", cfg_.momentum > 0.0},
          {"rotate", cfg_.rotate},
          {"step", step_}};
}

std::vector<uint8_t> OneBitAllreducePlan::state_dict() const {
  std::vector<const void*> arrays = {impl_->we_in(), impl_->se_in()};
  if (cfg_.momentum > 0.0) arrays.push_back(impl_->u_in());
  return detail::write_state(onebit_schema(), state_scalars(), arrays, device_, impl_->stream);
}

void OneBitAllreducePlan::load_state_dict(const uint8_t* data, size_t nbytes) {
  GC_CHECK_ARG(phase_ == 0, "onebit-allreduce: load_state_dict() during a step");
  const auto loaded = detail::read_state(onebit_schema(), data, nbytes, state_scalars());
  const size_t wb = static_cast<size_t>(numel_) * sizeof(float);
  if (cfg_.momentum > 0.0)
    device_copy(impl_->u_in(), device_, loaded.arrays[2], Device::kCPU, wb, impl_->stream);
  device_copy(impl_->we_in(), device_, loaded.arrays[0], Device::kCPU, wb, impl_->stream);
  device_copy(impl_->se_in(), device_, loaded.arrays[1], Device::kCPU,
              static_cast<size_t>(chunk_elems()) * sizeof(float), impl_->stream);
  step_ = loaded.step;
  start_step();
}

std::vector<uint8_t> detail::reshard_onebit_state(const std::vector<std::vector<uint8_t>>& states,
                                                  int world, int rank) {
  return reshard_by_schema(onebit_schema(), states, world, rank);
}

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The multi-bit two-phase allreduce (QuantPlan, plans/quant_plan.hpp): worker quantization
// and all-to-all of the chunks, server averaging and quantization, allgather; or, by the gather
// route, one allgather of every rank's chunks and every rank averaging all of them. Local work goes
// through the kernels' entry points (kernels/entry.hpp); the collectives are only asked for.
#include "plans/quant_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>

#include "compressors/checks.hpp"
#include "core/state_io.hpp"
#include "core/state_schema.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/quant.hpp"
#include "kernels/onebit_kernels.hpp"
#include "kernels/quant_kernels.hpp"
#include "kernels/reduce_kernels.hpp"
#include "kernels/topk_kernels.hpp"
#include "plans/envelope.hpp"
#include "plans/family.hpp"
#include "plans/options_hash.hpp"
#include "plans/two_phase.hpp"

namespace gradcomp {

namespace k = kernels;

void QuantConfig::validate() const {
  GC_CHECK_ARG(bits == 2 || bits == 4 || bits == 8, "quant: bits must be 2, 4 or 8, got ", bits);
  GC_CHECK_ARG(block_size >= 32 && block_size <= 8192 && (block_size & (block_size - 1)) == 0,
               "quant: block_size must be a power of two in [32, 8192], got ", block_size);
  GC_CHECK_ARG(scale_dtype == DType::kFloat32 || scale_dtype == DType::kFloat16,
               "quant: scale_dtype must be float32 or float16, got ", dtype_name(scale_dtype));
  GC_CHECK_ARG(static_cast<uint8_t>(rounding) <= 1, "quant: unknown rounding ", int(rounding));
  GC_CHECK_ARG(static_cast<uint8_t>(scale) <= 1, "quant: unknown scale ", int(scale));
}

double quant_bits_per_value(const QuantConfig& cfg) {
  const int per_block = (cfg.scale == QuantScale::kAsymmetric ? 2 : 1) *
                        (cfg.scale_dtype == DType::kFloat16 ? 16 : 32);
  return cfg.bits + static_cast<double>(per_block) / static_cast<double>(cfg.block_size);
}

namespace {

/// What every sent chunk starts with (24 bytes, little-endian): the sender's step envelope
/// (plans/envelope.hpp), which is the same in each of its chunks, so that every server reads every
/// rank's envelope and all reach one verdict, then what belongs to the chunk alone.
struct ChunkHeader {
  /// The sender's step and options hash. Its flag: in a worker chunk, the sender's gradient held
  /// NaN / Inf; in a server's averaged chunk, some worker chunk the server received was flagged.
  detail::ByteEnvelope envelope;
  /// Elements in the chunk (at most 2^40); in a server's averaged chunk kMismatch is added when
  /// the server refused a chunk it received, which only that server saw (a count or a scale
  /// damaged in flight), so that every rank fails the step alike.
  uint64_t count = 0;
  static constexpr uint64_t kMismatch = uint64_t{1} << 63;
};
static_assert(sizeof(ChunkHeader) == 24, "the chunk header is 24 bytes on the wire");

constexpr const char* kMustMatch =
    "bits, block_size, scale, scale_dtype, rounding, rotate, average and the bucket's size";

/// The kernels' geometry of a chunk of n elements laid out for `capacity` (0: n), from the
/// config: the constructor sizes the chunk slots with it and every step encodes and decodes with
/// it, so the two cannot disagree on the layout.
k::QuantGeom quant_geom(const QuantConfig& cfg, int64_t n, int64_t capacity) {
  k::QuantGeom geo;
  geo.bits = cfg.bits;
  geo.block = cfg.block_size;
  geo.asym = cfg.scale == QuantScale::kAsymmetric;
  geo.half = cfg.scale_dtype == DType::kFloat16;
  geo.n = n;
  geo.capacity = capacity;
  return geo;
}

}  // namespace

struct QuantPlan::Impl : detail::TwoPhaseState {
  Impl(Device dev, void* s) : TwoPhaseState(dev, s), ws(dev) {}
  // A step writes the errors' [1 - cur] and a kept step swaps.
  k::QuantWorkspace ws;
  std::string mismatch;  ///< this step: what the server found wrong with a received chunk
  float* we_out() { return static_cast<float*>(we[1 - cur].data()); }
  float* se_out() { return static_cast<float*>(se[1 - cur].data()); }
};

QuantPlan::QuantPlan(const QuantConfig& cfg, int64_t numel, int world, int rank, DType grad_dtype,
                     Device device, int device_index, void* stream, PlanForm form, bool average,
                     QuantRoute route)
    : cfg_(cfg),
      form_(form),
      route_(route),
      average_(average),
      numel_(numel),
      world_(world),
      rank_(rank),
      dtype_(grad_dtype),
      device_(device) {
  cfg_.validate();
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40), "numel must be in [0, 2^40], got ",
               numel);
  GC_CHECK_ARG(world >= 1 && world <= (1 << 20), "world size must be in [1, 2^20], got ", world);
  GC_CHECK_ARG(rank >= 0 && rank < world, "rank ", rank, " is outside [0, ", world, ")");
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(grad_dtype)), "quant: unsupported gradient dtype");
  if (device == Device::kCUDA && !built_with_cuda()) throw_not_built_with_cuda("QuantPlan on CUDA");
  GC_CHECK_ARG(static_cast<uint8_t>(form) <= 2, "quant: unknown plan form ", int(form));
  GC_CHECK_ARG(static_cast<uint8_t>(route) <= 1, "quant: unknown route ", int(route));
  GC_CHECK_ARG(route == QuantRoute::kTwoPhase || form == PlanForm::kAllreduce,
               "quant: the gather route is the allreduce's (a shard form moves one chunk per "
               "rank already)");
  if (form == PlanForm::kAllreduce) {
    chunk_elems_ = detail::two_phase_chunk_elems(numel, world, cfg_.block_size);
  } else {
    // the caller's chunks (FSDP's shards) are the chunks: they need not hold whole blocks, so the
    // block rotation, which needs whole blocks per chunk to be undone by a chunk's owner, is out
    const char* f = form == PlanForm::kReduceScatter ? "reduce-scatter" : "allgather";
    GC_CHECK_ARG(numel % world == 0, "quant ", f, ": the bucket's ", numel,
                 " elements must split into ", world, " equal chunks (one per rank)");
    GC_CHECK_ARG(!cfg_.rotate, "quant ", f,
                 ": rotate is not available (the rotation needs chunks of whole blocks)");
    GC_CHECK_ARG(form == PlanForm::kReduceScatter || (!cfg_.error_feedback && !cfg_.check_finite),
                 "quant allgather: error_feedback and check_finite must be off (parameters are "
                 "gathered, not summed: there is no error to feed back and no step to skip)");
    GC_CHECK_ARG(form == PlanForm::kReduceScatter || cfg_.rounding == QuantRounding::kNearest,
                 "quant allgather: rounding must be nearest (a module's forward and backward "
                 "gathers must give the same weights)");
    GC_CHECK_ARG(form == PlanForm::kAllgather || cfg_.check_finite,
                 "quant reduce-scatter: check_finite must be on (a non-finite gradient would "
                 "otherwise reach the chunks' owners as an Inf scale, which only each owner sees: "
                 "one rank would raise alone)");
    chunk_elems_ = numel / world;
  }
  const k::QuantGeom geo = quant_geom(cfg_, chunk_elems_, 0);
  block_bytes_ = sizeof(ChunkHeader) + static_cast<size_t>(geo.body_bytes());
  // what the chunks of every rank must agree on (the step envelope's options): the codec that
  // lays out and decodes them, the bucket they cut (the form: the same chunks either way), the
  // rotation (a rotated chunk summed with an unrotated one is a wrong average with the same
  // layout) and whether the owners write the average or the sum
  detail::OptionsHash h;
  h.add(numel).add(static_cast<int>(form)).add(cfg_.bits).add(cfg_.block_size);
  h.add(static_cast<int>(cfg_.scale)).add(static_cast<int>(cfg_.scale_dtype));
  h.add(static_cast<int>(cfg_.rounding)).add(static_cast<int>(cfg_.rotate));
  h.add(static_cast<int>(average_));
  if (route == QuantRoute::kGather) h.add(1);  // (the two-phase hash as it always was)
  options_hash_ = static_cast<uint32_t>(h.value());
  impl_ = std::make_unique<Impl>(device, stream);
  impl_->device_index = device_index;
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world), B = block_bytes_;
  const auto n = static_cast<size_t>(numel), ce = static_cast<size_t>(chunk_elems_);
  const size_t wn = form == PlanForm::kAllgather ? 0 : n;   // no worker error to gather
  const size_t sn = form == PlanForm::kAllreduce ? ce : 0;  // only the allreduce has a server
  for (Buffer& b : s.we)
    device_zero(device, b.get<float>(wn + 1), (wn + 1) * sizeof(float), stream);
  for (Buffer& b : s.se)
    device_zero(device, b.get<float>(sn + 1), (sn + 1) * sizeof(float), stream);
  // the bytes a chunk does not fill (padding, a short last chunk) stay zero for good
  device_zero(device, s.send.get<uint8_t>(P * B), P * B, stream);
  device_zero(device, s.gsend.get<uint8_t>(B), B, stream);
  // the gather route receives every rank's P chunks
  s.recv.get<uint8_t>(route == QuantRoute::kGather ? P * P * B : P * B);
  s.grecv.get<uint8_t>(P * B);
  s.avg.get<float>(ce + 1);
}

QuantPlan::~QuantPlan() = default;

std::string QuantPlan::name() const {
  return form_ == PlanForm::kAllreduce ? (route_ == QuantRoute::kGather ? "quant_gather" : "quant")
         : form_ == PlanForm::kReduceScatter ? "quant_rs"
                                             : "quant_ag";
}

const float* QuantPlan::worker_error() const { return impl_->we_in(); }
const float* QuantPlan::server_error() const { return impl_->se_in(); }

void QuantPlan::begin(const TensorView& grad) {
  Impl& s = *impl_;
  GC_CHECK_ARG(phase_ == 0, "quant rank ", rank_,
               ": begin() called while a step is in progress (run next() until it returns "
               "nullopt)");
  detail::check_grad(grad, numel_, device_, s.device_index, cfg_.tensor_id, "quant");
  GC_CHECK_ARG(grad.dtype == dtype_, "quant tensor ", cfg_.tensor_id, ": gradient is ",
               dtype_name(grad.dtype), " but the plan was built for ", dtype_name(dtype_));
  s.bad = -1;
  s.bad_what.clear();
  s.mismatch.clear();
  s.grad = grad;
  s.src = grad.data;
  s.src_t = grad.dtype;
  phase_ = 1;
  start_step();
  // a bad gradient changes nothing here: phase 1 raises the flag of this rank's step envelope (in
  // every chunk it sends) instead of sending its data, and every rank learns of it from the step's
  // own data
  const bool prescan = cfg_.check_finite && (cfg_.rotate || device_ == Device::kCUDA);
  if (prescan && numel_ > 0) {
    // the rotation spreads a bad value over its block and the CUDA compress checks nothing:
    // scanned first, so the index is the gradient's own
    const int64_t bad = k::first_nonfinite(s.ex, grad.data, grad.dtype, numel_, s.sws);
    if (bad >= 0) {
      s.bad = bad;
      s.bad_what = detail::cat("gradient has a non-finite value (NaN or Inf) at index ", bad);
      return;
    }
  }
  if (cfg_.rotate && numel_ > 0) {
    const detail::TwoPhaseSource r = detail::two_phase_rotate(
        s.ex, grad, true, s.rot, cfg_.block_size, cfg_.check_finite, s.sws);
    s.src = r.data;
    s.src_t = DType::kFloat32;
    if (r.bad >= 0) {
      s.bad = r.bad;
      s.bad_what = r.what;
    }
  }
}

std::optional<Collective> QuantPlan::next() {
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world_), B = block_bytes_;
  const int64_t CE = chunk_elems_;
  auto chunk_len = [&](int64_t q) { return std::clamp<int64_t>(numel_ - q * CE, 0, CE); };
  k::QuantGeom geo = quant_geom(cfg_, 0, CE);  // geo.n is set per chunk
  // this rank's step envelope (the same in every chunk it sends) and a chunk's own count
  auto header = [&](int64_t len, bool flag, bool mismatch = false) {
    ChunkHeader h;
    h.envelope = detail::byte_envelope({step_, options_hash_, flag});
    h.count = static_cast<uint64_t>(len) | (mismatch ? ChunkHeader::kMismatch : 0);
    return h;
  };
  auto put_header = [&](uint8_t* dst, const ChunkHeader& h) {
    device_copy(dst, device_, &h, Device::kCPU, sizeof h, s.stream);
  };
  // the `count` (default P) received chunks' headers (B bytes apart), on the host
  auto get_headers = [&](const uint8_t* src, size_t count = 0) {
    std::vector<ChunkHeader> hs(count ? count : P);
    for (size_t q = 0; q < hs.size(); ++q)
      device_copy(&hs[q], Device::kCPU, src + q * B, device_, sizeof(ChunkHeader), s.stream);
    return hs;
  };
  // the verdict of the senders' envelopes: every receiver holds the same P of them
  auto envelopes = [&](const std::vector<ChunkHeader>& hs) {
    static_assert(offsetof(ChunkHeader, envelope) == 0, "the envelope starts the header");
    return detail::read_byte_envelopes(reinterpret_cast<const uint8_t*>(hs.data()),
                                       sizeof(ChunkHeader), world_);
  };
  auto flagged = [](const ChunkHeader& h) { return h.envelope.step < 0; };
  // what is wrong with a received chunk's scales ("" when they are usable): a scale that no
  // encoder makes (NaN, Inf, a negative step) would poison the average and the server error
  auto scale_fault = [&](const uint8_t* body, int64_t len) -> std::string {
    const int spb = geo.scales_per_block(), sb = geo.scale_bytes();
    const int64_t count = (len + cfg_.block_size - 1) / cfg_.block_size * spb;
    std::vector<uint8_t> host(static_cast<size_t>(count * sb));
    device_copy(host.data(), Device::kCPU, body, device_, host.size(), s.stream);
    for (int64_t i = 0; i < count; ++i) {
      float v;
      if (geo.half) {
        uint16_t h;
        std::memcpy(&h, host.data() + 2 * i, 2);
        v = half_to_float(h);
      } else {
        std::memcpy(&v, host.data() + 4 * i, 4);
      }
      const bool is_step = !geo.asym || i % 2 == 1;
      if (!std::isfinite(v) || (is_step && v < 0.0f))
        return detail::cat("has an invalid scale (", v, ") for block ", i / spb);
    }
    return "";
  };
  // the kernels draw random words four at a time from a chunk's first index, which must be a
  // multiple of 4: allreduce chunks start on whole blocks; a shard form's chunk q draws from
  // q * CE rounded up to 4 (still one stream index per element)
  auto rng_of = [&](uint64_t role, int64_t first) {
    if (form_ != PlanForm::kAllreduce && CE > 0) first = first / CE * ((CE + 3) / 4 * 4);
    k::QuantRng r;
    r.stochastic = cfg_.rounding == QuantRounding::kStochastic;
    r.key = RngKey{cfg_.seed, static_cast<uint64_t>(step_), cfg_.tensor_id};
    r.role = role;
    r.first = static_cast<uint64_t>(first);
    return r;
  };
  // a step some rank's non-finite gradient dropped: `nbytes` at `out` become NaN (the output the
  // optimizer sees), nothing else changes; OnNonFinite::kRaise raises on every rank
  auto skip_step = [&](void* out, size_t nbytes) -> std::optional<Collective> {
    device_fill_nan(device_, out, nbytes, s.stream);
    set_skipped(true);
    if (on_nonfinite_ == OnNonFinite::kRaise) {
      GC_CHECK_ARG(s.bad < 0, "quant tensor ", cfg_.tensor_id, " rank ", rank_, ": ", s.bad_what,
                   "; the step was dropped on every rank and no state changed ",
                   "(on_nonfinite='raise')");
      GC_CHECK_ARG(false, "quant tensor ", cfg_.tensor_id, " rank ", rank_,
                   ": another rank's gradient held a non-finite value (NaN or Inf); the step ",
                   "was dropped on every rank and no state changed (on_nonfinite='raise')");
    }
    return std::nullopt;
  };
  // the last step of both routes: the average of chunk q, decoded from `nb` bodies (summed in
  // rank order, times `scale`), rotated back and cast into the gradient
  auto decode_chunk = [&](size_t q, const uint8_t* const* bodies, int nb, float scale) {
    const int64_t L = chunk_len(static_cast<int64_t>(q));
    if (L == 0) return;
    const DType ot = s.grad.dtype;
    void* dst = static_cast<uint8_t*>(s.grad.data) + static_cast<size_t>(q * CE) * dtype_size(ot);
    float* f = ot == DType::kFloat32 ? static_cast<float*>(dst) : static_cast<float*>(s.avg.data());
    geo.n = L;
    k::quant_decode_average(s.ex, bodies, nb, geo, scale, f, s.ws);
    if (cfg_.rotate)  // chunks hold whole blocks: chunk q starts at global block q CE / S
      k::hadamard_rotate(s.ex, f, L / cfg_.block_size, cfg_.block_size,
                         static_cast<int64_t>(q) * CE / cfg_.block_size, true);
    if (ot != DType::kFloat32)
      k::convert_saturating({device_, s.stream}, f, dst, ot, L);  // finite stays finite
  };
  Collective c;
  c.device = device_;
  c.stream = s.stream;
  c.world = world_;
  c.type = ElemType::kU8;
  c.count = B;
  // the phase's collective of B-byte chunks; the step moves on to `phase`
  auto ask = [&](CollectiveKind kind, const void* send, void* recv, const char* tag, int phase) {
    c.kind = kind;
    c.send = send;
    c.recv = recv;
    c.tag = tag;
    phase_ = phase;
    return c;
  };
  switch (phase_) {
    case 1: {  // (1) worker: quantize every chunk into its send block
      auto* send = static_cast<uint8_t*>(s.send.data());
      const size_t es = dtype_size(s.src_t);
      if (form_ == PlanForm::kAllgather) {  // only this rank's own chunk leaves it
        auto* gsend = static_cast<uint8_t*>(s.gsend.data());
        const int64_t L = chunk_len(rank_), off = static_cast<int64_t>(rank_) * CE;
        if (L > 0) {
          geo.n = L;
          k::quant_compress(
              s.ex, static_cast<const uint8_t*>(s.src) + static_cast<size_t>(off) * es, s.src_t,
              nullptr, nullptr, geo, rng_of(static_cast<uint64_t>(rank_), off), false,
              gsend + sizeof(ChunkHeader));
        }
        put_header(gsend, header(L, false));
        return ask(CollectiveKind::kAllgather, gsend, s.grecv.data(), "quant gather", 3);
      }
      const bool ef = cfg_.error_feedback;
      const bool check = cfg_.check_finite && device_ == Device::kCPU && !cfg_.rotate;
      for (size_t q = 0; q < P && s.bad < 0; ++q) {
        const int64_t L = chunk_len(static_cast<int64_t>(q)), off = static_cast<int64_t>(q) * CE;
        if (L == 0) continue;
        geo.n = L;
        const int64_t bad = k::quant_compress(
            s.ex, static_cast<const uint8_t*>(s.src) + static_cast<size_t>(off) * es, s.src_t,
            ef ? s.we_in() + off : nullptr, ef ? s.we_out() + off : nullptr, geo,
            rng_of(static_cast<uint64_t>(rank_), off), check, send + q * B + sizeof(ChunkHeader));
        if (bad >= 0) {
          s.bad = off + bad;
          s.bad_what = detail::cat("gradient has a non-finite value (NaN or Inf) at index ", s.bad);
        }
      }
      for (size_t q = 0; q < P; ++q)
        put_header(send + q * B, header(chunk_len(static_cast<int64_t>(q)), s.bad >= 0));
      if (route_ == QuantRoute::kGather) {  // every rank's chunks to every rank
        c.count = P * B;
        return ask(CollectiveKind::kAllgather, send, s.recv.data(), "quant gather all", 4);
      }
      return ask(CollectiveKind::kAllToAll, send, s.recv.data(), "quant worker chunks", 2);
    }
    case 2: {  // (2) server: average chunk `rank` of every worker, add server error, quantize
      const int64_t L = chunk_len(rank_), off = static_cast<int64_t>(rank_) * CE;
      const auto* recv = static_cast<const uint8_t*>(s.recv.data());
      auto* gsend = static_cast<uint8_t*>(s.gsend.data());
      const std::vector<ChunkHeader> hs = get_headers(recv);
      const detail::EnvelopeVerdict v = envelopes(hs);
      if (!v.agreed())
        s.mismatch =
            "the senders' step envelopes disagree (other options, other steps, or a "
            "chunk that is not a quant chunk)";
      // what only this server sees: a chunk cut short or a scale no encoder writes (a flagged
      // chunk's body is not read: its sender stopped encoding at the bad value)
      for (size_t q = 0; q < P && s.mismatch.empty(); ++q) {
        std::string d;
        if (hs[q].count != static_cast<uint64_t>(L))
          d = detail::cat("holds ", hs[q].count, " elements, not ", L);
        else if (!flagged(hs[q]) && L > 0)
          d = scale_fault(recv + q * B + sizeof(ChunkHeader), L);
        if (!d.empty()) s.mismatch = detail::cat("rank ", q, "'s chunk ", rank_, " ", d);
      }
      if (form_ == PlanForm::kReduceScatter) {
        // every server saw every rank's envelope: the verdict and the flag agree across ranks
        // (see quant_plan.hpp)
        phase_ = 0;
        if (!v.agreed()) detail::throw_disagreement(v, name().c_str(), kMustMatch, step_, true);
        GC_CHECK_ARG(s.mismatch.empty(), "quant tensor ", cfg_.tensor_id, " rank ", rank_, ": ",
                     s.mismatch, "; the step failed and no state changed");
        const size_t es = dtype_size(s.grad.dtype);
        void* dst = static_cast<uint8_t*>(s.grad.data) + static_cast<size_t>(off) * es;
        if (v.flagged) return skip_step(dst, static_cast<size_t>(L) * es);
        if (L > 0) {
          std::vector<const uint8_t*> bodies(P);
          for (size_t q = 0; q < P; ++q) bodies[q] = recv + q * B + sizeof(ChunkHeader);
          geo.n = L;
          const bool f32 = s.grad.dtype == DType::kFloat32;
          float* f = f32 ? static_cast<float*>(dst) : static_cast<float*>(s.avg.data());
          k::quant_decode_average(s.ex, bodies.data(), world_, geo,
                                  average_ ? 1.0f / static_cast<float>(world_) : 1.0f, f, s.ws);
          if (!f32) k::convert_saturating({device_, s.stream}, f, dst, s.grad.dtype, L);
        }
        if (cfg_.error_feedback) s.cur = 1 - s.cur;
        ++step_;
        set_skipped(false, true);
        return std::nullopt;
      }
      // the allreduce: a refused chunk is passed on (kMismatch) rather than raised here, where
      // only this server might see it; phase 3 ends the step alike on every rank
      const bool mismatch = !s.mismatch.empty();
      if (!mismatch && !v.flagged && L > 0) {
        std::vector<const uint8_t*> bodies(P);
        for (size_t q = 0; q < P; ++q) bodies[q] = recv + q * B + sizeof(ChunkHeader);
        geo.n = L;
        float* avg = static_cast<float*>(s.avg.data());
        k::quant_decode_average(s.ex, bodies.data(), world_, geo, 1.0f / static_cast<float>(world_),
                                avg, s.ws);
        const bool ef = cfg_.error_feedback;
        k::quant_compress(
            s.ex, avg, DType::kFloat32, ef ? s.se_in() : nullptr, ef ? s.se_out() : nullptr, geo,
            rng_of(static_cast<uint64_t>(world_ + rank_), off), false, gsend + sizeof(ChunkHeader));
      }
      put_header(gsend, header(L, v.flagged, mismatch));
      return ask(CollectiveKind::kAllgather, gsend, s.grecv.data(), "quant server chunks", 3);
    }
    case 3: {  // (3) decode every averaged chunk into the gradient
      const auto* grecv = static_cast<const uint8_t*>(s.grecv.data());
      const std::vector<ChunkHeader> hs = get_headers(grecv);
      const detail::EnvelopeVerdict v = envelopes(hs);
      phase_ = 0;
      // no state changed (the step wrote only the other copy of the errors)
      if (!v.agreed()) detail::throw_disagreement(v, name().c_str(), kMustMatch, step_, true);
      std::string fault;
      for (size_t q = 0; q < P && fault.empty(); ++q) {
        const int64_t L = chunk_len(static_cast<int64_t>(q));
        const uint64_t count = hs[q].count & ~ChunkHeader::kMismatch;
        if (count != static_cast<uint64_t>(L))
          fault =
              detail::cat("the averaged chunk of rank ", q, " holds ", count, " elements, not ", L);
        else if (hs[q].count & ChunkHeader::kMismatch)
          fault = detail::cat("rank ", q, " refused a chunk it received",
                              q == static_cast<size_t>(rank_) ? ": " + s.mismatch : std::string());
        else if (!flagged(hs[q]) && L > 0) {
          const std::string d = scale_fault(grecv + q * B + sizeof(ChunkHeader), L);
          if (!d.empty()) fault = detail::cat("the averaged chunk of rank ", q, " ", d);
        }
      }
      GC_CHECK_ARG(fault.empty(), "quant tensor ", cfg_.tensor_id, " rank ", rank_, ": ", fault,
                   "; the step failed on every rank and no state changed");
      if (v.flagged) return skip_step(s.grad.data, static_cast<size_t>(s.grad.nbytes()));
      for (size_t q = 0; q < P; ++q) {
        const uint8_t* body = grecv + q * B + sizeof(ChunkHeader);
        decode_chunk(q, &body, 1, 1.0f);
      }
      if (cfg_.error_feedback) s.cur = 1 - s.cur;  // the step's errors become the state
      ++step_;
      set_skipped(false, true);
      return std::nullopt;
    }
    case 4: {  // the gather route: every rank averages every chunk of every rank
      const auto* recv = static_cast<const uint8_t*>(s.recv.data());
      const size_t RB = P * B;  // one rank's P chunks: rank r's chunk q at r RB + q B
      phase_ = 0;
      const std::vector<ChunkHeader> hs = get_headers(recv, P * P);  // (r P + q: B bytes apart)
      // each sender's envelope from its first chunk. Every rank received the same bytes, so the
      // verdict and every fault below are reached alike on every rank; a chunk damaged on its way
      // to one rank is refused by that rank alone, as the two phases' averaged chunks are. No
      // state changed on a failure (the step wrote only the other copy of the worker error).
      std::vector<ChunkHeader> first(P);
      for (size_t r = 0; r < P; ++r) first[r] = hs[r * P];
      const detail::EnvelopeVerdict v = envelopes(first);
      if (!v.agreed()) detail::throw_disagreement(v, name().c_str(), kMustMatch, step_, true);
      std::string fault;
      for (size_t r = 0; r < P && fault.empty(); ++r)
        for (size_t q = 0; q < P && fault.empty(); ++q) {
          const ChunkHeader& h = hs[r * P + q];
          const int64_t L = chunk_len(static_cast<int64_t>(q));
          if (std::memcmp(&h.envelope, &first[r].envelope, sizeof h.envelope) != 0)
            fault = "carries another step envelope than its first chunk";
          else if (h.count != static_cast<uint64_t>(L))
            fault = detail::cat("holds ", h.count, " elements, not ", L);
          else if (!flagged(h) && L > 0)
            fault = scale_fault(recv + r * RB + q * B + sizeof(ChunkHeader), L);
          if (!fault.empty()) fault = detail::cat("rank ", r, "'s chunk ", q, " ", fault);
        }
      GC_CHECK_ARG(fault.empty(), "quant tensor ", cfg_.tensor_id, " rank ", rank_, ": ", fault,
                   "; the step failed on every rank and no state changed");
      if (v.flagged) return skip_step(s.grad.data, static_cast<size_t>(s.grad.nbytes()));
      std::vector<const uint8_t*> bodies(P);
      for (size_t q = 0; q < P; ++q) {
        for (size_t r = 0; r < P; ++r) bodies[r] = recv + r * RB + q * B + sizeof(ChunkHeader);
        decode_chunk(q, bodies.data(), world_, 1.0f / static_cast<float>(world_));
      }
      if (cfg_.error_feedback) s.cur = 1 - s.cur;  // the step's worker error becomes the state
      ++step_;
      set_skipped(false, true);
      return std::nullopt;
    }
    default:
      GC_CHECK_ARG(false, "quant rank ", rank_, ": next() called before begin() (no step in ",
                   "progress)");
  }
  return std::nullopt;
}

void QuantPlan::undo_state() {
  if (cfg_.error_feedback) impl_->cur = 1 - impl_->cur;  // [1 - cur] still holds the prior state
  --step_;
}

namespace {
// The quant plan's state, declared once (core/state_schema.hpp): the options it was built with,
// the step, each rank's worker error (the ranks' mean when resharded) and, in the allreduce form,
// the server error of the rank's chunk (cut anew for another world size, as the 1-bit plan's).
QuantConfig config_of(const detail::StateScalars& v) {
  QuantConfig c;
  c.bits = static_cast<int>(v.at("bits"));
  c.block_size = v.at("block_size");
  c.rounding = static_cast<QuantRounding>(v.at("rounding"));
  c.scale = static_cast<QuantScale>(v.at("scale"));
  c.scale_dtype = static_cast<DType>(v.at("scale_dtype"));
  return c;
}

const detail::StateSchema& quant_schema(PlanForm form) {
  using detail::FieldRole;
  using detail::FieldType;
  static const auto fields = [](bool server) {
    std::vector<detail::StateField> f = {{"numel", FieldRole::kNumel},
                                         {"world", FieldRole::kWorld},
                                         {"rank", FieldRole::kRank},
                                         {"bits", FieldRole::kOption, FieldType::kU8},
                                         {"block_size", FieldRole::kOption, FieldType::kI64},
                                         {"rounding", FieldRole::kOption, FieldType::kU8},
                                         {"scale", FieldRole::kOption, FieldType::kU8},
                                         {"scale_dtype", FieldRole::kOption, FieldType::kU8},
                                         {"error_feedback", FieldRole::kOption, FieldType::kU8},
                                         {"rotate", FieldRole::kOption, FieldType::kU8},
                                         {"seed", FieldRole::kOption, FieldType::kU64},
                                         {"step", FieldRole::kStep},
                                         {"worker_error", FieldRole::kMean}};
    if (server) f.push_back({"server_error", FieldRole::kChunk});
    return f;
  };
  static const detail::StateSchema allreduce{
      "quant-allreduce", fields(true),
      [](const detail::StateScalars& v, int world) {
        return detail::two_phase_chunk_elems(v.at("numel"), world, v.at("block_size"));
      },
      [](const detail::StateScalars& v) { config_of(v).validate(); }};
  // the reduce-scatter form's state belongs to its world size (FSDP pads each parameter to it)
  static const detail::StateSchema reduce_scatter{
      "quant-reduce-scatter", fields(false), nullptr,
      [](const detail::StateScalars& v) {
        const int64_t numel = v.at("numel"), P = v.at("world");
        GC_CHECK_ARG(numel % P == 0, "state_dict: numel ", numel, " is not a bucket of ", P,
                     " equal chunks");
        config_of(v).validate();
        GC_CHECK_ARG(v.at("rotate") == 0, "state_dict: a reduce-scatter state with rotate");
      },
      true};
  return form == PlanForm::kAllreduce ? allreduce : reduce_scatter;
}
}  // namespace

detail::StateScalars QuantPlan::state_scalars() const {
  return {{"numel", numel_},
          {"world", world_},
          {"rank", rank_},
          {"bits", cfg_.bits},
          {"block_size", cfg_.block_size},
          {"rounding", static_cast<int64_t>(cfg_.rounding)},
          {"scale", static_cast<int64_t>(cfg_.scale)},
          {"scale_dtype", static_cast<int64_t>(cfg_.scale_dtype)},
          {"error_feedback", cfg_.error_feedback},
          {"rotate", cfg_.rotate},
          {"seed", static_cast<int64_t>(cfg_.seed)},
          {"step", step_}};
}

std::vector<uint8_t> QuantPlan::state_dict() const {
  if (form_ == PlanForm::kAllgather) return {};
  std::vector<const void*> arrays = {impl_->we_in()};
  if (form_ == PlanForm::kAllreduce) arrays.push_back(impl_->se_in());
  return detail::write_state(quant_schema(form_), state_scalars(), arrays, device_, impl_->stream);
}

void QuantPlan::load_state_dict(const uint8_t* data, size_t nbytes) {
  GC_CHECK_ARG(phase_ == 0, "quant: load_state_dict() during a step");
  if (form_ == PlanForm::kAllgather) return BucketPlan::load_state_dict(data, nbytes);
  const auto loaded = detail::read_state(quant_schema(form_), data, nbytes, state_scalars());
  device_copy(impl_->we_in(), device_, loaded.arrays[0], Device::kCPU,
              static_cast<size_t>(numel_) * sizeof(float), impl_->stream);
  if (form_ == PlanForm::kAllreduce && route_ == QuantRoute::kTwoPhase)
    device_copy(impl_->se_in(), device_, loaded.arrays[1], Device::kCPU,
                static_cast<size_t>(chunk_elems_) * sizeof(float), impl_->stream);
  if (form_ == PlanForm::kAllreduce && route_ == QuantRoute::kGather) {
    // no server here: what the server error owes the average of this rank's chunk goes into this
    // rank's worker error for it, P times (the average divides by P); both server copies stay 0
    const int64_t off = static_cast<int64_t>(rank_) * chunk_elems_;
    const int64_t L = std::clamp<int64_t>(numel_ - off, 0, chunk_elems_);
    std::vector<float> se(static_cast<size_t>(L));  // (copied: the state's bytes are unaligned)
    if (L > 0) std::memcpy(se.data(), loaded.arrays[1], se.size() * sizeof(float));
    if (std::any_of(se.begin(), se.end(), [](float x) { return x != 0.0f; })) {
      std::vector<float> we(static_cast<size_t>(L));
      std::memcpy(we.data(), loaded.arrays[0] + static_cast<size_t>(off) * sizeof(float),
                  we.size() * sizeof(float));
      for (int64_t i = 0; i < L; ++i) we[i] += static_cast<float>(world_) * se[i];
      device_copy(impl_->we_in() + off, device_, we.data(), Device::kCPU, we.size() * sizeof(float),
                  impl_->stream);
    }
  }
  step_ = loaded.step;
  start_step();
}

std::vector<uint8_t> detail::reshard_quant_state(const std::vector<std::vector<uint8_t>>& states,
                                                 int world, int rank) {
  return reshard_by_schema(quant_schema(PlanForm::kAllreduce), states, world, rank);
}

std::vector<uint8_t> detail::reshard_quant_shard_state(const RankStateList& states, int world,
                                                       int rank) {
  return reshard_by_schema(quant_schema(PlanForm::kReduceScatter), states, world, rank);
}

}  // namespace gradcomp

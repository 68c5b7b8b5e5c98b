// SPDX-License-Identifier: Apache-2.0
// The reduce-scatter form of top-k (TopKReduceScatterPlan, plans/topk_plan.hpp): per destination
// chunk, the k largest magnitudes of residual + gradient, one all-to-all of equal parts, a
// rank-ordered fp32 scatter-add on the chunk's owner.
#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include "core/state_io.hpp"
#include "core/state_schema.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/topk.hpp"
#include "kernels/reduce_kernels.hpp"
#include "kernels/topk_kernels.hpp"
#include "plans/envelope.hpp"
#include "plans/family.hpp"
#include "plans/options_hash.hpp"
#include "plans/topk_plan.hpp"

namespace gradcomp {

namespace k = kernels;

namespace {
/// The header of every part (24 bytes, little-endian): the sender's step envelope
/// (plans/envelope.hpp; its flag: the sender's gradient held NaN / Inf), the same in each of its
/// parts, then the pairs used (at most k); then room for k uint32 indices (chunk-local), then for
/// k fp32 values.
struct PartHeader {
  detail::ByteEnvelope envelope;
  uint64_t count = 0;
};
static_assert(sizeof(PartHeader) == 24, "the part header is 24 bytes on the wire");
}  // namespace

struct TopKReduceScatterPlan::Impl {
  Impl(Device d, void* s)
      : v{Buffer(d, s), Buffer(d, s)}, send(d, s), recv(d, s), idx(d, s), wide(d, s), ws(d) {}
  Buffer v[2];  ///< residual: [cur] is the state; a step writes [1 - cur] and a kept step swaps
  Buffer send, recv, idx, wide;
  k::SelectWorkspace ws;
  int cur = 0;
  int64_t bad = -1;
  float* v_in() { return static_cast<float*>(v[cur].data()); }
  float* v_out() { return static_cast<float*>(v[1 - cur].data()); }
};

TopKReduceScatterPlan::TopKReduceScatterPlan(const Options& o, int64_t numel, DType grad_dtype,
                                             int world, int rank, Device device, int device_index,
                                             void* stream)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      o_(o),
      rank_(rank),
      chunk_(0),
      k_(0),
      part_(0) {
  GC_CHECK_ARG(o.ratio > 0 && o.ratio <= 1, "topk reduce-scatter: ratio must be in (0, 1], got ",
               o.ratio);
  o.select.validate();
  GC_CHECK_ARG(rank >= 0 && rank < world, "topk reduce-scatter: rank ", rank, " is outside [0, ",
               world, ")");
  GC_CHECK_ARG(numel % world == 0, "topk reduce-scatter: the bucket's ", numel,
               " elements must split into ", world, " equal chunks (one per rank)");
  chunk_ = numel / world;
  GC_CHECK_ARG(chunk_ < (int64_t{1} << 32), "topk reduce-scatter: chunks of ", chunk_,
               " elements; indices are uint32");
  k_ = topk_count(o.ratio, chunk_);
  part_ = sizeof(PartHeader) + 8 * static_cast<size_t>(k_);
  // what every rank's parts depend on (the step envelope's options): their size and layout
  options_hash_ = static_cast<uint32_t>(detail::OptionsHash().add(numel).add(k_).value());
  impl_ = std::make_unique<Impl>(device, stream);
  const auto n = static_cast<size_t>(numel), P = static_cast<size_t>(world);
  for (Buffer& b : impl_->v) device_zero(device, b.get<float>(n + 1), (n + 1) * 4, stream);
  device_zero(device, impl_->send.get<uint8_t>(P * part_), P * part_, stream);
  impl_->recv.get<uint8_t>(P * part_);
  impl_->idx.get<uint32_t>(static_cast<size_t>(k_) + 1);
  impl_->wide.get<float>(static_cast<size_t>(chunk_) + 1);
}

TopKReduceScatterPlan::~TopKReduceScatterPlan() = default;

const float* TopKReduceScatterPlan::residual() const { return impl_->v_in(); }

size_t TopKReduceScatterPlan::workspace_bytes() const {
  const Impl& s = *impl_;
  return s.send.capacity() + s.recv.capacity() + s.idx.capacity() + s.wide.capacity();
}

std::optional<Collective> TopKReduceScatterPlan::next() {
  require_begun();
  Impl& s = *impl_;
  const size_t P = static_cast<size_t>(world_), B = part_;
  const k::Exec ex{device_, stream_};
  auto* send = static_cast<uint8_t*>(s.send.data());
  auto* recv = static_cast<uint8_t*>(s.recv.data());
  switch (phase_) {
    case 0: {  // residual + gradient, then chunk q's k largest to rank q
      s.bad = o_.check_finite && numel_ > 0 ? first_nonfinite() : -1;
      PartHeader h;
      h.envelope = detail::byte_envelope({step_, options_hash_, s.bad >= 0});
      float* v = s.v_out();
      if (s.bad < 0 && numel_ > 0) {
        // without error feedback the residual starts every step at zero
        if (!o_.error_feedback) device_zero(device_, v, static_cast<size_t>(numel_) * 4, stream_);
        k::dgc_accumulate(ex, grad_.data, dtype_, numel_, 1.0f, 0.0f, false, nullptr, v, nullptr,
                          o_.error_feedback ? s.v_in() : nullptr);
      }
      auto* idx = s.idx.get<uint32_t>(static_cast<size_t>(k_) + 1);
      for (size_t q = 0; q < P; ++q) {
        uint8_t* part = send + q * B;
        h.count = 0;
        if (s.bad < 0 && chunk_ > 0) {
          float* vq = v + static_cast<int64_t>(q) * chunk_;
          const RngKey key{o_.seed, static_cast<uint64_t>(step_),
                           o_.tensor_id * 0x9E3779B1u + static_cast<uint32_t>(q)};
          const int64_t c = k::select(ex, vq, chunk_, k_, o_.select, key, idx, s.ws);
          // the pairs: indices, then the values taken out of the residual
          device_copy(part + sizeof(PartHeader), device_, idx, device_, static_cast<size_t>(c) * 4,
                      stream_);
          k::gather_and_clear(ex, vq, nullptr, idx, c,
                              part + sizeof(PartHeader) + 4 * static_cast<size_t>(k_),
                              DType::kFloat32, nullptr);
          h.count = static_cast<uint64_t>(c);
        }
        device_copy(part, device_, &h, Device::kCPU, sizeof h, stream_);
      }
      phase_ = 1;
      return make(CollectiveKind::kAllToAll, ElemType::kU8, send, recv, B, "topk shard parts");
    }
    case 1: {  // rank r: the P parts of its chunk, checked, added in rank order
      std::vector<uint8_t> host(P * B);
      device_copy(host.data(), Device::kCPU, recv, device_, host.size(), stream_);
      std::vector<PartHeader> hs(P);
      for (size_t q = 0; q < P; ++q) std::memcpy(&hs[q], host.data() + q * B, sizeof(PartHeader));
      static_assert(offsetof(PartHeader, envelope) == 0, "the envelope starts the header");
      const detail::EnvelopeVerdict v = detail::read_byte_envelopes(
          reinterpret_cast<const uint8_t*>(hs.data()), sizeof(PartHeader), world_);
      phase_ = kDone;
      // every rank saw every rank's envelope: steps, options and flags agree across the servers
      const bool skip =
          detail::require_agreement(v, "topk_rs", "ratio and the bucket's size", step_);
      std::string fault;
      for (size_t q = 0; q < P && fault.empty(); ++q) {
        if (hs[q].envelope.step < 0) continue;  // flagged: its sender wrote no pairs
        if (hs[q].count > static_cast<uint64_t>(k_)) {
          fault = detail::cat("rank ", q, "'s part holds ", hs[q].count, " pairs in room for ", k_);
          break;
        }
        const uint8_t* ix = host.data() + q * B + sizeof(PartHeader);
        for (uint64_t j = 0; j < hs[q].count; ++j) {
          uint32_t i;
          std::memcpy(&i, ix + 4 * j, 4);
          if (i >= static_cast<uint64_t>(chunk_)) {
            fault =
                detail::cat("rank ", q, "'s part has index ", i, " outside the chunk of ", chunk_);
            break;
          }
        }
      }
      // (seen by this receiver alone: a part damaged in flight)
      GC_CHECK_ARG(fault.empty(), "topk reduce-scatter tensor ", o_.tensor_id, " rank ", rank_,
                   ": ", fault, "; the step failed and no state changed");
      const size_t gs = dtype_size(dtype_);
      void* own = static_cast<uint8_t*>(grad_.data) + static_cast<size_t>(rank_ * chunk_) * gs;
      if (skip) {
        device_fill_nan(device_, own, static_cast<size_t>(chunk_) * gs, stream_);
        set_skipped(true);
        if (on_nonfinite_ == OnNonFinite::kRaise)
          GC_CHECK_ARG(false, "topk reduce-scatter tensor ", o_.tensor_id, " rank ", rank_, ": ",
                       s.bad >= 0 ? detail::cat("gradient has a non-finite value (NaN or Inf) at "
                                                "index ",
                                                s.bad)
                                  : std::string("another rank's gradient held a non-finite value"),
                       "; the step was dropped on every rank and no state changed "
                       "(on_nonfinite='raise')");
        return std::nullopt;
      }
      if (chunk_ > 0) {
        float* w = s.wide.get<float>(static_cast<size_t>(chunk_) + 1);
        device_zero(device_, w, static_cast<size_t>(chunk_) * 4, stream_);
        for (size_t q = 0; q < P; ++q) {
          const uint8_t* part = recv + q * B + sizeof(PartHeader);
          k::scatter_add(ex, reinterpret_cast<const uint32_t*>(part),
                         part + 4 * static_cast<size_t>(k_), DType::kFloat32,
                         static_cast<int64_t>(hs[q].count), 1.0f, w);
        }
        k::convert({device_, stream_}, w, DType::kFloat32, own, dtype_, chunk_,
                   o_.average ? float(world_) : 1.0f);
      }
      s.cur = 1 - s.cur;  // the step's residual becomes the state
      ++step_;
      set_skipped(false, true);
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

void TopKReduceScatterPlan::undo_state() {
  impl_->cur = 1 - impl_->cur;  // [1 - cur] still holds the residual before the step
  --step_;
}

namespace {
// The state, declared once (core/state_schema.hpp): the settings that size and key the steps,
// the step, and the rank's residual over the whole bucket. It belongs to its world size (FSDP pads
// each parameter to it), so resharding only checks the states and hands each rank its own back.
const detail::StateSchema& topk_rs_schema() {
  using detail::FieldRole;
  using detail::FieldType;
  static const detail::StateSchema s{
      "topk-reduce-scatter",
      {{"numel", FieldRole::kNumel},
       {"world", FieldRole::kWorld},
       {"rank", FieldRole::kRank},
       {"k", FieldRole::kOption, FieldType::kI64},
       {"error_feedback", FieldRole::kOption, FieldType::kU8},
       {"seed", FieldRole::kOption, FieldType::kU64},
       {"step", FieldRole::kStep},
       {"residual", FieldRole::kMean}},
      nullptr,
      [](const detail::StateScalars& v) {
        const int64_t numel = v.at("numel"), P = v.at("world"), k = v.at("k");
        GC_CHECK_ARG(numel % P == 0, "state_dict: numel ", numel, " is not a bucket of ", P,
                     " equal chunks");
        GC_CHECK_ARG(k >= 0 && k <= numel / P, "state_dict: k ", k, " out of range");
      },
      true};
  return s;
}
}  // namespace

detail::StateScalars TopKReduceScatterPlan::state_scalars() const {
  return {{"numel", numel_},
          {"world", world_},
          {"rank", rank_},
          {"k", k_},
          {"error_feedback", o_.error_feedback},
          {"seed", static_cast<int64_t>(o_.seed)},
          {"step", step_}};
}

std::vector<uint8_t> TopKReduceScatterPlan::state_dict() const {
  return detail::write_state(topk_rs_schema(), state_scalars(), {impl_->v_in()}, device_, stream_);
}

void TopKReduceScatterPlan::load_state_dict(const uint8_t* data, size_t nbytes) {
  require_idle("load_state_dict()");
  const auto loaded = detail::read_state(topk_rs_schema(), data, nbytes, state_scalars());
  device_copy(impl_->v_in(), device_, loaded.arrays[0], Device::kCPU,
              static_cast<uint64_t>(numel_) * 4, stream_);
  step_ = loaded.step;
  start_step();
}

std::vector<uint8_t> detail::reshard_topk_shard_state(const RankStateList& states, int world,
                                                      int rank) {
  return reshard_by_schema(topk_rs_schema(), states, world, rank);
}

}  // namespace gradcomp

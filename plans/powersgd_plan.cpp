// SPDX-License-Identifier: Apache-2.0
// One PowerSGD step on a bucket as a plan (PowerSGDPlan, plans/powersgd_plan.hpp): compress
// (M, P = M Q), allreduce P, orthogonalize, Q = M^T P, allreduce Q, reconstruct. The CPU runs the
// fused phases of kernels/powersgd_kernels.hpp; CUDA runs them group by group (cuBLAS / cuSOLVER).
#include "plans/powersgd_plan.hpp"  // PowerSGDPlan

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compressors/powersgd_impl.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/powersgd_kernels.hpp"
#include "kernels/scan_kernels.hpp"
#include "kernels/topk_kernels.hpp"
#include "plans/envelope.hpp"
#include "plans/options_hash.hpp"

namespace gradcomp {

namespace {
std::unique_ptr<PowerSGDState> checked(std::unique_ptr<PowerSGDState> s) {
  GC_CHECK_ARG(s != nullptr, "PowerSGD plan: null state");
  return s;
}

// What decides every rank's collectives and Q: ranks that differ in any of it would sum P and Q
// of different projections. Told through the step envelope (plans/envelope.hpp).
uint32_t options_hash(const PowerSGDConfig& c, const std::vector<std::vector<int64_t>>& shapes) {
  detail::OptionsHash h;
  h.add(c.rank).add(c.start_iter).add(c.min_compression_rate).add(c.error_feedback);
  h.add(c.warm_start).add(c.orthogonalization_epsilon).add(c.seed).add(c.first_tensor_id);
  h.add(static_cast<int>(c.orthogonalization)).add(c.fuse_uncompressed_with_p);
  h.add(c.check_finite).add(shapes.size());
  for (const auto& s : shapes) h.add(s.size()).add_all(s);
  return static_cast<uint32_t>(h.value());
}

}  // namespace

using detail::kGpuScratchFloats;

PowerSGDPlan::PowerSGDPlan(PowerSGDState& state, int world) : st_(state), world_(world) {
  GC_CHECK_ARG(world >= 1, "PowerSGD plan: world size must be >= 1, got ", world);
  options_hash_ = options_hash(st_.cfg_, st_.impl_->shapes);
}

PowerSGDPlan::PowerSGDPlan(std::unique_ptr<PowerSGDState> state, int world)
    : owned_(checked(std::move(state))), st_(*owned_), world_(world) {
  GC_CHECK_ARG(world >= 1, "PowerSGD plan: world size must be >= 1, got ", world);
  options_hash_ = options_hash(st_.cfg_, st_.impl_->shapes);
}

void PowerSGDPlan::begin(const TensorView& bucket) {
  GC_CHECK_ARG(bucket.numel == numel(), "PowerSGD: the bucket has ", numel(), " elements, got ",
               bucket.describe());
  GC_CHECK_ARG(bucket.numel == 0 || bucket.data != nullptr, "PowerSGD: null bucket data");
  const auto& shapes = st_.impl_->shapes;
  std::vector<TensorView> views;
  views.reserve(shapes.size());
  auto* p = static_cast<uint8_t*>(bucket.data);
  const size_t elem = dtype_size(bucket.dtype);
  for (const auto& s : shapes) {
    const int64_t one = 1;
    const TensorView v = s.empty()
                             ? TensorView(p, &one, 1, bucket.dtype, bucket.device,
                                          bucket.device_index, bucket.stream)
                             : TensorView(p, s.data(), static_cast<int>(s.size()), bucket.dtype,
                                          bucket.device, bucket.device_index, bucket.stream);
    if (p != nullptr) p += static_cast<size_t>(v.numel) * elem;
    views.push_back(v);
  }
  begin(views);  // checks dtype and device per tensor
}

void PowerSGDPlan::load_state_dict(const uint8_t* data, size_t nbytes) {
  GC_CHECK_ARG(phase_ == Phase::kIdle || phase_ == Phase::kDone,
               "PowerSGD plan: load_state_dict() called while a step is in progress");
  st_.load_state_dict(data, nbytes);
  start_step();
}

void PowerSGDPlan::begin(const std::vector<TensorView>& grads) {
  GC_CHECK_ARG(phase_ == Phase::kIdle || phase_ == Phase::kDone,
               "PowerSGD plan: begin() called while a step is in progress");
  const auto& shapes = st_.impl_->shapes;
  GC_CHECK_ARG(grads.size() == shapes.size(), "PowerSGD: the bucket has ", shapes.size(),
               " tensors, got ", grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const TensorView& g = grads[i];
    GC_CHECK_ARG(g.dtype == st_.dtype_, "PowerSGD: tensor ", i, " must be ", dtype_name(st_.dtype_),
                 ", got ", g.describe());
    GC_CHECK_ARG(g.device == st_.device_ &&
                     (st_.device_ == Device::kCPU || g.device_index == st_.device_index_),
                 "PowerSGD: tensor ", i, " must be on ", device_name(st_.device_),
                 st_.device_ == Device::kCUDA ? detail::cat(":", st_.device_index_) : "", ", got ",
                 g.describe());
    bool same = static_cast<size_t>(g.ndim) == shapes[i].size() ||
                (shapes[i].empty() && g.ndim == 1 && g.numel == 1);
    for (size_t d = 0; same && d < shapes[i].size(); ++d) same = g.shape[d] == shapes[i][d];
    if (!same) {
      std::string want = "[";
      for (size_t d = 0; d < shapes[i].size(); ++d)
        want += (d ? ", " : "") + std::to_string(shapes[i][d]);
      GC_CHECK_ARG(false, "PowerSGD: tensor ", i, " must have shape ", want, "], got ",
                   g.describe());
    }
    GC_CHECK_ARG(g.numel == 0 || g.data != nullptr, "PowerSGD: tensor ", i, " has null data");
  }
  // CPU: the finiteness check rides on P and the uncompressed pack in the first next() phase
  // (phase_compress): no extra pass over the bucket. CUDA: one scan here. The plain steps before
  // start_iter scan the sum instead (kPlainWait), which a non-finite value on any rank reaches.
  grads_ = grads;
  bad_ = false;
  esaved_ = flipped_ = false;
  ++st_.impl_->generation;  // (saved copies now belong to this step)
  bad_what_.clear();
  start_step();
  const bool plain = st_.step_ < st_.cfg_.start_iter;
  if (st_.cfg_.check_finite && st_.device_ == Device::kCUDA && !plain) find_bad();
  issued_.clear();
  phase_ = Phase::kStart;
}

Collective PowerSGDPlan::make(void* buf, size_t count, const char* tag) const {
  Collective c;
  c.kind = CollectiveKind::kAllreduceSum;
  c.type = ElemType::kF32;
  c.send = buf;
  c.recv = buf;
  c.count = count;
  c.device = st_.device_;
  c.stream = st_.impl_->stream;
  c.tag = tag;
  c.world = world_;
  return c;
}

std::optional<Collective> PowerSGDPlan::next() {
  auto& im = *st_.impl_;
  const float world = static_cast<float>(world_);
  float* pbuf = static_cast<float*>(im.pbuf.data());
  float* ubuf = pbuf + st_.p_numel_;
  auto issue = [&](Collective c) {
    issued_.push_back(c);
    return std::optional<Collective>(std::move(c));
  };
  auto done = [&](bool compressed) {
    PowerSGDStats& s = st_.stats_;
    s.step = st_.step_;
    s.compressed = compressed;
    s.dense_bytes = 0;
    for (const auto& g : grads_) s.dense_bytes += static_cast<uint64_t>(g.nbytes());
    s.sent_bytes = 0;
    for (const auto& c : issued_) s.sent_bytes += c.send_bytes();
    s.collectives = static_cast<int>(issued_.size());
    for (size_t i = 0; i < st_.info_.size(); ++i)
      s.rank_used[i] = compressed ? st_.info_[i].rank : 0;
    ++st_.step_;
    phase_ = Phase::kDone;
    grads_.clear();
    last_compressed_ = compressed;
    undo_at_ = st_.step_;
    undo_gen_ = st_.impl_->generation;
    set_skipped(false, st_.cfg_.check_finite);
    return std::optional<Collective>();
  };
  switch (phase_) {
    case Phase::kIdle:
      GC_CHECK_ARG(false, "PowerSGD plan: next() called before begin()");
      return std::nullopt;
    case Phase::kDone:
      return std::nullopt;
    case Phase::kStart: {
      if (st_.step_ < st_.cfg_.start_iter) {  // plain allreduce of the whole bucket
        if (im.total_numel == 0) return done(false);
        float* b = static_cast<float*>(im.plain.data());
        int64_t off = 0;
        for (const auto& g : grads_) {
          k::load(im.ex, g.data, g.dtype, g.numel, b + off, false);
          off += g.numel;
        }
        // sent as it is: a NaN or Inf of any rank makes its element of the sum NaN or Inf on
        // every rank, which kPlainWait's scan of the sum finds (with a finite sum that overflows)
        phase_ = Phase::kPlainWait;
        return first(b, static_cast<size_t>(im.total_numel), "powersgd plain");
      }
      phase_compress();
      const size_t np = static_cast<size_t>(st_.p_numel_), nu = static_cast<size_t>(st_.u_numel_);
      if (np == 0 && nu == 0) return done(true);
      if (np > 0 && (nu == 0 || st_.cfg_.fuse_uncompressed_with_p)) {
        phase_ = Phase::kWaitP;
        return first(pbuf, np + nu, nu ? "powersgd P+uncompressed" : "powersgd P");
      }
      phase_ = Phase::kWaitU;
      return first(ubuf, nu, "powersgd uncompressed");
    }
    case Phase::kPlainWait: {
      check_envelope();
      // The whole sum is scanned: a finite gradient whose sum over ranks overflows fp32 can do
      // so at any element, and every rank holds the same sum, so every rank skips alike.
      const float* b = static_cast<const float*>(im.plain.data());
      if (st_.cfg_.check_finite && sum_nonfinite(b, im.total_numel)) {
        find_bad();  // (this rank's own gradient, still as it came, names the bad value)
        return skip_step();
      }
      int64_t off = 0;
      for (const auto& g : grads_) {
        k::store_mean(im.ex, b + off, g.numel, world, g.data, g.dtype);
        off += g.numel;
      }
      return done(false);
    }
    case Phase::kWaitU:
      check_envelope();
      if (st_.cfg_.check_finite && sum_nonfinite(ubuf, st_.u_numel_)) return skip_step();
      if (st_.p_numel_ > 0) {
        phase_ = Phase::kWaitP;
        return issue(make(pbuf, static_cast<size_t>(st_.p_numel_), "powersgd P"));
      }
      phase_finish();
      return done(true);
    case Phase::kWaitP:
      // P is small: all of it is scanned, so that a sum over ranks that overflows is caught as
      // well as a rank's NaN (every rank holds the same sum, so every rank skips)
      check_envelope();  // (when P was the step's first allreduce)
      if (st_.cfg_.check_finite && sum_nonfinite(pbuf, issued_.back().count)) return skip_step();
      phase_project();
      phase_ = Phase::kWaitQ;
      return issue(make(im.qbuf.data(), static_cast<size_t>(st_.q_numel_), "powersgd Q"));
    case Phase::kWaitQ:
      phase_finish();
      return done(true);
  }
  return std::nullopt;
}

// local: M = grad (+ error); Q drawn / kept; P = M Q; uncompressed tensors packed.
void PowerSGDPlan::phase_compress() {
  auto& im = *st_.impl_;
  const k::Exec& ex = im.ex;
  const bool gpu = ex.cuda();
  const auto& cfg = st_.cfg_;
  im.point_groups();
  float* M = im.err();
  float* U = static_cast<float*>(im.pbuf.data()) + st_.p_numel_;
  const bool direct = st_.dtype_ == DType::kFloat32 && !cfg.error_feedback;
  for (size_t gi = 0; gi < im.groups.size(); ++gi) {
    auto& ptrs = im.member_grads[gi];
    for (size_t b = 0; b < ptrs.size(); ++b) ptrs[b] = grads_[im.members[gi][b]].data;
  }
  const bool forms_m = k::psgd_forms_m_itself(ex);
  // check_finite: Q as it was (small), restored if the step is skipped; CUDA also saves the
  // error, which M is formed in.
  const bool check = cfg.check_finite;
  q_ready_saved_ = st_.q_ready_;
  if (check && st_.q_numel_ > 0)
    device_copy(im.qsave.data(), st_.device_, im.qbuf.data(), st_.device_,
                static_cast<size_t>(st_.q_numel_) * 4, im.stream);
  float* PU = static_cast<float*>(im.pbuf.data());
  const size_t pu_bytes = static_cast<size_t>(st_.p_numel_ + st_.u_numel_) * 4;
  if (bad_) {  // (CUDA, found in begin()) nothing of this rank's gradient is sent: NaN instead
    device_fill_nan(st_.device_, PU, pu_bytes, im.stream);
    return;
  }
  if (gpu && check && cfg.error_feedback && st_.m_numel_ > 0) {  // for a skipped or undone step
    device_copy(im.esave.data(), st_.device_, M, st_.device_, static_cast<size_t>(st_.m_numel_) * 4,
                im.stream);
    esaved_ = true;
  }
  for (size_t i = 0; i < grads_.size(); ++i) {
    const TensorView& g = grads_[i];
    const PowerSGDTensorInfo& t = st_.info_[i];
    if (t.rank > 0 && (forms_m || direct)) continue;  // M formed by compute_p / the gradient is M
    float* dst = t.rank > 0 ? M + t.m_offset : U + t.u_offset;
    k::load(ex, g.data, g.dtype, g.numel, dst, t.rank > 0 && cfg.error_feedback);
  }
  // Warm start keeps Q; a column that became exactly zero (a zero gradient, a dependent column)
  // would stay zero forever (P = M 0), so it is re-drawn. Without warm start Q is re-drawn.
  const bool fresh = !cfg.warm_start || !st_.q_ready_;
  const uint64_t step = static_cast<uint64_t>(st_.step_);
  for (const auto& grp : im.groups) {
    k::fill_q(ex, grp, cfg.seed, step, !fresh);
    if (!fresh)  // a warm-started Q brought near 1 (kernels/powersgd_kernels.hpp)
      k::prescale_blocks(ex, grp.Q, grp.batch, grp.m * grp.r, cfg.orthogonalization_epsilon);
  }
  st_.q_ready_ = true;
  k::psgd_compute_p(ex, {im.groups, im.member_grads, st_.dtype_, cfg.error_feedback, direct},
                    im.ctx);
  if (!check) return;
  // A NaN/Inf in M = grad + error makes its row of P non-finite (NaN * 0 and Inf * 0 are NaN, so
  // even a zero Q row cannot hide it); an uncompressed one lands in the pack as it is. So P and
  // the pack (small) are tested, and the bucket is scanned only to name the first bad index. A
  // finite gradient whose P overflows is treated alike (its step would poison the error); CUDA
  // scanned the gradient in begin(), so there only that overflow is left to find. On the CPU
  // compress_p wrote no state (the error is not stored before finish()).
  if (k::first_nonfinite(ex, PU, DType::kFloat32, st_.p_numel_ + st_.u_numel_, im.sws) < 0) return;
  find_bad();
  if (!bad_) {
    bad_ = true;
    bad_what_ = "the gradient is finite but its projection P overflows fp32 ";
  }
  device_fill_nan(st_.device_, PU, pu_bytes, im.stream);
}

// This rank's first non-finite gradient value: sets bad_ and the message naming tensor and index.
void PowerSGDPlan::find_bad() {
  for (size_t i = 0; i < grads_.size(); ++i) {
    const TensorView& g = grads_[i];
    const int64_t bad =
        k::first_nonfinite({g.device, g.stream}, g.data, g.dtype, g.numel, st_.impl_->sws);
    if (bad < 0) continue;
    bad_ = true;
    bad_what_ = detail::cat("tensor ", i, " (", g.describe(),
                            ") holds a non-finite value at index ", bad, " ");
    return;
  }
}

void PowerSGDPlan::restore_state() {
  auto& im = *st_.impl_;
  if (st_.step_ < st_.cfg_.start_iter) return;  // a plain step changes no state before its end
  // a compressed step: Q (and on CUDA the error) back
  if (st_.q_numel_ > 0)
    device_copy(im.qbuf.data(), st_.device_, im.qsave.data(), st_.device_,
                static_cast<size_t>(st_.q_numel_) * 4, im.stream);
  st_.q_ready_ = q_ready_saved_;
  if (esaved_)  // (CUDA; the CPU has not written the error yet)
    device_copy(im.mbuf.data(), st_.device_, im.esave.data(), st_.device_,
                static_cast<size_t>(st_.m_numel_) * 4, im.stream);
}

std::optional<Collective> PowerSGDPlan::first(float* buf, size_t count, const char* tag) {
  static_assert(detail::kEnvelopeFloats == detail::kSumEnvelopeSlots,
                "PowerSGDState leaves room for the step envelope");
  envelope_ = nullptr;
  if (world_ > 1) {  // (the buffers have room for it: PowerSGDState)
    envelope_ = buf + count;
    const std::vector<uint8_t> e =
        detail::sum_envelope({st_.step_, options_hash_, false}, DType::kFloat32, world_);
    device_copy(envelope_, st_.device_, e.data(), Device::kCPU, e.size(), st_.impl_->stream);
    count += detail::kSumEnvelopeSlots;
  }
  issued_.push_back(make(buf, count, tag));
  return issued_.back();
}

void PowerSGDPlan::check_envelope() {
  if (envelope_ == nullptr) return;
  std::vector<uint8_t> h(detail::kSumEnvelopeSlots * sizeof(float));
  device_copy(h.data(), Device::kCPU, envelope_, st_.device_, h.size(), st_.impl_->stream);
  if (st_.device_ == Device::kCUDA) cuda::stream_synchronize(st_.impl_->stream);
  envelope_ = nullptr;
  const detail::EnvelopeVerdict v = detail::read_sum_envelope(h.data(), DType::kFloat32, world_);
  if (v.agreed()) return;
  // every rank holds the same sums: the step ends here on every rank, the state as before it
  // (Q is saved only with check_finite; a plain step has changed nothing)
  const bool kept = st_.step_ < st_.cfg_.start_iter || st_.cfg_.check_finite;
  if (st_.cfg_.check_finite) restore_state();
  grads_.clear();
  issued_.clear();
  phase_ = Phase::kDone;
  detail::throw_disagreement(v, "powersgd",
                             "rank, start_iter, min_compression_rate, error_feedback, "
                             "warm_start, seed, the orthogonalization and the bucket's shapes",
                             st_.step_, kept);
}

std::optional<Collective> PowerSGDPlan::skip_step() {
  restore_state();
  for (const TensorView& g : grads_)
    device_fill_nan(g.device, g.data, static_cast<size_t>(g.nbytes()), g.stream);
  grads_.clear();
  issued_.clear();
  phase_ = Phase::kDone;
  set_skipped(true);
  if (on_nonfinite_ == OnNonFinite::kRaise) {
    GC_CHECK_ARG(!bad_, "PowerSGD: ", bad_what_, "(the step was dropped on every rank and no ",
                 "state changed; on_nonfinite='raise')");
    GC_CHECK_ARG(false, "PowerSGD: another rank's gradient held a non-finite value (NaN or Inf), ",
                 "or the sum over ranks of P (or of the gradient, before start_iter) overflowed ",
                 "fp32; the step was dropped on every rank and no state changed ",
                 "(on_nonfinite='raise')");
  }
  return std::nullopt;
}

bool PowerSGDPlan::sum_nonfinite(const float* buf, int64_t n) {
  return k::first_nonfinite(st_.impl_->ex, buf, DType::kFloat32, n, st_.impl_->sws) >= 0;
}

void PowerSGDPlan::undo_state() {
  GC_CHECK_ARG(st_.step_ == undo_at_ && st_.impl_->generation == undo_gen_,
               "PowerSGD plan: undo_step(): the state was stepped or loaded since, through ",
               "another plan or directly (undo through the plan that ran the last step)");
  auto& im = *st_.impl_;
  if (last_compressed_) {  // Q, its readiness and the error as before the step
    if (st_.q_numel_ > 0)
      device_copy(im.qbuf.data(), st_.device_, im.qsave.data(), st_.device_,
                  static_cast<size_t>(st_.q_numel_) * 4, im.stream);
    st_.q_ready_ = q_ready_saved_;
    if (esaved_)  // CUDA: the copy; the CPU wrote the new error into the other buffer
      device_copy(im.mbuf.data(), st_.device_, im.esave.data(), st_.device_,
                  static_cast<size_t>(st_.m_numel_) * 4, im.stream);
    if (flipped_) im.flip = !im.flip;
  }
  --st_.step_;
  undo_at_ = -1;
}

// local: P = P_sum / world; P_hat = orth(P); Q = M^T P_hat.
void PowerSGDPlan::phase_project() {
  auto& im = *st_.impl_;
  const auto& cfg = st_.cfg_;
  k::divide(im.ex, static_cast<float*>(im.pbuf.data()), st_.p_numel_, static_cast<float>(world_));
  const bool direct = st_.dtype_ == DType::kFloat32 && !cfg.error_feedback;
  k::psgd_project(im.ex, {im.groups, im.member_grads, st_.dtype_, cfg.error_feedback, direct},
                  cfg.orthogonalization_epsilon, cfg.orthogonalization, im.ctx);
}

// local: Q = Q_sum / world; grad = P_hat Q^T; error = M - grad; uncompressed = sum / world.
void PowerSGDPlan::phase_finish() {
  auto& im = *st_.impl_;
  const bool ef = st_.cfg_.error_feedback;
  const float world = static_cast<float>(world_);
  k::divide(im.ex, static_cast<float*>(im.qbuf.data()), st_.q_numel_, world);
  const bool direct = st_.dtype_ == DType::kFloat32 && !ef;
  k::psgd_finish(im.ex, {im.groups, im.member_grads, st_.dtype_, ef, direct}, im.ctx,
                 static_cast<float*>(im.scratch.data()),
                 static_cast<int64_t>(im.scratch.capacity() / 4));
  if (im.dbuf) {  // the new error went into the other buffer: it is now the state
    im.flip = !im.flip;
    flipped_ = true;
  }
  const float* U = static_cast<const float*>(im.pbuf.data()) + st_.p_numel_;
  for (size_t i = 0; i < grads_.size(); ++i) {
    const PowerSGDTensorInfo& t = st_.info_[i];
    if (t.rank > 0) continue;
    const TensorView& g = grads_[i];
    k::store_mean(im.ex, U + t.u_offset, g.numel, world, g.data, g.dtype);
  }
}

}  // namespace gradcomp

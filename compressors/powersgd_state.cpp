// SPDX-License-Identifier: Apache-2.0
// PowerSGD for one bucket: layout (compress or not, batch groups) and state (error, Q, step,
// checkpoints). The plan that runs one step is plans/powersgd_plan.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include "compressors/powersgd_impl.hpp"
#include "core/state_io.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/runtime.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/powersgd_kernels.hpp"

namespace gradcomp {

namespace k = kernels;
using detail::kGpuScratchFloats;

namespace {
constexpr int kMaxRank = 4096;

// Element count of tensor i of shape s, checked before anything is allocated: dimensions >= 0,
// and the tensor together with the `before` elements of the tensors ahead of it within
// kPowerSGDMaxBucketNumel (every partial product stays below 2^64, so nothing overflows).
int64_t checked_numel(const std::vector<int64_t>& s, size_t i, int64_t before) {
  constexpr int64_t kMax = kPowerSGDMaxBucketNumel;
  int64_t numel = 1;
  for (int64_t d : s) {
    GC_CHECK_ARG(d >= 0, "tensor ", i, " has a negative dimension ", d);
    if (d <= kMax && (d == 0 || numel <= kMax / d)) {
      numel *= d;
      continue;
    }
    std::string shape;
    for (int64_t e : s) shape += (shape.empty() ? "[" : ", ") + std::to_string(e);
    GC_CHECK_ARG(false, "PowerSGD: tensor ", i, " of shape ", shape, "] exceeds ", kMax,
                 " elements in a dimension or in total (the bound kPowerSGDMaxBucketNumel)");
  }
  GC_CHECK_ARG(numel <= kMax - before, "PowerSGD: the bucket holds more than ", kMax,
               " elements at tensor ", i, " (the bound kPowerSGDMaxBucketNumel)");
  return numel;
}
}  // namespace

void PowerSGDConfig::validate() const {
  GC_CHECK_ARG(rank >= 1 && rank <= kMaxRank, "PowerSGD rank must be in [1, ", kMaxRank, "], got ",
               rank);
  GC_CHECK_ARG(start_iter >= 0, "start_iter must be >= 0, got ", start_iter);
  GC_CHECK_ARG(std::isfinite(min_compression_rate) && min_compression_rate >= 0.0,
               "min_compression_rate must be finite and >= 0, got ", min_compression_rate);
  GC_CHECK_ARG(std::isfinite(orthogonalization_epsilon) && orthogonalization_epsilon >= 0.0f,
               "orthogonalization_epsilon must be finite and >= 0, got ",
               orthogonalization_epsilon);
  GC_CHECK_ARG(static_cast<uint8_t>(orthogonalization) <= 3, "unknown orthogonalization ",
               int(orthogonalization));
  GC_CHECK_ARG(
      orthogonalization != Orthogonalization::kGramSchmidt || rank <= kPowerSGDMaxGramSchmidtRank,
      "fused Gram-Schmidt supports rank <= ", kPowerSGDMaxGramSchmidtRank, ", got rank ", rank,
      " (use Orthogonalization::kHouseholder or kAuto)");
}

PowerSGDState::PowerSGDState(const PowerSGDConfig& cfg,
                             const std::vector<std::vector<int64_t>>& shapes, DType grad_dtype,
                             Device device, int device_index, void* stream)
    : cfg_(cfg), dtype_(grad_dtype), device_(device), device_index_(device_index) {
  cfg_.validate();
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(grad_dtype)), "unsupported gradient dtype ",
               int(grad_dtype));
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("PowerSGD state on a CUDA device");
  GC_CHECK_ARG(
      device == Device::kCPU || cfg_.orthogonalization != Orthogonalization::kGramSchmidtUnfused,
      "Orthogonalization::kGramSchmidtUnfused is a CPU baseline; use kGramSchmidt on CUDA");
  impl_ = std::make_unique<Impl>(device, stream);
  impl_->stream = stream;
  impl_->shapes = shapes;
  info_.resize(shapes.size());
  std::map<std::tuple<int64_t, int64_t, int>, int> group_of;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& s = shapes[i];
    GC_CHECK_ARG(s.size() <= static_cast<size_t>(TensorView::kMaxDims), "tensor ", i, " has ",
                 s.size(), " dimensions, at most ", TensorView::kMaxDims, " are supported");
    const int64_t numel = checked_numel(s, i, impl_->total_numel);
    PowerSGDTensorInfo& t = info_[i];
    t.n = s.empty() ? 1 : s[0];
    t.m = t.n > 0 ? numel / t.n : 0;
    impl_->total_numel += numel;
    impl_->max_numel = std::max(impl_->max_numel, numel);
    const int r = static_cast<int>(std::min<int64_t>({cfg_.rank, t.n, t.m}));
    constexpr int64_t kBlasMax = std::numeric_limits<int>::max();  // BLAS/LAPACK take int sizes
    const bool compress = s.size() >= 2 && r >= 1 && t.n <= kBlasMax && t.m <= kBlasMax &&
                          static_cast<double>(t.n + t.m) * r * cfg_.min_compression_rate <
                              static_cast<double>(t.n) * static_cast<double>(t.m);
    if (compress) {
      t.rank = r;
      auto key = std::make_tuple(t.n, t.m, r);
      auto it = group_of.find(key);
      if (it == group_of.end()) {
        it = group_of.emplace(key, static_cast<int>(impl_->members.size())).first;
        impl_->members.emplace_back();
      }
      t.group = it->second;
      impl_->members[t.group].push_back(i);
    } else {
      t.u_offset = u_numel_;
      u_numel_ += numel;
    }
  }
  // Group-contiguous layout so that a group is one strided batch.
  std::vector<uint32_t> ids;
  for (const auto& mem : impl_->members)
    for (size_t i : mem) {
      PowerSGDTensorInfo& t = info_[i];
      t.m_offset = m_numel_;
      t.p_offset = p_numel_;
      t.q_offset = q_numel_;
      m_numel_ += t.n * t.m;
      p_numel_ += t.n * t.rank;
      q_numel_ += t.m * t.rank;
      ids.push_back(cfg_.first_tensor_id + static_cast<uint32_t>(i));
    }
  float* M = impl_->mbuf.get<float>(static_cast<size_t>(m_numel_));
  // (+ the step envelope that PowerSGDPlan appends to a step's first allreduce)
  float* P =
      impl_->pbuf.get<float>(static_cast<size_t>(p_numel_ + u_numel_) + detail::kEnvelopeFloats);
  float* Q = impl_->qbuf.get<float>(static_cast<size_t>(q_numel_));
  uint32_t* id = impl_->ids.get<uint32_t>(ids.size());
  if (!ids.empty()) device_copy(id, device, ids.data(), Device::kCPU, ids.size() * 4, stream);
  if (m_numel_ > 0) device_zero(device, M, static_cast<size_t>(m_numel_) * 4, stream);
  if (q_numel_ > 0) device_zero(device, Q, static_cast<size_t>(q_numel_) * 4, stream);
  int64_t id_off = 0, max_member = 0;
  for (const auto& mem : impl_->members) {
    const PowerSGDTensorInfo& t = info_[mem[0]];
    k::PsgdGroup g;
    g.batch = static_cast<int64_t>(mem.size());
    g.n = t.n;
    g.m = t.m;
    g.r = t.rank;
    g.M = M + t.m_offset;
    impl_->group_m_off.push_back(t.m_offset);
    g.P = P + t.p_offset;
    g.Q = Q + t.q_offset;
    g.ids = id + id_off;
    id_off += g.batch;
    max_member = std::max(max_member, t.n * t.m);
    impl_->groups.push_back(g);
  }
  for (const auto& mem : impl_->members) impl_->member_grads.emplace_back(mem.size(), nullptr);
  if (device == Device::kCUDA) {
    impl_->scratch.get<float>(
        static_cast<size_t>(std::max(max_member, std::min<int64_t>(kGpuScratchFloats, m_numel_))));
  }
  if (cfg_.check_finite) {
    impl_->qsave.get<float>(static_cast<size_t>(q_numel_));
    if (cfg_.error_feedback && m_numel_ > 0) {
      device_zero(device, impl_->esave.get<float>(static_cast<size_t>(m_numel_)),
                  static_cast<size_t>(m_numel_) * 4, stream);
      impl_->dbuf = device == Device::kCPU;
    }
  }
  if (cfg_.start_iter > 0)
    impl_->plain.get<float>(static_cast<size_t>(impl_->total_numel) + detail::kEnvelopeFloats);
  stats_.rank_used.assign(info_.size(), 0);
}

PowerSGDState::~PowerSGDState() = default;

size_t PowerSGDState::num_groups() const { return impl_->groups.size(); }

std::vector<float> PowerSGDState::error(size_t i) const {
  const PowerSGDTensorInfo& t = info_.at(i);
  std::vector<float> out(static_cast<size_t>(t.n * t.m), 0.0f);
  if (t.rank > 0 && cfg_.error_feedback && !out.empty())
    device_copy(out.data(), Device::kCPU, impl_->err() + t.m_offset, device_, out.size() * 4,
                impl_->stream);
  return out;
}

std::vector<float> PowerSGDState::q(size_t i) const {
  const PowerSGDTensorInfo& t = info_.at(i);
  if (t.rank == 0 || !q_ready_) return {};
  std::vector<float> out(static_cast<size_t>(t.m * t.rank));
  device_copy(out.data(), Device::kCPU, static_cast<const float*>(impl_->qbuf.data()) + t.q_offset,
              device_, out.size() * 4, impl_->stream);
  return out;
}

std::vector<uint8_t> PowerSGDState::state_dict() const {
  detail::StateWriter w("powersgd");
  w.put<uint64_t>(info_.size());
  for (const auto& t : info_) {
    w.put<int64_t>(t.n);
    w.put<int64_t>(t.m);
    w.put<int32_t>(t.rank);
  }
  w.put<uint8_t>(cfg_.error_feedback);
  w.put<uint8_t>(cfg_.warm_start);
  w.put<int64_t>(step_);
  w.put<uint8_t>(q_ready_);
  w.put_array(impl_->err(), device_, cfg_.error_feedback ? m_numel_ * 4 : 0, impl_->stream);
  w.put_array(impl_->qbuf.data(), device_, q_ready_ ? q_numel_ * 4 : 0, impl_->stream);
  return w.take();
}

void PowerSGDState::load_state_dict(const uint8_t* data, size_t nbytes) {
  detail::StateReader r(data, nbytes, "powersgd");
  r.expect<uint64_t>("tensor count", info_.size());
  for (const auto& t : info_) {
    r.expect<int64_t>("rows", t.n);
    r.expect<int64_t>("cols", t.m);
    r.expect<int32_t>("rank", t.rank);
  }
  r.expect<uint8_t>("error_feedback", cfg_.error_feedback);
  r.expect<uint8_t>("warm_start", cfg_.warm_start);
  const auto step = r.get_step();
  const auto qr = r.get<uint8_t>("q_ready");
  GC_CHECK_ARG(qr <= 1, "state_dict: bad q_ready flag ", int(qr));
  const uint8_t* err = r.finite_array("error", cfg_.error_feedback ? m_numel_ * 4 : 0);
  const uint8_t* q = r.finite_array("Q", qr ? q_numel_ * 4 : 0);
  r.finish();
  // Everything checked: now change the state.
  if (cfg_.error_feedback && m_numel_ > 0)
    device_copy(impl_->err(), device_, err, Device::kCPU, m_numel_ * 4, impl_->stream);
  if (qr && q_numel_ > 0)
    device_copy(impl_->qbuf.data(), device_, q, Device::kCPU, q_numel_ * 4, impl_->stream);
  if (device_ == Device::kCUDA) cuda::stream_synchronize(impl_->stream);  // host source dies
  ++impl_->generation;  // a plan's kept step can no longer be taken back
  step_ = step;
  q_ready_ = qr != 0;
}

// PowerSGD's state (PowerSGDState::state_dict above): the tensors' (n, m, rank), flags, step,
// q_ready, the error of the compressed tensors and Q. Every rank's error adds to the average with
// weight 1/P, so every rank of the new job gets their mean (the sum over ranks / P is kept). Q is
// the same on every rank (it is the result of an allreduce); the mean keeps it exactly then, and
// is still a basis to start from if a backend's sums differed in the last bits.
std::vector<uint8_t> detail::reshard_powersgd_state(
    const std::vector<std::vector<uint8_t>>& states) {
  RankStates rs(states, "powersgd");
  const auto count = rs.same<uint64_t>("tensor count");
  StateWriter w("powersgd");
  w.put<uint64_t>(count);
  constexpr int64_t kMax = int64_t{1} << 40;
  int64_t m_numel = 0, q_numel = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const auto n = rs.same<int64_t>("rows");
    const auto m = rs.same<int64_t>("cols");
    const auto r = rs.same<int32_t>("rank");
    GC_CHECK_ARG(n >= 0 && m >= 0 && r >= 0 && n <= kMax && m <= kMax && r <= m,
                 "state_dict: tensor ", i, " has a bad shape or rank (", n, " x ", m, ", rank ", r,
                 ")");
    if (r > 0) {
      GC_CHECK_ARG(m == 0 || n <= kMax / m, "state_dict: tensor ", i, " is too large");
      m_numel += n * m;
      q_numel += m * r;
      GC_CHECK_ARG(m_numel <= kMax && q_numel <= kMax, "state_dict: the tensors are too large");
    }
    w.put<int64_t>(n);
    w.put<int64_t>(m);
    w.put<int32_t>(r);
  }
  const auto ef = rs.same<uint8_t>("error_feedback");
  const auto warm = rs.same<uint8_t>("warm_start");
  const auto step = rs.same<int64_t>("step");
  GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ", step,
               " out of range");
  const auto qr = rs.same<uint8_t>("q_ready");
  GC_CHECK_ARG(qr <= 1, "state_dict: bad q_ready flag ", int(qr));
  const std::vector<float> err = rs.mean("error", ef ? m_numel : 0);
  const std::vector<float> q = rs.mean("Q", qr ? q_numel : 0);
  rs.finish();
  w.put<uint8_t>(ef);
  w.put<uint8_t>(warm);
  w.put<int64_t>(step);
  w.put<uint8_t>(qr);
  w.put_floats(err);
  w.put_floats(q);
  return w.take();
}

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The two-level allreduce (HierarchicalPlan, plans/hierarchical_plan.hpp): a full-precision
// reduce-scatter inside the node, any family's plan across nodes on each shard, an allgather inside
// the node.
#include "plans/hierarchical_plan.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "core/state_io.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/reduce_kernels.hpp"

namespace gradcomp {

namespace k = kernels;

namespace {

// The phases of a step (GradientPlan::phase_): 0 = begun, then one per collective in flight.
constexpr int kShardsSent = 1;  // the node all-to-all of the shards
constexpr int kInner = 2;       // the inner plan's collectives across nodes
constexpr int kGathered = 3;    // the node allgather of the averaged shards

// What a rank's shard came to, carried beside the shard in the node allgather.
enum Outcome : uint64_t { kKept = 0, kSkipped = 1, kFailed = 2 };

constexpr size_t kHeaderBytes = 16;  // step, options hash
constexpr size_t kStatusBytes = 8;   // Outcome

}  // namespace

struct HierarchicalPlan::Impl {
  Impl(Device d, void* s) : send(d, s), recv(d, s), wide(d, s), shard(d, s), gathered(d, s) {}
  Buffer send;        // L blocks of (header, shard) in the bucket's dtype
  Buffer recv;        // the same, received
  Buffer wide;        // fp32 copy of recv (half-precision buckets)
  Buffer shard;       // this rank's shard (c elements), then its outcome
  Buffer gathered;    // every local rank's (shard, outcome)
  std::string error;  // why this rank's part of the step failed ("" = it did not)
  Outcome outcome = kKept;
};

int64_t HierarchicalPlan::shard_elems(int64_t numel, int per_node) {
  GC_CHECK_ARG(per_node >= 1, "hierarchical plan: per_node must be >= 1, got ", per_node);
  return numel / per_node + (numel % per_node != 0);
}

std::vector<std::vector<int64_t>> HierarchicalPlan::shard_shapes(
    const std::vector<std::vector<int64_t>>& shapes, int64_t numel, int per_node, int local) {
  GC_CHECK_ARG(local >= 0 && local < per_node, "hierarchical plan: local rank ", local,
               " outside [0, ", per_node, ")");
  const int64_t c = shard_elems(numel, per_node);
  const int64_t lo = c * local, hi = lo + c;
  std::vector<std::vector<int64_t>> out;
  int64_t at = 0;  // where the current tensor starts in the bucket
  auto piece = [&](int64_t elems) {
    if (elems > 0) out.push_back({elems});
  };
  const std::vector<std::vector<int64_t>> whole{{numel}};
  for (const auto& s : shapes.empty() ? whole : shapes) {
    int64_t e = 1;
    for (int64_t d : s) {
      GC_CHECK_ARG(d >= 0, "hierarchical plan: negative dimension ", d, " in a tensor shape");
      e = d == 0 ? 0 : e * d;
    }
    const int64_t a = std::max(at, lo), b = std::min(at + e, hi);
    if (a < b) {
      if (s.size() >= 2) {  // rows of cols elements: whole rows stay a matrix
        const int64_t cols = e / s[0];
        const int64_t r0 = (a - at + cols - 1) / cols, r1 = (b - at) / cols;
        if (r0 < r1) {
          piece(at + r0 * cols - a);
          out.push_back({r1 - r0, cols});
          piece(b - (at + r1 * cols));
        } else {
          piece(b - a);
        }
      } else {
        piece(b - a);
      }
    }
    at += e;
  }
  GC_CHECK_ARG(at == numel, "hierarchical plan: the tensor shapes hold ", at,
               " elements, the bucket ", numel);
  piece(hi - std::max(lo, std::min(numel, hi)));  // the zero padding of the last shards
  return out;
}

HierarchicalPlan::HierarchicalPlan(std::unique_ptr<BucketPlan> inner, int64_t numel, DType dtype,
                                   int world, int rank, int per_node, uint64_t options_hash,
                                   Device device, int device_index, void* stream)
    : GradientPlan(numel, dtype, world, device, device_index, stream),
      inner_(std::move(inner)),
      rank_(rank),
      per_node_(per_node),
      shard_(0),
      options_hash_(options_hash),
      impl_(std::make_unique<Impl>(device, stream)) {
  GC_CHECK_ARG(per_node >= 1 && world % per_node == 0, "hierarchical plan: ", world,
               " ranks do not split into nodes of ", per_node,
               " (per_node must divide the world "
               "size)");
  GC_CHECK_ARG(rank >= 0 && rank < world, "hierarchical plan: rank ", rank, " outside [0, ", world,
               ")");
  shard_ = shard_elems(numel, per_node);
  const int N = world / per_node;
  GC_CHECK_ARG((N == 1) == (inner_ == nullptr), "hierarchical plan: ",
               N == 1 ? "one node has no cross-node plan" : "the cross-node plan is missing");
  if (inner_) {
    GC_CHECK_ARG(inner_->numel() == shard_, "hierarchical plan: the cross-node plan averages ",
                 inner_->numel(), " elements, the shard has ", shard_);
    // this plan applies the policy once every shard's outcome is known (a shard's plan that
    // raised alone would leave its node's other ranks waiting in the allgather)
    on_nonfinite_ = inner_->on_nonfinite();
    inner_->set_on_nonfinite(per_node == 1 ? on_nonfinite_ : OnNonFinite::kSkip);
  }
}

HierarchicalPlan::~HierarchicalPlan() = default;

std::string HierarchicalPlan::name() const {
  return detail::cat("hierarchical(", nodes(), "x", per_node_, ", ",
                     inner_ ? inner_->name() : std::string("none"), ")");
}

size_t HierarchicalPlan::workspace_bytes() const {
  return impl_->send.capacity() + impl_->recv.capacity() + impl_->wide.capacity() +
         impl_->shard.capacity() + impl_->gathered.capacity();
}

void HierarchicalPlan::on_begin() {
  impl_->error.clear();
  impl_->outcome = kKept;
  if (inner_) inner_->set_on_nonfinite(per_node_ == 1 ? on_nonfinite_ : OnNonFinite::kSkip);
}

void HierarchicalPlan::undo_state() {
  if (inner_ && inner_->can_undo()) inner_->undo_step();
  --step_;
}

std::optional<Collective> HierarchicalPlan::next() {
  require_begun();
  const size_t es = static_cast<size_t>(dtype_size(dtype_));
  const size_t L = static_cast<size_t>(per_node_), c = static_cast<size_t>(shard_);
  const size_t H = kHeaderBytes / es, B = H + c;  // block: header, shard
  switch (phase_) {
    case 0: {
      if (per_node_ == 1) {  // no node level: the cross-node plan runs on the bucket itself
        if (!inner_) {
          ++step_;
          end_step(false, -1);
          return std::nullopt;
        }
        inner_->begin(grad_);
        return forward();
      }
      // every shard with the header: the step (stateless plans: 0, nothing to keep in step) and
      // the options hash
      const std::array<uint64_t, 2> header{stateful() ? static_cast<uint64_t>(step_) : 0,
                                           options_hash_};
      auto* send = impl_->send.get<uint8_t>(L * B * es);
      const auto* g = static_cast<const uint8_t*>(grad_.data);
      for (size_t i = 0; i < L; ++i) {
        uint8_t* blk = send + i * B * es;
        device_copy(blk, device_, header.data(), Device::kCPU, kHeaderBytes, stream_);
        const size_t len = shard_len(i);
        device_copy(blk + H * es, device_, g + i * c * es, device_, len * es, stream_);
        device_zero(device_, blk + (H + len) * es, (c - len) * es, stream_);
      }
      phase_ = kShardsSent;
      return on_node(CollectiveKind::kAllToAll, send, impl_->recv.get<uint8_t>(L * B * es), B,
                     "hierarchical shards");
    }
    case kShardsSent: {
      const auto* recv = static_cast<const uint8_t*>(impl_->recv.data());
      // this rank's header, as phase 0 wrote it (the send buffer may be device memory)
      const std::array<uint64_t, 2> mine{stateful() ? static_cast<uint64_t>(step_) : 0,
                                         options_hash_};
      std::array<uint64_t, 2> theirs{};
      const int local = rank_ % per_node_;
      for (size_t i = 0; i < L && impl_->error.empty(); ++i) {
        device_copy(theirs.data(), Device::kCPU, recv + i * B * es, device_, kHeaderBytes, stream_);
        if (theirs[1] != mine[1])
          impl_->error = detail::cat(
              "hierarchical plan: the options differ between the ranks of this node (local rank ",
              i, " and local rank ", local,
              " built their plans with other families, options or "
              "layouts); the step was dropped and no state changed");
        else if (theirs[0] != mine[0])
          impl_->error = detail::cat(
              "hierarchical plan: the ranks of this node are at different steps (local rank ", i,
              " at step ", theirs[0], ", local rank ", local, " at step ", mine[0],
              "): restore every rank from the same checkpoint; the step was dropped and no "
              "state changed");
      }
      // the shard: this node's mean of shard `local`, summed in rank order in fp32
      auto* shard = impl_->shard.get<uint8_t>(c * es + kStatusBytes);
      if (!impl_->error.empty()) {
        // poisoned, so that the cross-node plan of this shard skips the step on every node
        device_fill_nan(device_, shard, c * es, stream_);
      } else if (dtype_ == DType::kFloat32) {
        k::reduce_blocks({device_, stream_}, recv + H * es, L, c, B, ElemType::kF32, shard);
        k::convert({device_, stream_}, shard, DType::kFloat32, shard, DType::kFloat32, shard_,
                   float(per_node_));
      } else {
        float* w = impl_->wide.get<float>(L * B);
        k::convert({device_, stream_}, recv, dtype_, w, DType::kFloat32,
                   static_cast<int64_t>(L * B), 1.0f);
        k::reduce_blocks({device_, stream_}, w + H, L, c, B, ElemType::kF32, w + H);
        k::convert({device_, stream_}, w + H, DType::kFloat32, shard, dtype_, shard_,
                   float(per_node_));
      }
      if (!inner_) return gather_shards();
      const int64_t dims[1] = {shard_};
      inner_->begin(TensorView(shard, dims, 1, dtype_, device_, device_index_, stream_));
      return forward();
    }
    case kInner:
      return forward();
    case kGathered:
      finish();
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

std::optional<Collective> HierarchicalPlan::forward() {
  std::optional<Collective> c;
  try {
    c = inner_->next();
  } catch (const std::exception& e) {
    // the cross-node plan raises on every rank of its group at the same point (ranks at
    // different steps, other options); with one rank per node that is every rank
    if (per_node_ == 1) {  // the inner plan ended the step on every rank (raise policy, or a
      phase_ = kDone;      // check that failed): nothing was kept
      set_skipped(true);
      throw;
    }
    impl_->error = e.what();
    impl_->outcome = kFailed;
    return gather_shards();
  }
  if (c) {
    c->scope = Scope::kCross;
    phase_ = kInner;
    return c;
  }
  if (per_node_ == 1) {  // the inner plan applied the policy itself (it skipped on every rank)
    phase_ = kDone;
    if (inner_->skipped()) {
      set_skipped(true);
    } else {
      ++step_;
      set_skipped(false, inner_->can_undo());
    }
    return std::nullopt;
  }
  if (impl_->outcome != kFailed)
    impl_->outcome = !impl_->error.empty() ? kFailed : inner_->skipped() ? kSkipped : kKept;
  return gather_shards();
}

std::optional<Collective> HierarchicalPlan::gather_shards() {
  const size_t es = static_cast<size_t>(dtype_size(dtype_));
  const size_t L = static_cast<size_t>(per_node_), c = static_cast<size_t>(shard_);
  if (!impl_->error.empty()) impl_->outcome = kFailed;
  const size_t G = c + kStatusBytes / es;
  auto* shard = impl_->shard.get<uint8_t>(G * es);
  const uint64_t outcome = impl_->outcome;
  device_copy(shard + c * es, device_, &outcome, Device::kCPU, kStatusBytes, stream_);
  phase_ = kGathered;
  return on_node(CollectiveKind::kAllgather, shard, impl_->gathered.get<uint8_t>(L * G * es), G,
                 "hierarchical gather");
}

Collective HierarchicalPlan::on_node(CollectiveKind kind, const void* send, void* recv,
                                     size_t count, const char* tag) const {
  Collective c = make(kind, elem_type(dtype_), send, recv, count, tag);
  c.scope = Scope::kNode;
  c.world = per_node_;
  return c;
}

size_t HierarchicalPlan::shard_len(size_t i) const {
  const auto n = static_cast<size_t>(numel_), c = static_cast<size_t>(shard_);
  return std::min(c, n - std::min(n, i * c));
}

void HierarchicalPlan::finish() {
  const size_t es = static_cast<size_t>(dtype_size(dtype_));
  const size_t L = static_cast<size_t>(per_node_), c = static_cast<size_t>(shard_);
  const size_t G = c + kStatusBytes / es;
  const auto* all = static_cast<const uint8_t*>(impl_->gathered.data());
  auto* g = static_cast<uint8_t*>(grad_.data);
  bool failed = false, skipped = false;
  size_t failed_shard = 0;
  for (size_t i = 0; i < L; ++i) {
    uint64_t o = 0;
    device_copy(&o, Device::kCPU, all + (i * G + c) * es, device_, kStatusBytes, stream_);
    if (o == kFailed && !failed) {
      failed = true;
      failed_shard = i;
    }
    skipped = skipped || o == kSkipped;
    const size_t len = shard_len(i);
    device_copy(g + i * c * es, device_, all + i * G * es, device_, len * es, stream_);
  }
  if (!failed && !skipped) {
    ++step_;
    end_step(false, -1, inner_ && inner_->can_undo());
    return;
  }
  // some shard was not kept: neither is this rank's (its prior state is still held)
  if (inner_ && inner_->can_undo()) inner_->undo_step();
  if (failed) {
    phase_ = kDone;
    set_skipped(true);
    device_fill_nan(device_, grad_.data, static_cast<size_t>(grad_.nbytes()), stream_);
    if (!impl_->error.empty()) throw InvalidArgument(impl_->error);
    throw InvalidArgument(
        detail::cat("hierarchical plan: the step failed for shard ", failed_shard,
                    " (the ranks of local rank ", failed_shard,
                    " on every node say why: ranks at different steps or with other options); "
                    "the step was dropped on every rank and no state changed"));
  }
  // a NaN/Inf in some rank's gradient: name this rank's first one, if it has one (send still
  // holds the gradient's blocks)
  int64_t bad = -1;
  const auto* send = static_cast<const uint8_t*>(impl_->send.data());
  const size_t H = kHeaderBytes / es, B = H + c;
  for (size_t i = 0; i < L && bad < 0; ++i) {
    const size_t len = shard_len(i);
    const int64_t j = first_nonfinite(send + (i * B + H) * es, dtype_, static_cast<int64_t>(len));
    if (j >= 0) bad = static_cast<int64_t>(i * c) + j;
  }
  end_step(true, bad);
}

std::vector<uint8_t> HierarchicalPlan::state_dict() const {
  if (!stateful()) return {};
  detail::StateWriter w("hierarchical");
  w.put<int64_t>(numel_);
  w.put<int32_t>(world_);
  w.put<int32_t>(per_node_);
  w.put<int32_t>(rank_ % per_node_);
  w.put<uint64_t>(options_hash_);
  w.put<int64_t>(step_);
  const std::vector<uint8_t> inner = inner_->state_dict();
  w.put_array(inner.data(), Device::kCPU, inner.size(), nullptr);
  return w.take();
}

void HierarchicalPlan::load_state_dict(const uint8_t* data, size_t nbytes) {
  require_idle("load_state_dict()");
  if (!stateful()) {
    BucketPlan::load_state_dict(data, nbytes);
    return;
  }
  detail::StateReader r(data, nbytes, "hierarchical");
  r.expect<int64_t>("numel", numel_);
  r.expect<int32_t>("world", world_);
  r.expect<int32_t>("per_node", per_node_);
  r.expect<int32_t>("local_rank", rank_ % per_node_);
  r.expect<uint64_t>("options_hash", options_hash_);
  const int64_t step = r.get_step();
  const auto [inner, len] = r.blob("inner state");
  r.finish();
  inner_->load_state_dict(inner, len);  // validates whole, or changes nothing
  step_ = step;
  start_step();
}

}  // namespace gradcomp

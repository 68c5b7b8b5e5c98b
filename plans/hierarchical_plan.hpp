// SPDX-License-Identifier: Apache-2.0
// The two-level plan: full precision inside a node, any family across nodes
// (hierarchical_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plans/gradient_plan.hpp"

namespace gradcomp {

/// A two-level allreduce for clusters of nodes with fast links inside a node and a slower network
/// between nodes. The job's P = N L ranks are N nodes of L ranks, node-major (rank = node L +
/// local rank, as torchrun numbers them). One step:
///  1. reduce-scatter inside the node at full precision (Scope::kNode): the bucket is cut into
///     L shards of c = ceil(n / L) elements (the last ones zero-padded); one all-to-all of the
///     shards in the bucket's dtype, then local rank i sums shard i of its node's ranks in rank
///     order in fp32 and divides by L;
///  2. the inner plan (any family, built for a bucket of c elements and N ranks) averages shard
///     i across the nodes among the ranks of local rank i (Scope::kCross): each rank compresses
///     1/L of the gradient and the cross-node traffic is split over L links;
///  3. allgather of the shards inside the node (Scope::kNode), written back into the bucket.
/// The result is the average over all P ranks, identical on every rank; it equals, shard by
/// shard, the inner plan's average over N ranks of the node means. With one node (N = 1) there
/// is no inner plan: steps 1 and 3 are the whole (full-precision) allreduce; with one rank per
/// node (L = 1) steps 1 and 3 are skipped.
///
/// Agreement. Every shard sent in step 1 carries a 16-byte header (this plan's step and a hash of
/// the family, options, bucket (id, size, shapes) and layout); a rank that receives a header
/// other than its own poisons its shard (NaN) so that its cross group skips the step, and raises
/// once the step is over (the other nodes see a skipped step: with check_finite off, or a
/// stateless family, only the NaN average; nothing more crosses the nodes for it). The
/// allgather of step 3 carries each shard's outcome (kept, skipped, failed), so every rank sees
/// every shard's: when one was skipped (a NaN/Inf in some rank's gradient, found by the inner
/// plan's check_finite) every rank's bucket comes out NaN, the shards that were kept are taken
/// back (undo_step) and the plan's policy (set_on_nonfinite) applies on every rank; when one
/// failed (the inner plan raised on its cross group: ranks at different steps, other options)
/// every rank raises, and no state changed. The inner plan always runs with OnNonFinite::kSkip.
/// A rank never throws before the step's last collective, so no peer is left waiting.
///
/// State: the step counter and the inner plan's state (this rank's shard), checked against the
/// layout on load. A checkpoint resumes on the same layout only.
///
/// Example (2 nodes of 2 ranks; `node` and `cross` are communicators of those groups):
///   gradcomp::BucketSpec b;  b.numel = n;  b.world = 4;  b.rank = r;
///   auto plan = gradcomp::make_hierarchical_plan("topk", b, /*per_node=*/2, {{"ratio", 0.01}});
///   plan->begin(grad);  gradcomp::run_plan(*plan, node, cross);
class HierarchicalPlan : public GradientPlan {
 public:
  /// `inner` averages a bucket of shard_elems(numel, per_node) elements over world / per_node
  /// ranks (nullptr when world == per_node); `options_hash` identifies its family and options
  /// (ranks with another hash fail the step).
  HierarchicalPlan(std::unique_ptr<BucketPlan> inner, int64_t numel, DType dtype, int world,
                   int rank, int per_node, uint64_t options_hash, Device device = Device::kCPU,
                   int device_index = 0, void* stream = nullptr);
  ~HierarchicalPlan() override;
  /// Elements of each shard: ceil(numel / per_node).
  static int64_t shard_elems(int64_t numel, int per_node);
  /// Local rank i's shard's tensors: each tensor of `shapes` (the bucket's, back to back; {} =
  /// one 1-D tensor) cut to [i c, (i + 1) c), whole rows of a matrix kept as a matrix (rows x the
  /// product of the other dimensions), partial rows and vectors as 1-D pieces, and the zero
  /// padding as a last 1-D piece. What the inner plan of a family that reads shapes (PowerSGD,
  /// random-k's dense_below) is built with.
  static std::vector<std::vector<int64_t>> shard_shapes(
      const std::vector<std::vector<int64_t>>& shapes, int64_t numel, int per_node, int local);
  std::optional<Collective> next() override;
  std::string name() const override;
  bool stateful() const override { return inner_ && inner_->stateful(); }
  std::vector<uint8_t> state_dict() const override;
  void load_state_dict(const uint8_t* data, size_t nbytes) override;
  size_t workspace_bytes() const override;
  int per_node() const { return per_node_; }
  int nodes() const { return world_ / per_node_; }
  int local_rank() const { return rank_ % per_node_; }
  int64_t step() const { return step_; }
  /// The plan that averages this rank's shard across nodes (nullptr with one node).
  const BucketPlan* inner() const { return inner_.get(); }

 private:
  void on_begin() override;
  void undo_state() override;
  std::optional<Collective> forward();
  std::optional<Collective> gather_shards();
  void finish();
  /// A collective among the ranks of this node.
  Collective on_node(CollectiveKind kind, const void* send, void* recv, size_t count,
                     const char* tag) const;
  /// Elements of the bucket in shard i (the rest of the shard is zero padding).
  size_t shard_len(size_t i) const;
  struct Impl;
  std::unique_ptr<BucketPlan> inner_;
  int rank_, per_node_;
  int64_t shard_;
  uint64_t options_hash_;
  int64_t step_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// The random-k allreduce (randomk_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/compressor.hpp"
#include "gradcomp/topk.hpp"
#include "gradcomp/wire.hpp"
#include "gradcomp/workspace.hpp"
#include "plans/sparsify_plan.hpp"

namespace gradcomp {

/// Random-k allreduce: every rank selects the same indices (shared RNG), so the values alone
/// are summed (rank-ordered allreduce in the value dtype) and decoded once with scale 1/P. fp16
/// values (value_dtype) are sent as each rank's share of the average instead (v / P, saturated
/// so that the sum of P shares stays below 65504; RandomKCompressor::set_shares) and decoded
/// with scale 1: a sum of values each below 65504 but past it together is no overflow step.
/// The allreduce's length is decided from the step the ranks last agreed on (the schedule's
/// largest count for a new plan or after a failed step), not from this rank's own counter, so
/// that a rank whose state was replaced in a live plan (within a warm-up whose count changes
/// from step to step too) sums as many values as the others; the consensus slots after them
/// then tell every rank. When every rank's count exceeds the agreed one (every rank loaded the
/// same older state) the step encodes and sums again at that count.
///
/// Example:  gradcomp::RandomKAllreducePlan plan(gradcomp::RandomKConfig{}, n, comm.size());
/// Its compressor, state and undo: detail::SparsifyPlan.
class RandomKAllreducePlan : public detail::SparsifyPlan<RandomKCompressor> {
 public:
  RandomKAllreducePlan(const RandomKConfig& cfg, int64_t numel, int world,
                       DType grad_dtype = DType::kFloat32, Device device = Device::kCPU,
                       int device_index = 0, void* stream = nullptr);
  std::optional<Collective> next() override;
  std::string name() const override { return "randomk"; }
  size_t workspace_bytes() const override;

 private:
  std::optional<Collective> advance();  ///< next() without the failure handling
  /// Encodes this step and writes the consensus slots after the values the ranks agree to sum
  /// (see next()); returns the allreduce's collective.
  Collective encode_and_send();
  /// Writes the consensus slots after the first `m` values; returns how many elements the
  /// allreduce then sums (values and slots).
  size_t put_consensus(const PayloadHeader& h, size_t m);
  /// After the sum: InvalidArgument on every rank when some rank's step or options differ;
  /// returns whether some rank's values did not fit the agreed count.
  bool check_consensus(const PayloadHeader& h);
  /// Values the allreduce carries: the count at the agreed step, or the schedule's largest.
  size_t agreed_count() const;
  Payload payload_;
  Buffer acc_;
  uint32_t options_hash_ = 0;  ///< low bits of detail::OptionsHash (plans/options_hash.hpp)
  int64_t max_count_ = 0;  ///< the largest count of any step of the warm-up schedule
  size_t sent_ = 0;        ///< this step: the values (and slots) the allreduce sums
  bool shares_ = false;    ///< values are sent as shares of the average (fp16 values)
};

}  // namespace gradcomp

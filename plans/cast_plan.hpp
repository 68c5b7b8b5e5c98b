// SPDX-License-Identifier: Apache-2.0
// The plain and cast plans: allreduce (dense_plan.cpp, cast_plan.cpp) and the shard forms
// (shard_plan.cpp).
// Private to the library (not installed): users build plans by name with make_plan()
// (gradcomp/make_plan.hpp) and drive them through the BucketPlan interface (gradcomp/plan.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "gradcomp/workspace.hpp"
#include "plans/gradient_plan.hpp"

namespace gradcomp {

/// Plain allreduce: sum in the gradient's dtype (in place), then divide by the rank count.
///
/// Example:  gradcomp::DenseAllreducePlan plan(n, gradcomp::DType::kFloat32, comm.size());
class DenseAllreducePlan : public GradientPlan {
 public:
  DenseAllreducePlan(int64_t numel, DType dtype, int world, Device device = Device::kCPU,
                     int device_index = 0, void* stream = nullptr);
  std::optional<Collective> next() override;
  std::string name() const override { return "dense"; }
  size_t workspace_bytes() const override { return 0; }
};

/// Cast allreduce: wire = cast_to_wire(grad / P) (divided first, so fp16 does not overflow),
/// summed by `route` (see CastRoute), grad = the sum. Every rank ends with the same bits on
/// either route.
///
/// Example:  gradcomp::CastAllreducePlan plan(n, DType::kFloat32, DType::kFloat16, P);
class CastAllreducePlan : public GradientPlan {
 public:
  CastAllreducePlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world,
                    Device device = Device::kCPU, int device_index = 0, void* stream = nullptr,
                    CastRoute route = CastRoute::kAllreduce);
  std::optional<Collective> next() override;
  std::string name() const override;
  CastRoute route() const { return route_; }
  size_t workspace_bytes() const override { return wire_.capacity() + chunks_.capacity(); }

 private:
  std::optional<Collective> next_reduce_scatter();
  std::optional<Collective> next_gather();
  DType wire_dtype_;
  CastRoute route_;
  Buffer wire_;
  Buffer chunks_;  ///< kReduceScatter: the P received chunks, then the own reduced chunk;
                   ///< kGather: the P buffers (summed widened in one pass, never stored in fp32)
};

/// The reduce-scatter and allgather forms of the plain and cast plans (PlanForm): chunks move in
/// `wire_dtype` (float32 = lossless for an fp32 bucket; float16 / bfloat16 = half the bytes) and
/// are summed in fp32 in rank order, so every rank's chunk has the same bits whoever computes
/// it. Reduce-scatter: an all-to-all of the wire chunks, then rank r sums the P chunks r and
/// writes sum / P (`average`, else the sum) into its chunk r in the bucket's dtype; an fp16 or
/// bf16 wire divides before the cast (so fp16 does not overflow), an fp32 wire after the sum (so
/// the result is what a rank-ordered fp32 reduce-scatter gives). Allgather: each rank's chunk r
/// in the wire dtype to every rank, widened back into the bucket. Stateless: a NaN simply travels.
/// The bucket's numel must be a multiple of P.
///
/// Example:  gradcomp::ShardCastPlan rs(n, DType::kFloat32, DType::kBFloat16, P,
///                                      PlanForm::kReduceScatter);
class ShardCastPlan : public GradientPlan {
 public:
  ShardCastPlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world, int rank,
                PlanForm form, bool average = true, Device device = Device::kCPU,
                int device_index = 0, void* stream = nullptr);
  std::optional<Collective> next() override;
  std::string name() const override;
  PlanForm form() const { return form_; }
  int64_t chunk_elems() const { return chunk_; }
  size_t workspace_bytes() const override {
    return wire_.capacity() + chunks_.capacity() + wide_.capacity();
  }

 private:
  DType wire_dtype_;
  int rank_;
  PlanForm form_;
  bool average_;
  int64_t chunk_;
  Buffer wire_, chunks_, wide_;
};

}  // namespace gradcomp

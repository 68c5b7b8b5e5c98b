// SPDX-License-Identifier: Apache-2.0
// Plain allreduce plan: rank-ordered sum in the gradient's dtype, then / world.
#include "gradcomp/error.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/cast_plan.hpp"

namespace gradcomp {

namespace k = kernels;

DenseAllreducePlan::DenseAllreducePlan(int64_t numel, DType dtype, int world, Device device,
                                       int device_index, void* stream)
    : GradientPlan(numel, dtype, world, device, device_index, stream) {}

std::optional<Collective> DenseAllreducePlan::next() {
  require_begun();
  switch (phase_) {
    case 0:
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(dtype_), grad_.data, grad_.data,
                  static_cast<size_t>(numel_), "dense sum");
    case 1:
      k::convert({device_, stream_}, grad_.data, dtype_, grad_.data, dtype_, numel_, float(world_));
      phase_ = 2;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

}  // namespace gradcomp

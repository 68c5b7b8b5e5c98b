// SPDX-License-Identifier: Apache-2.0
// fp16/bf16 cast allreduce plan: one allreduce in the wire type, or all-to-all + rank-ordered
// fp32 sum + allgather (CastRoute).
#include "plans/cast_plan.hpp"

#include <algorithm>
#include <cstring>

#include "gradcomp/error.hpp"
#include "kernels/reduce_kernels.hpp"

namespace gradcomp {

namespace k = kernels;

namespace {
/// Elements per rank of the reduce-scatter cast route (the buffer padded to P equal chunks).
size_t cast_chunk(int64_t numel, int world) {
  return (static_cast<size_t>(numel) + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
}
}  // namespace

CastAllreducePlan::CastAllreducePlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world,
                                     Device device, int device_index, void* stream, CastRoute route)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      wire_dtype_(wire_dtype),
      route_(route),
      wire_(device, stream),
      chunks_(device, stream) {
  GC_CHECK_ARG(wire_dtype == DType::kFloat16 || wire_dtype == DType::kBFloat16,
               "CastAllreducePlan: wire dtype must be fp16 or bf16, got ", dtype_name(wire_dtype));
  GC_CHECK_ARG(route == CastRoute::kAllreduce || route == CastRoute::kReduceScatter ||
                   route == CastRoute::kGather,
               "CastAllreducePlan: unknown route ", static_cast<int>(route));
  if (route == CastRoute::kAllreduce) {
    wire_.reserve(static_cast<size_t>(numel) * 2);
  } else if (route == CastRoute::kGather) {
    wire_.reserve(static_cast<size_t>(numel) * 2);
    chunks_.reserve(static_cast<size_t>(numel) * static_cast<size_t>(world) * 2);
  } else {
    const size_t padded = cast_chunk(numel, world) * static_cast<size_t>(world);
    wire_.reserve(padded * 2);
    chunks_.reserve(padded * 2);
  }
}

std::string CastAllreducePlan::name() const {
  std::string n = wire_dtype_ == DType::kFloat16 ? "cast_fp16" : "cast_bf16";
  return route_ == CastRoute::kAllreduce ? n
         : route_ == CastRoute::kGather  ? n + "_gather"
                                         : n + "_rs";
}

std::optional<Collective> CastAllreducePlan::next() {
  require_begun();
  if (route_ == CastRoute::kReduceScatter) return next_reduce_scatter();
  if (route_ == CastRoute::kGather) return next_gather();
  switch (phase_) {
    case 0: {
      auto* w = wire_.get<uint16_t>(static_cast<size_t>(numel_));
      k::convert({device_, stream_}, grad_.data, dtype_, w, wire_dtype_, numel_, float(world_));
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(wire_dtype_), w, w,
                  static_cast<size_t>(numel_), "cast sum");
    }
    case 1:
      k::convert({device_, stream_}, wire_.data(), wire_dtype_, grad_.data, dtype_, numel_, 1.0f);
      phase_ = 2;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

std::optional<Collective> CastAllreducePlan::next_reduce_scatter() {
  const size_t c = cast_chunk(numel_, world_), P = static_cast<size_t>(world_);
  const size_t n = static_cast<size_t>(numel_);
  const ElemType wt = elem_type(wire_dtype_);
  switch (phase_) {
    case 0: {  // wire = cast(grad / P), zero-padded to P chunks; chunk r goes to rank r
      auto* w = wire_.get<uint16_t>(P * c);
      k::convert({device_, stream_}, grad_.data, dtype_, w, wire_dtype_, numel_, float(world_));
      if (P * c > n) device_zero(device_, w + n, (P * c - n) * 2, stream_);
      auto* in = chunks_.get<uint16_t>(P * c);
      phase_ = 1;
      return make(CollectiveKind::kAllToAll, wt, w, in, c, "cast chunks");
    }
    case 1: {  // chunk j of every rank, widened, summed in rank order, rounded once
      auto* in = chunks_.get<uint16_t>(P * c);
      k::sum_widened({device_, stream_}, in, wire_dtype_, P, c, c, in, nullptr, wire_dtype_);
      phase_ = 2;
      return make(CollectiveKind::kAllgather, wt, in, wire_.data(), c, "cast gather");
    }
    case 2:
      k::convert({device_, stream_}, wire_.data(), wire_dtype_, grad_.data, dtype_, numel_, 1.0f);
      phase_ = 3;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

std::optional<Collective> CastAllreducePlan::next_gather() {
  const size_t n = static_cast<size_t>(numel_), P = static_cast<size_t>(world_);
  const ElemType wt = elem_type(wire_dtype_);
  switch (phase_) {
    case 0: {  // wire = cast(grad / P); every rank's whole wire buffer to every rank
      auto* w = wire_.get<uint16_t>(n);
      k::convert({device_, stream_}, grad_.data, dtype_, w, wire_dtype_, numel_, float(world_));
      phase_ = 1;
      return make(CollectiveKind::kAllgather, wt, w, chunks_.get<uint16_t>(P * n), n,
                  "cast gather all");
    }
    case 1: {  // the P buffers widened, summed in rank order, rounded once (as the RS route),
               // written to the gradient in its dtype: one pass, no widened copy of P buffers
      auto* all = chunks_.get<uint16_t>(P * n);
      k::sum_widened({device_, stream_}, all, wire_dtype_, P, n, n, nullptr, grad_.data, dtype_);
      phase_ = 2;
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

}  // namespace gradcomp

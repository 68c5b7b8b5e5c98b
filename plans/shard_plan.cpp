// SPDX-License-Identifier: Apache-2.0
// The reduce-scatter and allgather forms of the plain and cast plans (ShardCastPlan,
// plans/cast_plan.hpp): what sharded data parallelism (FSDP2, ZeRO) runs instead of an allreduce.
#include "gradcomp/error.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/cast_plan.hpp"

namespace gradcomp {

namespace k = kernels;

ShardCastPlan::ShardCastPlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world, int rank,
                             PlanForm form, bool average, Device device, int device_index,
                             void* stream)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      wire_dtype_(wire_dtype),
      rank_(rank),
      form_(form),
      average_(average),
      chunk_(0),
      wire_(device, stream),
      chunks_(device, stream),
      wide_(device, stream) {
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(wire_dtype)), "shard plan: unknown wire dtype");
  GC_CHECK_ARG(form == PlanForm::kReduceScatter || form == PlanForm::kAllgather,
               "shard plan: the form must be reduce_scatter or allgather, got ", int(form));
  GC_CHECK_ARG(rank >= 0 && rank < world, "shard plan: rank ", rank, " is outside [0, ", world,
               ")");
  GC_CHECK_ARG(numel % world == 0, "shard plan: the bucket's ", numel, " elements must split into ",
               world, " equal chunks (one per rank)");
  chunk_ = numel / world;
  const auto n = static_cast<size_t>(numel), c = static_cast<size_t>(chunk_);
  const size_t ws = dtype_size(wire_dtype);
  if (form == PlanForm::kReduceScatter) {
    wire_.reserve(n * ws);
    chunks_.reserve(n * ws);
    wide_.reserve(n * sizeof(float));
  } else {
    wire_.reserve(c * ws);
    chunks_.reserve(n * ws);
  }
}

std::string ShardCastPlan::name() const {
  const char* w = wire_dtype_ == DType::kFloat32   ? "fp32"
                  : wire_dtype_ == DType::kFloat16 ? "fp16"
                                                   : "bf16";
  return std::string(form_ == PlanForm::kReduceScatter ? "rs_" : "ag_") + w;
}

std::optional<Collective> ShardCastPlan::next() {
  require_begun();
  const auto n = static_cast<size_t>(numel_), c = static_cast<size_t>(chunk_);
  const size_t ws = dtype_size(wire_dtype_), gs = dtype_size(dtype_);
  const ElemType wt = elem_type(wire_dtype_);
  const bool half_wire = wire_dtype_ != DType::kFloat32;
  auto* own = static_cast<uint8_t*>(grad_.data) + static_cast<size_t>(rank_) * c * gs;
  if (form_ == PlanForm::kReduceScatter) {
    switch (phase_) {
      case 0: {  // chunk r of the wire copy goes to rank r
        // a half-precision wire carries grad / P (an fp16 sum of P gradients can overflow where
        // their average does not); an fp32 wire carries the gradient and divides after the sum
        void* w = wire_.get<uint8_t>(n * ws);
        k::convert({device_, stream_}, grad_.data, dtype_, w, wire_dtype_, numel_,
                   half_wire && average_ ? float(world_) : 1.0f);
        phase_ = 1;
        return make(CollectiveKind::kAllToAll, wt, w, chunks_.get<uint8_t>(n * ws), c,
                    "shard chunks");
      }
      case 1: {  // the P chunks r, in fp32, summed in rank order into this rank's chunk
        float* f = wide_.get<float>(n);
        k::convert({device_, stream_}, chunks_.data(), wire_dtype_, f, DType::kFloat32, numel_,
                   1.0f);
        k::reduce_blocks({device_, stream_}, f, static_cast<size_t>(world_), c, c, ElemType::kF32,
                         f);
        k::convert({device_, stream_}, f, DType::kFloat32, own, dtype_, chunk_,
                   !half_wire && average_ ? float(world_) : 1.0f);
        end_step(false, -1);
        return std::nullopt;
      }
      default:
        return std::nullopt;
    }
  }
  switch (phase_) {
    case 0: {  // this rank's chunk in the wire dtype to every rank
      void* w = wire_.get<uint8_t>(c * ws);
      k::convert({device_, stream_}, own, dtype_, w, wire_dtype_, chunk_, 1.0f);
      phase_ = 1;
      return make(CollectiveKind::kAllgather, wt, w, chunks_.get<uint8_t>(n * ws), c,
                  "shard gather");
    }
    case 1:  // every chunk, own included, widened back: every rank holds the same values
      k::convert({device_, stream_}, chunks_.data(), wire_dtype_, grad_.data, dtype_, numel_, 1.0f);
      end_step(false, -1);
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

}  // namespace gradcomp

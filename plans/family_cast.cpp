// SPDX-License-Identifier: Apache-2.0
// The dense families: plain allreduce, and the fp16 / bf16 casts (a wire type, fp32 sums).
#include "gradcomp/error.hpp"
#include "plans/cast_plan.hpp"
#include "plans/family.hpp"
#include "plans/options.hpp"

namespace gradcomp::detail {
namespace {

/// The shard plan of a dense family: the chunks cast to `wire` (the bucket's own dtype for plain
/// allreduce), summed in fp32 in rank order.
std::unique_ptr<BucketPlan> shard_cast(const BucketSpec& b, PlanForm form, const Options& o,
                                       DType wire) {
  const bool average = form == PlanForm::kReduceScatter ? o.flag("average") : true;
  return std::make_unique<ShardCastPlan>(b.numel, b.dtype, wire, b.world, b.rank, form, average,
                                         b.device, b.device_index, b.stream);
}

std::unique_ptr<BucketPlan> cast_plan(const BucketSpec& b, const Options& o, DType wire) {
  const std::string& r = o.name("route");
  CastRoute route;
  if (r == "auto") {
    // on gloo (which sums half precision slowly) the backend only moves bytes; on 2 ranks one
    // allgather of the whole buffer moves the same bytes as the reduce-scatter route in one
    // message round instead of two
    const bool gloo = b.backend == "gloo" || (b.backend.empty() && b.device == Device::kCPU);
    route = !gloo          ? CastRoute::kAllreduce
            : b.world == 2 ? CastRoute::kGather
                           : CastRoute::kReduceScatter;
  } else {
    route = o.pick<CastRoute>("route");
  }
  return std::make_unique<CastAllreducePlan>(b.numel, b.dtype, wire, b.world, b.device,
                                             b.device_index, b.stream, route);
}

PlanOptions cast_defaults() { return {{"route", std::string("auto")}}; }

template <DType Wire>
Family cast_family(const char* name) {
  Family f;
  f.name = name;
  f.defaults = cast_defaults;
  f.build = [](const BucketSpec& b, const Options& o) { return cast_plan(b, o, Wire); };
  f.shard_forms = {PlanForm::kReduceScatter, PlanForm::kAllgather};
  f.shard_defaults = [](PlanForm form) { return shard_defaults_from(cast_defaults(), form); };
  f.build_shard = [](const BucketSpec& b, PlanForm form, const Options& o) {
    return shard_cast(b, form, o, Wire);
  };
  return f;
}

}  // namespace

const Family& allreduce_family() {
  static const Family f = [] {
    Family a;
    a.name = "allreduce";
    a.defaults = [] { return PlanOptions{}; };
    a.build = [](const BucketSpec& b, const Options&) -> std::unique_ptr<BucketPlan> {
      return std::make_unique<DenseAllreducePlan>(b.numel, b.dtype, b.world, b.device,
                                                  b.device_index, b.stream);
    };
    a.shard_forms = {PlanForm::kReduceScatter, PlanForm::kAllgather};
    a.shard_defaults = [](PlanForm form) { return shard_defaults_from({}, form); };
    a.build_shard = [](const BucketSpec& b, PlanForm form, const Options& o) {
      return shard_cast(b, form, o, b.dtype);
    };
    return a;
  }();
  return f;
}

const Family& fp16_family() {
  static const Family f = cast_family<DType::kFloat16>("fp16");
  return f;
}

const Family& bf16_family() {
  static const Family f = cast_family<DType::kBFloat16>("bf16");
  return f;
}

}  // namespace gradcomp::detail

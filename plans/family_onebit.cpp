// SPDX-License-Identifier: Apache-2.0
// The 1-bit family (sign compression with worker and server error feedback).
#include "gradcomp/error.hpp"
#include "gradcomp/onebit.hpp"
#include "plans/family.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/options.hpp"

namespace gradcomp::detail {
namespace {

PlanOptions onebit_defaults() {
  const OneBitConfig d;
  // The recommended plan settings (see plan_defaults() in gradcomp/make_plan.hpp), not
  // OneBitConfig{}'s.
  return {{"scaling", std::string("sign_l2")},
          {"block_size", int64_t{128}},
          {"rotate", true},
          {"error_feedback", d.error_feedback},
          {"check_finite", d.check_finite},
          {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))},
          {"momentum", d.momentum}};
}

std::unique_ptr<BucketPlan> onebit_plan(const BucketSpec& b, const Options& o) {
  OneBitConfig c;
  c.scaling = o.pick<OneBitScaling>("scaling");
  c.block_size = o.integer("block_size");
  c.rotate = o.flag("rotate");
  c.error_feedback = o.flag("error_feedback");
  c.check_finite = o.flag("check_finite");
  c.momentum = o.real("momentum");
  c.tensor_id = b.bucket_id;
  return std::make_unique<OneBitAllreducePlan>(c, b.numel, b.world, b.rank, b.device,
                                               b.device_index, b.stream);
}

}  // namespace

const Family& onebit_family() {
  static const Family f = [] {
    Family o;
    o.name = "onebit";
    o.stateful = true;
    o.defaults = onebit_defaults;
    o.build = onebit_plan;
    o.states = {{"onebit-allreduce", reshard_onebit_state}};
    // the elements per scale were called chunk_size by OneBitConfig (still accepted there) and by
    // the per-tensor codec's keyword
    o.aliases = {{"chunk_size", "block_size"}};
    return o;
  }();
  return f;
}

}  // namespace gradcomp::detail

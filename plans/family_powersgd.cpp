// SPDX-License-Identifier: Apache-2.0
// The PowerSGD family (low-rank approximation of each matrix of the bucket, error feedback).
#include <algorithm>

#include "compressors/powersgd_impl.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/powersgd.hpp"
#include "plans/family.hpp"
#include "plans/options.hpp"
#include "plans/powersgd_plan.hpp"

namespace gradcomp::detail {
namespace {

PlanOptions powersgd_defaults() {
  const PowerSGDConfig d;
  return {{"rank", int64_t{d.rank}},
          {"min_compression_rate", d.min_compression_rate},
          {"use_error_feedback", d.error_feedback},
          {"warm_start", d.warm_start},
          {"orthogonalization_epsilon", static_cast<double>(d.orthogonalization_epsilon)},
          {"seed", static_cast<int64_t>(d.seed)},
          {"orthogonalization", std::string(enum_name(d.orthogonalization))},
          {"check_finite", d.check_finite},
          {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))}};
}

std::unique_ptr<BucketPlan> powersgd_plan(const BucketSpec& b, const Options& o) {
  PowerSGDConfig c;
  c.rank = static_cast<int>(std::min<int64_t>(o.integer("rank"), int64_t{1} << 30));
  c.min_compression_rate = o.real("min_compression_rate");
  c.error_feedback = o.flag("use_error_feedback");
  c.warm_start = o.flag("warm_start");
  c.orthogonalization_epsilon = static_cast<float>(o.real("orthogonalization_epsilon"));
  c.seed = o.seed("seed");
  c.orthogonalization = o.pick<Orthogonalization>("orthogonalization");
  c.check_finite = o.flag("check_finite");
  GC_CHECK_ARG(b.bucket_id < 65536, "powersgd: bucket_id must be < 65536 (tensor ids ",
               "bucket_id * 65536 + i), got ", b.bucket_id);
  c.first_tensor_id = b.bucket_id * 65536u;
  std::vector<std::vector<int64_t>> shapes = b.shapes;
  if (shapes.empty()) shapes.push_back({b.numel});
  // the state checks every shape (dimensions, bounds) and the plan that they fill the bucket
  auto st = std::make_unique<PowerSGDState>(c, shapes, b.dtype, b.device, b.device_index, b.stream);
  GC_CHECK_ARG(st->compressed_numel() + st->uncompressed_numel() == b.numel,
               "powersgd: the shapes hold ", st->compressed_numel() + st->uncompressed_numel(),
               " elements but the bucket has ", b.numel);
  return std::make_unique<PowerSGDPlan>(std::move(st), b.world);
}

}  // namespace

const Family& powersgd_family() {
  static const Family f = [] {
    Family p;
    p.name = "powersgd";
    // torch's PowerSGD hook says use_error_feedback; every other family says error_feedback
    p.aliases = {{"error_feedback", "use_error_feedback"}};
    p.stateful = true;
    p.uses_shapes = true;  // the matrices to approximate
    p.defaults = powersgd_defaults;
    p.build = powersgd_plan;
    p.states = {
        {"powersgd", [](const RankStateList& s, int, int) { return reshard_powersgd_state(s); }}};
    return p;
  }();
  return f;
}

}  // namespace gradcomp::detail

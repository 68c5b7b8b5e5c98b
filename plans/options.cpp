// SPDX-License-Identifier: Apache-2.0
#include "plans/options.hpp"

#include <utility>

#include "gradcomp/error.hpp"

namespace gradcomp::detail {

const char* option_type_name(const PlanOption& v) {
  switch (v.index()) {
    case 0:
      return "a flag (bool)";
    case 1:
      return "an integer";
    case 2:
      return "a number";
    case 3:
      return "a name (str)";
    default:
      return "a list of numbers";
  }
}

namespace {
/// `given` with every alias renamed to its option; both spellings of one option is an error.
PlanOptions canonical(const std::string& family, const PlanOptions& given,
                      const std::vector<std::pair<const char*, const char*>>& aliases) {
  PlanOptions out = given;
  for (const auto& [spelling, option] : aliases) {
    auto it = out.find(spelling);
    if (it == out.end()) continue;
    GC_CHECK_ARG(out.count(option) == 0, "invalid options for compressor '", family, "': '",
                 spelling, "' and '", option, "' are two spellings of one option; give one");
    out.emplace(option, it->second);
    out.erase(spelling);
  }
  return out;
}
}  // namespace

Options::Options(const std::string& family, PlanOptions defaults, const PlanOptions& given_as,
                 const std::vector<std::pair<const char*, const char*>>& aliases)
    : family_(family), values_(std::move(defaults)) {
  const PlanOptions given = canonical(family, given_as, aliases);
  std::vector<std::string> unknown;
  for (const auto& [k, v] : given) {
    auto it = values_.find(k);
    if (it == values_.end()) {
      unknown.push_back(k);
      continue;
    }
    const bool same = it->second.index() == v.index();
    const bool int_for_real = it->second.index() == 2 && v.index() == 1;
    GC_CHECK_ARG(same || int_for_real, "invalid option for compressor '", family, "': ", k,
                 " must be ", option_type_name(it->second), ", got ", option_type_name(v));
    it->second = int_for_real ? PlanOption(static_cast<double>(std::get<int64_t>(v))) : v;
  }
  if (!unknown.empty()) {
    std::string u, known;
    for (const auto& k : unknown) u += (u.empty() ? "'" : ", '") + k + "'";
    for (const auto& [k, v] : values_) known += (known.empty() ? "'" : ", '") + k + "'";
    throw InvalidArgument(detail::cat("unknown option(s) [", u, "] for compressor '", family,
                                      "'; known: [", known, "]"));
  }
}

uint64_t Options::seed(const char* k) const {
  const int64_t v = integer(k);
  GC_CHECK_ARG(v >= 0, "invalid option for compressor '", family_, "': ", k, " must be >= 0, got ",
               v);
  return static_cast<uint64_t>(v);
}

PlanOptions sparsify_defaults(const SparsifyConfig& d) {
  return {{"ratio", d.ratio},
          {"momentum", d.momentum},
          {"nesterov", d.nesterov},
          {"momentum_masking", d.momentum_masking},
          {"clip_norm", d.clip_norm},
          {"clip_scaling", std::string(enum_name(d.clip_scaling))},
          {"warmup_ratios", d.warmup_ratios},
          {"warmup_steps", d.warmup_steps},
          {"value_dtype", std::string(enum_name(d.value_dtype))},
          {"error_feedback", d.error_feedback},
          {"check_finite", d.check_finite},
          {"on_nonfinite", std::string(enum_name(OnNonFinite::kSkip))},
          {"seed", static_cast<int64_t>(d.seed)}};
}

PlanOptions shard_defaults_from(PlanOptions o, PlanForm form) {
  o.erase("route");
  o.erase("rotate");
  if (form == PlanForm::kReduceScatter) o["average"] = true;
  return o;
}

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// The option reader every family's descriptor (plans/family.hpp) parses its options with: the
// given options over the family's defaults, each read with the type its default has, and one
// message form for every refusal ("invalid option for compressor 'quant': bits ...").
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gradcomp/error.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/topk.hpp"

namespace gradcomp::detail {

/// "a flag (bool)", "an integer", ...: the type of an option value, for messages.
const char* option_type_name(const PlanOption& v);

/// The given options over the family's defaults. An unknown option or a value of another type
/// than its default (an integer where a real is expected is taken) is an InvalidArgument naming
/// it and the known ones.
class Options {
 public:
  /// `aliases`: other spellings of options, {spelling, option}: given under either name (not
  /// both), an option is read under its own.
  Options(const std::string& family, PlanOptions defaults, const PlanOptions& given,
          const std::vector<std::pair<const char*, const char*>>& aliases = {});
  bool has(const char* k) const { return values_.count(k) != 0; }
  bool flag(const char* k) const { return std::get<bool>(values_.at(k)); }
  int64_t integer(const char* k) const { return std::get<int64_t>(values_.at(k)); }
  double real(const char* k) const { return std::get<double>(values_.at(k)); }
  const std::string& name(const char* k) const { return std::get<std::string>(values_.at(k)); }
  /// A named option parsed as enum E; an unknown name is refused naming the option and the
  /// compressor (parse_enum's own message names only the kind: "unknown dtype 'int8'").
  template <class E>
  E pick(const char* k) const {
    try {
      return parse_enum<E>(name(k));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          detail::cat("invalid option for compressor '", family_, "': ", k, ": ", e.what()));
    }
  }
  const std::vector<double>& list(const char* k) const {
    return std::get<std::vector<double>>(values_.at(k));
  }
  /// A non-negative integer option (a seed).
  uint64_t seed(const char* k) const;
  const std::string& family() const { return family_; }
  /// The on_nonfinite policy where the form has one (kSkip otherwise).
  OnNonFinite on_nonfinite() const {
    return has("on_nonfinite") ? pick<OnNonFinite>("on_nonfinite") : OnNonFinite::kSkip;
  }

 private:
  std::string family_;
  PlanOptions values_;
};

/// The option table top-k and random-k share (DGC's sparsification), defaults from `d`.
PlanOptions sparsify_defaults(const SparsifyConfig& d);

/// The shared part of a top-k / random-k configuration from parsed options.
template <class C>
C sparsify_config(const Options& o, uint32_t tensor_id) {
  C c;
  c.ratio = o.real("ratio");
  c.momentum = o.real("momentum");
  c.nesterov = o.flag("nesterov");
  c.momentum_masking = o.flag("momentum_masking");
  c.clip_norm = o.real("clip_norm");
  c.clip_scaling = o.pick<SparsifyConfig::ClipScaling>("clip_scaling");
  c.warmup_ratios = o.list("warmup_ratios");
  c.warmup_steps = o.integer("warmup_steps");
  c.value_dtype = o.pick<DType>("value_dtype");
  c.error_feedback = o.flag("error_feedback");
  c.check_finite = o.flag("check_finite");
  c.seed = o.seed("seed");
  c.tensor_id = tensor_id;
  return c;
}

/// The shard forms' options from a family's allreduce options: without the allreduce's route and
/// rotation (the shard forms have one route, and the caller's chunks need not hold whole
/// rotation blocks); the reduce-scatter adds "average" (true: the chunk's average, false: its
/// sum).
PlanOptions shard_defaults_from(PlanOptions allreduce_defaults, PlanForm form);

/// Top-k's codec configuration (validated) from parsed options (plans/family_sparsify.cpp).
TopKConfig topk_config_of(const Options& o, uint32_t tensor_id);

}  // namespace gradcomp::detail

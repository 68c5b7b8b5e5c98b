// SPDX-License-Identifier: Apache-2.0
// The list of families (plans/family.hpp): the one place a new family is added.
#include <limits>

#include "core/state_io.hpp"
#include "gradcomp/error.hpp"
#include "plans/family.hpp"

namespace gradcomp {
namespace detail {

const std::vector<const Family*>& families() {
  static const std::vector<const Family*> all = {
      &allreduce_family(), &fp16_family(),  &bf16_family(),     &topk_family(), &randomk_family(),
      &onebit_family(),    &quant_family(), &powersgd_family(), &fp8_family()};
  return all;
}

const Family& family(const std::string& name) {
  std::string known;
  for (const Family* f : families()) {
    if (name == f->name) return *f;
    known += (known.empty() ? "" : ", ") + std::string(f->name);
  }
  throw InvalidArgument("unknown compressor '" + name + "'; choose one of " + known);
}

const StateKind* state_kind(const std::string& kind) {
  for (const Family* f : families())
    for (const StateKind& s : f->states)
      if (kind == s.kind) return &s;
  return nullptr;
}

}  // namespace detail

std::vector<FamilyTraits> family_traits() {
  std::vector<FamilyTraits> out;
  for (const detail::Family* f : detail::families()) {
    FamilyTraits t;
    t.name = f->name;
    t.stateful = f->stateful;
    t.uses_shapes = f->uses_shapes;
    t.shard_forms = f->shard_forms;
    for (const auto& s : f->states) t.state_kinds.emplace_back(s.kind);
    t.summary = f->summary;
    for (const auto& [spelling, option] : f->aliases) t.aliases.emplace_back(spelling, option);
    for (const auto& d : f->option_docs) {
      FamilyTraits::Doc doc{d.option, d.form, d.meaning, {}};
      for (const char* v : d.values) doc.values.emplace_back(v);
      t.option_docs.push_back(std::move(doc));
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<std::string> plan_names() {
  std::vector<std::string> names;
  for (const detail::Family* f : detail::families()) names.emplace_back(f->name);
  return names;
}

std::vector<std::string> shard_plan_names() {
  std::vector<std::string> names;
  for (const detail::Family* f : detail::families())
    if (!f->shard_forms.empty()) names.emplace_back(f->name);
  return names;
}

PlanOptions plan_defaults(const std::string& name) { return detail::family(name).defaults(); }

bool plan_is_stateful(const std::string& name) { return detail::family(name).stateful; }

}  // namespace gradcomp

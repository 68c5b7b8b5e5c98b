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

std::vector<uint8_t> check_shard_states(const RankStateList& states, int world,
                                        const std::string& kind, const char* array,
                                        void (*family_fields)(RankStates&, int64_t, int64_t)) {
  RankStates rs(states, kind);
  const auto P = static_cast<int64_t>(rs.size());
  const auto numel = rs.same<int64_t>("numel");
  const auto saved_world = rs.same<int32_t>("world");
  GC_CHECK_ARG(saved_world == P, "state_dict: the states were saved by a job of ", saved_world,
               " ranks, ", P, " were given (one per rank, in rank order)");
  GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40) && numel % P == 0, "state_dict: numel ",
               numel, " is not a bucket of ", P, " equal chunks");
  for (int64_t r = 0; r < P; ++r) {
    const auto got = rs[static_cast<size_t>(r)].get<int32_t>("rank");
    GC_CHECK_ARG(got == r, "state_dict: state ", r, " was saved by rank ", got,
                 " (give one state per rank, in rank order)");
  }
  family_fields(rs, numel, P);
  const auto step = rs.same<int64_t>("step");
  GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ", step,
               " out of range");
  (void)rs.arrays(array, static_cast<uint64_t>(numel) * sizeof(float));
  rs.finish();
  // a sharded job's bucket is padded to its world size (FSDP pads every parameter to P rows'
  // worth): its worker error has no place in a bucket of another size
  GC_CHECK_ARG(world == P, "reshard_state: a reduce-scatter state (sharded training) belongs ",
               "to its world size (", P, " ranks) and cannot be resharded to ", world,
               "; resume on as many ranks, or start the error feedback afresh");
  return {};
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

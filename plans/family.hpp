// SPDX-License-Identifier: Apache-2.0
// The family registry: everything make_plan(), make_shard_plan(), reshard_state(), the bindings
// and the Python hooks know about a compressor family is one descriptor (a Family), defined in the
// family's own file (plans/family_<name>.cpp) and listed once in plans/families.cpp. The public
// entry points (gradcomp/make_plan.hpp) only look families up here: adding a family is its plan,
// its descriptor and one line in the list, never another if-chain.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/state_io.hpp"
#include "gradcomp/make_plan.hpp"

namespace gradcomp::detail {

class Options;
class RankStates;

/// One kind of state_dict() a family's plans write (the kind string of its StateWriter) and how
/// reshard_state() resumes it on `world` ranks. The function checks every state (one job's, one
/// step) and returns rank `rank`'s new state; with world == states.size() the caller hands back
/// the rank's own bytes, so it may return {} there. It refuses, naming the field, what it cannot
/// reshard.
struct StateKind {
  const char* kind;
  std::vector<uint8_t> (*reshard)(const RankStateList& states, int world, int rank);
};

/// What an option means, for the options reference (docs/OPTIONS.md, written by
/// scripts/gen_options_doc.py): kept beside the option table so that a family brings its own.
/// `form`: "" for every table of the family, else the shard form ("reduce_scatter" /
/// "allgather") whose table it describes; `values`: an option's accepted names, each of which the
/// meaning names.
struct OptionDoc {
  const char* option;
  const char* form;
  const char* meaning;
  std::vector<const char*> values;
};

/// A compressor family, registered once.
struct Family {
  const char* name;
  /// One line for the options reference: what the family is. Empty: the reference's own line.
  const char* summary = "";
  /// Other spellings accepted for its options, {spelling, option} (a name users know from
  /// elsewhere, or an older one): either may be given, not both.
  std::vector<std::pair<const char*, const char*>> aliases;
  /// Meanings of its options, for the options reference (families registered before these
  /// existed keep theirs in scripts/gen_options_doc.py).
  std::vector<OptionDoc> option_docs;
  /// The plans carry state between steps (checkpointed with the model); a test checks this
  /// against what a plan of the family says (BucketPlan::stateful).
  bool stateful = false;
  /// The plan reads the bucket's tensor shapes (BucketSpec::shapes): callers that know them
  /// pass them only to these families.
  bool uses_shapes = false;
  /// Every option of the allreduce plan with its default (plan_defaults).
  PlanOptions (*defaults)() = nullptr;
  /// The allreduce plan for bucket `b` from the parsed options.
  std::unique_ptr<BucketPlan> (*build)(const BucketSpec& b, const Options& o) = nullptr;
  /// The shard forms (sharded training): empty, and the two functions null, where the family has
  /// none. shard_defaults is called only for a form in `shard_forms`.
  std::vector<PlanForm> shard_forms;
  PlanOptions (*shard_defaults)(PlanForm form) = nullptr;
  std::unique_ptr<BucketPlan> (*build_shard)(const BucketSpec& b, PlanForm form,
                                             const Options& o) = nullptr;
  /// Why a shard form it lacks is missing, for the refusal ("parameters are not sparse").
  const char* missing_form_reason = nullptr;
  /// The state kinds its plans write, with their resharding.
  std::vector<StateKind> states;
};

/// Every registered family, in plan_names() order.
const std::vector<const Family*>& families();
/// The family called `name`; InvalidArgument naming the known ones otherwise.
const Family& family(const std::string& name);
/// The family and state kind whose plans write states of `kind`; nullptr if none.
const StateKind* state_kind(const std::string& kind);

// One accessor per family, each defined in plans/family_<name>.cpp (function-local statics: no
// order of static initialisation to depend on).
const Family& allreduce_family();
const Family& fp16_family();
const Family& bf16_family();
const Family& topk_family();
const Family& randomk_family();
const Family& onebit_family();
const Family& quant_family();
const Family& powersgd_family();
const Family& fp8_family();

// Resharding of the families whose state layout lives in a plan file (the codecs' own live
// beside their states in compressors/).
std::vector<uint8_t> reshard_onebit_state(const RankStateList& states, int world, int rank);
std::vector<uint8_t> reshard_quant_state(const RankStateList& states, int world, int rank);
std::vector<uint8_t> reshard_quant_shard_state(const RankStateList& states, int world, int rank);
std::vector<uint8_t> reshard_topk_shard_state(const RankStateList& states, int world, int rank);

}  // namespace gradcomp::detail

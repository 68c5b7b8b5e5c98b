// SPDX-License-Identifier: Apache-2.0
// A family's checkpoint state, declared once: the fields in their order on the wire, each with
// the role that says how it behaves (a setting that must match, the step, an array averaged over
// ranks or cut into per-rank chunks). Saving (state_dict), loading (load_state_dict: everything
// checked before anything is copied) and resuming on another world size (reshard_state) are all
// derived from the declaration, so a family no longer writes its state three times and the three
// cannot drift apart. The bytes are those of core/state_io.hpp's StateWriter, field by field, so
// a schema written for an existing state keeps its checkpoints loadable.
//
// Not covered: PowerSGD's state (compressors/powersgd_state.cpp). Its fields are a list, a count
// and then (rows, cols, rank) per tensor, which a map of named scalars cannot hold and load must
// compare element by element; its arrays are sized by sums over that list (the compressed
// tensors' n*m and m*rank), not by numel or a chunk; its q_ready flag is neither a setting nor
// the step (read, checked <= 1, handed back, the same on every rank); and an absent array is
// written with length 0 rather than left out. Each would be its own extension (list-valued
// scalars, a size function per array, a state-flag role, empty-not-absent arrays), together a
// second schema language for one family, so it keeps its hand-written three.
//
// Example (a two-phase family):
//   const StateSchema s{"x-allreduce",
//                       {{"numel", FieldRole::kNumel}, {"world", FieldRole::kWorld},
//                        {"rank", FieldRole::kRank}, {"bits", FieldRole::kOption, FieldType::kU8},
//                        {"step", FieldRole::kStep}, {"worker_error", FieldRole::kMean},
//                        {"server_error", FieldRole::kChunk}},
//                       chunk_elems_fn, validate_fn};
//   auto bytes = write_state(s, scalars, {worker_error_ptr, server_error_ptr}, device, stream);
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/state_io.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp::detail {

/// How a field behaves across ranks and world sizes.
enum class FieldRole : uint8_t {
  kNumel,   ///< int64: the bucket's elements; the same on every rank, sizes the arrays
  kWorld,   ///< int32: ranks of the job that saved it; rewritten when resharded
  kRank,    ///< int32: the rank that saved it; rewritten when resharded
  kOption,  ///< a setting: the plan's own on load, the same on every rank, kept when resharded
  kStep,    ///< int64: the step, the same on every rank
  kMean,    ///< fp32 array of numel values: the ranks' element-wise mean when resharded
  kChunk,   ///< fp32 array, this rank's chunk of one vector over the bucket (a two-phase plan's
            ///< server error): cut anew for the new world size when resharded, exactly
};

/// The storage of a scalar field (kOption; the other scalar roles have fixed types).
enum class FieldType : uint8_t { kU8, kI32, kI64, kU64, kU32 };

/// A state's scalar fields by name, as read or to be written (unsigned values bit-cast).
using StateScalars = std::map<std::string, int64_t>;

struct StateField {
  const char* name;
  FieldRole role;
  FieldType type = FieldType::kI64;  ///< kOption only
  /// An array written only when this says so from the scalars (nullptr: always).
  bool (*present)(const StateScalars& s) = nullptr;
};

struct StateSchema {
  const char* kind;
  std::vector<StateField> fields;
  /// Elements of a kChunk array on `world` ranks (needed when the schema has one).
  int64_t (*chunk_elems)(const StateScalars& s, int world) = nullptr;
  /// Refuses settings that could not have been saved (before they size anything when
  /// resharding a checkpoint from disk); nullptr: none to check.
  void (*validate)(const StateScalars& s) = nullptr;
  /// The state belongs to its world size (a sharded job pads its buckets to it): resharding
  /// checks the states whole and refuses another world size; on as many ranks the caller hands
  /// each rank its own bytes back.
  bool belongs_to_world = false;
};

/// The state: `scalars` holds every scalar field (numel, world, rank, step and the options) and
/// `arrays` each present array in field order (on `device`, in `stream`'s order). A schema
/// without kWorld (a state that is the same on every rank, such as the sparsifiers') needs no
/// "world" among the scalars unless it has a kChunk array.
std::vector<uint8_t> write_state(const StateSchema& schema, const StateScalars& scalars,
                                 const std::vector<const void*>& arrays, Device device,
                                 void* stream);

/// A state checked for loading into a plan whose scalars are `expected` (every scalar field but
/// the step, which is read): each array present, finite and of its size. InvalidArgument naming
/// the field otherwise; the caller copies nothing before this returns.
struct LoadedState {
  int64_t step = 0;
  std::vector<const uint8_t*> arrays;  ///< host pointers into the input, in field order
};
LoadedState read_state(const StateSchema& schema, const uint8_t* data, size_t nbytes,
                       const StateScalars& expected);

/// The server errors of a P-rank checkpoint (`se[r]`: rank r's chunk of `ce_old` fp32 values, in
/// the average's units) laid end to end are one vector over the bucket; the chunk of rank `rank`
/// in a job whose chunks hold `ce_new` elements, exactly (zeros past the old end).
std::vector<float> rechunk_server_error(const std::vector<const uint8_t*>& se, int64_t ce_old,
                                        int64_t ce_new, int rank);

/// reshard_state() for a schema (gradcomp/make_plan.hpp): the states of one job's ranks, checked
/// whole, to rank `rank` of `world` ranks.
std::vector<uint8_t> reshard_by_schema(const StateSchema& schema, const RankStateList& states,
                                       int world, int rank);

}  // namespace gradcomp::detail

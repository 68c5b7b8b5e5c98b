// SPDX-License-Identifier: Apache-2.0
#include "core/state_schema.hpp"

#include <cstring>
#include <limits>

#include "core/state_io.hpp"
#include "gradcomp/error.hpp"

namespace gradcomp::detail {
namespace {

bool is_array(const StateField& f) {
  return f.role == FieldRole::kMean || f.role == FieldRole::kChunk;
}

bool present(const StateField& f, const StateScalars& s) {
  return is_array(f) && (f.present == nullptr || f.present(s));
}

FieldType type_of(const StateField& f) {
  switch (f.role) {
    case FieldRole::kWorld:
    case FieldRole::kRank:
      return FieldType::kI32;
    case FieldRole::kOption:
      return f.type;
    default:
      return FieldType::kI64;
  }
}

/// f(T{}) with the C++ type a scalar field is stored as.
template <class F>
auto with_type(FieldType t, F&& f) {
  switch (t) {
    case FieldType::kU8:
      return f(uint8_t{});
    case FieldType::kI32:
      return f(int32_t{});
    case FieldType::kU32:
      return f(uint32_t{});
    case FieldType::kI64:
      return f(int64_t{});
    default:
      return f(uint64_t{});
  }
}

void put(StateWriter& w, FieldType t, int64_t v) {
  with_type(t, [&](auto z) { w.put<decltype(z)>(static_cast<decltype(z)>(v)); });
}

/// Reads a scalar and checks it equals `want` (the reader's own message names the field).
void expect(StateReader& r, const char* name, FieldType t, int64_t want) {
  with_type(t, [&](auto z) { r.expect<decltype(z)>(name, static_cast<decltype(z)>(want)); });
}

/// A scalar every rank must hold alike.
int64_t same(RankStates& rs, const char* name, FieldType t) {
  return with_type(t, [&](auto z) { return static_cast<int64_t>(rs.same<decltype(z)>(name)); });
}

int64_t elems(const StateSchema& s, const StateField& f, const StateScalars& v, int world) {
  if (f.role == FieldRole::kMean) return v.at("numel");
  GC_CHECK_ARG(s.chunk_elems != nullptr && world > 0, "state schema '", s.kind,
               "': no chunk size for '", f.name,
               "' (a kChunk array needs chunk_elems and a world)");
  return s.chunk_elems(v, world);
}

/// The world size the scalars were saved with; 0 for a state without one (only kChunk arrays
/// need it, and elems() refuses them then).
int world_of(const StateScalars& v) {
  const auto it = v.find("world");
  return it == v.end() ? 0 : static_cast<int>(it->second);
}

}  // namespace

std::vector<float> rechunk_server_error(const std::vector<const uint8_t*>& se, int64_t ce_old,
                                        int64_t ce_new, int rank) {
  const int64_t total = static_cast<int64_t>(se.size()) * ce_old;
  std::vector<float> out(static_cast<size_t>(ce_new), 0.0f);
  for (int64_t i = 0; i < ce_new; ++i) {
    const int64_t g = static_cast<int64_t>(rank) * ce_new + i;  // global position
    if (g < total)
      std::memcpy(&out[static_cast<size_t>(i)],
                  se[static_cast<size_t>(g / ce_old)] + (g % ce_old) * 4, 4);
  }
  return out;
}

std::vector<uint8_t> write_state(const StateSchema& schema, const StateScalars& scalars,
                                 const std::vector<const void*>& arrays, Device device,
                                 void* stream) {
  StateWriter w(schema.kind);
  const int world = world_of(scalars);
  size_t next = 0;
  for (const StateField& f : schema.fields) {
    if (!is_array(f)) {
      put(w, type_of(f), scalars.at(f.name));
    } else if (present(f, scalars)) {
      GC_CHECK(next < arrays.size(), "state schema '", schema.kind, "': no data for '", f.name,
               "'");
      const auto bytes = static_cast<uint64_t>(elems(schema, f, scalars, world)) * sizeof(float);
      w.put_array(arrays[next++], device, bytes, stream);
    }
  }
  GC_CHECK(next == arrays.size(), "state schema '", schema.kind, "': ", arrays.size() - next,
           " arrays more than its fields");
  return w.take();
}

LoadedState read_state(const StateSchema& schema, const uint8_t* data, size_t nbytes,
                       const StateScalars& expected) {
  StateReader r(data, nbytes, schema.kind);
  LoadedState out;
  const int world = world_of(expected);
  for (const StateField& f : schema.fields) {
    if (f.role == FieldRole::kStep) {
      out.step = r.get_step();
    } else if (!is_array(f)) {
      expect(r, f.name, type_of(f), expected.at(f.name));
    } else if (present(f, expected)) {
      const auto bytes = static_cast<uint64_t>(elems(schema, f, expected, world)) * sizeof(float);
      out.arrays.push_back(r.finite_array(f.name, bytes));
    }
  }
  r.finish();
  return out;
}

std::vector<uint8_t> reshard_by_schema(const StateSchema& schema, const RankStateList& states,
                                       int world, int rank) {
  RankStates rs(states, schema.kind);
  const int P = static_cast<int>(rs.size());
  StateScalars v;
  std::vector<std::vector<float>> arrays;
  bool validated = false;
  for (const StateField& f : schema.fields) {
    switch (f.role) {
      case FieldRole::kNumel: {
        const auto numel = rs.same<int64_t>(f.name);
        GC_CHECK_ARG(numel >= 0 && numel <= (int64_t{1} << 40), "state_dict: numel ", numel,
                     " out of range");
        v[f.name] = numel;
        break;
      }
      case FieldRole::kWorld: {
        const auto saved = rs.same<int32_t>(f.name);
        GC_CHECK_ARG(saved == P, "state_dict: the states were saved by a job of ", saved,
                     " ranks, ", P, " were given (one per rank, in rank order)");
        v[f.name] = saved;
        break;
      }
      case FieldRole::kRank:
        for (int r = 0; r < P; ++r) {
          const auto got = rs[static_cast<size_t>(r)].get<int32_t>(f.name);
          GC_CHECK_ARG(got == r, "state_dict: state ", r, " was saved by rank ", got,
                       " (give one state per rank, in rank order)");
        }
        break;
      case FieldRole::kOption:
        v[f.name] = same(rs, f.name, f.type);
        break;
      case FieldRole::kStep: {
        const auto step = rs.same<int64_t>(f.name);
        GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ",
                     step, " out of range");
        v[f.name] = step;
        break;
      }
      case FieldRole::kMean:
      case FieldRole::kChunk: {
        if (!validated && schema.validate != nullptr) schema.validate(v);  // before any sizing
        validated = true;
        if (!present(f, v)) break;
        if (schema.belongs_to_world) {  // checked, not moved
          (void)rs.arrays(f.name, static_cast<uint64_t>(elems(schema, f, v, P)) * sizeof(float));
        } else if (f.role == FieldRole::kMean) {
          arrays.push_back(rs.mean(f.name, v.at("numel")));
        } else {
          const int64_t ce = schema.chunk_elems(v, P);
          const auto chunks = rs.arrays(f.name, static_cast<uint64_t>(ce) * sizeof(float));
          arrays.push_back(rechunk_server_error(chunks, ce, schema.chunk_elems(v, world), rank));
        }
        break;
      }
    }
  }
  rs.finish();
  if (schema.belongs_to_world) {
    GC_CHECK_ARG(world == P, "reshard_state: a reduce-scatter state (sharded training) belongs ",
                 "to its world size (", P, " ranks) and cannot be resharded to ", world,
                 "; resume on as many ranks, or start the error feedback afresh");
    return {};
  }
  for (const StateField& f : schema.fields) {
    if (f.role == FieldRole::kWorld) v[f.name] = world;
    if (f.role == FieldRole::kRank) v[f.name] = rank;
  }
  std::vector<const void*> ptrs;
  for (const auto& a : arrays) ptrs.push_back(a.data());
  return write_state(schema, v, ptrs, Device::kCPU, nullptr);
}

}  // namespace gradcomp::detail

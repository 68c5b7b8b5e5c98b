// SPDX-License-Identifier: Apache-2.0
// The checkpoint state top-k and random-k share, declared once (core/state_schema.hpp): saved,
// loaded and resharded for another world size from the same declaration.
#include "compressors/sparsify_state.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "core/state_schema.hpp"
#include "gradcomp/error.hpp"

namespace gradcomp::detail {
namespace {

/// The momentum array is written with momentum on a non-empty bucket: an empty bucket's
/// momentum buffer was never allocated, and its states have always been written without the
/// array (has_momentum still 1), so they load as before and now reshard too.
bool has_momentum_array(const StateScalars& v) {
  return v.at("has_momentum") != 0 && v.at("numel") > 0;
}

// The fields in the order their checkpoints have always had (numel, step, has_momentum u8,
// tensor_id u32, residual, momentum). The state is the same kind of thing on every rank (no
// world, rank or chunk): every rank's residual and momentum add to the average with weight 1/P,
// so giving every rank of the new job their mean keeps both sums over ranks / P (what the
// residuals will still send, the momenta's future contribution) as they were.
std::vector<StateField> sparsify_fields() {
  return {{"numel", FieldRole::kNumel},
          {"step", FieldRole::kStep},
          {"has_momentum", FieldRole::kOption, FieldType::kU8},
          {"tensor_id", FieldRole::kOption, FieldType::kU32},
          {"residual", FieldRole::kMean},
          {"momentum", FieldRole::kMean, FieldType::kI64, has_momentum_array}};
}

void validate_sparsify(const StateScalars& v) {
  const int64_t has_u = v.at("has_momentum");
  GC_CHECK_ARG(has_u <= 1, "state_dict: bad has_momentum flag ", has_u);
}

const StateSchema& sparsify_schema(const std::string& kind) {
  static const StateSchema topk{"topk", sparsify_fields(), nullptr, validate_sparsify};
  static const StateSchema randomk{"randomk", sparsify_fields(), nullptr, validate_sparsify};
  if (kind == "topk") return topk;
  GC_CHECK(kind == "randomk", "no sparsifier state of kind '", kind, "'");
  return randomk;
}

}  // namespace

std::vector<uint8_t> SparsifyState::state_dict(const char* kind, int64_t numel,
                                               int64_t step) const {
  GC_CHECK(numel == n_, kind, ": state of ", numel, " elements, the buffers hold ", n_);
  const StateScalars s = {{"numel", numel},
                          {"step", step},
                          {"has_momentum", cfg_.momentum > 0.0},
                          {"tensor_id", cfg_.tensor_id}};
  std::vector<const void*> arrays = {v()};
  if (has_momentum_array(s)) arrays.push_back(u());
  return write_state(sparsify_schema(kind), s, arrays, dev_, stream_);
}

int64_t SparsifyState::load_state_dict(const char* kind, int64_t numel, const uint8_t* data,
                                       size_t nbytes) {
  GC_CHECK(numel == n_, kind, ": state of ", numel, " elements, the buffers hold ", n_);
  const StateScalars expected = {
      {"numel", numel}, {"has_momentum", cfg_.momentum > 0.0}, {"tensor_id", cfg_.tensor_id}};
  const LoadedState saved = read_state(sparsify_schema(kind), data, nbytes, expected);
  // every field checked: now overwrite
  const size_t bytes = static_cast<size_t>(n_) * sizeof(float);
  device_copy(v(), dev_, saved.arrays[0], Device::kCPU, bytes, stream_);
  if (saved.arrays.size() > 1)
    device_copy(u(), dev_, saved.arrays[1], Device::kCPU, bytes, stream_);
  return saved.step;
}

std::vector<uint8_t> reshard_sparsify_state(const std::vector<std::vector<uint8_t>>& states,
                                            const std::string& kind, int world, int rank) {
  return reshard_by_schema(sparsify_schema(kind), states, world, rank);
}

}  // namespace gradcomp::detail

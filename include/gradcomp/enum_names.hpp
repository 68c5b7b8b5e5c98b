// SPDX-License-Identifier: Apache-2.0
// The names of every enum an option or keyword takes, one table per enum. make_plan's parser and
// plan_defaults, the codec and DropCompute bindings, and the Python enums (nb::enum_) all read
// these tables, so a name is written once:
//
//   parse_enum<TopKRoute>("sparse") == TopKRoute::kSparse
//   enum_name(TopKRoute::kSparse) == "sparse"
//   parse_enum<TopKRoute>("fast")  -> InvalidArgument "unknown top-k route 'fast' (expected auto,
//                                     sparse or dense)"
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "gradcomp/error.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/orthogonalization.hpp"
#include "gradcomp/plans.hpp"
#include "gradcomp/select.hpp"
#include "gradcomp/straggler.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/topk.hpp"

namespace gradcomp {

template <class E>
struct EnumName {
  const char* name;
  E value;
};

/// EnumNames<E>: `what` (the enum in messages) and `table`, whose first `members` entries name
/// every value once (the canonical names, bound as the Python enum's members and returned by
/// enum_name) and whose remaining entries are accepted aliases.
template <class E>
struct EnumNames;

template <>
struct EnumNames<DType> {
  static constexpr const char* what = "dtype";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<DType> table[] = {
      {"float32", DType::kFloat32}, {"float16", DType::kFloat16}, {"bfloat16", DType::kBFloat16},
      {"fp32", DType::kFloat32},    {"float", DType::kFloat32},   {"fp16", DType::kFloat16},
      {"half", DType::kFloat16},    {"bf16", DType::kBFloat16}};
};

template <>
struct EnumNames<OnNonFinite> {
  static constexpr const char* what = "on_nonfinite policy";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<OnNonFinite> table[] = {{"skip", OnNonFinite::kSkip},
                                                    {"raise", OnNonFinite::kRaise}};
};

template <>
struct EnumNames<Device> {
  static constexpr const char* what = "device";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<Device> table[] = {{"cpu", Device::kCPU}, {"cuda", Device::kCUDA}};
};

template <>
struct EnumNames<SelectMethod> {
  static constexpr const char* what = "selection method";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<SelectMethod> table[] = {{"exact", SelectMethod::kExact},
                                                     {"sampled", SelectMethod::kSampled}};
};

template <>
struct EnumNames<OneBitScaling> {
  static constexpr const char* what = "1-bit scaling";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<OneBitScaling> table[] = {{"column_means", OneBitScaling::kColumnMeans},
                                                      {"sign_l1", OneBitScaling::kSignL1},
                                                      {"sign_l2", OneBitScaling::kSignL2},
                                                      {"1bit_sgd", OneBitScaling::kColumnMeans}};
};

template <>
struct EnumNames<Orthogonalization> {
  static constexpr const char* what = "orthogonalization";
  static constexpr std::size_t members = 4;
  static constexpr EnumName<Orthogonalization> table[] = {
      {"auto", Orthogonalization::kAuto},
      {"gram_schmidt", Orthogonalization::kGramSchmidt},
      {"householder", Orthogonalization::kHouseholder},
      {"gram_schmidt_unfused", Orthogonalization::kGramSchmidtUnfused}};
};

template <>
struct EnumNames<TopKRoute> {
  static constexpr const char* what = "top-k route";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<TopKRoute> table[] = {
      {"auto", TopKRoute::kAuto}, {"sparse", TopKRoute::kSparse}, {"dense", TopKRoute::kDense}};
};

template <>
struct EnumNames<TopKExchange> {
  static constexpr const char* what = "top-k size exchange";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<TopKExchange> table[] = {{"auto", TopKExchange::kAuto},
                                                     {"bound", TopKExchange::kBound},
                                                     {"sizes", TopKExchange::kSizes}};
};

template <>
struct EnumNames<CastRoute> {
  static constexpr const char* what = "cast route";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<CastRoute> table[] = {{"allreduce", CastRoute::kAllreduce},
                                                  {"reduce_scatter", CastRoute::kReduceScatter}};
};

template <>
struct EnumNames<SparsifyConfig::ClipScaling> {
  static constexpr const char* what = "clip_scaling";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<SparsifyConfig::ClipScaling> table[] = {
      {"sqrt_world", SparsifyConfig::ClipScaling::kSqrtWorld},
      {"none", SparsifyConfig::ClipScaling::kNone}};
};

template <>
struct EnumNames<straggler::DropPoint> {
  static constexpr const char* what = "drop point";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<straggler::DropPoint> table[] = {
      {"before_forward", straggler::DropPoint::kBeforeForward},
      {"between_forward_backward", straggler::DropPoint::kBetweenForwardBackward},
      {"after_backward", straggler::DropPoint::kAfterBackward}};
};

template <>
struct EnumNames<straggler::StopModel> {
  static constexpr const char* what = "stop model";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<straggler::StopModel> table[] = {
      {"preemptive", straggler::StopModel::kPreemptive},
      {"boundary", straggler::StopModel::kMicroBatchBoundary},
      {"micro_batch_boundary", straggler::StopModel::kMicroBatchBoundary}};
};

template <>
struct EnumNames<straggler::Normalization> {
  static constexpr const char* what = "normalization";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<straggler::Normalization> table[] = {
      {"nominal", straggler::Normalization::kNominal},
      {"actual", straggler::Normalization::kActual}};
};

template <>
struct EnumNames<straggler::DelayKind> {
  static constexpr const char* what = "delay kind";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<straggler::DelayKind> table[] = {
      {"normal", straggler::DelayKind::kNormal},
      {"lognormal", straggler::DelayKind::kBoundedLogNormal},
      {"bounded_lognormal", straggler::DelayKind::kBoundedLogNormal}};
};

/// The canonical names of E, "a, b or c" (for messages).
template <class E>
std::string enum_choices() {
  using N = EnumNames<E>;
  std::string s;
  for (std::size_t i = 0; i < N::members; ++i) {
    if (i > 0) s += (i + 1 == N::members) ? " or " : ", ";
    s += N::table[i].name;
  }
  return s;
}

/// A bound enum member as an option value (the Python bindings): the enum's `what`, this
/// separator, the member's name. parse_enum accepts it only for its own enum, so that a member of
/// another enum that happens to share a name (TopKRoute.auto given as the fp16 plan's route) is
/// an error rather than read by its name.
inline constexpr char kEnumMemberSeparator = '\x1f';

/// The value named `s` (a canonical name or an alias, or a tagged member of E); InvalidArgument
/// naming E and its choices, or the other enum a tagged member belongs to.
template <class E>
E parse_enum(std::string_view s) {
  if (const auto sep = s.find(kEnumMemberSeparator); sep != std::string_view::npos) {
    const std::string_view what = s.substr(0, sep);
    s = s.substr(sep + 1);
    if (what != EnumNames<E>::what)
      throw InvalidArgument(detail::cat("expected a ", EnumNames<E>::what, " (", enum_choices<E>(),
                                        "), got the ", what, " '", s, "'"));
  }
  for (const auto& e : EnumNames<E>::table)
    if (s == e.name) return e.value;
  throw InvalidArgument(
      detail::cat("unknown ", EnumNames<E>::what, " '", s, "' (expected ", enum_choices<E>(), ")"));
}

/// The canonical name of `v` ("?" for a value outside the enum).
template <class E>
const char* enum_name(E v) {
  using N = EnumNames<E>;
  for (std::size_t i = 0; i < N::members; ++i)
    if (N::table[i].value == v) return N::table[i].name;
  return "?";
}

}  // namespace gradcomp

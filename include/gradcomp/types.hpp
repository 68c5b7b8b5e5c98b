// SPDX-License-Identifier: Apache-2.0
// The value types every layer shares (element and device types, the collectives' vocabulary),
// and the one way an enum gets names: EnumNames<E>, a table written once beside the enum, read
// by parse_enum / enum_name here, by make_plan's option parser, by messages and by the Python
// enums (nb::enum_). Every header that defines an enum an option or message names gives its table
// right after it.
//
//   parse_enum<DType>("float16") == DType::kFloat16      enum_name(DType::kFloat16) == "float16"
//   parse_enum<DType>("fp8")  -> InvalidArgument "unknown dtype 'fp8' (expected float32, float16
//                                or bfloat16)"
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "gradcomp/error.hpp"

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

/// Element types a gradient may have.
enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

/// Where the memory lives; picks the backend at run time.
enum class Device : uint8_t { kCPU = 0, kCUDA = 1 };

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
inline bool dtype_valid(uint8_t t) { return t <= 2; }

/// The collectives a plan may ask for (gradcomp/plan.hpp, Collective).
enum class CollectiveKind : uint8_t {
  kAllreduceSum = 0,  ///< recv[i] = sum over ranks (in rank order) of send[i]; count elements
  kAllgather = 1,     ///< recv = concat over ranks of send (count elements each)
  kAllToAll = 2,      ///< send holds P blocks of count; recv block r = block `rank` of rank r
  kBroadcast = 3,     ///< recv on every rank = send of rank `root` (count elements)
};

/// Which ranks a collective runs among. Flat plans use the whole group (kWorld); a hierarchical
/// plan (HierarchicalPlan, plans/hierarchical_plan.hpp) runs its full-precision reduce-scatter and
/// allgather among the ranks of one node (kNode) and its compressed allreduce among the ranks of
/// equal local rank on every node (kCross). A driver runs each on the matching communicator.
enum class Scope : uint8_t { kWorld = 0, kNode = 1, kCross = 2 };

/// The element types of a collective's buffers.
enum class ElemType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kU8 = 3, kU32 = 4, kI64 = 5 };

inline size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::kF32:
    case ElemType::kU32:
      return 4;
    case ElemType::kF16:
    case ElemType::kBF16:
      return 2;
    case ElemType::kU8:
      return 1;
    case ElemType::kI64:
      return 8;
  }
  return 0;
}

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
struct EnumNames<Device> {
  static constexpr const char* what = "device";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<Device> table[] = {{"cpu", Device::kCPU}, {"cuda", Device::kCUDA}};
};

template <>
struct EnumNames<ElemType> {
  static constexpr const char* what = "element type";
  static constexpr std::size_t members = 6;
  static constexpr EnumName<ElemType> table[] = {
      {"float32", ElemType::kF32}, {"float16", ElemType::kF16}, {"bfloat16", ElemType::kBF16},
      {"uint8", ElemType::kU8},    {"uint32", ElemType::kU32},  {"int64", ElemType::kI64}};
};

template <>
struct EnumNames<CollectiveKind> {
  static constexpr const char* what = "collective";
  static constexpr std::size_t members = 4;
  static constexpr EnumName<CollectiveKind> table[] = {{"allreduce", CollectiveKind::kAllreduceSum},
                                                       {"allgather", CollectiveKind::kAllgather},
                                                       {"all-to-all", CollectiveKind::kAllToAll},
                                                       {"broadcast", CollectiveKind::kBroadcast}};
};

template <>
struct EnumNames<Scope> {
  static constexpr const char* what = "collective scope";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<Scope> table[] = {
      {"world", Scope::kWorld}, {"node", Scope::kNode}, {"cross", Scope::kCross}};
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

inline const char* dtype_name(DType t) { return enum_name(t); }
inline const char* device_name(Device d) { return enum_name(d); }
inline const char* collective_name(CollectiveKind k) { return enum_name(k); }
inline const char* scope_name(Scope s) { return enum_name(s); }
inline const char* elem_type_name(ElemType t) { return enum_name(t); }

}  // namespace gradcomp

// SPDX-License-Identifier: Apache-2.0
// Error types and check macros. Every error message says what was expected, what was got and, when
// known, which tensor. Python sees InvalidArgument (and CorruptPayload) as ValueError, the rest as
// RuntimeError.
#pragma once

#include <charconv>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace gradcomp {

/// Base of every exception thrown by gradcomp.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller passed something the library cannot accept (bad option, size, dtype, ...).
/// The call that threw changed no state.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A payload failed validation on decode (corrupt header, truncated section, index out of range).
class CorruptPayload : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// A failure reported by CUDA, NCCL, MPI or BLAS.
class BackendError : public Error {
 public:
  using Error::Error;
};

/// A CUDA entry point was called in a build made without nvcc.
class NotBuiltWithCuda : public Error {
 public:
  using Error::Error;
};

namespace detail {
/// An unsigned integer printed in hexadecimal by cat (lower case, no prefix), as a stream after
/// std::hex would: cat("0x", hex(crc)).
struct Hex {
  unsigned long long v;
};
template <class T>
constexpr Hex hex(T v) {
  static_assert(std::is_integral_v<T>, "detail::hex takes an integer");
  return Hex{static_cast<unsigned long long>(v)};
}

template <class>
inline constexpr bool kNotFormattable = false;

/// Appends one value as `std::ostream <<` would print it with the default format (bool as 1/0,
/// the char types as characters, floating point as %g with 6 digits), numbers through
/// std::to_chars: no stream, no locale. Inserting a number into an ostringstream crashed
/// (SIGSEGV inside the stream) the Python extension built on a GPU machine (GCC 13, CUDA 13) the
/// first time it built a message, that of a skipped fp16 step; the cause inside the C++ runtime
/// was not found, and to_chars avoids it. Hexadecimal: detail::hex. Any other type is a compile
/// error (format it explicitly): no message goes through a stream.
template <class T>
void cat_one(std::string& s, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    s += v ? '1' : '0';
  } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> ||
                       std::is_same_v<U, unsigned char>) {
    s += static_cast<char>(v);
  } else if constexpr (std::is_integral_v<U> || std::is_floating_point_v<U>) {
    char b[64];
    std::to_chars_result r;
    if constexpr (std::is_integral_v<U>)
      r = std::to_chars(b, b + sizeof b, v);
    else
      r = std::to_chars(b, b + sizeof b, v, std::chars_format::general, 6);
    s.append(b, r.ptr);
  } else if constexpr (std::is_same_v<U, Hex>) {
    char b[24];
    const std::to_chars_result r = std::to_chars(b, b + sizeof b, v.v, 16);
    s.append(b, r.ptr);
  } else if constexpr (std::is_convertible_v<const U&, std::string_view>) {
    s.append(std::string_view(v));
  } else {
    static_assert(kNotFormattable<U>, "detail::cat: numbers, text, bool, chars or detail::hex");
  }
}

template <class... A>
std::string cat(A&&... a) {
  std::string s;
  (cat_one(s, a), ...);
  return s;
}
}  // namespace detail

}  // namespace gradcomp

/// Argument check: throws gradcomp::InvalidArgument with the streamed message.
/// Example: GC_CHECK_ARG(k <= n, "k (", k, ") must be <= n (", n, ")");
#define GC_CHECK_ARG(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond)) throw ::gradcomp::InvalidArgument(::gradcomp::detail::cat(__VA_ARGS__)); \
  } while (0)

/// Payload validation check: throws gradcomp::CorruptPayload.
#define GC_CHECK_PAYLOAD(cond, ...)                                                                \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      throw ::gradcomp::CorruptPayload(::gradcomp::detail::cat("corrupt payload: ", __VA_ARGS__)); \
  } while (0)

/// Internal invariant: a failure is a gradcomp bug, reported with its location.
#define GC_CHECK(cond, ...)                                                                    \
  do {                                                                                         \
    if (!(cond))                                                                               \
      throw ::gradcomp::Error(::gradcomp::detail::cat("gradcomp internal error at ", __FILE__, \
                                                      ":", __LINE__, ": ", #cond, " ",         \
                                                      ##__VA_ARGS__));                         \
  } while (0)

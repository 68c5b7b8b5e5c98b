// SPDX-License-Identifier: Apache-2.0
// Error types and check macros. Every error message says what was expected, what was got and, when
// known, which tensor. Python sees InvalidArgument (and CorruptPayload) as ValueError, the rest as
// RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
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
template <class... A>
std::string cat(A&&... a) {
  std::ostringstream os;
  (os << ... << std::forward<A>(a));
  return os.str();
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

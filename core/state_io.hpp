// SPDX-License-Identifier: Apache-2.0
// Byte (de)serialisation of compressor state: a tagged header, then fields in order, then a
// checksum. Readers check every length before copying, and a mismatch is an InvalidArgument naming
// the field.
//
// Layout (version 2, host byte order): magic u32 | version u32 | kind (u64 length + bytes) |
// the compressor's fields | CRC-32C u32 of every byte before it. StateReader verifies magic,
// version and checksum before it hands out a single field, so a checkpoint damaged anywhere (a
// flipped byte, a truncation, an append) is rejected before the compressor looks at it; and
// finite_array() rejects NaN/Inf in arrays that hold gradient-like values (a state saved with
// check_finite off, or made by hand). Version 1 (no checksum) is not read.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/crc32c.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp::detail {

inline constexpr uint32_t kStateMagic = 0x53434347u;  // "GCCS"
inline constexpr uint32_t kStateVersion = 2;          // 2: CRC-32C trailer

class StateWriter {
 public:
  explicit StateWriter(const std::string& kind) {
    put<uint32_t>(kStateMagic);
    put<uint32_t>(kStateVersion);
    put_string(kind);
  }
  template <class T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  /// A device array: length in bytes, then the bytes (copied to host).
  void put_array(const void* p, Device dev, uint64_t bytes, void* stream) {
    put<uint64_t>(bytes);
    const size_t off = buf_.size();
    buf_.resize(off + bytes);
    device_copy(buf_.data() + off, Device::kCPU, p, dev, bytes, stream);
  }
  /// A host array of fp32 values.
  void put_floats(const std::vector<float>& v) {
    put_array(v.data(), Device::kCPU, v.size() * sizeof(float), nullptr);
  }
  /// The finished state: appends the checksum (call once, last).
  std::vector<uint8_t> take() {
    put<uint32_t>(crc32c(buf_.data(), buf_.size()));
    return std::move(buf_);
  }

 private:
  std::vector<uint8_t> buf_;
};

class StateReader {
 public:
  StateReader(const uint8_t* data, size_t n, const std::string& kind) : StateReader(data, n) {
    GC_CHECK_ARG(kind_ == kind, "state_dict: saved by a '", kind_, "' compressor, loading into '",
                 kind, "'");
  }
  /// Opens a state of any kind (magic, version and checksum verified); kind() says which.
  StateReader(const uint8_t* data, size_t n) : p_(data), n_(n) {
    GC_CHECK_ARG(data != nullptr || n == 0, "state_dict: null data");
    GC_CHECK_ARG(get<uint32_t>("magic") == kStateMagic,
                 "state_dict: not a gradcomp state (bad magic)");
    const auto ver = get<uint32_t>("version");
    GC_CHECK_ARG(ver == kStateVersion, "state_dict: version ", ver, ", this build reads ",
                 kStateVersion, ver < kStateVersion ? " (saved by an older gradcomp)" : "");
    GC_CHECK_ARG(n_ - pos_ >= sizeof(uint32_t), "state_dict: truncated before the checksum");
    n_ -= sizeof(uint32_t);  // fields end where the checksum starts
    uint32_t stored;
    std::memcpy(&stored, p_ + n_, sizeof stored);
    const uint32_t computed = crc32c(p_, n_);
    GC_CHECK_ARG(stored == computed, "state_dict: checksum mismatch (stored 0x",
                 detail::hex(stored), ", computed 0x", detail::hex(computed), " over ", n_,
                 " bytes): the state is corrupt or truncated; nothing was loaded");
    kind_ = get_string("kind");
  }
  const std::string& kind() const { return kind_; }
  template <class T>
  T get(const char* field) {
    GC_CHECK_ARG(pos_ + sizeof(T) <= n_, "state_dict: truncated at field '", field, "'");
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  /// The step counter of a compressor or plan: a restored object must be able to take another
  /// step, so INT64_MAX (whose increment overflows) is refused with the negative values.
  int64_t get_step() {
    const auto step = get<int64_t>("step");
    GC_CHECK_ARG(step >= 0 && step < std::numeric_limits<int64_t>::max(), "state_dict: step ", step,
                 " out of range [0, 2^63 - 1)");
    return step;
  }
  /// Reads a field and checks it equals what this object was built with.
  template <class T>
  void expect(const char* field, const T& want) {
    const T got = get<T>(field);
    GC_CHECK_ARG(got == want, "state_dict: field '", field, "' is ", +got,
                 " in the saved state but ", +want, " here (layout mismatch)");
  }
  std::string get_string(const char* field) {
    const auto len = get<uint64_t>(field);
    GC_CHECK_ARG(len <= n_ - pos_, "state_dict: truncated in field '", field, "'");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }
  /// Returns a pointer to an array of exactly `bytes` bytes inside the input (checked).
  const uint8_t* array(const char* field, uint64_t bytes) {
    const auto len = get<uint64_t>(field);
    GC_CHECK_ARG(len == bytes, "state_dict: array '", field, "' has ", len, " bytes, expected ",
                 bytes, " (layout mismatch)");
    GC_CHECK_ARG(len <= n_ - pos_, "state_dict: truncated in array '", field, "'");
    const uint8_t* r = p_ + pos_;
    pos_ += len;
    return r;
  }
  /// An array of any length (another object's state nested in this one): its bytes and length.
  std::pair<const uint8_t*, uint64_t> blob(const char* field) {
    const auto len = get<uint64_t>(field);
    GC_CHECK_ARG(len <= n_ - pos_, "state_dict: truncated in array '", field, "'");
    const uint8_t* r = p_ + pos_;
    pos_ += len;
    return {r, len};
  }
  /// array() of fp32 values that must all be finite (residuals, momenta, errors, factors): NaN or
  /// Inf is an InvalidArgument naming the field and the first bad element.
  const uint8_t* finite_array(const char* field, uint64_t bytes) {
    GC_CHECK_ARG(bytes % sizeof(float) == 0, "state_dict: array '", field, "' of ", bytes,
                 " bytes is not fp32");
    const uint8_t* r = array(field, bytes);
    for (uint64_t i = 0; i < bytes / sizeof(float); ++i) {
      float x;
      std::memcpy(&x, r + i * sizeof(float), sizeof x);
      GC_CHECK_ARG(std::isfinite(x), "state_dict: array '", field, "' holds a non-finite value (",
                   x, ") at element ", i, "; nothing was loaded");
    }
    return r;
  }
  void finish() {
    GC_CHECK_ARG(pos_ == n_, "state_dict: ", n_ - pos_, " unexpected trailing bytes");
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  std::string kind_;
};

/// One job's states, one per rank in rank order (what reshard_state reads).
using RankStateList = std::vector<std::vector<uint8_t>>;

/// One bucket's states saved by every rank of a job (rank order), read field by field in step:
/// what resharding a checkpoint to another world size starts from (reshard_state,
/// gradcomp/make_plan.hpp). Each state is verified (magic, version, checksum, kind) on opening.
class RankStates {
 public:
  RankStates(const std::vector<std::vector<uint8_t>>& states, const std::string& kind) {
    for (size_t r = 0; r < states.size(); ++r) {
      try {
        rs_.emplace_back(states[r].data(), states[r].size(), kind);
      } catch (const InvalidArgument& e) {
        GC_CHECK_ARG(false, "rank ", r, "'s ", e.what());
      }
    }
  }
  size_t size() const { return rs_.size(); }
  StateReader& operator[](size_t r) { return rs_[r]; }
  /// A field every rank must hold alike (sizes, options, the step): read and compared.
  template <class T>
  T same(const char* field) {
    const T v = rs_[0].get<T>(field);
    for (size_t r = 1; r < rs_.size(); ++r) {
      const T w = rs_[r].get<T>(field);
      GC_CHECK_ARG(w == v, "state_dict: field '", field, "' is ", +v, " on rank 0 but ", +w,
                   " on rank ", r, ": the states are not one job's checkpoint of one step");
    }
    return v;
  }
  /// The same fp32 array of every rank (`bytes` each, finite).
  std::vector<const uint8_t*> arrays(const char* field, uint64_t bytes) {
    std::vector<const uint8_t*> a;
    for (auto& r : rs_) a.push_back(r.finite_array(field, bytes));
    return a;
  }
  /// The element-wise mean over ranks of arrays(field, 4 n): each element summed in fp64 in rank
  /// order, divided by the number of ranks, rounded once to fp32 (finite, as its inputs are).
  std::vector<float> mean(const char* field, int64_t n) {
    const auto a = arrays(field, static_cast<uint64_t>(n) * sizeof(float));
    std::vector<float> m(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      double s = 0.0;
      for (const uint8_t* p : a) {
        float x;
        std::memcpy(&x, p + i * sizeof x, sizeof x);  // state bytes carry no alignment promise
        s += x;
      }
      m[static_cast<size_t>(i)] = static_cast<float>(s / static_cast<double>(a.size()));
    }
    return m;
  }
  void finish() {
    for (auto& r : rs_) r.finish();
  }

 private:
  std::vector<StateReader> rs_;
};

}  // namespace gradcomp::detail

// SPDX-License-Identifier: Apache-2.0
// Byte (de)serialisation of compressor state: a tagged header, then fields in order. Readers
// check every length before copying, and a mismatch is an InvalidArgument naming the field.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp::detail {

inline constexpr uint32_t kStateMagic = 0x53434347u;  // "GCCS"
inline constexpr uint32_t kStateVersion = 1;

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
  std::vector<uint8_t> take() { return std::move(buf_); }

 private:
  std::vector<uint8_t> buf_;
};

class StateReader {
 public:
  StateReader(const uint8_t* data, size_t n, const std::string& kind) : p_(data), n_(n) {
    GC_CHECK_ARG(data != nullptr || n == 0, "state_dict: null data");
    GC_CHECK_ARG(get<uint32_t>("magic") == kStateMagic,
                 "state_dict: not a gradcomp state (bad magic)");
    const auto ver = get<uint32_t>("version");
    GC_CHECK_ARG(ver == kStateVersion, "state_dict: version ", ver, ", this build reads ",
                 kStateVersion);
    const std::string got = get_string("kind");
    GC_CHECK_ARG(got == kind, "state_dict: saved by a '", got, "' compressor, loading into '",
                 kind, "'");
  }
  template <class T>
  T get(const char* field) {
    GC_CHECK_ARG(pos_ + sizeof(T) <= n_, "state_dict: truncated at field '", field, "'");
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  /// Reads a field and checks it equals what this object was built with.
  template <class T>
  void expect(const char* field, const T& want) {
    const T got = get<T>(field);
    GC_CHECK_ARG(got == want, "state_dict: field '", field, "' is ", +got, " in the saved state but ",
                 +want, " here (layout mismatch)");
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
  void finish() {
    GC_CHECK_ARG(pos_ == n_, "state_dict: ", n_ - pos_, " unexpected trailing bytes");
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

}  // namespace gradcomp::detail

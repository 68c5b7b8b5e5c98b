// SPDX-License-Identifier: Apache-2.0
// Reusable, grow-only device-tagged buffers. Hot paths ask a Buffer for at least N bytes; it
// allocates only when it must grow, so steady-state steps never allocate. On CUDA the allocation
// is stream-ordered (cudaMallocAsync on the caller's stream, served from the device's pool).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "gradcomp/runtime.hpp"

namespace gradcomp {

/// An owning buffer on one device. Move-only. Contents survive growth only when asked.
///
/// Example:
///   gradcomp::Buffer b(gradcomp::Device::kCPU);
///   float* p = b.get<float>(1024);  // at least 1024 floats
class Buffer {
 public:
  explicit Buffer(Device dev = Device::kCPU, void* stream = nullptr) : dev_(dev), stream_(stream) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      swap(o);
    }
    return *this;
  }
  ~Buffer() { release(); }

  /// Ensures capacity >= bytes; returns the pointer. keep=true copies the old contents over.
  void* reserve(size_t bytes, bool keep = false) {
    if (bytes <= cap_) return ptr_;
    size_t want = bytes < 64 ? 64 : bytes;
    if (want < cap_ + cap_ / 2) want = cap_ + cap_ / 2;  // geometric growth
    void* p = device_malloc(dev_, want, stream_);
    if (keep && size_ > 0) device_copy(p, dev_, ptr_, dev_, size_, stream_);
    release_ptr();
    ptr_ = p;
    cap_ = want;
    return ptr_;
  }
  /// Ensures capacity for n elements of T, sets size() to n*sizeof(T); returns typed pointer.
  template <class T>
  T* get(size_t n, bool keep = false) {
    T* p = static_cast<T*>(reserve(n * sizeof(T), keep));
    size_ = n * sizeof(T);
    return p;
  }
  void set_stream(void* s) { stream_ = s; }
  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  void resize(size_t bytes, bool keep = true) {
    reserve(bytes, keep);
    size_ = bytes;
  }
  size_t capacity() const { return cap_; }
  Device device() const { return dev_; }
  void release() noexcept {
    release_ptr();
    size_ = 0;
  }

 private:
  void release_ptr() noexcept {
    if (ptr_) device_free(dev_, ptr_, stream_);
    ptr_ = nullptr;
    cap_ = 0;
  }
  void swap(Buffer& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(cap_, o.cap_);
    std::swap(size_, o.size_);
    std::swap(dev_, o.dev_);
    std::swap(stream_, o.stream_);
  }
  void* ptr_ = nullptr;
  size_t cap_ = 0;
  size_t size_ = 0;
  Device dev_ = Device::kCPU;
  void* stream_ = nullptr;
};

}  // namespace gradcomp

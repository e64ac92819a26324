// A 64-byte aligned, uninitialised byte buffer (weights, workspaces). It
// allocates with the aligned operator new, so a test that replaces the
// global operator new sees (and can fail) these allocations too; buffers of
// kArenaMin bytes or more are carved from huge-page slabs (huge_arena.hpp),
// themselves allocated that way.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <utility>

#include "cpu/huge_arena.hpp"

namespace ep_moe {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes) { resize(bytes); }
  ~AlignedBuffer() { release(ptr_, size_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      release(ptr_, size_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }

  // Discards the contents. Throws std::bad_alloc.
  void resize(size_t bytes) {
    if (bytes == size_) return;
    void* p = nullptr;
    if (bytes > 0) {
      const size_t rounded = (bytes + 63) / 64 * 64;
      if (rounded < bytes) throw std::bad_alloc();
      p = bytes >= kArenaMin ? arena_alloc(bytes) : ::operator new (rounded, std::align_val_t{64});
    }
    release(ptr_, size_);
    ptr_ = p;
    size_ = bytes;
  }

  size_t size() const { return size_; }
  template <class T = void>
  T* data() {
    return static_cast<T*>(ptr_);
  }
  template <class T = void>
  const T* data() const {
    return static_cast<const T*>(ptr_);
  }

 private:
  static void release(void* p, size_t bytes) noexcept {
    if (!p) return;
    if (bytes >= kArenaMin) arena_free(p, bytes);
    else ::operator delete (p, std::align_val_t{64});
  }

  void* ptr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ep_moe

#include "cpu/huge_arena.hpp"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define EP_MOE_ARENA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EP_MOE_ARENA_ASAN 1
#endif
#endif
#if defined(EP_MOE_ARENA_ASAN)
#include <sanitizer/asan_interface.h>
#endif

namespace ep_moe {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
#if defined(EP_MOE_ARENA_ASAN)
constexpr size_t kGap = 64;
void poison(const void* p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
void unpoison(const void* p, size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#else
constexpr size_t kGap = 0;
void poison(const void*, size_t) {}
void unpoison(const void*, size_t) {}
#endif

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
// A buffer's bytes in its slab: a multiple of 64 (so the next one stays
// aligned) and the sanitizer gap.
size_t span_of(size_t bytes) { return round_up(bytes, 64) + kGap; }

struct Range {
  size_t at, bytes;
};

struct Slab {
  char* base = nullptr;
  size_t bytes = 0, used = 0;
  // Sorted by `at`, no two adjacent. Its capacity is reserved when the slab
  // is made: every buffer spans at least kArenaMin bytes, so there are at
  // most bytes / kArenaMin + 1 free ranges, and freeing never allocates.
  std::vector<Range> free;
};

class Arena {
 public:
  void* alloc(size_t bytes) {
    if (bytes < kArenaMin || bytes > SIZE_MAX / 2) throw std::bad_alloc();
    const size_t need = span_of(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    Slab* best = nullptr;
    size_t best_i = 0;
    for (Slab& s : slabs_)
      for (size_t i = 0; i < s.free.size(); ++i)
        if (s.free[i].bytes >= need && (!best || s.free[i].bytes < best->free[best_i].bytes)) {
          best = &s;
          best_i = i;
        }
    if (!best) {
      best = &add_slab(std::max(kArenaSlab, round_up(need, kHugePage)));
      best_i = 0;
    }
    Range& r = best->free[best_i];
    char* p = best->base + r.at;
    r.at += need;
    r.bytes -= need;
    if (r.bytes == 0) best->free.erase(best->free.begin() + static_cast<std::ptrdiff_t>(best_i));
    best->used += need;
    unpoison(p, bytes);
    return p;
  }

  void free(void* ptr, size_t bytes) noexcept {
    char* p = static_cast<char*>(ptr);
    const size_t need = span_of(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto it =
        std::find_if(slabs_.begin(), slabs_.end(), [&](const Slab& s) { return p >= s.base && p < s.base + s.bytes; });
    if (it == slabs_.end()) return;  // not ours: nothing sane to do in a noexcept path
    Slab& s = *it;
    poison(p, need);
    s.used -= need;
    if (s.used == 0) {
      unpoison(s.base, s.bytes);
      ::operator delete (s.base, std::align_val_t{kHugePage});
      slabs_.erase(it);
      return;
    }
    const size_t at = static_cast<size_t>(p - s.base);
    auto next = std::lower_bound(s.free.begin(), s.free.end(), at, [](const Range& r, size_t a) { return r.at < a; });
    Range merged{at, need};
    if (next != s.free.end() && next->at == at + need) {
      merged.bytes += next->bytes;
      next = s.free.erase(next);
    }
    if (next != s.free.begin() && std::prev(next)->at + std::prev(next)->bytes == at) {
      Range& prev = *std::prev(next);
      prev.bytes += merged.bytes;
      merged = prev;
    } else {
      s.free.insert(next, merged);  // within the reserved capacity
    }
    give_back_pages(s, merged);
  }

  ArenaStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    ArenaStats st;
    for (const Slab& s : slabs_) {
      ++st.slabs;
      st.slab_bytes += s.bytes;
      st.used_bytes += s.used;
      st.free_ranges += s.free.size();
    }
    return st;
  }

 private:
  Slab& add_slab(size_t bytes) {
    slabs_.reserve(slabs_.size() + 1);
    Slab s;
    s.free.reserve(bytes / kArenaMin + 2);
    s.base = static_cast<char*>(::operator new (bytes, std::align_val_t{kHugePage}));
    s.bytes = bytes;
    s.free.push_back({0, bytes});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Advice only (THP in madvise mode, as on Debian); a kernel without THP
    // ignores it and the slab is plain pages.
    (void)madvise(s.base, bytes, MADV_HUGEPAGE);
#endif
    poison(s.base, bytes);
    slabs_.push_back(std::move(s));
    return slabs_.back();
  }

  // The whole 2 MiB pages of a free range go back to the system; the next
  // buffer there faults them in again. Partial pages stay, so no huge page
  // is split.
  static void give_back_pages(const Slab& s, const Range& r) {
#if defined(__linux__) && defined(MADV_DONTNEED)
    const size_t from = round_up(r.at, kHugePage), to = (r.at + r.bytes) / kHugePage * kHugePage;
    if (to > from) (void)madvise(s.base + from, to - from, MADV_DONTNEED);
#else
    (void)s;
    (void)r;
#endif
  }

  std::mutex mu_;
  std::vector<Slab> slabs_;
};

// Never destroyed: buffers may be freed from static destructors of the host
// after this translation unit's statics are gone.
Arena& arena() {
  static Arena* a = new Arena();
  return *a;
}

}  // namespace

void* arena_alloc(size_t bytes) { return arena().alloc(bytes); }
void arena_free(void* p, size_t bytes) noexcept { arena().free(p, bytes); }
ArenaStats arena_stats() { return arena().stats(); }

}  // namespace ep_moe

// Where large buffers (expert weights, big workspaces) live: slabs of at
// least kArenaSlab bytes that start on a 2 MiB boundary and ask for
// transparent huge pages, carved into buffers.
//
// Why: decode streams every local expert's weights once per token. A
// quantized expert's matrices are smaller than 2 MiB (Qwen3-30B-A3B Q4_K:
// 1.8 MB gate/up, 0.9 MB down), so one buffer each would sit on 4 KiB pages,
// and the stream would take a TLB miss every 4 KiB; in one slab they share
// 2 MiB pages. Big bf16 matrices gain too: their tails past the last 2 MiB
// boundary are in the slab's huge pages as well.
//
// Rules: a slab is made when no free range fits (kArenaSlab bytes, or the
// buffer rounded up to 2 MiB when larger), best fit across slabs, freed
// ranges merged with their neighbours, and a slab given back as soon as it
// holds no buffer. Freed memory inside a slab that covers whole 2 MiB pages
// is returned to the system (MADV_DONTNEED), so the resident size follows the
// live buffers. The slab's memory comes from the aligned operator new, so a
// test that replaces it sees (and can fail) the slab allocations. Under
// AddressSanitizer each buffer is followed by a poisoned 64-byte gap and the
// free ranges are poisoned, so out-of-bounds reads still report.
// Thread-safe (one mutex); nothing here runs in a forward unless a workspace
// grows.
#pragma once

#include <cstddef>

namespace ep_moe {

// Buffers of this many bytes or more come from the arena (smaller ones from
// the aligned operator new directly: a slab's huge page for a few KiB of a
// tiny test layer would be waste).
constexpr size_t kArenaMin = size_t{256} << 10;
constexpr size_t kArenaSlab = size_t{64} << 20;

// `bytes` >= kArenaMin; 64-byte aligned. Throws std::bad_alloc.
void* arena_alloc(size_t bytes);
// p from arena_alloc(bytes), with the same bytes.
void arena_free(void* p, size_t bytes) noexcept;

struct ArenaStats {
  size_t slabs = 0;        // slabs held
  size_t slab_bytes = 0;   // their bytes
  size_t used_bytes = 0;   // bytes of live buffers (rounded to 64, gaps included)
  size_t free_ranges = 0;  // free ranges over all slabs
};
ArenaStats arena_stats();

}  // namespace ep_moe

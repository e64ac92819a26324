// What the interleaved-row block kernels share (qgroups_avx512vnni.cpp on
// groups of 16 rows, qgroups_avx2.cpp on 8; pack.hpp's kGroupRows): the
// decode stream's prefetches and the activation rows' parts (also read by
// the int8 tiles, qtile_avx512vnni.cpp).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/quant.hpp"
#include "cpu/isa.hpp"

namespace ep_moe {
namespace cpu {
// Internal linkage: each includer is built with its own ISA flags, so no
// function of these may be shared between them at link time.
namespace {

// Decode streams each panel from memory once: every 64 bytes read
// prefetch the line `ahead` bytes on, past the panel's end into the panel
// this thread takes next. Spread over the reads, so that they overlap the
// arithmetic (a burst of a whole row's lines at once left long rows
// waiting on the memory); a few KiB ahead covers the latency at two
// threads' share of the bandwidth. With PREFETCHT1: into L2 where the
// CPU stops it there, since a prefetch into L1 holds one of the core's
// few L1 miss buffers until its line comes from memory, and with ~100
// lines in flight the arithmetic's own loads (the activations, the L1
// prefetcher's) queued behind them; L2 keeps more misses in flight, and
// the L1 prefetcher brings each line on from L2. Where T1 fills L1 anyway
// (AMD before Zen 4), a shorter lead keeps fewer lines in flight
// (isa.hpp's decode_prefetch_bytes picks it).
struct Stream {
  const uint8_t* end;   // this panel's end
  const uint8_t* next;  // the next panel (null: none)
  size_t bytes;         // this panel's size, taken to be the next one's too
  // Where ahead() stops being at(): this panel's end, or the next panel's
  // where that follows this one in memory (an expert's panels do). A
  // panel not much longer than the lead (a down projection's, k = 768:
  // 7 KiB of Q4_K) would otherwise take at()'s checks for most blocks.
  const uint8_t* reach;
  size_t lead;  // bytes ahead (decode_prefetch_bytes)
  [[gnu::always_inline]] void at(const uint8_t* p) const {
    const uint8_t* t = p + lead;
    if (t >= end) {
      const auto past = static_cast<size_t>(t - end);
      if (!next || past >= bytes) return;
      t = next + past;
    }
    _mm_prefetch(reinterpret_cast<const char*>(t), _MM_HINT_T1);
  }
  // at() once for each line that starts in [p, p + n). Blocks whose size
  // is no multiple of 64 bytes (a group of Q8_0, Q4_0, MXFP4 or Q6_K
  // blocks) would otherwise ask for the line they share with the next
  // block twice: a prefetch instruction in 4-5 that brings no new line
  // but takes issue slots and a miss buffer's lookup from the stream.
  [[gnu::always_inline]] void lines(const uint8_t* p, size_t n) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    for (uintptr_t l = (a + 63) & ~uintptr_t{63}; l < a + n; l += 64) at(reinterpret_cast<const uint8_t*>(l));
  }
  // Whether the ahead line of every byte of [p, p + n) lies in this
  // panel (or the next, where reach says so): then ahead() is at() for
  // them. All but a panel's last few KiB of blocks are inside, so a
  // kernel that prefetches between its loads asks once a block and spends
  // one instruction a line instead of at()'s checks (the 8-row K-quant
  // kernels: their arithmetic on a line is only ~20 instructions). lines()
  // keeps at(): its prefetches come in a burst at a block's start, and
  // the unchecked burst streamed Q8_0 slower.
  [[gnu::always_inline]] bool inside(const uint8_t* p, size_t n) const { return p + n + lead <= reach; }
  [[gnu::always_inline]] void ahead(const uint8_t* p) const {
    _mm_prefetch(reinterpret_cast<const char*>(p + lead), _MM_HINT_T1);
  }
};

// The prefetch of the line at p of a block for which in = st &&
// st->inside(block): the unchecked ahead() inside, else at(); none
// without a stream.
[[gnu::always_inline]] inline void prefetch_line(const Stream* st, bool in, const uint8_t* p) {
  if (__builtin_expect(in, 1)) st->ahead(p);
  else if (st) st->at(p);
}

// M activation rows' quants, their block scales and their sums of 16
// (common/quant.hpp's act_q, act_d, act_s).
template <int M>
struct Acts {
  const int8_t* q[M];
  const float* d[M];
  const int16_t* s[M];
  Acts(const void* const* a, int k) {
    for (int r = 0; r < M; ++r) {
      q[r] = act_q(a[r]);
      d[r] = act_d(a[r], k);
      s[r] = act_s(a[r], k);
    }
  }
};

// Up to kCallRows activation rows a call of a group kernel (4 keep every
// sum in registers with AVX-512); more go round again, the group then in
// L1 or L2.
constexpr int kCallRows = 4;
// A group kernel: M activation rows a through the group of rows at g, k
// elements, into c[i * ldc + l]; st: the decode stream, or null.
using GroupFn = void (*)(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st);

// A QGemmFn over groups of R rows (kernels.hpp): fns[m - 1] takes m
// activation rows. Decode (one pass of rows) streams the panel from
// memory, prefetching; calls of more rows are bound by their arithmetic.
template <int R>
void run_groups(const GroupFn* fns, size_t row_bytes, int m, const void* const* a, int k, const void* panel, int nr,
                float* c, int ldc, const void* next) {
  if (m <= 0) return;
  const auto* p0 = static_cast<const uint8_t*>(panel);
  const size_t panel_bytes = static_cast<size_t>(nr) * row_bytes;
  const auto* end = p0 + panel_bytes;
  const auto* nx = static_cast<const uint8_t*>(next);
  // Once per includer: a call per panel into isa.cpp would be the only
  // out-of-line work on this path.
  static const size_t lead = decode_prefetch_bytes();
  const Stream stream{end, nx, panel_bytes, nx == end ? end + panel_bytes : end, lead};
  const Stream* st = m <= kCallRows ? &stream : nullptr;
  for (int g = 0; g < nr / R; ++g)
    for (int i0 = 0; i0 < m; i0 += kCallRows) {
      const int mm = m - i0 < kCallRows ? m - i0 : kCallRows;
      fns[mm - 1](p0 + static_cast<size_t>(g) * R * row_bytes, k, a + i0, c + static_cast<ptrdiff_t>(i0) * ldc + g * R,
                  ldc, st);
    }
}

inline int32_t rd32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The activations' i16 sums over groups 2p and 2p+1 of block b as one
// dword (from the row's sums of 16: groups of 16 are them).
template <int G>
inline int32_t sum_pair(const int16_t* s16, int b, int p) {
  if constexpr (G == 16) return rd32(s16 + 16 * b + 2 * p);
  const int16_t* s = s16 + 16 * b + 4 * p;
  const auto lo = static_cast<uint16_t>(s[0] + s[1]), hi = static_cast<uint16_t>(s[2] + s[3]);
  return static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16);
}

}  // namespace
}  // namespace cpu
}  // namespace ep_moe

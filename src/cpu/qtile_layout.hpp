// The int8 tiles' unpacked panels (kernels.hpp's QUnpackFn output): written
// by the unpackers in qgroups_avx512vnni.cpp (panels of 32 rows, for
// qtile_avx512vnni.cpp) and qgroups_avx2.cpp (16 rows, for qtile_avx2.cpp).
// The weights are u8 in k-groups of 4 across the panel's C rows: each
// k-group is C dwords, row n's 4 consecutive elements in dword n.
#pragma once

#include <xmmintrin.h>

#include <cstddef>
#include <cstdint>

#include "cpu/kernels.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cpu {

constexpr int kCols = kQTileCols;          // the AVX-512 tiles' panel rows: two vectors of 16
constexpr size_t kGroupBytes = 4 * kCols;  // one k-group of 4 across the columns

// Q8_0, Q4_0, MXFP4: each block of 32 elements is 8 k-groups (8 x 4 C
// bytes) and the C rows' scales as f32 (4 C bytes).
template <int C>
constexpr size_t kBlockAOf = 8 * 4 * C + 4 * C;
constexpr size_t kBlockA = kBlockAOf<kCols>;

// Q4_K, Q5_K, Q6_K, IQ4_XS: G groups a block (8 of 32 elements; Q6_K 16 of
// 16), each with an integer scale s_g, and per group a coefficient c_g
// against the activations' sum over the group, A_g:
//   Q4_K, Q5_K: d sum_g s_g (sum q a) - dmin sum_g m_g A_g (m_g: the mins);
//   Q6_K:   d sum_g s_g (sum (q - 32) a), q stored as it is, c_g = 32 s_g;
//   IQ4_XS: d sum_g (l_g - 32) (sum v a), v + 128 stored, c_g = 128 (l_g - 32);
// the last two take c_g A_g off the i32 sum (exactly), Q4_K and Q5_K scale
// it by dmin in f32. Unpacked, each block of 256 is 64 k-groups (64 x 4 C
// bytes), then per column the G scales, one dword each ([group][column]),
// the coefficients as i16 pairs ([pair][column]: groups 2p and 2p+1 in one
// dword), d and dmin (Q4_K, Q5_K) as f32. A scale's dword is what the
// tiles multiply by: i32 for vpmulld (AVX-512), the i16 pair (s, s) for
// madd (the AVX2 tiles, whose maddubs sums are i16 pairs).
template <int T, int C = kCols>
struct KLayout {
  static constexpr int G = T == EP_MOE_DTYPE_Q6_K ? 16 : 8;  // groups a block
  static constexpr int KG = 64 / G;                          // k-groups a group
  static constexpr bool kSub = T == EP_MOE_DTYPE_Q6_K || T == EP_MOE_DTYPE_IQ4_XS;
  static constexpr size_t kGroup = 4 * C;  // one k-group's bytes
  static constexpr size_t kSc = 64 * kGroup, kCoef = kSc + G * kGroup, kD = kCoef + G / 2 * kGroup;
  static constexpr size_t kDmin = kD + kGroup, kBlock = kDmin + kGroup;
};
static_assert(kBlockA * 8 == qtile_panel_bytes(EP_MOE_DTYPE_Q8_0, 256) &&
                  kBlockAOf<16> * 8 == qtile_panel_bytes(EP_MOE_DTYPE_MXFP4, 256, 16) &&
                  KLayout<EP_MOE_DTYPE_Q4_K>::kBlock == qtile_panel_bytes(EP_MOE_DTYPE_Q4_K, 256) &&
                  KLayout<EP_MOE_DTYPE_Q6_K>::kBlock == qtile_panel_bytes(EP_MOE_DTYPE_Q6_K, 256) &&
                  KLayout<EP_MOE_DTYPE_Q6_K, 16>::kBlock == qtile_panel_bytes(EP_MOE_DTYPE_Q6_K, 256, 16) &&
                  KLayout<EP_MOE_DTYPE_IQ4_XS>::kBlock == qtile_panel_bytes(EP_MOE_DTYPE_IQ4_XS, 256),
              "kernels.hpp's qtile_panel_bytes states these layouts");

// The panel the caller unpacks next, prefetched into L2 while the tiles
// run over this one (the unpacking reads its rows side by side, which the
// hardware prefetchers do not follow well from memory): lines [first,
// first + count) of it, spread over the `blocks` block steps of a register
// tile. Internal linkage, as in qgroups.hpp: its includers are built with
// different ISA flags.
namespace {
struct Ahead {
  const char* next = nullptr;
  size_t first = 0, count = 0;
  int blocks = 1;
  void at(int b) const {
    if (!next) return;
    const size_t l0 = first + count * static_cast<size_t>(b) / static_cast<size_t>(blocks);
    const size_t l1 = first + count * static_cast<size_t>(b + 1) / static_cast<size_t>(blocks);
    for (size_t l = l0; l < l1; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
  }
};

// A register tile's rows through an unpacked panel: (a, k, the panel, c,
// ldc, the next panel's prefetch).
using TileFn = void (*)(const void* const*, int, const uint8_t*, float*, int, const Ahead&);

// A QTileFn over register tiles of R rows (fns[mm - 1] takes mm): rows [0,
// m) of a through the unpacked panel `tiles`, with the next block panel's
// lines (next: panel_bytes of it, or null) shared out over the calls and
// each call's share spread over its `blocks` block steps.
template <int R>
void run_tiles(const TileFn* fns, int m, const void* const* a, int k, const void* tiles, float* c, int ldc,
               const void* next, size_t panel_bytes, int blocks) {
  const size_t lines = (panel_bytes + 63) / 64;
  const int calls = (m + R - 1) / R;
  Ahead ahead;
  ahead.next = static_cast<const char*>(next);
  ahead.blocks = blocks;
  for (int i0 = 0, call = 0; i0 < m; i0 += R, ++call) {
    const int mm = m - i0 < R ? m - i0 : R;
    ahead.first = lines * static_cast<size_t>(call) / static_cast<size_t>(calls);
    ahead.count = lines * static_cast<size_t>(call + 1) / static_cast<size_t>(calls) - ahead.first;
    fns[mm - 1](a + i0, k, static_cast<const uint8_t*>(tiles), c + static_cast<ptrdiff_t>(i0) * ldc, ldc, ahead);
  }
}
}  // namespace

}  // namespace cpu
}  // namespace ep_moe

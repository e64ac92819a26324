// Block formats on rows interleaved 16 at a time (pack.hpp's kGroupRows):
// the AVX-512 tables' qgemm and qunpack entries for every block format
// where the CPU has AVX512_VNNI (kernels.hpp's QGemmFn and QUnpackFn;
// built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma
// -mf16c).
//
// Row-at-a-time kernels spend most of a block's instructions on its
// scales and on one row's lanes, so a lone activation
// row (decode) reads the weights below the memory's rate on a fast memory.
// Here each 64-byte load holds 4 consecutive elements of 16 weight rows:
// one vpdpbusd multiplies them (as u8) with 4 elements of an activation row
// (s8, broadcast) into 16 i32 row sums, and a block's scales are decoded
// once for its 16 rows. As in the int8 tiles, the u8 weights carry an
// offset where the format is signed (Q8_0 +128, Q4_0's nibbles as stored,
// MXFP4's doubled values +12, Q6_K's 6 bits as stored, IQ4_XS's table
// values +128) that comes off through the activations' block or group
// sums, and the K formats' and IQ4_XS's group scales multiply the i32
// group sums. The i32 sums are the exact integers the tiles form
// (qtile_avx512vnni.cpp, bounds there), scaled in f32 in the same steps,
// so the two give the same bits.
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/qgroups.hpp"
#include "cpu/qtile_layout.hpp"

namespace ep_moe {
namespace cpu {

namespace {

using GP = GroupParts<kGroupRows>;

inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }
inline __m512 f16x16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }

// x in each 128-bit lane (GCC 12 warns falsely on the undefined source
// lanes of _mm512_broadcast_i32x4 and _mm512_shuffle_i32x4; bug 105593).
inline __m512i lanes(__m128i x) {
  return _mm512_set4_epi32(_mm_extract_epi32(x, 3), _mm_extract_epi32(x, 2), _mm_extract_epi32(x, 1),
                           _mm_cvtsi128_si32(x));
}

// The f32 sums of M activation rows against a group's 16 rows: c[i * ldc
// + l] for activation row i, weight row l.
template <int M>
struct Sums {
  __m512 v[M];
  Sums() {
    for (int r = 0; r < M; ++r) v[r] = _mm512_setzero_ps();
  }
  void store(float* c, int ldc) const {
    for (int r = 0; r < M; ++r) _mm512_storeu_ps(c + static_cast<ptrdiff_t>(r) * ldc, v[r]);
  }
};

// A block's 16 rows' 6-bit scales and mins, 4 to a dword: byte j of sc03
// (mn03) is group j's scale (min), of sc47 (mn47) group 4 + j's
// (common/quant.cpp's scale_min_k4 on the three words side by side).
struct Scales {
  __m512i sc03, sc47, mn03, mn47;
};
inline Scales scales(const uint8_t* blk) {
  const __m512i u0 = load(blk + GP::kQ4kWords), u1 = load(blk + GP::kQ4kWords + 64),
                u2 = load(blk + GP::kQ4kWords + 128);
  const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f);
  const __m512i top2 = _mm512_set1_epi32(0x30303030);
  return {_mm512_and_si512(u0, low6),
          _mm512_or_si512(_mm512_and_si512(u2, low4), _mm512_and_si512(_mm512_srli_epi32(u0, 2), top2)),
          _mm512_and_si512(u1, low6),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), low4),
                          _mm512_and_si512(_mm512_srli_epi32(u1, 2), top2))};
}
// Byte j of each dword as i32.
inline __m512i byte_of(__m512i v, int j) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xff));
}
// Bytes j and j + 1 of each dword as an i16 pair.
inline __m512i pair_of(__m512i v, int j) {
  const __m512i x = _mm512_srli_epi32(v, 8 * j);
  return _mm512_or_si512(_mm512_and_si512(x, _mm512_set1_epi32(0xff)),
                         _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0xff00)), 8));
}
inline __m512i group_scale(const Scales& s, int j) { return byte_of(j < 4 ? s.sc03 : s.sc47, j % 4); }
inline __m512i min_pair(const Scales& s, int p) { return pair_of(p < 2 ? s.mn03 : s.mn47, 2 * (p % 2)); }

// --- Q4_K and Q5_K: blocks of 256, scales and mins per 32 --------------------
// M activation rows (Q8_K-style, one f32 scale per 256) through a group
// of 16 interleaved rows: c[i * ldc + l] for row i, weight row l < 16.
// Q5_K's fifth bits (qh bit 2 ch of byte l for element 64 ch + l, bit
// 2 ch + 1 for element 64 ch + 32 + l) join the nibbles at bit 4.
// Per block, the same exact i32 sums as the tiles (bounds there); a lone
// row's sums of a group go round two chains (one chain of 8 dependent
// vpdpbusd would bind its rate).
// Bit j of each byte moved to bit 4 (other bits: anything).
inline __m512i bit_to4(__m512i x, int j) {
  return j <= 4 ? _mm512_slli_epi16(x, static_cast<unsigned>(4 - j))
                : _mm512_srli_epi16(x, static_cast<unsigned>(j - 4));
}

template <int M, bool Five>
void group_dot_k45(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  constexpr int P = M == 1 ? 2 : 1;
  constexpr size_t kBlock = Five ? GP::kQ5kBlock : GP::kQ4kBlock, kQuants = Five ? GP::kQ5kQuants : GP::kQ4kQuants;
  const Acts<M> act(a, k);
  const __m512i m4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  Sums<M> acc;
  for (int b = 0; b < k / 256; ++b, g += kBlock) {
    if (st)
      for (size_t off = 0; off < kQuants; off += 64) st->at(g + off);
    const Scales sc = scales(g);
    __m512i tot[M];
    for (int r = 0; r < M; ++r) tot[r] = _mm512_setzero_si512();
    const uint8_t* qs = g + kQuants;
    for (int ch = 0; ch < 4; ++ch) {  // elements 64 ch ..: groups 2 ch (low nibbles) and 2 ch + 1 (high)
      __m512i lo[M][P], hi[M][P];
      for (int r = 0; r < M; ++r)
        for (int u = 0; u < P; ++u) lo[r][u] = hi[r][u] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const uint8_t* p = qs + 64 * (8 * ch + v);
        if (st) st->at(p);
        const __m512i w = load(p);
        __m512i wl = _mm512_and_si512(w, m4), wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        if constexpr (Five) {
          const __m512i qh = load(g + GP::kQ5kQh + 64 * v);
          wl = _mm512_or_si512(wl, _mm512_and_si512(bit_to4(qh, 2 * ch), bit4));
          wh = _mm512_or_si512(wh, _mm512_and_si512(bit_to4(qh, 2 * ch + 1), bit4));
        }
        for (int r = 0; r < M; ++r) {
          const int8_t* ar = act.q[r] + 256 * b + 64 * ch + 4 * v;
          lo[r][v % P] = _mm512_dpbusd_epi32(lo[r][v % P], wl, _mm512_set1_epi32(rd32(ar)));
          hi[r][v % P] = _mm512_dpbusd_epi32(hi[r][v % P], wh, _mm512_set1_epi32(rd32(ar + 32)));
        }
      }
      const __m512i sl = group_scale(sc, 2 * ch), sh = group_scale(sc, 2 * ch + 1);
      for (int r = 0; r < M; ++r) {
        __m512i l = lo[r][0], h = hi[r][0];
        for (int u = 1; u < P; ++u) {
          l = _mm512_add_epi32(l, lo[r][u]);
          h = _mm512_add_epi32(h, hi[r][u]);
        }
        tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(l, sl));
        tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(h, sh));
      }
    }
    const __m512 dv = f16x16(g), mv = f16x16(g + GP::kQ4kDmin);
    for (int r = 0; r < M; ++r) {
      __m512i mins = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        mins = _mm512_dpwssd_epi32(mins, min_pair(sc, p), _mm512_set1_epi32(sum_pair<8>(act.s[r], b, p)));
      const __m512 da = _mm512_set1_ps(act.d[r][8 * b]);
      acc.v[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[r]), _mm512_mul_ps(dv, da), acc.v[r]);
      acc.v[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(mv, da), acc.v[r]);
    }
  }
  acc.store(c, ldc);
}

// --- Q6_K: blocks of 256, int8 scales per 16 ---------------------------------
// Byte j of each dword, sign-extended to i32.
inline __m512i sbyte_of(__m512i v, int j) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24); }

// A block's values (u8, 0 .. 63: the format's plus 32) for dword v < 8 of
// half h: x[0] elements 128 h + 4 v .., x[1] + 32, x[2] + 64, x[3] + 96 (4
// elements of each of the 16 rows): ql's low or high nibbles with two bits
// of qh.
inline void q6_values(const uint8_t* blk, int h, int v, __m512i (&x)[4]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i l0 = load(blk + GP::kQ6kQl + 64 * (16 * h + v)), l1 = load(blk + GP::kQ6kQl + 64 * (16 * h + 8 + v));
  const __m512i qh = load(blk + GP::kQ6kQh + 64 * (8 * h + v));
  x[0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), top));
  x[1] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), top));
  x[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(qh, top));
  x[3] =
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_and_si512(_mm512_srli_epi16(qh, 2), top));
}
// Group g's scale (i32) and groups 2p, 2p+1's coefficients 32 s as an i16 pair.
inline __m512i q6_scale(const uint8_t* blk, int g) {
  return sbyte_of(load(blk + GP::kQ6kScales + 64 * (g / 4)), g % 4);
}
inline __m512i q6_coef(const uint8_t* blk, int p) {
  const __m512i lo = _mm512_slli_epi32(q6_scale(blk, 2 * p), 5), hi = _mm512_slli_epi32(q6_scale(blk, 2 * p + 1), 21);
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), hi);
}

// M activation rows (Q8_K-style) through a group of 16 interleaved rows,
// as for Q4_K: per block sum_g s_g (sum q a) - sum_g 32 s_g A_g, exact in
// i32, then d. Each quarter of a block (half h, dwords 4 vq ..) feeds four
// groups: 8 h + vq + {0, 2, 4, 6}.
template <int M>
void group_dot_q6k(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  const Acts<M> act(a, k);
  Sums<M> acc;
  for (int b = 0; b < k / 256; ++b, g += GP::kQ6kBlock) {
    if (st) st->lines(g, GP::kQ6kBlock);
    __m512i tot[M];
    for (int r = 0; r < M; ++r) tot[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h)
      for (int vq = 0; vq < 2; ++vq) {
        __m512i t[M][4];
        for (int r = 0; r < M; ++r)
          for (int u = 0; u < 4; ++u) t[r][u] = _mm512_setzero_si512();
        for (int v = 4 * vq; v < 4 * vq + 4; ++v) {
          __m512i x[4];
          q6_values(g, h, v, x);
          for (int r = 0; r < M; ++r) {
            const int8_t* ar = act.q[r] + 256 * b + 128 * h + 4 * v;
            for (int u = 0; u < 4; ++u)
              t[r][u] = _mm512_dpbusd_epi32(t[r][u], x[u], _mm512_set1_epi32(rd32(ar + 32 * u)));
          }
        }
        for (int u = 0; u < 4; ++u) {
          const __m512i sc = q6_scale(g, 8 * h + vq + 2 * u);
          for (int r = 0; r < M; ++r) tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(t[r][u], sc));
        }
      }
    const __m512 dv = f16x16(g);
    for (int r = 0; r < M; ++r) {
      __m512i off = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p)
        off = _mm512_dpwssd_epi32(off, q6_coef(g, p), _mm512_set1_epi32(sum_pair<16>(act.s[r], b, p)));
      acc.v[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(tot[r], off)),
                                 _mm512_mul_ps(dv, _mm512_set1_ps(act.d[r][8 * b])), acc.v[r]);
    }
  }
  acc.store(c, ldc);
}

// --- IQ4_XS: blocks of 256, 6-bit scales per 32, a table of values ---------
// A block's 16 rows' scales_l (dwords) and scales_h (widened to dwords);
// scale(j): group j's l_j - 32 as i32 (scales_l nibble j, scales_h bits
// 2j, 2j + 1 above it); coef(p): groups 2p and 2p + 1's coefficients
// 128 (l - 32) as an i16 pair.
struct Iq4Scales {
  __m512i sl, sh;
  explicit Iq4Scales(const uint8_t* blk)
      : sl(load(blk + GP::kIq4ScalesL)),
        sh(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + GP::kIq4ScalesH)))) {}
  __m512i scale(int j) const {
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, static_cast<unsigned>(4 * j)), _mm512_set1_epi32(0xF));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sh, static_cast<unsigned>(2 * j)), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
  }
  __m512i coef(int p) const {
    const __m512i lo = _mm512_slli_epi32(scale(2 * p), 7), hi = _mm512_slli_epi32(scale(2 * p + 1), 23);
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), hi);
  }
};
// The table's values + 128 (u8) of quant dword w of a block: lo elements
// 32 (w / 4) + 4 (w % 4) .., hi 16 further on, of the 16 rows.
struct Iq4Values {
  __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512i table =
      lanes(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)), _mm_set1_epi8(-128)));
  void of(const uint8_t* blk, int w, __m512i* lo, __m512i* hi) const {
    const __m512i x = load(blk + GP::kIq4Quants + 64 * w);
    *lo = _mm512_shuffle_epi8(table, _mm512_and_si512(x, m4));
    *hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(x, 4), m4));
  }
};

// M activation rows (Q8_K-style) through a group of 16 interleaved rows:
// per block sum_j (l_j - 32) (sum (v + 128) a) - sum_j 128 (l_j - 32) A_j,
// exact in i32 (bounds at the tiles), then d.
template <int M>
void group_dot_iq4(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  const Iq4Values val;
  const Acts<M> act(a, k);
  Sums<M> acc;
  for (int b = 0; b < k / 256; ++b, g += GP::kIq4Block) {
    if (st)
      for (size_t off = 0; off < GP::kIq4Quants; off += 64) st->at(g + off);
    const Iq4Scales sc(g);
    __m512i tot[M];
    for (int r = 0; r < M; ++r) tot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i t[M][2];
      for (int r = 0; r < M; ++r) t[r][0] = t[r][1] = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        if (st) st->at(g + GP::kIq4Quants + 64 * (4 * j + v));
        __m512i lo, hi;
        val.of(g, 4 * j + v, &lo, &hi);
        for (int r = 0; r < M; ++r) {
          const int8_t* ar = act.q[r] + 256 * b + 32 * j + 4 * v;
          t[r][0] = _mm512_dpbusd_epi32(t[r][0], lo, _mm512_set1_epi32(rd32(ar)));
          t[r][1] = _mm512_dpbusd_epi32(t[r][1], hi, _mm512_set1_epi32(rd32(ar + 16)));
        }
      }
      const __m512i s_j = sc.scale(j);
      for (int r = 0; r < M; ++r)
        tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(_mm512_add_epi32(t[r][0], t[r][1]), s_j));
    }
    const __m512 dv = f16x16(g);
    for (int r = 0; r < M; ++r) {
      __m512i off = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        off = _mm512_dpwssd_epi32(off, sc.coef(p), _mm512_set1_epi32(sum_pair<8>(act.s[r], b, p)));
      acc.v[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(tot[r], off)),
                                 _mm512_mul_ps(dv, _mm512_set1_ps(act.d[r][8 * b])), acc.v[r]);
    }
  }
  acc.store(c, ldc);
}

// --- Q8_0, Q4_0, MXFP4: a scale per 32 ---------------------------------------
template <int T>
constexpr int kScaleBytes = T == EP_MOE_DTYPE_MXFP4 ? 1 : 2;
template <int T>
constexpr int kBlockBytes = T == EP_MOE_DTYPE_Q8_0   ? 34
                            : T == EP_MOE_DTYPE_Q4_0 ? 18
                                                     : 17;
template <int T>
constexpr int kOffset = T == EP_MOE_DTYPE_Q8_0   ? 128
                        : T == EP_MOE_DTYPE_Q4_0 ? 8
                                                 : 12;

// A block's 16 rows' scales as f32: f16 d, or MXFP4's e8m0 as
// common/quant.cpp's e8m0_half makes it (2^(e - 128), subnormal below e 2).
template <int T>
inline __m512 scales32(const uint8_t* blk) {
  if constexpr (T != EP_MOE_DTYPE_MXFP4) {
    return f16x16(blk);
  } else {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, sub));
  }
}

// The u8 values (the format's plus kOffset) of quant vector v of a block:
// Q8_0's vectors 0-7 are elements 4v .. 4v+3 of the 16 rows; the nibble
// formats' vectors 0-3 give elements 4v .. (lo) and 16 + 4v .. (hi).
template <int T>
struct Values {
  __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
  __m512i table =
      lanes(_mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)), _mm_set1_epi8(12)));
  __m512i bytes(const uint8_t* q) const { return _mm512_xor_si512(load(q), flip); }
  void nibbles(const uint8_t* q, __m512i* lo, __m512i* hi) const {
    const __m512i w = load(q);
    *lo = _mm512_and_si512(w, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
    if constexpr (T == EP_MOE_DTYPE_MXFP4) {
      *lo = _mm512_shuffle_epi8(table, *lo);
      *hi = _mm512_shuffle_epi8(table, *hi);
    }
  }
};

// M activation rows (Q8_0-style, one f32 scale per 32) through a group of
// 16 interleaved rows: c[i * ldc + l] for row i, weight row l < 16. Per
// block, t = sum (w + z) a - z sum a, exact in i32 (at most 32 * 255 * 127
// before the offset is taken off); a block's products go round two chains.
template <int T, int M>
void group_dot_a(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  constexpr int z = kOffset<T>;
  constexpr size_t gb = kGroupRows * static_cast<size_t>(kBlockBytes<T>);
  const Values<T> val;
  const Acts<M> act(a, k);
  Sums<M> acc;
  for (int b = 0; b < k / 32; ++b, g += gb) {
    if (st) st->lines(g, gb);
    const uint8_t* qs = g + kGroupRows * kScaleBytes<T>;
    __m512i t[M][2];
    for (int r = 0; r < M; ++r) {
      t[r][0] = _mm512_set1_epi32(-z * (act.s[r][2 * b] + act.s[r][2 * b + 1]));
      t[r][1] = _mm512_setzero_si512();
    }
    if constexpr (T == EP_MOE_DTYPE_Q8_0) {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m512i w = val.bytes(qs + 64 * v);
        for (int r = 0; r < M; ++r)
          t[r][v % 2] = _mm512_dpbusd_epi32(t[r][v % 2], w, _mm512_set1_epi32(rd32(act.q[r] + 32 * b + 4 * v)));
      }
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512i lo, hi;
        val.nibbles(qs + 64 * v, &lo, &hi);
        for (int r = 0; r < M; ++r) {
          t[r][0] = _mm512_dpbusd_epi32(t[r][0], lo, _mm512_set1_epi32(rd32(act.q[r] + 32 * b + 4 * v)));
          t[r][1] = _mm512_dpbusd_epi32(t[r][1], hi, _mm512_set1_epi32(rd32(act.q[r] + 32 * b + 16 + 4 * v)));
        }
      }
    }
    const __m512 dv = scales32<T>(g);
    for (int r = 0; r < M; ++r)
      acc.v[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t[r][0], t[r][1])),
                                 _mm512_mul_ps(dv, _mm512_set1_ps(act.d[r][b])), acc.v[r]);
  }
  acc.store(c, ldc);
}

// --- the panel calls ---------------------------------------------------------
template <int T, int M>
void group_dot(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  if constexpr (T == EP_MOE_DTYPE_Q4_K || T == EP_MOE_DTYPE_Q5_K)
    group_dot_k45<M, T == EP_MOE_DTYPE_Q5_K>(g, k, a, c, ldc, st);
  else if constexpr (T == EP_MOE_DTYPE_Q6_K) group_dot_q6k<M>(g, k, a, c, ldc, st);
  else if constexpr (T == EP_MOE_DTYPE_IQ4_XS) group_dot_iq4<M>(g, k, a, c, ldc, st);
  else group_dot_a<T, M>(g, k, a, c, ldc, st);
}

template <int T, int... I>
constexpr std::array<GroupFn, sizeof...(I)> group_table(std::integer_sequence<int, I...>) {
  return {group_dot<T, I + 1>...};
}

template <int T>
void qgemm_groups(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc, const void* next) {
  static constexpr std::array<GroupFn, kCallRows> kGroups =
      group_table<T>(std::make_integer_sequence<int, kCallRows>{});
  run_groups<kGroupRows>(kGroups.data(), quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k), m, a, k, panel, nr, c, ldc,
                         next);
}

// --- unpacking for the int8 tiles (qtile_layout.hpp) --------------------------
// A panel of kCols interleaved rows (two groups) into the tiles' layout:
// the values as u8 split into k-groups, the scales (Q4_K: and mins)
// widened, d (and dmin) to f32.
static_assert(kCols == 2 * kGroupRows, "a tile panel is two groups");

template <int T>
void unpack_k45(const void* panel, int k, void* out) {
  using L = KLayout<T>;
  constexpr bool kFive = T == EP_MOE_DTYPE_Q5_K;
  constexpr size_t kBlock = kFive ? GP::kQ5kBlock : GP::kQ4kBlock, kQuants = kFive ? GP::kQ5kQuants : GP::kQ4kQuants;
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k);
  const __m512i m4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int b = 0; b < k / 256; ++b, o += L::kBlock)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * kGroupRows * rb + static_cast<size_t>(b) * kBlock;
      uint8_t* oh = o + 64 * h;
      for (int ch = 0; ch < 4; ++ch)
        for (int v = 0; v < 8; ++v) {
          const __m512i w = load(g + kQuants + 64 * (8 * ch + v));
          __m512i wl = _mm512_and_si512(w, m4), wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
          if constexpr (kFive) {
            const __m512i qh = load(g + GP::kQ5kQh + 64 * v);
            wl = _mm512_or_si512(wl, _mm512_and_si512(bit_to4(qh, 2 * ch), bit4));
            wh = _mm512_or_si512(wh, _mm512_and_si512(bit_to4(qh, 2 * ch + 1), bit4));
          }
          _mm512_storeu_si512(oh + (16 * ch + v) * kGroupBytes, wl);
          _mm512_storeu_si512(oh + (16 * ch + 8 + v) * kGroupBytes, wh);
        }
      const Scales sc = scales(g);
      for (int j = 0; j < L::G; ++j) _mm512_storeu_si512(oh + L::kSc + j * 4 * kCols, group_scale(sc, j));
      for (int pr = 0; pr < L::G / 2; ++pr) _mm512_storeu_si512(oh + L::kCoef + pr * 4 * kCols, min_pair(sc, pr));
      _mm512_storeu_ps(oh + L::kD, f16x16(g));
      _mm512_storeu_ps(oh + L::kDmin, f16x16(g + GP::kQ4kDmin));
    }
}

void unpack_iq4(const void* panel, int k, void* out) {
  using L = KLayout<EP_MOE_DTYPE_IQ4_XS>;
  const Iq4Values val;
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(EP_MOE_DTYPE_IQ4_XS, k);
  for (int b = 0; b < k / 256; ++b, o += L::kBlock)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * kGroupRows * rb + static_cast<size_t>(b) * GP::kIq4Block;
      uint8_t* oh = o + 64 * h;
      for (int w = 0; w < 32; ++w) {  // k-groups 8 (w / 4) + w % 4 (lo) and 4 on (hi)
        __m512i lo, hi;
        val.of(g, w, &lo, &hi);
        _mm512_storeu_si512(oh + (8 * (w / 4) + w % 4) * kGroupBytes, lo);
        _mm512_storeu_si512(oh + (8 * (w / 4) + 4 + w % 4) * kGroupBytes, hi);
      }
      const Iq4Scales sc(g);
      for (int j = 0; j < L::G; ++j) _mm512_storeu_si512(oh + L::kSc + j * 4 * kCols, sc.scale(j));
      for (int pr = 0; pr < L::G / 2; ++pr) _mm512_storeu_si512(oh + L::kCoef + pr * 4 * kCols, sc.coef(pr));
      _mm512_storeu_ps(oh + L::kD, f16x16(g));
    }
}

void unpack_q6k(const void* panel, int k, void* out) {
  using L = KLayout<EP_MOE_DTYPE_Q6_K>;
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(EP_MOE_DTYPE_Q6_K, k);
  for (int b = 0; b < k / 256; ++b, o += L::kBlock)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * kGroupRows * rb + static_cast<size_t>(b) * GP::kQ6kBlock;
      uint8_t* oh = o + 64 * h;
      for (int hh = 0; hh < 2; ++hh)
        for (int v = 0; v < 8; ++v) {
          __m512i x[4];
          q6_values(g, hh, v, x);
          for (int u = 0; u < 4; ++u) _mm512_storeu_si512(oh + (32 * hh + 8 * u + v) * kGroupBytes, x[u]);
        }
      for (int j = 0; j < L::G; ++j) _mm512_storeu_si512(oh + L::kSc + j * 4 * kCols, q6_scale(g, j));
      for (int pr = 0; pr < L::G / 2; ++pr) _mm512_storeu_si512(oh + L::kCoef + pr * 4 * kCols, q6_coef(g, pr));
      _mm512_storeu_ps(oh + L::kD, f16x16(g));
    }
}

template <int T>
void unpack_a(const void* panel, int k, void* out) {
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k);
  constexpr size_t gb = kGroupRows * static_cast<size_t>(kBlockBytes<T>);
  const Values<T> val;
  for (int b = 0; b < k / 32; ++b, o += kBlockA)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * kGroupRows * rb + static_cast<size_t>(b) * gb;
      const uint8_t* qs = g + kGroupRows * kScaleBytes<T>;
      uint8_t* oh = o + 64 * h;
      if constexpr (T == EP_MOE_DTYPE_Q8_0) {
        for (int v = 0; v < 8; ++v) _mm512_storeu_si512(oh + v * kGroupBytes, val.bytes(qs + 64 * v));
      } else {
        for (int v = 0; v < 4; ++v) {
          __m512i lo, hi;
          val.nibbles(qs + 64 * v, &lo, &hi);
          _mm512_storeu_si512(oh + v * kGroupBytes, lo);
          _mm512_storeu_si512(oh + (4 + v) * kGroupBytes, hi);
        }
      }
      _mm512_storeu_ps(oh + 8 * kGroupBytes, scales32<T>(g));
    }
}

}  // namespace

void qgroups_avx512vnni(QGemmFn* gemm, QUnpackFn* unpack) {
  gemm[quant_index(EP_MOE_DTYPE_Q4_K)] = qgemm_groups<EP_MOE_DTYPE_Q4_K>;
  gemm[quant_index(EP_MOE_DTYPE_Q5_K)] = qgemm_groups<EP_MOE_DTYPE_Q5_K>;
  gemm[quant_index(EP_MOE_DTYPE_Q6_K)] = qgemm_groups<EP_MOE_DTYPE_Q6_K>;
  gemm[quant_index(EP_MOE_DTYPE_IQ4_XS)] = qgemm_groups<EP_MOE_DTYPE_IQ4_XS>;
  gemm[quant_index(EP_MOE_DTYPE_Q8_0)] = qgemm_groups<EP_MOE_DTYPE_Q8_0>;
  gemm[quant_index(EP_MOE_DTYPE_Q4_0)] = qgemm_groups<EP_MOE_DTYPE_Q4_0>;
  gemm[quant_index(EP_MOE_DTYPE_MXFP4)] = qgemm_groups<EP_MOE_DTYPE_MXFP4>;
  unpack[quant_index(EP_MOE_DTYPE_Q4_K)] = unpack_k45<EP_MOE_DTYPE_Q4_K>;
  unpack[quant_index(EP_MOE_DTYPE_Q5_K)] = unpack_k45<EP_MOE_DTYPE_Q5_K>;
  unpack[quant_index(EP_MOE_DTYPE_Q6_K)] = unpack_q6k;
  unpack[quant_index(EP_MOE_DTYPE_IQ4_XS)] = unpack_iq4;
  unpack[quant_index(EP_MOE_DTYPE_Q8_0)] = unpack_a<EP_MOE_DTYPE_Q8_0>;
  unpack[quant_index(EP_MOE_DTYPE_Q4_0)] = unpack_a<EP_MOE_DTYPE_Q4_0>;
  unpack[quant_index(EP_MOE_DTYPE_MXFP4)] = unpack_a<EP_MOE_DTYPE_MXFP4>;
}

}  // namespace cpu
}  // namespace ep_moe

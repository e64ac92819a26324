// Block formats on rows interleaved 8 at a time (pack.hpp's kGroupRows8):
// the qgemm entries of the AVX2 table, and of the AVX-512 ones where the
// CPU has no AVX512_VNNI (kernels.hpp's QGemmFn), and the activation rows'
// quantizer of every x86 table (built with -mavx2 -mfma -mf16c).
//
// Each 256-bit load holds 4 consecutive elements of 8 weight rows: maddubs
// multiplies them (u8) with 4 elements of an activation row (s8,
// broadcast) into an i16 pair a row, and a block's scales are decoded once
// for its 8 rows. Where the weights are small unsigned values several
// maddubs are added in i16 before one madd widens them to i32 (by the
// group's scale or by ones): as many as the bound allows, |a| <= 127
// making a pair at most 2 * 127 * max(w):
//   Q4_K, Q4_0 (w <= 15): 3810, 8 a sum;   Q5_K (31): 7874, 4;
//   Q6_K (63, its 6 bits as stored): 16002, 2;   MXFP4 (its doubled
//   values + 12, <= 24): 6096, 4;
// against 32767. Signed weights (Q8_0, IQ4_XS's table values) go through
// the sign trick, |w| times a with w's sign, a pair reaching 2 * 127 *
// 127 = 32258: each widened at once. The offsets (Q6_K's 32, Q4_0's 8,
// MXFP4's 12) and the K formats' mins come off through the activations'
// sums of 16, as in qgroups_avx512vnni.cpp. Every sum is an exact integer
// in i32, scaled in f32 once per block (per 32 elements: Q8_0, Q4_0,
// MXFP4; per 256: the others).
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/qgroups.hpp"

namespace ep_moe {
namespace cpu {

namespace {

constexpr int R = kGroupRows8;
using GP = GroupParts<R>;

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m256 f16x8(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
// 4 activation values broadcast to every row's dword.
inline __m256i bcast(const int8_t* p) { return _mm256_set1_epi32(rd32(p)); }
// An i16 value in each dword's low half, as the pair (x, x): the madd
// operand that scales both of a maddubs pair's sums.
inline __m256i pair16(__m256i x) {
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(x, 16));
}
// w (u8) times the 4 values at p of an activation row, an i16 pair a row.
inline __m256i dot_u(__m256i w, const int8_t* p) { return _mm256_maddubs_epi16(w, bcast(p)); }
// Signed w as |w| times the values with w's sign (aw = |w|).
inline __m256i dot_s(__m256i aw, __m256i w, const int8_t* p) {
  return _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast(p), w));
}

// The f32 sums of M activation rows against a group's 8 rows: c[i * ldc +
// l] for activation row i, weight row l.
template <int M>
struct Sums {
  __m256 v[M];
  Sums() {
    for (int r = 0; r < M; ++r) v[r] = _mm256_setzero_ps();
  }
  void store(float* c, int ldc) const {
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(c + static_cast<ptrdiff_t>(r) * ldc, v[r]);
  }
};

// --- Q4_K and Q5_K: blocks of 256, 6-bit scales and mins per 32 ------------
// A block's 8 rows' scales and mins, 4 to a dword: byte j of sc03 (mn03)
// is group j's scale (min), of sc47 (mn47) group 4 + j's.
struct Scales {
  __m256i sc03, sc47, mn03, mn47;
};
inline Scales scales(const uint8_t* blk) {
  const __m256i u0 = load(blk + GP::kQ4kWords), u1 = load(blk + GP::kQ4kWords + 4 * R),
                u2 = load(blk + GP::kQ4kWords + 8 * R);
  const __m256i low6 = _mm256_set1_epi32(0x3f3f3f3f), low4 = _mm256_set1_epi32(0x0f0f0f0f);
  const __m256i top2 = _mm256_set1_epi32(0x30303030);
  return {_mm256_and_si256(u0, low6),
          _mm256_or_si256(_mm256_and_si256(u2, low4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), top2)),
          _mm256_and_si256(u1, low6),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi32(u1, 2), top2))};
}
// Byte j of each dword as i32.
inline __m256i byte_of(__m256i v, int j) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), _mm256_set1_epi32(0xff));
}
// Bytes j and j + 1 of each dword as an i16 pair.
inline __m256i pair_of(__m256i v, int j) {
  const __m256i x = _mm256_srli_epi32(v, 8 * j);
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xff)),
                         _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xff00)), 8));
}
inline __m256i group_scale(const Scales& s, int j) { return byte_of(j < 4 ? s.sc03 : s.sc47, j % 4); }
inline __m256i min_pair(const Scales& s, int p) { return pair_of(p < 2 ? s.mn03 : s.mn47, 2 * (p % 2)); }
// Bit j of each byte moved to bit 4 (other bits: anything).
inline __m256i bit_to4(__m256i x, int j) {
  return j <= 4 ? _mm256_slli_epi16(x, static_cast<int>(4 - j)) : _mm256_srli_epi16(x, static_cast<int>(j - 4));
}

// M activation rows (Q8_K-style, one f32 scale per 256) through a group of
// 8 interleaved rows: per block d sum_g s_g (sum q a) - dmin sum_g m_g A_g.
// Quant dword 8 ch + v holds elements 64 ch + 4 v .. (low nibbles, group
// 2 ch) and 64 ch + 32 + 4 v .. (high, group 2 ch + 1); Q5_K's fifth bits
// (qh dword v, bit 2 ch for the low values, 2 ch + 1 for the high) join
// them at bit 4.
template <int M, bool Five>
void group_dot_k45(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  constexpr size_t kBlock = Five ? GP::kQ5kBlock : GP::kQ4kBlock, kQuants = Five ? GP::kQ5kQuants : GP::kQ4kQuants;
  constexpr int kRun = Five ? 4 : 8;  // maddubs a sum in i16 (header)
  const Acts<M> act(a, k);
  const __m256i m4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  Sums<M> acc;
  for (int b = 0; b < k / 256; ++b, g += kBlock) {
    if (st)
      for (size_t off = 0; off < kQuants; off += 64) st->at(g + off);
    const Scales sc = scales(g);
    __m256i tot[M];
    for (int r = 0; r < M; ++r) tot[r] = _mm256_setzero_si256();
    const uint8_t* qs = g + kQuants;
    for (int ch = 0; ch < 4; ++ch) {
      const __m256i sl = pair16(group_scale(sc, 2 * ch)), sh = pair16(group_scale(sc, 2 * ch + 1));
      for (int v0 = 0; v0 < 8; v0 += kRun) {
        __m256i lo[M], hi[M];
        for (int r = 0; r < M; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int v = v0; v < v0 + kRun; ++v) {
          const uint8_t* p = qs + 4 * R * (8 * ch + v);
          if (st && v % 2 == 0) st->at(p);
          const __m256i w = load(p);
          __m256i wl = _mm256_and_si256(w, m4), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
          if constexpr (Five) {
            const __m256i qh = load(g + GP::kQ5kQh + 4 * R * v);
            wl = _mm256_or_si256(wl, _mm256_and_si256(bit_to4(qh, 2 * ch), bit4));
            wh = _mm256_or_si256(wh, _mm256_and_si256(bit_to4(qh, 2 * ch + 1), bit4));
          }
          for (int r = 0; r < M; ++r) {
            const int8_t* ar = act.q[r] + 256 * b + 64 * ch + 4 * v;
            lo[r] = _mm256_add_epi16(lo[r], dot_u(wl, ar));
            hi[r] = _mm256_add_epi16(hi[r], dot_u(wh, ar + 32));
          }
        }
        for (int r = 0; r < M; ++r)
          tot[r] =
              _mm256_add_epi32(tot[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], sl), _mm256_madd_epi16(hi[r], sh)));
      }
    }
    const __m256 dv = f16x8(g), mv = f16x8(g + GP::kQ4kDmin);
    for (int r = 0; r < M; ++r) {
      __m256i mins = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p)
        mins =
            _mm256_add_epi32(mins, _mm256_madd_epi16(min_pair(sc, p), _mm256_set1_epi32(sum_pair<8>(act.s[r], b, p))));
      const __m256 da = _mm256_set1_ps(act.d[r][8 * b]);
      acc.v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[r]), _mm256_mul_ps(dv, da), acc.v[r]);
      acc.v[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(mv, da), acc.v[r]);
    }
  }
  acc.store(c, ldc);
}

// --- Q6_K: blocks of 256, int8 scales per 16 ---------------------------------
// Byte j of each dword, sign-extended to i32.
inline __m256i sbyte_of(__m256i v, int j) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * j), 24); }
inline __m256i q6_scale(const uint8_t* blk, int grp) {
  return sbyte_of(load(blk + GP::kQ6kScales + 4 * R * (grp / 4)), grp % 4);
}
// Groups 2p and 2p + 1's coefficients 32 s as an i16 pair.
inline __m256i q6_coef(const uint8_t* blk, int p) {
  const __m256i lo = _mm256_slli_epi32(q6_scale(blk, 2 * p), 5), hi = _mm256_slli_epi32(q6_scale(blk, 2 * p + 1), 21);
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), hi);
}
// A block's values (u8, 0 .. 63: the format's plus 32) of elements 128 h
// + 32 u + 4 v .. of the 8 rows, u = 0 .. 3: ql dword 16 h + 8 (u % 2) +
// v's low (u < 2) or high nibbles, with bits 2u, 2u + 1 of qh dword 8 h +
// v above them.
inline void q6_values(const uint8_t* blk, int h, int v, __m256i (&x)[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i l0 = load(blk + GP::kQ6kQl + 4 * R * (16 * h + v)),
                l1 = load(blk + GP::kQ6kQl + 4 * R * (16 * h + 8 + v));
  const __m256i qh = load(blk + GP::kQ6kQh + 4 * R * (8 * h + v));
  x[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top));
  x[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top));
  x[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, top));
  x[3] =
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
}

// M activation rows (Q8_K-style) through a group of 8 interleaved rows:
// per block d (sum_g s_g (sum q a) - sum_g 32 s_g A_g). Elements 128 h +
// 32 u + 4 v .. belong to group 8 h + 2 u + v / 4.
template <int M>
void group_dot_q6k(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  const Acts<M> act(a, k);
  Sums<M> acc;
  for (int b = 0; b < k / 256; ++b, g += GP::kQ6kBlock) {
    if (st)
      for (size_t off = 0; off < GP::kQ6kBlock; off += 64) st->at(g + off);
    __m256i tot[M];
    for (int r = 0; r < M; ++r) tot[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h)
      for (int vq = 0; vq < 2; ++vq) {
        __m256i s[4];
        for (int u = 0; u < 4; ++u) s[u] = pair16(q6_scale(g, 8 * h + 2 * u + vq));
        for (int v0 = 4 * vq; v0 < 4 * vq + 4; v0 += 2) {  // 2 maddubs a sum in i16
          __m256i t[M][4];
          for (int r = 0; r < M; ++r)
            for (int u = 0; u < 4; ++u) t[r][u] = _mm256_setzero_si256();
          for (int v = v0; v < v0 + 2; ++v) {
            __m256i x[4];
            q6_values(g, h, v, x);
            for (int r = 0; r < M; ++r)
              for (int u = 0; u < 4; ++u)
                t[r][u] = _mm256_add_epi16(t[r][u], dot_u(x[u], act.q[r] + 256 * b + 128 * h + 32 * u + 4 * v));
          }
          for (int r = 0; r < M; ++r)
            for (int u = 0; u < 4; ++u) tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(t[r][u], s[u]));
        }
      }
    const __m256 dv = f16x8(g);
    for (int r = 0; r < M; ++r) {
      __m256i off = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p)
        off = _mm256_add_epi32(off, _mm256_madd_epi16(q6_coef(g, p), _mm256_set1_epi32(sum_pair<16>(act.s[r], b, p))));
      acc.v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(tot[r], off)),
                                 _mm256_mul_ps(dv, _mm256_set1_ps(act.d[r][8 * b])), acc.v[r]);
    }
  }
  acc.store(c, ldc);
}

// --- IQ4_XS: blocks of 256, 6-bit scales per 32, a table of values ---------
// Group j's l_j - 32 for the 8 rows, as an i16 pair (scales_l nibble j,
// scales_h bits 2j, 2j + 1 above it).
inline __m256i iq4_scale(const uint8_t* blk, int j) {
  const __m256i sl = load(blk + GP::kIq4ScalesL);
  const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + GP::kIq4ScalesH)));
  const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), _mm256_set1_epi32(0xF));
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(sh, 2 * j), _mm256_set1_epi32(3));
  return pair16(_mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32)));
}

// M activation rows (Q8_K-style) through a group of 8 interleaved rows: per
// block d sum_j (l_j - 32) (sum v a), v the table's values. Quant dword 4 j
// + v holds elements 32 j + 4 v .. (low nibbles) and 32 j + 16 + 4 v ..
// (high).
template <int M>
void group_dot_iq4(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const Acts<M> act(a, k);
  Sums<M> acc;
  for (int b = 0; b < k / 256; ++b, g += GP::kIq4Block) {
    if (st)
      for (size_t off = 0; off < GP::kIq4Quants; off += 64) st->at(g + off);
    __m256i tot[M];
    for (int r = 0; r < M; ++r) tot[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i s = iq4_scale(g, j);
      for (int v = 0; v < 4; ++v) {
        const uint8_t* p = g + GP::kIq4Quants + 4 * R * (4 * j + v);
        if (st && v % 2 == 0) st->at(p);
        const __m256i x = load(p);
        const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(x, m4));
        const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
        const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
        for (int r = 0; r < M; ++r) {
          const int8_t* ar = act.q[r] + 256 * b + 32 * j + 4 * v;
          tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(dot_s(alo, lo, ar), s));
          tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(dot_s(ahi, hi, ar + 16), s));
        }
      }
    }
    const __m256 dv = f16x8(g);
    for (int r = 0; r < M; ++r)
      acc.v[r] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[r]), _mm256_mul_ps(dv, _mm256_set1_ps(act.d[r][8 * b])), acc.v[r]);
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
// The nibble formats' offset: Q4_0's nibbles as stored (value + 8),
// MXFP4's doubled values + 12.
template <int T>
constexpr int kOffset = T == EP_MOE_DTYPE_Q4_0 ? 8 : 12;

// A block's 8 rows' scales as f32: f16 d, or MXFP4's e8m0 as
// common/quant.cpp's e8m0_half makes it (2^(e - 128), subnormal below e 2).
template <int T>
inline __m256 scales32(const uint8_t* blk) {
  if constexpr (T != EP_MOE_DTYPE_MXFP4) {
    return f16x8(blk);
  } else {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
}

// M activation rows (Q8_0-style, one f32 scale per 32) through a group of
// 8 interleaved rows, per block: Q8_0 sum w a (sign trick); the nibble
// formats sum (w + z) a - z sum a, quant dword v holding elements 4 v ..
// (low nibbles) and 16 + 4 v .. (high). Exact in i32.
template <int T, int M>
void group_dot_a(const uint8_t* g, int k, const void* const* a, float* c, int ldc, const Stream* st) {
  constexpr size_t gb = R * static_cast<size_t>(kBlockBytes<T>);
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)), _mm_set1_epi8(12)));
  const Acts<M> act(a, k);
  Sums<M> acc;
  for (int b = 0; b < k / 32; ++b, g += gb) {
    if (st)
      for (size_t off = 0; off < gb; off += 64) st->at(g + off);
    const uint8_t* qs = g + R * kScaleBytes<T>;
    __m256i t[M];
    if constexpr (T == EP_MOE_DTYPE_Q8_0) {
      for (int r = 0; r < M; ++r) t[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m256i w = load(qs + 4 * R * v), aw = _mm256_abs_epi8(w);
        for (int r = 0; r < M; ++r)
          t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(dot_s(aw, w, act.q[r] + 32 * b + 4 * v), ones));
      }
    } else {
      __m256i lo[M], hi[M];
      for (int r = 0; r < M; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m256i w = load(qs + 4 * R * v);
        __m256i wl = _mm256_and_si256(w, m4), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        if constexpr (T == EP_MOE_DTYPE_MXFP4) {
          wl = _mm256_shuffle_epi8(table, wl);
          wh = _mm256_shuffle_epi8(table, wh);
        }
        for (int r = 0; r < M; ++r) {
          const int8_t* ar = act.q[r] + 32 * b + 4 * v;
          lo[r] = _mm256_add_epi16(lo[r], dot_u(wl, ar));
          hi[r] = _mm256_add_epi16(hi[r], dot_u(wh, ar + 16));
        }
      }
      for (int r = 0; r < M; ++r) {
        const __m256i z = _mm256_set1_epi32(-kOffset<T> * (act.s[r][2 * b] + act.s[r][2 * b + 1]));
        // Q4_0's 8 sums of at most 3810 fit one i16 sum; MXFP4's (6096) two.
        t[r] = T == EP_MOE_DTYPE_Q4_0
                   ? _mm256_madd_epi16(_mm256_add_epi16(lo[r], hi[r]), ones)
                   : _mm256_add_epi32(_mm256_madd_epi16(lo[r], ones), _mm256_madd_epi16(hi[r], ones));
        t[r] = _mm256_add_epi32(t[r], z);
      }
    }
    const __m256 dv = scales32<T>(g);
    for (int r = 0; r < M; ++r)
      acc.v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r]), _mm256_mul_ps(dv, _mm256_set1_ps(act.d[r][b])), acc.v[r]);
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
  run_groups<R>(kGroups.data(), quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k), m, a, k, panel, nr, c, ldc, next);
}

}  // namespace

// The activation rows' quantizer: the scalar quantizer's bytes, the same f32 multiply by 127 / amax and the
// same rounding (cvtps2dq, nearest even).
void quantize_act_avx2(const float* x, int64_t k, ActQuant aq, void* outp) {
  const int64_t kp = act_row_padded(k);
  auto* q = static_cast<int8_t*>(outp);
  auto* d = reinterpret_cast<float*>(static_cast<char*>(outp) + kp);
  auto* s = reinterpret_cast<int16_t*>(static_cast<char*>(outp) + kp + kp / 32 * 4);
  const int64_t bs = aq == ActQuant::Q8_K ? 256 : 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b0 = 0; b0 < kp; b0 += bs) {
    const int64_t end = b0 + bs < k ? b0 + bs : k;
    float amax = 0;
    int64_t i = b0;
    if (end - b0 == bs) {
      __m256 mx = _mm256_setzero_ps();
      for (; i < end; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      t = _mm_max_ss(t, _mm_movehdup_ps(t));
      amax = _mm_cvtss_f32(t);
    } else {
      for (; i < end; ++i) amax = amax > __builtin_fabsf(x[i]) ? amax : __builtin_fabsf(x[i]);
    }
    const float db = amax / 127.0f, id = db != 0.0f ? 127.0f / amax : 0.0f;
    if (end - b0 == bs) {
      const __m256 vid = _mm256_set1_ps(id);
      for (int64_t e = b0; e < end; e += 32) {
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e), vid));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e + 8), vid));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e + 16), vid));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e + 24), vid));
        const __m256i p16a = _mm256_packs_epi32(i0, i1), p16b = _mm256_packs_epi32(i2, i3);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        // The packs interleave the 128-bit lanes: put the 4-byte groups back in order.
        const __m256i ord = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + e), ord);
      }
    } else {
      for (int64_t e = b0; e < b0 + bs; ++e)
        q[e] = e < k ? static_cast<int8_t>(_mm_cvtss_si32(_mm_set_ss(x[e] * id))) : 0;
    }
    for (int64_t j = b0 / 32; j < (b0 + bs) / 32; ++j) d[j] = db;
  }
  for (int64_t g = 0; g < kp / 16; ++g) {
    int sum = 0;
    for (int e = 0; e < 16; ++e) sum += q[16 * g + e];
    s[g] = static_cast<int16_t>(sum);
  }
}

void qgroups_avx2(QGemmFn* gemm) {
  gemm[quant_index(EP_MOE_DTYPE_Q4_K)] = qgemm_groups<EP_MOE_DTYPE_Q4_K>;
  gemm[quant_index(EP_MOE_DTYPE_Q5_K)] = qgemm_groups<EP_MOE_DTYPE_Q5_K>;
  gemm[quant_index(EP_MOE_DTYPE_Q6_K)] = qgemm_groups<EP_MOE_DTYPE_Q6_K>;
  gemm[quant_index(EP_MOE_DTYPE_IQ4_XS)] = qgemm_groups<EP_MOE_DTYPE_IQ4_XS>;
  gemm[quant_index(EP_MOE_DTYPE_Q8_0)] = qgemm_groups<EP_MOE_DTYPE_Q8_0>;
  gemm[quant_index(EP_MOE_DTYPE_Q4_0)] = qgemm_groups<EP_MOE_DTYPE_Q4_0>;
  gemm[quant_index(EP_MOE_DTYPE_MXFP4)] = qgemm_groups<EP_MOE_DTYPE_MXFP4>;
}

}  // namespace cpu
}  // namespace ep_moe

// AVX2 block-format kernels (kernels.hpp's QGemmFn; built with -mavx2 -mfma
// -mf16c, called only when the CPU has them). Per weight row and up to eight
// activation rows at a time: each 32-byte piece of a block is unpacked to
// bytes once and multiplied with every row's int8 values by maddubs (u8 x
// s8 pairs into i16; signed weights through the sign trick, |w| * sign(a,
// w)), then by the sub-block scales with madd (i16 pairs into i32), summed
// exactly in i32 per block and scaled into f32 accumulators once per block.
// The integer sums are those of the portable kernels (qkernels_generic.cpp);
// only the order of the f32 additions differs.
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {

// Activation rows per pass over a weight row: each pass unpacks the row's
// blocks and their scales once for all of them, so more rows share that
// work; beyond 8 the accumulators no longer fit the 16 registers and spill.
constexpr int kTile = 8;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i q = load128(p), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

// Signed weights w times signed activations a, pairs summed into i16.
inline __m256i dot_ss(__m256i w, __m256i a) {
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// The int8 activation values of rows a[0 .. M) at element e.
// s32: the sums of each 32 (the K formats' mins), from `sums32` when
// given (qgemm makes them once per call), else null.
// ahead: where the kernel prefetches the weights it reads kAheadBytes on
// (decode), or null.
struct Ahead {
  const uint8_t* end;   // the panel's end: beyond it, the stream goes on at
  const uint8_t* next;  // the panel this thread takes next (null: none)
  size_t bytes;         // this panel's size, taken to be the next one's too
};

template <int M>
struct Rows {
  const int8_t* q[M];
  const float* d[M];
  const int16_t* s[M];
  const int16_t* s32[M];
  const Ahead* ahead;
  Rows(const void* const* a, int k, const int16_t* const* sums32 = nullptr, const Ahead* ah = nullptr) : ahead(ah) {
    for (int r = 0; r < M; ++r) {
      q[r] = act_q(a[r]);
      d[r] = act_d(a[r], k);
      s[r] = act_s(a[r], k);
      s32[r] = sums32 ? sums32[r] : nullptr;
    }
  }
};

// Decode reads each weight once, from memory: every block prefetches the
// lines kAheadBytes on in the stream (into the next panel past this one's
// end), spread over the row so that the reads overlap the arithmetic. A
// burst of a whole row's lines at once leaves long rows (k of 4096 and
// more) waiting on the memory more than short ones; a few KiB ahead covers
// the latency at two threads' share of the bandwidth. Inlined: a call would
// spill every live vector register around it (all are caller-saved).
constexpr size_t kAheadBytes = 6144;
[[gnu::always_inline]] inline void prefetch_ahead(const Ahead* ah, const uint8_t* block, int bb) {
  if (!ah) return;
  for (int off = 0; off < bb; off += 64) {
    const uint8_t* t = block + kAheadBytes + off;
    if (t >= ah->end) {
      const auto past = static_cast<size_t>(t - ah->end);
      if (!ah->next || past >= ah->bytes) return;
      t = ah->next + past;
    }
    _mm_prefetch(reinterpret_cast<const char*>(t), _MM_HINT_T0);
  }
}

// The sums of each 32 activation values of a row (from its sums of 16).
inline void sums32(const void* a, int k, int16_t* out) {
  const int16_t* s = act_s(a, k);
  for (int64_t j = 0; j < act_row_padded(k) / 32; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm_hadd_epi16(load128(s + 2 * j), load128(s + 2 * j + 8)));
}

// --- Q8_0 ------------------------------------------------------------------
template <int M>
void dot_q8_0(const uint8_t* w, const Rows<M>& a, int k, float* out) {
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 32; ++b, w += 34) {
    prefetch_ahead(a.ahead, w, 34);
    const __m256i wq = load(w + 2);
    const float dw = f16(w);
    for (int r = 0; r < M; ++r) {
      const __m256i p = _mm256_madd_epi16(dot_ss(wq, load(a.q[r] + 32 * b)), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a.d[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(acc[r]);
}

// --- Q4_0 ------------------------------------------------------------------
template <int M>
void dot_q4_0(const uint8_t* w, const Rows<M>& a, int k, float* out) {
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 32; ++b, w += 18) {
    prefetch_ahead(a.ahead, w, 18);
    const __m256i wq = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
    const float dw = f16(w);
    for (int r = 0; r < M; ++r) {
      const __m256i p = _mm256_madd_epi16(dot_ss(wq, load(a.q[r] + 32 * b)), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a.d[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(acc[r]);
}

// --- MXFP4 -------------------------------------------------------------------
template <int M>
void dot_mxfp4(const uint8_t* w, const Rows<M>& a, int k, float* out) {
  const __m256i table = _mm256_broadcastsi128_si256(load128(kMxfp4Values));
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 32; ++b, w += 17) {
    prefetch_ahead(a.ahead, w, 17);
    const __m256i wq = _mm256_shuffle_epi8(table, nibbles(w + 1));
    // 2^(e - 128) (e8m0_half, inlined: a call per block of 32 costs as much as its arithmetic).
    const uint32_t bits = w[0] < 2 ? uint32_t{0x00200000} << w[0] : static_cast<uint32_t>(w[0] - 1) << 23;
    float dw;
    std::memcpy(&dw, &bits, 4);
    for (int r = 0; r < M; ++r) {
      const __m256i p = _mm256_madd_epi16(dot_ss(wq, load(a.q[r] + 32 * b)), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a.d[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(acc[r]);
}

// --- Q4_K and Q5_K -----------------------------------------------------------
// The 12 scale bytes -> sc[0..7] in the first 8 bytes, m[0..7] in the next.
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// Two rows' 12 scale bytes (at s0, s1) as 8 u8 scales (low half) and 8 u8
// mins (high half) of each 128-bit lane, one row a lane, the four 32-bit
// words of a lane computed side by side:
//   [u0 & 63s, (u2 & 15s) | (u0 >> 6 & 3s) << 4, u1 & 63s, (u2 >> 4 & 15s) | (u1 >> 6 & 3s) << 4].
// The 16-byte loads read words 0-2; word 3 (the block's first quants) is
// not used.
inline __m256i k4_scales_two(const uint8_t* s0, const uint8_t* s1) {
  const __m256i u = _mm256_set_m128i(load128(s1), load128(s0));
  const __m256i a = _mm256_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));  // [u0, u0, u1, u1]
  const __m256i b = _mm256_shuffle_epi32(u, _MM_SHUFFLE(2, 2, 2, 2));  // u2
  const __m256i low6 = _mm256_and_si256(a, _mm256_set1_epi32(0x3f3f3f3f));
  const __m256i top2 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a, 6), _mm256_set1_epi32(0x03030303)), 4);
  const __m256i nib =
      _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)), _mm256_set1_epi32(0x0f0f0f0f));
  return _mm256_blend_epi32(low6, _mm256_or_si256(nib, top2), 0xAA);  // odd words: nibble | top bits
}
// One row's: the low lane.
inline __m128i k4_scales(const uint8_t* s12) { return _mm256_castsi256_si128(k4_scales_two(s12, s12)); }

// Shuffle masks that broadcast i16 word j of each 128-bit lane to all of it
// (constants: built per call they cost more than the block's arithmetic).
alignas(32) const int8_t kWordBcast[8][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
    {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5},
    {6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9},
    {10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
     10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
     12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13},
    {14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
     14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15}};
inline __m256i word_bcast(int j) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(kWordBcast[j])); }

template <int M, bool Five>
void dot_k45(const uint8_t* w, const Rows<M>& a, int k, float* out) {
  const int bb = Five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  // One accumulator a row: the scaled block sums, less (in lanes 0-3) the
  // mins against the activations' sums of 32 (a second one a row spills).
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 256; ++b, w += bb) {
    prefetch_ahead(a.ahead, w, bb);
    const __m128i scm = k4_scales(w + 4);
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
    const __m128i mn16 = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(scm, scm));
    // d and dmin at once.
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(rd32(w))));
    const uint8_t* qs = Five ? w + 48 : w + 16;
    const __m256i qh = Five ? load(w + 16) : _mm256_setzero_si256();
    __m256i sumi[M];
    for (int r = 0; r < M; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load(qs + 32 * j);
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (Five) {  // bit 2j of qh into bit 4 of the low values, bit 2j+1 of the high ones
        const int s0 = 2 * j, s1 = 2 * j + 1;
        const __m256i h0 = s0 <= 4 ? _mm256_slli_epi16(qh, 4 - s0) : _mm256_srli_epi16(qh, s0 - 4);
        const __m256i h1 = s1 <= 4 ? _mm256_slli_epi16(qh, 4 - s1) : _mm256_srli_epi16(qh, s1 - 4);
        lo = _mm256_or_si256(lo, _mm256_and_si256(h0, bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(h1, bit4));
      }
      const __m256i sl = _mm256_shuffle_epi8(sc16, word_bcast(2 * j));
      const __m256i sh = _mm256_shuffle_epi8(sc16, word_bcast(2 * j + 1));
      for (int r = 0; r < M; ++r) {
        const int8_t* ar = a.q[r] + 256 * b + 64 * j;
        const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(ar)), sl);
        const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(ar + 32)), sh);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
      }
    }
    for (int r = 0; r < M; ++r) {
      const __m128 dda = _mm_mul_ps(dd, _mm_set1_ps(a.d[r][8 * b]));  // [d da, dmin da]
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_broadcastss_ps(dda), acc[r]);
      // The mins against the 32-sums of the activations.
      const __m128i s16 =
          a.s32[r] ? load128(a.s32[r] + 8 * b) : _mm_hadd_epi16(load128(a.s[r] + 16 * b), load128(a.s[r] + 16 * b + 8));
      const __m256 mins = _mm256_zextps128_ps256(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, s16)));
      acc[r] = _mm256_fnmadd_ps(mins, _mm256_broadcastss_ps(_mm_shuffle_ps(dda, dda, 0x55)), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(acc[r]);
}

// One activation row against two weight rows (decode): the two rows'
// independent chains interleave, the activation loads are shared, and both
// rows' scales are unpacked in one pass (a lane each): the block's fixed
// work is a large part of a one-row dot product.
template <bool Five>
void dot_k45_two(const uint8_t* w0, const uint8_t* w1, const Rows<1>& a, int k, float* out) {
  const int bb = Five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 accm = _mm256_setzero_ps();  // lane r: row r's mins
  for (int b = 0; b < k / 256; ++b) {
    const uint8_t* wb0 = w0 + static_cast<size_t>(b) * bb;
    const uint8_t* wb1 = w1 + static_cast<size_t>(b) * bb;
    prefetch_ahead(a.ahead, wb0, bb);
    prefetch_ahead(a.ahead, wb1, bb);
    const __m256i scm = k4_scales_two(wb0 + 4, wb1 + 4);
    const __m256i sc = _mm256_unpacklo_epi8(scm, _mm256_setzero_si256());  // lane r: row r's 8 scales (i16)
    const __m256i mn = _mm256_unpackhi_epi8(scm, _mm256_setzero_si256());  // and mins
    __m256i sc16[2] = {_mm256_permute2x128_si256(sc, sc, 0x00), _mm256_permute2x128_si256(sc, sc, 0x11)};
    // [d0, dmin0, d1, dmin1]
    const __m128 dd = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(static_cast<int>(rd32(wb0))),
                                                      _mm_cvtsi32_si128(static_cast<int>(rd32(wb1)))));
    __m256i sumi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 4; ++j) {
      const int8_t* ar = a.q[0] + 256 * b + 64 * j;
      const __m256i alo = load(ar), ahi = load(ar + 32);
      for (int r = 0; r < 2; ++r) {
        const uint8_t* wb = r ? wb1 : wb0;
        const __m256i q = load((Five ? wb + 48 : wb + 16) + 32 * j);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (Five) {
          const __m256i qh = load(wb + 16);
          const int s0 = 2 * j, s1 = 2 * j + 1;
          const __m256i h0 = s0 <= 4 ? _mm256_slli_epi16(qh, 4 - s0) : _mm256_srli_epi16(qh, s0 - 4);
          const __m256i h1 = s1 <= 4 ? _mm256_slli_epi16(qh, 4 - s1) : _mm256_srli_epi16(qh, s1 - 4);
          lo = _mm256_or_si256(lo, _mm256_and_si256(h0, bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(h1, bit4));
        }
        const __m256i pl =
            _mm256_madd_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_shuffle_epi8(sc16[r], word_bcast(2 * j)));
        const __m256i ph =
            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, ahi), _mm256_shuffle_epi8(sc16[r], word_bcast(2 * j + 1)));
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
      }
    }
    const __m128 dda = _mm_mul_ps(dd, _mm_set1_ps(a.d[0][8 * b]));  // [d0 da, dmin0 da, d1 da, dmin1 da]
    const __m128i s16 =
        a.s32[0] ? load128(a.s32[0] + 8 * b) : _mm_hadd_epi16(load128(a.s[0] + 16 * b), load128(a.s[0] + 16 * b + 8));
    acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[0]), _mm256_broadcastss_ps(dda), acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[1]), _mm256_broadcastss_ps(_mm_movehl_ps(dda, dda)), acc[1]);
    // The mins against the 32-sums of the activations, both rows at once.
    const __m256 dmin =
        _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dda), _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
    accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn, _mm256_broadcastsi128_si256(s16))), dmin, accm);
  }
  for (int r = 0; r < 2; ++r) {
    __m128 m = r ? _mm256_extractf128_ps(accm, 1) : _mm256_castps256_ps128(accm);
    __m128 t = _mm_add_ps(m, _mm_movehl_ps(m, m));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    out[r] = hsum(acc[r]) - _mm_cvtss_f32(t);
  }
}

// --- Q6_K --------------------------------------------------------------------
template <int M>
void dot_q6_k(const uint8_t* w, const Rows<M>& a, int k, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 256; ++b, w += 210) {
    prefetch_ahead(a.ahead, w, 210);
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = f16(w + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(load128(sc));
    __m256i sumi[M];
    for (int r = 0; r < M; ++r)  // the offset 32: -32 sum_g sc_g s_g
      sumi[r] = _mm256_mullo_epi32(_mm256_madd_epi16(sc16, load(a.s[r] + 16 * b)), _mm256_set1_epi32(-32));
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load(ql + 64 * h), l1 = load(ql + 64 * h + 32), hb = load(qh + 32 * h);
      const __m256i q[4] = {_mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2)),
                            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2))};
      for (int s = 0; s < 4; ++s) {
        // Elements 128h + 32s .. +31: scale groups g and g+1 in the two lanes.
        const int g = 8 * h + 2 * s;
        const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        for (int r = 0; r < M; ++r) {
          const __m256i p = _mm256_maddubs_epi16(q[s], load(a.q[r] + 256 * b + 128 * h + 32 * s));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, scv));
        }
      }
    }
    for (int r = 0; r < M; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * a.d[r][8 * b]), acc[r]);
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(acc[r]);
}

// --- IQ4_XS --------------------------------------------------------------------
template <int M>
void dot_iq4_xs(const uint8_t* w, const Rows<M>& a, int k, float* out) {
  const __m256i table = _mm256_broadcastsi128_si256(load128(kIq4nlValues));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 256; ++b, w += 136) {
    prefetch_ahead(a.ahead, w, 136);
    const float d = f16(w);
    const int sh = w[2] | (w[3] << 8);
    const uint8_t* sl = w + 4;
    const uint8_t* qs = w + 8;
    __m256i sumi[M];
    for (int r = 0; r < M; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
      // Sub-blocks j and j+1: bytes 16j .. 16j+31; lane 0 holds j's, lane 1 j+1's.
      const __m256i q = load(qs + 16 * j);
      const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, m4));
      const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
      const int l0 = (((sl[j / 2]) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
      const int l1 = (((sl[j / 2] >> 4) & 0xF) | (((sh >> (2 * j + 2)) & 3) << 4)) - 32;
      const __m256i scv =
          _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(l1)), _mm_set1_epi16(static_cast<int16_t>(l0)));
      for (int r = 0; r < M; ++r) {
        const int8_t* ar = a.q[r] + 256 * b + 32 * j;
        // lo: elements 0..15 of each sub-block; hi: 16..31.
        const __m256i alo = _mm256_set_m128i(load128(ar + 32), load128(ar));
        const __m256i ahi = _mm256_set_m128i(load128(ar + 48), load128(ar + 16));
        // (Each maddubs sum reaches 2 * 127 * 127: two would overflow i16.)
        const __m256i pl = _mm256_madd_epi16(dot_ss(lo, alo), scv), ph = _mm256_madd_epi16(dot_ss(hi, ahi), scv);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
      }
    }
    for (int r = 0; r < M; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * a.d[r][8 * b]), acc[r]);
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(acc[r]);
}

// --- the panel kernels ---------------------------------------------------------
template <int T, int M>
void dot_rows(const uint8_t* w, const void* const* a, int k, float* out, const int16_t* const* s32, const Ahead* ah) {
  const Rows<M> rows(a, k, s32, ah);
  if constexpr (T == EP_MOE_DTYPE_Q8_0) dot_q8_0<M>(w, rows, k, out);
  else if constexpr (T == EP_MOE_DTYPE_Q4_0) dot_q4_0<M>(w, rows, k, out);
  else if constexpr (T == EP_MOE_DTYPE_MXFP4) dot_mxfp4<M>(w, rows, k, out);
  else if constexpr (T == EP_MOE_DTYPE_Q4_K) dot_k45<M, false>(w, rows, k, out);
  else if constexpr (T == EP_MOE_DTYPE_Q5_K) dot_k45<M, true>(w, rows, k, out);
  else if constexpr (T == EP_MOE_DTYPE_Q6_K) dot_q6_k<M>(w, rows, k, out);
  else dot_iq4_xs<M>(w, rows, k, out);
}

// dot_rows<T, 1 .. kTile>, by row count - 1.
using DotRowsFn = void (*)(const uint8_t*, const void* const*, int, float*, const int16_t* const*, const Ahead*);
template <int T, int... I>
constexpr std::array<DotRowsFn, sizeof...(I)> dot_table(std::integer_sequence<int, I...>) {
  return {dot_rows<T, I + 1>...};
}
template <int T>
constexpr std::array<DotRowsFn, kTile> kDots = dot_table<T>(std::make_integer_sequence<int, kTile>{});

template <int T>
void qgemm(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc, const void* next) {
  const size_t rb = quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k);
  float out[kTile];
  // The K formats' mins take each row's sums of 32, made once per call.
  constexpr bool kMins = T == EP_MOE_DTYPE_Q4_K || T == EP_MOE_DTYPE_Q5_K;
  constexpr int kMaxK = 8192, kMaxRows = 64;  // 32 KiB of stack; beyond, the kernel sums itself
  alignas(32) int16_t s32buf[kMins ? kMaxRows : 1][kMins ? kMaxK / 32 : 1];
  const int16_t* s32[kMaxRows + kTile] = {};
  const int16_t* const* s32p = m <= kMaxRows ? s32 : nullptr;
  if (kMins && k <= kMaxK && m <= kMaxRows)
    for (int i = 0; i < m; ++i) {
      sums32(a[i], k, s32buf[i]);
      s32[i] = s32buf[i];
    }
  // Each weight row once, every activation row against it while it is in
  // L1. Calls of up to kTile rows (decode) stream the panel: the kernels
  // prefetch ahead in it, and on into `next`.
  const uint8_t* p0 = static_cast<const uint8_t*>(panel);
  const size_t panel_bytes = static_cast<size_t>(nr) * rb;
  const Ahead ahead{p0 + panel_bytes, static_cast<const uint8_t*>(next), panel_bytes};
  constexpr bool kTwo = T == EP_MOE_DTYPE_Q4_K || T == EP_MOE_DTYPE_Q5_K;
  // The Q4_K/Q5_K kernels of two rows and more are bound by their
  // arithmetic, which the prefetches then slow down; the others' gain up to
  // a tile.
  const Ahead* ah = m <= (kTwo ? 1 : kTile) ? &ahead : nullptr;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* w = p0 + static_cast<size_t>(j) * rb;
    if (kTwo && m == 1 && j + 1 < nr) {  // decode: two weight rows at a time
      const Rows<1> rows(a, k, s32p, ah);
      float o2[2];
      dot_k45_two<T == EP_MOE_DTYPE_Q5_K>(w, w + rb, rows, k, o2);
      c[j] = o2[0];
      c[j + 1] = o2[1];
      ++j;
      continue;
    }
    for (int i0 = 0; i0 < m; i0 += kTile) {
      const int mm = m - i0 < kTile ? m - i0 : kTile;
      kDots<T>[mm - 1](w, a + i0, k, out, s32p ? s32p + i0 : nullptr, ah);
      for (int i = 0; i < mm; ++i) c[(i0 + i) * ldc + j] = out[i];
    }
  }
}

}  // namespace

void qkernels_avx2(QGemmFn* out) {
  out[quant_index(EP_MOE_DTYPE_Q8_0)] = qgemm<EP_MOE_DTYPE_Q8_0>;
  out[quant_index(EP_MOE_DTYPE_Q4_0)] = qgemm<EP_MOE_DTYPE_Q4_0>;
  out[quant_index(EP_MOE_DTYPE_Q4_K)] = qgemm<EP_MOE_DTYPE_Q4_K>;
  out[quant_index(EP_MOE_DTYPE_Q5_K)] = qgemm<EP_MOE_DTYPE_Q5_K>;
  out[quant_index(EP_MOE_DTYPE_Q6_K)] = qgemm<EP_MOE_DTYPE_Q6_K>;
  out[quant_index(EP_MOE_DTYPE_IQ4_XS)] = qgemm<EP_MOE_DTYPE_IQ4_XS>;
  out[quant_index(EP_MOE_DTYPE_MXFP4)] = qgemm<EP_MOE_DTYPE_MXFP4>;
}

// The scalar quantizer's bytes: the same f32 multiply by 127 / amax and the
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

}  // namespace cpu
}  // namespace ep_moe

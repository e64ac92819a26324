// AVX2 widening of block-format panels to f32 (Kernels::qdequant; built with
// -mavx2 -mfma -mf16c -ffp-contract=off, called only when the CPU has them).
//
// A prefill reuses each weight many times: past a few rows per expert the
// f32 tiles over a widened panel beat the integer block kernels, whose
// per-block scaling costs a conversion and an FMA per row (Q8_0: 8 vector
// operations per 32 products against the tiles' ~5). A panel of nr rows is
// decoded 8 rows at a time, one block of each, into floats (row order, in
// L1) and transposed 8 x 8 into the f32 panel layout (pack.hpp: element
// (kk, j) at kk * nr + j). The values are common/quant.cpp's dequant_block
// bit for bit: the same products in the same order, never fused (hence
// -ffp-contract=off).
#include <immintrin.h>

#include <cstring>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 8 int8 values (the low 8 bytes of q) as floats.
inline __m256 cvt8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

// y[0 .. 16) = s * (16 int8 of q).
inline void put16(__m128i q, __m256 s, float* y) {
  _mm256_storeu_ps(y, _mm256_mul_ps(s, cvt8(q)));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(s, cvt8(_mm_srli_si128(q, 8))));
}
// y[0 .. 32) = s * (32 int8 of q).
inline void put32(__m256i q, __m256 s, float* y) {
  put16(_mm256_castsi256_si128(q), s, y);
  put16(_mm256_extracti128_si256(q, 1), s, y + 16);
}

// 16 bytes of nibbles: the low nibbles (elements 0..15) and the high ones (16..31).
inline __m128i lo_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(0x0F)); }
inline __m128i hi_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)); }

void decode_q8_0(const uint8_t* b, float* y) { put32(load256(b + 2), _mm256_set1_ps(f16(b)), y); }

void decode_q4_0(const uint8_t* b, float* y) {
  const __m128i q = load128(b + 2), eight = _mm_set1_epi8(8);
  const __m256 d = _mm256_set1_ps(f16(b));
  put16(_mm_sub_epi8(lo_nibbles(q), eight), d, y);
  put16(_mm_sub_epi8(hi_nibbles(q), eight), d, y + 16);
}

void decode_mxfp4(const uint8_t* b, float* y) {
  const __m128i table = load128(kMxfp4Values), q = load128(b + 1);
  const __m256 d = _mm256_set1_ps(e8m0_half(b[0]));
  put16(_mm_shuffle_epi8(table, lo_nibbles(q)), d, y);
  put16(_mm_shuffle_epi8(table, hi_nibbles(q)), d, y + 16);
}

void decode_iq4_xs(const uint8_t* b, float* y) {
  const __m128i table = load128(kIq4nlValues);
  const float d = f16(b);
  const int sh = b[2] | (b[3] << 8);
  for (int j = 0; j < 8; ++j) {
    const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
    const __m256 dl = _mm256_set1_ps(d * static_cast<float>(ls - 32));
    const __m128i q = load128(b + 8 + 16 * j);
    put16(_mm_shuffle_epi8(table, lo_nibbles(q)), dl, y + 32 * j);
    put16(_mm_shuffle_epi8(table, hi_nibbles(q)), dl, y + 32 * j + 16);
  }
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min (common/quant.cpp's scale_min_k4).
inline void scale_min(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// y[0 .. 32) = dj * v - mj for the 32 unsigned values v (bytes of q).
inline void put32_k(__m256i q, float dj, float mj, float* y) {
  const __m256 d = _mm256_set1_ps(dj), m = _mm256_set1_ps(mj);
  const __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i part = i % 2 ? _mm_srli_si128(h[i / 2], 8) : h[i / 2];
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
    _mm256_storeu_ps(y + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d, v), m));
  }
}

template <bool Five>
void decode_k45(const uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = Five ? b + 48 : b + 16;
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i qh = Five ? load256(b + 16) : _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min(j, scales, &sc, &m);
    const __m256i q = load256(qs + 32 * (j / 2));
    __m256i v = j % 2 == 0 ? _mm256_and_si256(q, m4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (Five)  // bit j of each qh byte into bit 4
      v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
    put32_k(v, d * static_cast<float>(sc), dmin * static_cast<float>(m), y + 32 * j);
  }
}

void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    const __m256i hb = load256(qh + 32 * h);
    for (int s = 0; s < 4; ++s) {
      const __m256i l = load256(ql + 64 * h + 32 * (s % 2));
      const __m256i lo = s < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * s)), m3);
      const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off);
      const int e = 128 * h + 32 * s;
      float* ye = y + e;
      put16(_mm256_castsi256_si128(v), _mm256_set1_ps(d * static_cast<float>(sc[e / 16])), ye);
      put16(_mm256_extracti128_si256(v, 1), _mm256_set1_ps(d * static_cast<float>(sc[e / 16 + 1])), ye + 16);
    }
  }
}

using DecodeFn = void (*)(const uint8_t*, float*);

// 8 rows of 8 floats, transposed in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

template <int BE, DecodeFn Decode>
void qdequant(ep_moe_dtype_t t, const void* panel, int nr, int k, float* out) {
  const int bb = quant_block_bytes(t);
  const size_t rb = quant_row_bytes(t, k);
  const auto* p = static_cast<const uint8_t*>(panel);
  alignas(32) float rows[8][BE];
  for (int b = 0; b < k / BE; ++b)
    for (int j0 = 0; j0 < nr; j0 += 8) {
      for (int r = 0; r < 8; ++r) Decode(p + static_cast<size_t>(j0 + r) * rb + static_cast<size_t>(b) * bb, rows[r]);
      for (int kk = 0; kk < BE; kk += 8) {
        __m256 v[8];
        for (int r = 0; r < 8; ++r) v[r] = _mm256_load_ps(rows[r] + kk);
        transpose8(v);
        float* o = out + static_cast<size_t>(b * BE + kk) * static_cast<size_t>(nr) + j0;
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + static_cast<size_t>(c) * static_cast<size_t>(nr), v[c]);
      }
    }
}

template <ep_moe_dtype_t T, int BE, DecodeFn Decode>
void qdequant_fn(const void* panel, int nr, int k, float* out) {
  qdequant<BE, Decode>(T, panel, nr, k, out);
}

}  // namespace

void qdequant_avx2(QDequantFn* out) {
  out[quant_index(EP_MOE_DTYPE_Q8_0)] = qdequant_fn<EP_MOE_DTYPE_Q8_0, 32, decode_q8_0>;
  out[quant_index(EP_MOE_DTYPE_Q4_0)] = qdequant_fn<EP_MOE_DTYPE_Q4_0, 32, decode_q4_0>;
  out[quant_index(EP_MOE_DTYPE_MXFP4)] = qdequant_fn<EP_MOE_DTYPE_MXFP4, 32, decode_mxfp4>;
  out[quant_index(EP_MOE_DTYPE_Q4_K)] = qdequant_fn<EP_MOE_DTYPE_Q4_K, 256, decode_k45<false>>;
  out[quant_index(EP_MOE_DTYPE_Q5_K)] = qdequant_fn<EP_MOE_DTYPE_Q5_K, 256, decode_k45<true>>;
  out[quant_index(EP_MOE_DTYPE_Q6_K)] = qdequant_fn<EP_MOE_DTYPE_Q6_K, 256, decode_q6_k>;
  out[quant_index(EP_MOE_DTYPE_IQ4_XS)] = qdequant_fn<EP_MOE_DTYPE_IQ4_XS, 256, decode_iq4_xs>;
}

}  // namespace cpu
}  // namespace ep_moe

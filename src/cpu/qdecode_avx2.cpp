// Row decoders of the decoded formats with AVX2 (qdecoded.hpp's
// RowDecodeFn): the same bytes as the portable decoder (the traits'
// decode, expanded), checked against it by the unit tests. Bit-field
// formats (Q2_K, Q3_K, Q4_1, Q5_0, Q5_1, IQ4_NL) are shifts, masks and
// byte shuffles over 32 values at a time; the grid formats look up 4 grid
// entries (8 values each) and their sign masks per 32 values and apply the
// signs with byte arithmetic.
#include <immintrin.h>

#include <cstring>

#include "common/quant_grids.hpp"
#include "cpu/qdecoded.hpp"

namespace ep_moe {
namespace cpu {

namespace {

inline float f16at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void store32(void* p, __m256i v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }

// The same scale for the 2 groups of 16 of 32 values.
inline void fill_scales32(float s, float* sc) { sc[0] = sc[1] = s; }

// 2-bit fields of Q2_K and Q3_K: element 128 h + 32 s + i is bits 2 s of
// qs[32 h + i].
template <int S>
inline __m256i crumbs(__m256i x) {
  return _mm256_and_si256(_mm256_srli_epi16(x, 2 * S), _mm256_set1_epi8(3));
}

void dec_q2_k(const uint8_t* b, int k, int8_t* v, float* sc, float* mn) {
  for (int blk = 0; blk < k / 256; ++blk, b += 84, v += 256, sc += 16, mn += 16) {
    for (int h = 0; h < 2; ++h) {
      const __m256i x = load32(b + 16 + 32 * h);
      store32(v + 128 * h, crumbs<0>(x));
      store32(v + 128 * h + 32, crumbs<1>(x));
      store32(v + 128 * h + 64, crumbs<2>(x));
      store32(v + 128 * h + 96, crumbs<3>(x));
    }
    const __m256 d = _mm256_set1_ps(f16at(b + 80)), dmin = _mm256_set1_ps(-f16at(b + 82));
    for (int g = 0; g < 16; g += 8) {
      const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + g)));
      // d * (s & 15) and -(dmin * (s >> 4)): the products as GGUF computes them.
      _mm256_storeu_ps(sc + g, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(s, _mm256_set1_epi32(15)))));
      _mm256_storeu_ps(mn + g, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(s, 4))));
    }
  }
}

void dec_q3_k(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const __m256i four = _mm256_set1_epi8(4), zero = _mm256_setzero_si256();
  for (int blk = 0; blk < k / 256; ++blk, b += 110, v += 256, sc += 16) {
    const __m256i hm = load32(b);
    for (int h = 0; h < 2; ++h) {
      const __m256i x = load32(b + 32 + 32 * h);
      const __m256i q[4] = {crumbs<0>(x), crumbs<1>(x), crumbs<2>(x), crumbs<3>(x)};
      for (int s = 0; s < 4; ++s) {
        // Less 4 where bit j = 4 h + s of hmask is clear.
        const __m256i bit = _mm256_and_si256(hm, _mm256_set1_epi8(static_cast<char>(1 << (4 * h + s))));
        store32(v + 128 * h + 32 * s, _mm256_sub_epi8(q[s], _mm256_and_si256(_mm256_cmpeq_epi8(bit, zero), four)));
      }
    }
    const uint8_t* s = b + 96;
    const float d = f16at(b + 108);
    for (int j = 0; j < 16; ++j) {
      const int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
      const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      sc[j] = d * static_cast<float>((low | (high << 4)) - 32);
    }
  }
}

// 32 values of a 32-element block: the low nibbles of qs[0 .. 16), then the
// high ones.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
}
// 16 where bit i of qh is set, for the 32 values.
inline __m256i fifth_bits(uint32_t qh) {
  const __m256i rep = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(16));
}

template <int Kind>  // 0 Q4_1, 1 Q5_0, 2 Q5_1, 3 IQ4_NL
void dec_32(const uint8_t* b, int k, int8_t* v, float* sc, float* mn) {
  constexpr int bytes = Kind == 0 ? 20 : Kind == 1 ? 22 : Kind == 2 ? 24 : 18;
  constexpr int qs = Kind == 0 ? 4 : Kind == 1 ? 6 : Kind == 2 ? 8 : 2;
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
  for (int blk = 0; blk < k / 32; ++blk, b += bytes, v += 32, sc += 2, mn += 2) {
    __m256i x = nibbles32(b + qs);
    if (Kind == 1 || Kind == 2) x = _mm256_or_si256(x, fifth_bits(rd32(b + (Kind == 1 ? 2 : 4))));
    if (Kind == 1) x = _mm256_sub_epi8(x, _mm256_set1_epi8(16));
    if (Kind == 3) x = _mm256_shuffle_epi8(_mm256_set_m128i(table, table), x);
    store32(v, x);
    fill_scales32(f16at(b), sc);
    if (Kind == 0 || Kind == 2) mn[0] = mn[1] = f16at(b + 2);
  }
}

// 32 values from 4 grid entries (8 values each, bytes of a u64) with sign
// masks (0xff for each negative value).
inline __m256i signed_grid(uint64_t g0, uint64_t g1, uint64_t g2, uint64_t g3, uint64_t m0, uint64_t m1, uint64_t m2,
                           uint64_t m3) {
  const __m256i g = _mm256_setr_epi64x(static_cast<long long>(g0), static_cast<long long>(g1),
                                       static_cast<long long>(g2), static_cast<long long>(g3));
  const __m256i m = _mm256_setr_epi64x(static_cast<long long>(m0), static_cast<long long>(m1),
                                       static_cast<long long>(m2), static_cast<long long>(m3));
  return _mm256_sub_epi8(_mm256_xor_si256(g, m), m);
}

void dec_iq2_xxs(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  for (int blk = 0; blk < k / 256; ++blk, b += 66, v += 256, sc += 16) {
    const float d = f16at(b);
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t a0 = rd32(b + 2 + 8 * ib), a1 = rd32(b + 6 + 8 * ib);
      store32(v + 32 * ib, signed_grid(G.iq2xxs[a0 & 0xFF], G.iq2xxs[(a0 >> 8) & 0xFF], G.iq2xxs[(a0 >> 16) & 0xFF],
                                       G.iq2xxs[a0 >> 24], G.sign_mask[a1 & 127], G.sign_mask[(a1 >> 7) & 127],
                                       G.sign_mask[(a1 >> 14) & 127], G.sign_mask[(a1 >> 21) & 127]));
      fill_scales32(d * (0.5f + static_cast<float>(a1 >> 28)) * 0.25f, sc + 2 * ib);
    }
  }
}

// IQ2_XS and IQ2_S: scales of 4 bits per 16 values at `ls`.
inline void iq2_scales16(float d, const uint8_t* ls, float* sc) {
  for (int j = 0; j < 16; ++j) sc[j] = d * (0.5f + static_cast<float>((ls[j / 2] >> (4 * (j % 2))) & 0xF)) * 0.25f;
}

void dec_iq2_xs(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  for (int blk = 0; blk < k / 256; ++blk, b += 74, v += 256, sc += 16) {
    for (int l = 0; l < 32; l += 4) {
      const uint16_t q0 = rd16(b + 2 + 2 * l), q1 = rd16(b + 4 + 2 * l), q2 = rd16(b + 6 + 2 * l),
                     q3 = rd16(b + 8 + 2 * l);
      store32(v + 8 * l,
              signed_grid(G.iq2xs[q0 & 511], G.iq2xs[q1 & 511], G.iq2xs[q2 & 511], G.iq2xs[q3 & 511],
                          G.sign_mask[q0 >> 9], G.sign_mask[q1 >> 9], G.sign_mask[q2 >> 9], G.sign_mask[q3 >> 9]));
    }
    iq2_scales16(f16at(b), b + 66, sc);
  }
}

void dec_iq2_s(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  for (int blk = 0; blk < k / 256; ++blk, b += 82, v += 256, sc += 16) {
    const uint8_t* qs = b + 2;
    const uint8_t* signs = b + 34;
    const uint8_t* qh = b + 66;
    for (int l = 0; l < 32; l += 4) {
      const int h = qh[l / 4];
      store32(v + 8 * l, signed_grid(G.iq2s[qs[l] | ((h & 3) << 8)], G.iq2s[qs[l + 1] | ((h >> 2 & 3) << 8)],
                                     G.iq2s[qs[l + 2] | ((h >> 4 & 3) << 8)], G.iq2s[qs[l + 3] | ((h >> 6) << 8)],
                                     G.bit_mask[signs[l]], G.bit_mask[signs[l + 1]], G.bit_mask[signs[l + 2]],
                                     G.bit_mask[signs[l + 3]]));
    }
    iq2_scales16(f16at(b), b + 74, sc);
  }
}

inline uint64_t pair(uint32_t lo, uint32_t hi) { return lo | static_cast<uint64_t>(hi) << 32; }

void dec_iq3_xxs(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  for (int blk = 0; blk < k / 256; ++blk, b += 98, v += 256, sc += 16) {
    const float d = f16at(b);
    const uint8_t* qs = b + 2;
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t aux = rd32(b + 66 + 4 * ib);
      const uint8_t* q = qs + 8 * ib;
      store32(v + 32 * ib, signed_grid(pair(G.iq3xxs[q[0]], G.iq3xxs[q[1]]), pair(G.iq3xxs[q[2]], G.iq3xxs[q[3]]),
                                       pair(G.iq3xxs[q[4]], G.iq3xxs[q[5]]), pair(G.iq3xxs[q[6]], G.iq3xxs[q[7]]),
                                       G.sign_mask[aux & 127], G.sign_mask[(aux >> 7) & 127],
                                       G.sign_mask[(aux >> 14) & 127], G.sign_mask[(aux >> 21) & 127]));
      fill_scales32(d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f, sc + 2 * ib);
    }
  }
}

void dec_iq3_s(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  for (int blk = 0; blk < k / 256; ++blk, b += 110, v += 256, sc += 16) {
    const float d = f16at(b);
    const uint8_t* qs = b + 2;
    const uint8_t* qh = b + 66;
    const uint8_t* signs = b + 74;
    for (int ib = 0; ib < 8; ++ib) {
      const int h = qh[ib];
      const uint8_t* q = qs + 8 * ib;
      const auto e = [&](int i) { return G.iq3s[q[i] | ((h >> i & 1) << 8)]; };
      const uint8_t* s = signs + 4 * ib;
      store32(v + 32 * ib, signed_grid(pair(e(0), e(1)), pair(e(2), e(3)), pair(e(4), e(5)), pair(e(6), e(7)),
                                       G.bit_mask[s[0]], G.bit_mask[s[1]], G.bit_mask[s[2]], G.bit_mask[s[3]]));
      fill_scales32(d * static_cast<float>(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF)), sc + 2 * ib);
    }
  }
}

// 32 ternary values as 8 g + delta, from 4 grid entries (bytes -1, 0, 1)
// and the deltas (+1 or -1 in each byte of d0 .. d3).
inline __m256i ternary(uint64_t g0, uint64_t g1, uint64_t g2, uint64_t g3, __m256i delta) {
  const __m256i g = _mm256_setr_epi64x(static_cast<long long>(g0), static_cast<long long>(g1),
                                       static_cast<long long>(g2), static_cast<long long>(g3));
  // 8 g: a shift of the 16-bit lanes and a mask per byte.
  const __m256i g8 = _mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8(static_cast<char>(0xF8)));
  return _mm256_add_epi8(g8, delta);
}

void dec_iq1_s(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  for (int blk = 0; blk < k / 256; ++blk, b += 50, v += 256, sc += 16) {
    const float d = f16at(b);
    const uint8_t* qs = b + 2;
    for (int ib = 0; ib < 8; ++ib) {
      const uint16_t h = rd16(b + 34 + 2 * ib);
      const uint8_t* q = qs + 4 * ib;
      const __m256i delta = _mm256_set1_epi8(h & 0x8000 ? -1 : 1);
      store32(v + 32 * ib, ternary(G.iq1s[q[0] | ((h & 7) << 8)], G.iq1s[q[1] | ((h >> 3 & 7) << 8)],
                                   G.iq1s[q[2] | ((h >> 6 & 7) << 8)], G.iq1s[q[3] | ((h >> 9 & 7) << 8)], delta));
      fill_scales32(d * static_cast<float>(2 * ((h >> 12) & 7) + 1) * 0.125f, sc + 2 * ib);
    }
  }
}

void dec_iq1_m(const uint8_t* b, int k, int8_t* v, float* sc, float* /*mn*/) {
  const auto& G = grids::expanded();
  const auto dl = [](int h) { return static_cast<long long>(h & 8 ? 0xFFFFFFFFFFFFFFFFull : 0x0101010101010101ull); };
  for (int blk = 0; blk < k / 256; ++blk, b += 56, v += 256, sc += 16) {
    const uint8_t* qs = b;
    const uint8_t* qh = b + 32;
    uint16_t w[4];
    std::memcpy(w, b + 48, 8);
    const auto bits =
        static_cast<uint16_t>((w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00) | (w[3] & 0xF000));
    const float d = _cvtsh_ss(bits);
    for (int ib = 0; ib < 8; ++ib) {
      const int h0 = qh[2 * ib], h1 = qh[2 * ib + 1];
      const uint8_t* q = qs + 4 * ib;
      const __m256i delta = _mm256_setr_epi64x(dl(h0), dl(h0 >> 4), dl(h1), dl(h1 >> 4));
      store32(v + 32 * ib, ternary(G.iq1s[q[0] | ((h0 & 7) << 8)], G.iq1s[q[1] | ((h0 >> 4 & 7) << 8)],
                                   G.iq1s[q[2] | ((h1 & 7) << 8)], G.iq1s[q[3] | ((h1 >> 4 & 7) << 8)], delta));
    }
    for (int j = 0; j < 16; ++j) sc[j] = d * static_cast<float>(2 * ((w[j / 4] >> (3 * (j % 4))) & 7) + 1) * 0.125f;
  }
}

}  // namespace

RowDecodeFn row_decoder_avx2(ep_moe_dtype_t t) {
  switch (t) {
    case EP_MOE_DTYPE_Q2_K: return dec_q2_k;
    case EP_MOE_DTYPE_Q3_K: return dec_q3_k;
    case EP_MOE_DTYPE_Q4_1: return dec_32<0>;
    case EP_MOE_DTYPE_Q5_0: return dec_32<1>;
    case EP_MOE_DTYPE_Q5_1: return dec_32<2>;
    case EP_MOE_DTYPE_IQ4_NL: return dec_32<3>;
    case EP_MOE_DTYPE_IQ2_XXS: return dec_iq2_xxs;
    case EP_MOE_DTYPE_IQ2_XS: return dec_iq2_xs;
    case EP_MOE_DTYPE_IQ2_S: return dec_iq2_s;
    case EP_MOE_DTYPE_IQ3_XXS: return dec_iq3_xxs;
    case EP_MOE_DTYPE_IQ3_S: return dec_iq3_s;
    case EP_MOE_DTYPE_IQ1_S: return dec_iq1_s;
    case EP_MOE_DTYPE_IQ1_M: return dec_iq1_m;
    default: return nullptr;
  }
}

}  // namespace cpu
}  // namespace ep_moe

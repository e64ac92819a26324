// The decoded formats' row dot with AVX512_VNNI (qdecoded.hpp): per 64
// elements vpdpbusd of v + 128 (as u8) with the int8 activations, less
// vpdpbusd of 128 with them (exact in int32), giving 16 lanes of 4
// elements, converted and scaled by the lanes' sc d_a in f32.
// GCC 12 warns falsely inside its own AVX-512 intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "cpu/qdecoded.hpp"

namespace ep_moe {
namespace cpu {

namespace {

inline float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  __m128 s = _mm512_castps512_ps128(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct RowDotAvx512Vnni {
  static RowDecodeFn decoder(ep_moe_dtype_t t) { return row_decoder_avx2(t); }
  static float dot(const DecodedRow& w, const void* arow, int k, bool has_min) {
    const int8_t* q = act_q(arow);
    const float* d = act_d(arow, k);
    const int8_t* v = w.v;
    const float* scx = w.scx;
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    // d_a of each lane: elements 32 h .. 32 h + 31 are lanes 8 h .. 8 h + 7.
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int b = 0;
    const auto step = [&](int at, __m512& acc) {
      const __m512i vv = _mm512_xor_si512(_mm512_loadu_si512(v + at), bias);
      const __m512i qq = _mm512_loadu_si512(q + at);
      const __m512i p = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), vv, qq),
                                         _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, qq));
      const __m512 da = _mm512_permutexvar_ps(
          half, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d + at / 32)))));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(_mm512_loadu_ps(scx + at / 4), da), acc);
    };
    for (; b + 128 <= k; b += 128) {
      step(b, acc0);
      step(b + 64, acc1);
    }
    for (; b + 64 <= k; b += 64) step(b, acc0);
    float acc = hsum(_mm512_add_ps(acc0, acc1));
    // A last 32 (k an odd multiple of 32: the 32-element formats).
    for (; b < k; b += 16) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += v[b + i] * q[b + i];
      acc += d[b / 32] * (scx[b / 4] * static_cast<float>(sum));
    }
    if (has_min) {
      const int16_t* s = act_s(arow, k);
      const float* mn = w.mn;
      const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
      __m512 m = _mm512_setzero_ps();
      int g = 0;
      for (; g + 16 <= k / 16; g += 16) {
        const __m512 sf =
            _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g))));
        const __m512 dd = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(d + g / 2)));
        m = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(mn + g), sf), dd, m);
      }
      acc += hsum(m);
      for (; g < k / 16; ++g) acc += d[g / 2] * (mn[g] * static_cast<float>(s[g]));
    }
    return acc;
  }
};

}  // namespace

void qdecoded_avx512vnni(QGemmFn* gemm) { set_decoded<RowDotAvx512Vnni>(gemm); }

}  // namespace cpu
}  // namespace ep_moe

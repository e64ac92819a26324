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

// 64 values' dot: 16 int32 lanes of 4 products each (lanes 4 j .. 4 j + 3
// group j of the 4), exact: vpdpbusd of v + 128 as u8, less 128 sum(q).
inline __m512i dot64(const int8_t* v, const int8_t* q) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i qq = _mm512_loadu_si512(q);
  return _mm512_sub_epi32(
      _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_loadu_si512(v), bias), qq),
      _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, qq));
}

struct RowDotAvx512Vnni {
  static RowDecodeFn decoder(ep_moe_dtype_t t) { return row_decoder_avx2(t); }
  static float dot(const DecodedRow& w, const void* arow, int k, bool has_min) {
    const int8_t* q = act_q(arow);
    const float* d = act_d(arow, k);
    const int16_t* s = act_s(arow, k);
    // Per 256 values (16 groups): the groups' sc d_a, then each 64 values'
    // lanes scaled by their four groups'.
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i four = _mm512_set1_epi32(4);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), m = _mm512_setzero_ps();
    int b = 0;
    for (; b + 256 <= k; b += 256) {
      const __m512 da = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(d + b / 32)));
      const __m512 ls = _mm512_mul_ps(_mm512_loadu_ps(w.sc + b / 16), da);
      __m512i idx = quad;
      for (int c = 0; c < 4; c += 2) {
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(w.v + b + 64 * c, q + b + 64 * c)),
                               _mm512_permutexvar_ps(idx, ls), acc0);
        idx = _mm512_add_epi32(idx, four);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(w.v + b + 64 * c + 64, q + b + 64 * c + 64)),
                               _mm512_permutexvar_ps(idx, ls), acc1);
        idx = _mm512_add_epi32(idx, four);
      }
      if (has_min) {
        const __m512 sf =
            _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b / 16))));
        m = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(w.mn + b / 16), sf), da, m);
      }
    }
    return hsum(_mm512_add_ps(_mm512_add_ps(acc0, acc1), m)) + decoded_tail(w, q, d, s, b / 16, k / 16, has_min);
  }
  // Four rows against one activation row: its loads and its 128 sum(q)
  // correction shared.
  static void dot4(const DecodedRow* w, const void* arow, int k, bool has_min, float* out) {
    const int8_t* q = act_q(arow);
    const float* d = act_d(arow, k);
    const int16_t* s = act_s(arow, k);
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i four = _mm512_set1_epi32(4);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int b = 0;
    for (; b + 256 <= k; b += 256) {
      const __m512 da = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(d + b / 32)));
      __m512 ls[4];
      for (int r = 0; r < 4; ++r) ls[r] = _mm512_mul_ps(_mm512_loadu_ps(w[r].sc + b / 16), da);
      __m512i idx = quad;
      for (int c = 0; c < 4; ++c, idx = _mm512_add_epi32(idx, four)) {
        const int at = b + 64 * c;
        const __m512i qq = _mm512_loadu_si512(q + at);
        const __m512i corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, qq);
        for (int r = 0; r < 4; ++r) {
          const __m512i vv = _mm512_xor_si512(_mm512_loadu_si512(w[r].v + at), bias);
          const __m512i p = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), vv, qq), corr);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, ls[r]), acc[r]);
        }
      }
      if (has_min) {
        const __m512 sd = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b / 16)))),
            da);
        for (int r = 0; r < 4; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r].mn + b / 16), sd, acc[r]);
      }
    }
    for (int r = 0; r < 4; ++r) out[r] = hsum(acc[r]) + decoded_tail(w[r], q, d, s, b / 16, k / 16, has_min);
  }
};

}  // namespace

void qdecoded_avx512vnni(QGemmFn* gemm) { set_decoded<RowDotAvx512Vnni>(gemm); }

}  // namespace cpu
}  // namespace ep_moe

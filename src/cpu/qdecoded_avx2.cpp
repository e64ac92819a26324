// The decoded formats' row dot with AVX2 (qdecoded.hpp): per 32 elements
// maddubs of |v| with the activations carrying v's signs (|v| <= 127, so
// no pair of products saturates), madd to 8 int32 lanes of 4 elements,
// converted and scaled by the lanes' sc d_a in f32.
#include <immintrin.h>

#include "cpu/qdecoded.hpp"

namespace ep_moe {
namespace cpu {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct RowDotAvx2 {
  static RowDecodeFn decoder(ep_moe_dtype_t t) { return row_decoder_avx2(t); }
  static float dot(const DecodedRow& w, const void* arow, int k, bool has_min) {
    const int8_t* q = act_q(arow);
    const float* d = act_d(arow, k);
    const int8_t* v = w.v;
    const float* scx = w.scx;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= k / 32; b += 2) {
      for (int u = 0; u < 2; ++u) {
        const __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * (b + u)));
        const __m256i qq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * (b + u)));
        const __m256i p =
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vv, vv), _mm256_sign_epi8(qq, vv)), ones);
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(scx + 8 * (b + u)), _mm256_broadcast_ss(d + b + u));
        if (u == 0) acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc0);
        else acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc1);
      }
    }
    for (; b < k / 32; ++b) {
      const __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * b));
      const __m256i qq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
      const __m256i p =
          _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vv, vv), _mm256_sign_epi8(qq, vv)), ones);
      const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(scx + 8 * b), _mm256_broadcast_ss(d + b));
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc0);
    }
    float acc = hsum(_mm256_add_ps(acc0, acc1));
    if (has_min) {
      // sum_g mn_g d_a(g) asum_g, 8 groups (128 elements) at a time.
      const int16_t* s = act_s(arow, k);
      const float* mn = w.mn;
      const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
      __m256 m = _mm256_setzero_ps();
      int g = 0;
      for (; g + 8 <= k / 16; g += 8) {
        const __m256 sf =
            _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g))));
        const __m256 dd = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d + g / 2)), dup);
        m = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(mn + g), sf), dd, m);
      }
      acc += hsum(m);
      for (; g < k / 16; ++g) acc += d[g / 2] * (mn[g] * static_cast<float>(s[g]));
    }
    return acc;
  }
};

}  // namespace

void qdecoded_avx2(QGemmFn* gemm) { set_decoded<RowDotAvx2>(gemm); }

}  // namespace cpu
}  // namespace ep_moe

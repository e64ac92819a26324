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

// 32 values' dot: 8 int32 lanes of 4 products each (lanes 0-3 the first
// 16 values, 4-7 the second).
inline __m256i dot32(const int8_t* v, const int8_t* q) {
  const __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  const __m256i qq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vv, vv), _mm256_sign_epi8(qq, vv)),
                           _mm256_set1_epi16(1));
}

struct RowDotAvx2 {
  static RowDecodeFn decoder(ep_moe_dtype_t t) { return row_decoder_avx2(t); }
  static float dot(const DecodedRow& w, const void* arow, int k, bool has_min) {
    const int8_t* q = act_q(arow);
    const float* d = act_d(arow, k);
    const int16_t* s = act_s(arow, k);
    // Per 128 values (8 groups): the groups' sc d_a, then each 32 values'
    // lanes scaled by their two groups'.
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), m = _mm256_setzero_ps();
    int b = 0;
    for (; b + 128 <= k; b += 128) {
      const __m256 da = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d + b / 32)), dup);
      const __m256 ls = _mm256_mul_ps(_mm256_loadu_ps(w.sc + b / 16), da);
      const __m256 l0 = _mm256_permutevar8x32_ps(ls, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
      const __m256 l1 = _mm256_permutevar8x32_ps(ls, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
      const __m256 l2 = _mm256_permutevar8x32_ps(ls, _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5));
      const __m256 l3 = _mm256_permutevar8x32_ps(ls, _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7));
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.v + b, q + b)), l0, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.v + b + 32, q + b + 32)), l1, acc1);
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.v + b + 64, q + b + 64)), l2, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(w.v + b + 96, q + b + 96)), l3, acc1);
      if (has_min) {
        // sum_g mn_g d_a(g) asum_g over the 8 groups.
        const __m256 sf =
            _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b / 16))));
        m = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(w.mn + b / 16), sf), da, m);
      }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), m)) + decoded_tail(w, q, d, s, b / 16, k / 16, has_min);
  }
  // maddubs carries each weight's sign into the activations, so four rows
  // share only the activation rows' loads, which stay in L1: four dots.
  static void dot4(const DecodedRow* w, const void* arow, int k, bool has_min, float* out) {
    for (int r = 0; r < 4; ++r) out[r] = dot(w[r], arow, k, has_min);
  }
};

}  // namespace

void qdecoded_avx2(QGemmFn* gemm) { set_decoded<RowDotAvx2>(gemm); }

}  // namespace cpu
}  // namespace ep_moe

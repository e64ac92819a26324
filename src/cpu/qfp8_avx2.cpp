// The FP8_E4M3 block kernel with AVX2 and F16C: qfp8_avx512.cpp's
// arithmetic on 8 lanes (each code widened to the f16 of its value / 256,
// then to f32, times the int8 activations and their scales; per 128
// elements the block's scale times 256). Four weight rows share each
// activation load.
#include <immintrin.h>

#include <cstring>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 codes as two vectors of 8 f32 (value / 256).
inline void widen16(const uint8_t* codes, __m256* lo, __m256* hi) {
  const __m256i w = _mm256_and_si256(
      _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), 7),
      _mm256_set1_epi16(static_cast<short>(0xBF80)));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
}

constexpr int kPrefetchBlocks = 12;  // 1.5 KiB ahead in each row

template <int R>
void rows_dot(const uint8_t* const* w, const void* arow, int k, float* out) {
  const auto* q = static_cast<const int8_t*>(arow);
  const float* d = act_d(arow, k);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < k / 128; ++b) {
    // Each row's stream prefetched kPrefetchBlocks ahead of its reads.
    if (b + kPrefetchBlocks < k / 128)
      for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(w[r] + 132 * (b + kPrefetchBlocks));
        _mm_prefetch(p, _MM_HINT_T0);
        _mm_prefetch(p + 64, _MM_HINT_T0);
        _mm_prefetch(p + 128, _MM_HINT_T0);
      }
    __m256 blk[R];
    for (int r = 0; r < R; ++r) blk[r] = _mm256_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      const int at = 128 * b + 16 * c;
      const __m256 da = _mm256_set1_ps(d[at / 32]);
      const __m256 a0 = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + at)))), da);
      const __m256 a1 = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + at + 8)))), da);
      for (int r = 0; r < R; ++r) {
        __m256 lo, hi;
        widen16(w[r] + 132 * b + 4 + 16 * c, &lo, &hi);
        blk[r] = _mm256_fmadd_ps(lo, a0, _mm256_fmadd_ps(hi, a1, blk[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      float s;
      std::memcpy(&s, w[r] + 132 * b, 4);
      acc[r] = _mm256_fmadd_ps(blk[r], _mm256_set1_ps(s * 256.0f), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

#include "cpu/qfp8_rows.inc"

}  // namespace

QGemmFn qfp8_avx2() { return qgemm_fp8; }

}  // namespace cpu
}  // namespace ep_moe

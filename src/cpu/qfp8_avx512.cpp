// The FP8_E4M3 block kernel with AVX-512 (kernels.hpp's QGemmFn, rows one
// after another): each E4M3 code widened in registers to the f16 of its
// value / 256 (sign-extend, shift left 7, clear bit 14: the code's
// exponent and mantissa land in f16's, subnormals included), to f32 by
// vcvtph2ps, and multiplied in f32 with the int8 activations (Q8_0-style
// rows) times their scales; per 128 elements the sum takes the block's
// scale times 256. Four weight rows share each activation load.
// GCC 12 warns falsely inside its own AVX-512 intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/kernels.hpp"

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

// 32 codes as two vectors of 16 f32 (value / 256).
inline void widen32(const uint8_t* codes, __m512* lo, __m512* hi) {
  const __m512i w = _mm512_and_si512(
      _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))), 7),
      _mm512_set1_epi16(static_cast<short>(0xBF80)));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
}

constexpr int kPrefetchBlocks = 12;  // 1.5 KiB ahead in each row

template <int R>
void rows_dot(const uint8_t* const* w, const void* arow, int k, float* out) {
  const auto* q = static_cast<const int8_t*>(arow);
  const float* d = act_d(arow, k);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < k / 128; ++b) {
    // Each row's stream prefetched kPrefetchBlocks ahead of its reads.
    if (b + kPrefetchBlocks < k / 128)
      for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(w[r] + 132 * (b + kPrefetchBlocks));
        _mm_prefetch(p, _MM_HINT_T0);
        _mm_prefetch(p + 64, _MM_HINT_T0);
        _mm_prefetch(p + 128, _MM_HINT_T0);
      }
    __m512 blk[R];
    for (int r = 0; r < R; ++r) blk[r] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const int at = 128 * b + 32 * c;
      const __m512 da = _mm512_set1_ps(d[at / 32]);
      const __m512 a0 = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + at)))), da);
      const __m512 a1 = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + at + 16)))), da);
      for (int r = 0; r < R; ++r) {
        __m512 lo, hi;
        widen32(w[r] + 132 * b + 4 + 32 * c, &lo, &hi);
        blk[r] = _mm512_fmadd_ps(lo, a0, _mm512_fmadd_ps(hi, a1, blk[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      float s;
      std::memcpy(&s, w[r] + 132 * b, 4);
      acc[r] = _mm512_fmadd_ps(blk[r], _mm512_set1_ps(s * 256.0f), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

#include "cpu/qfp8_rows.inc"

}  // namespace

QGemmFn qfp8_avx512() { return qgemm_fp8; }

}  // namespace cpu
}  // namespace ep_moe

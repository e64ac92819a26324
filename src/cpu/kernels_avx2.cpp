// AVX2 + FMA + F16C tiles (built with -mavx2 -mfma -mf16c; called only
// when the CPU has them).
#include <immintrin.h>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#define VEC __m256
#define LANES 8
#define NR 16
#define MR 6
static inline __m256 vzero() { return _mm256_setzero_ps(); }
static inline __m256 vset1(float v) { return _mm256_set1_ps(v); }
static inline __m256 vfmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __m256 vload_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 vload_even(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
static inline __m256 vload_odd(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                              _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
static inline __m256 vload_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

#include "cpu/kernels_x86.inc"

const Kernels& kernels_avx2() {
  static const Kernels k{Isa::Avx2, NR, MR, {gemm<0>, gemm<1>, gemm<2>}};
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

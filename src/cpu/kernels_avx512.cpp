// AVX-512 tiles (built with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c;
// called only when the CPU has them).
#include <immintrin.h>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#define VEC __m512
#define LANES 16
#define NR 32
#define MR 8
static inline __m512 vzero() { return _mm512_setzero_ps(); }
static inline __m512 vset1(float v) { return _mm512_set1_ps(v); }
static inline __m512 vfmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 vload_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 vload_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m512 vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#include "cpu/kernels_x86.inc"

const Kernels& kernels_avx512() {
  static const Kernels k{Isa::Avx512, NR, MR, {tile<0>, tile<1>, tile<2>}};
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

// AVX-512 tiles plus the bf16 pair-dot tile (built with -mavx512bf16; called
// only when the CPU has AVX512_BF16).
#include <immintrin.h>

#include <cstring>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#include "cpu/kernels_avx512.inc"

namespace {

// Panel rows k and k+1 (32 bf16 each) interleaved by 16-bit words: in every
// 128-bit lane L, `lo` holds the pairs of columns 8L..8L+3 and `hi` those of
// 8L+4..8L+7, as vdpbf16ps wants them (row k in the low half of each pair).
// The accumulators are therefore column-permuted; kOut0/kOut1 undo it.
alignas(64) const int32_t kOut0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) const int32_t kOut1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

template <int M>
void dot_tile_m(const uint16_t* const* a, int k, const void* panel, float* c) {
  __m512 lo_acc[M], hi_acc[M];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    lo_acc[i] = _mm512_setzero_ps();
    hi_acc[i] = _mm512_setzero_ps();
  }
  const uint16_t* w = static_cast<const uint16_t*>(panel);
  int kk = 0;
  for (; kk + 1 < k; kk += 2) {
    const __m512i r0 = _mm512_loadu_si512(w + static_cast<size_t>(kk) * NR);
    const __m512i r1 = _mm512_loadu_si512(w + static_cast<size_t>(kk + 1) * NR);
    const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(r0, r1));
    const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(r0, r1));
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      int32_t pair;
      std::memcpy(&pair, a[i] + kk, 4);
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      lo_acc[i] = _mm512_dpbf16_ps(lo_acc[i], av, lo);
      hi_acc[i] = _mm512_dpbf16_ps(hi_acc[i], av, hi);
    }
  }
  if (kk < k) {  // odd k: the last row paired with zeros (nothing read past the panel)
    const __m512i r0 = _mm512_loadu_si512(w + static_cast<size_t>(kk) * NR);
    const __m512i z = _mm512_setzero_si512();
    const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(r0, z));
    const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(r0, z));
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const int32_t pair = a[i][kk];
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      lo_acc[i] = _mm512_dpbf16_ps(lo_acc[i], av, lo);
      hi_acc[i] = _mm512_dpbf16_ps(hi_acc[i], av, hi);
    }
  }
  const __m512i p0 = _mm512_load_si512(kOut0), p1 = _mm512_load_si512(kOut1);
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(c + i * NR, _mm512_permutex2var_ps(lo_acc[i], p0, hi_acc[i]));
    _mm512_storeu_ps(c + i * NR + LANES, _mm512_permutex2var_ps(lo_acc[i], p1, hi_acc[i]));
  }
}

void dot_tile(int m, const uint16_t* const* a, int k, const void* panel, float* c) {
  switch (m) {
    case 1: dot_tile_m<1>(a, k, panel, c); break;
    case 2: dot_tile_m<2>(a, k, panel, c); break;
    case 3: dot_tile_m<3>(a, k, panel, c); break;
    case 4: dot_tile_m<4>(a, k, panel, c); break;
    case 5: dot_tile_m<5>(a, k, panel, c); break;
    case 6: dot_tile_m<6>(a, k, panel, c); break;
    case 7: dot_tile_m<7>(a, k, panel, c); break;
    case 8: dot_tile_m<8>(a, k, panel, c); break;
    default: break;
  }
}

void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i))));
  }
}

}  // namespace

const Kernels& kernels_avx512bf16() {
  static const Kernels k{Isa::Avx512Bf16, NR, MR, {tile<0>, tile<1>, tile<2>}, dot_tile, to_bf16};
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

// Q2_K and Q3_K on rows one after another on the AVX-512 tables of a VNNI
// CPU (AVX-512 BW is all they use), the block decoded in
// registers (kernels.hpp's QGemmFn) for calls of up to kMaxRows activation
// rows (decode); larger calls take the decoded-row kernel this replaces
// (qdecoded.hpp), which decodes each row once for all of them.
//
// Per block: the 64 bytes of 2-bit values as four vectors of u8 (vector s:
// bytes 0-31 elements 32 s + i, bytes 32-63 elements 128 + 32 s + i), each
// against the activations in that order (permuted once per call) by
// vpmaddubsw (the values are at most 3: no pair saturates), then
// vpmaddwd with its group's 4-bit scale: int32 lanes of 4 elements of one
// group; the block's sum times d d_a. The mins:
// the 16 4-bit mins against the activation row's sums of 16 by vpmaddwd,
// times dmin d_a. Q3_K the same way with its high bits (the values + 4,
// 0..7, as u8; the 4 taken off through the sums of 16) and its 6-bit
// signed scales. Every integer sum is exact.
// GCC 12 warns falsely inside its own AVX-512 intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {

constexpr int kMaxRows = 8;
QGemmFn q2k_many_rows = nullptr;  // the decoded-row kernels, for larger calls
QGemmFn q3k_many_rows = nullptr;

inline float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  __m128 s = _mm512_castps512_ps128(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float f16at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Activation row q (k values) in the blocks' order: per 256, for s = 0..3
// the 32 values at 32 s, then the 32 at 128 + 32 s.
void permute_q2k(const int8_t* q, int k, int8_t* out) {
  for (int b = 0; b < k; b += 256)
    for (int s = 0; s < 4; ++s) {
      std::memcpy(out + b + 64 * s, q + b + 32 * s, 32);
      std::memcpy(out + b + 64 * s + 32, q + b + 128 + 32 * s, 32);
    }
}

// M activation rows (a compile-time count, so that each row's
// accumulators stay in registers across the blocks).
template <int M>
void q2k_rows(const void* const* a, int k, const void* panel, int nr, float* c, int ldc) {
  constexpr int m = M;
  thread_local std::vector<int8_t> perm;
  if (perm.size() < static_cast<size_t>(M) * static_cast<size_t>(k))
    perm.resize(static_cast<size_t>(M) * static_cast<size_t>(k));
  for (int i = 0; i < m; ++i) permute_q2k(act_q(a[i]), k, perm.data() + static_cast<size_t>(i) * k);
  const float* da[M];
  const int16_t* sa[M];
  for (int i = 0; i < m; ++i) {
    da[i] = act_d(a[i], k);
    sa[i] = act_s(a[i], k);
  }
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m512i two = _mm512_set1_epi8(3);
  // 16-bit lanes 0-7 group 2 s, 8-15 2 s + 1, 16-23 8 + 2 s, 24-31 9 + 2 s.
  __m256i lane_groups[4];
  for (int s = 0; s < 4; ++s) {
    alignas(32) uint8_t g[32];
    for (int l = 0; l < 32; ++l) g[l] = static_cast<uint8_t>((l < 16 ? 2 * s : 8 + 2 * s) + (l / 8) % 2);
    lane_groups[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g));
  }
  const size_t rb = static_cast<size_t>(k / 256) * 84;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* row = static_cast<const uint8_t*>(panel) + static_cast<size_t>(j) * rb;
    __m512 acc[M];
    __m256 macc[M];
    for (int i = 0; i < m; ++i) {
      acc[i] = _mm512_setzero_ps();
      macc[i] = _mm256_setzero_ps();
    }
    for (int b = 0; b < k / 256; ++b) {
      const uint8_t* blk = row + 84 * static_cast<size_t>(b);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
      const __m512i x = _mm512_loadu_si512(blk + 16);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
      const __m128i scl = _mm_and_si128(sc, nib);
      const __m256i scl2 = _mm256_broadcastsi128_si256(scl);  // vpshufb picks within each 128-bit half
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), nib));
      const __m512i crumb[4] = {_mm512_and_si512(x, two), _mm512_and_si512(_mm512_srli_epi16(x, 2), two),
                                _mm512_and_si512(_mm512_srli_epi16(x, 4), two),
                                _mm512_and_si512(_mm512_srli_epi16(x, 6), two)};
      // Each group's scale in the 16-bit lanes of its 8 pairs of products.
      __m512i lsc[4];
      for (int s = 0; s < 4; ++s) lsc[s] = _mm512_cvtepu8_epi16(_mm256_shuffle_epi8(scl2, lane_groups[s]));
      const float d = f16at(blk + 80), dmin = f16at(blk + 82);
      for (int i = 0; i < m; ++i) {
        const int8_t* q = perm.data() + static_cast<size_t>(i) * k + 256 * b;
        __m512i isum = _mm512_setzero_si512();
        // maddubs: pairs of products (at most 2 x 3 x 127), then pairs of
        // those times the group's scale (vpmaddwd): int32 lanes of 4 values.
        for (int s = 0; s < 4; ++s)
          isum = _mm512_add_epi32(
              isum, _mm512_madd_epi16(_mm512_maddubs_epi16(crumb[s], _mm512_loadu_si512(q + 64 * s)), lsc[s]));
        const float dai = da[i][8 * b];
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * dai), acc[i]);
        const __m256i mm =
            _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa[i] + 16 * b)));
        macc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(dmin * dai), macc[i]);
      }
    }
    for (int i = 0; i < m; ++i) {
      __m128 ms = _mm_add_ps(_mm256_castps256_ps128(macc[i]), _mm256_extractf128_ps(macc[i], 1));
      ms = _mm_add_ps(ms, _mm_movehl_ps(ms, ms));
      ms = _mm_add_ss(ms, _mm_movehdup_ps(ms));
      c[i * ldc + j] = hsum(acc[i]) - _mm_cvtss_f32(ms);
    }
  }
}

// Q3_K's 16 6-bit scales (less 32) as signed bytes, group j in byte j.
inline __m128i q3k_scales(const uint8_t* sc) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(lo8, nib), _mm_and_si128(_mm_srli_epi16(lo8, 4), nib));
  uint32_t x;
  std::memcpy(&x, sc + 8, 4);
  const __m128i high = _mm_and_si128(
      _mm_setr_epi32(static_cast<int>(x), static_cast<int>(x >> 2), static_cast<int>(x >> 4), static_cast<int>(x >> 6)),
      _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

template <int M>
void q3k_rows(const void* const* a, int k, const void* panel, int nr, float* c, int ldc) {
  thread_local std::vector<int8_t> perm;
  if (perm.size() < static_cast<size_t>(M) * static_cast<size_t>(k))
    perm.resize(static_cast<size_t>(M) * static_cast<size_t>(k));
  for (int i = 0; i < M; ++i) permute_q2k(act_q(a[i]), k, perm.data() + static_cast<size_t>(i) * k);
  const float* da[M];
  const int16_t* sa[M];
  for (int i = 0; i < M; ++i) {
    da[i] = act_d(a[i], k);
    sa[i] = act_s(a[i], k);
  }
  const __m512i two = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
  __m256i lane_groups[4];
  for (int s = 0; s < 4; ++s) {
    alignas(32) uint8_t g[32];
    for (int l = 0; l < 32; ++l) g[l] = static_cast<uint8_t>((l < 16 ? 2 * s : 8 + 2 * s) + (l / 8) % 2);
    lane_groups[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g));
  }
  const size_t rb = static_cast<size_t>(k / 256) * 110;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* row = static_cast<const uint8_t*>(panel) + static_cast<size_t>(j) * rb;
    __m512 acc[M];
    __m256 macc[M];
    for (int i = 0; i < M; ++i) {
      acc[i] = _mm512_setzero_ps();
      macc[i] = _mm256_setzero_ps();
    }
    for (int b = 0; b < k / 256; ++b) {
      const uint8_t* blk = row + 110 * static_cast<size_t>(b);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
      const __m512i x = _mm512_loadu_si512(blk + 32);
      // hmask bit s of byte i for elements 32 s + i, bit 4 + s for 128 + 32 s + i.
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(hm), _mm256_srli_epi16(hm, 4), 1);
      __m512i u[4];
      for (int s = 0; s < 4; ++s)
        u[s] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x, 2 * s), two),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, s), one), 2));
      const __m128i sc8 = q3k_scales(blk + 96);
      const __m256i sc2 = _mm256_broadcastsi128_si256(sc8);
      __m512i lsc[4];
      for (int s = 0; s < 4; ++s) lsc[s] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc2, lane_groups[s]));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      const float d = f16at(blk + 108);
      for (int i = 0; i < M; ++i) {
        const int8_t* q = perm.data() + static_cast<size_t>(i) * k + 256 * b;
        __m512i isum = _mm512_setzero_si512();
        for (int s = 0; s < 4; ++s)
          isum = _mm512_add_epi32(
              isum, _mm512_madd_epi16(_mm512_maddubs_epi16(u[s], _mm512_loadu_si512(q + 64 * s)), lsc[s]));
        const float dd = d * da[i][8 * b];
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dd), acc[i]);
        const __m256i mm =
            _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa[i] + 16 * b)));
        macc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(4.0f * dd), macc[i]);
      }
    }
    for (int i = 0; i < M; ++i) {
      __m128 ms = _mm_add_ps(_mm256_castps256_ps128(macc[i]), _mm256_extractf128_ps(macc[i], 1));
      ms = _mm_add_ps(ms, _mm_movehl_ps(ms, ms));
      ms = _mm_add_ss(ms, _mm_movehdup_ps(ms));
      c[i * ldc + j] = hsum(acc[i]) - _mm_cvtss_f32(ms);
    }
  }
}

void qgemm_q3k(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc, const void* next) {
  switch (m) {
    case 1: return q3k_rows<1>(a, k, panel, nr, c, ldc);
    case 2: return q3k_rows<2>(a, k, panel, nr, c, ldc);
    case 3: return q3k_rows<3>(a, k, panel, nr, c, ldc);
    case 4: return q3k_rows<4>(a, k, panel, nr, c, ldc);
    default: break;
  }
  if (m > kMaxRows) return q3k_many_rows(m, a, k, panel, nr, c, ldc, next);
  for (int r0 = 0; r0 < m; r0 += 4) qgemm_q3k(std::min(4, m - r0), a + r0, k, panel, nr, c + r0 * ldc, ldc, next);
}

void qgemm_q2k(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc, const void* next) {
  switch (m) {
    case 1: return q2k_rows<1>(a, k, panel, nr, c, ldc);
    case 2: return q2k_rows<2>(a, k, panel, nr, c, ldc);
    case 3: return q2k_rows<3>(a, k, panel, nr, c, ldc);
    case 4: return q2k_rows<4>(a, k, panel, nr, c, ldc);
    default: break;
  }
  if (m > kMaxRows) return q2k_many_rows(m, a, k, panel, nr, c, ldc, next);
  for (int r0 = 0; r0 < m; r0 += 4)  // 5 .. 8 rows: 4, then the rest
    qgemm_q2k(std::min(4, m - r0), a + r0, k, panel, nr, c + r0 * ldc, ldc, next);
}

}  // namespace

void qfused_avx512vnni(QGemmFn* gemm) {
  const int q2k = quant_index(EP_MOE_DTYPE_Q2_K), q3k = quant_index(EP_MOE_DTYPE_Q3_K);
  if (gemm[q2k] != qgemm_q2k) q2k_many_rows = gemm[q2k];
  if (gemm[q3k] != qgemm_q3k) q3k_many_rows = gemm[q3k];
  gemm[q2k] = qgemm_q2k;
  gemm[q3k] = qgemm_q3k;
}

}  // namespace cpu
}  // namespace ep_moe

// AVX512-VNNI int8 tiles for block-format prefill (kernels.hpp's
// QTileFn; built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2
// -mfma -mf16c, called only when the CPU has AVX512_VNNI).
//
// A panel's 32 weight rows are first unpacked to u8 (once per panel,
// however many rows then use it; by qgroups_avx512vnni.cpp, from the
// interleaved rows) in k-groups of 4 across the columns
// (qtile_layout.hpp): each 64-byte vector holds 4 consecutive elements of
// 16 weight rows, so one vpdpbusd multiplies them with 4 elements of one
// activation row (broadcast) and sums the fours into 16 i32 columns: 64
// products an instruction, the sums staying in i32 across a block's
// k-groups. Up to 6 activation rows (4 for the blocks of 256) share each
// loaded weight vector, where the interleaved-row kernels take 4 and read
// the group again for more. The block's scales are then applied once per
// 32 elements (Q8_0, Q4_0, MXFP4) or per 256 (the K formats and IQ4_XS,
// whose per-group scales multiply the i32 sums).
//
// vpdpbusd multiplies u8 by s8: the weights are stored as u = w + z (z
// the format's offset: Q8_0 128, Q4_0 8, MXFP4 12, Q6_K 32 and IQ4_XS 128
// through their coefficients; Q4_K and Q5_K are unsigned already), the
// activations stay s8, and z times the activation block's sum is taken
// off the i32 sum. Every i32 sum is an exact integer (bounds below).
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cpu/qgroups.hpp"
#include "cpu/qtile_layout.hpp"

namespace ep_moe {
namespace cpu {

namespace {

// --- Q8_0, Q4_0, MXFP4: a scale per 32 ---------------------------------------
template <int T>
constexpr int offset_a() {
  return T == EP_MOE_DTYPE_Q8_0 ? 128 : T == EP_MOE_DTYPE_Q4_0 ? 8 : 12;
}

// M activation rows (a: quantize_act_row's rows, one f32 scale per 32)
// through an unpacked panel; c[i * ldc + j] for row i, column j < 32.
// Per block and row, t = sum (w + z) a - z sum a, exact in i32: at most
// 32 * 255 * 127 before the offset is taken off.
template <int T, int M>
void tile_a(const void* const* a, int k, const uint8_t* up, float* c, int ldc, const Ahead& ahead) {
  constexpr int z = offset_a<T>();
  const int8_t* q[M];
  const float* d[M];
  const int16_t* s[M];
  for (int m = 0; m < M; ++m) {
    q[m] = act_q(a[m]);
    d[m] = act_d(a[m], k);
    s[m] = act_s(a[m], k);
  }
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int b = 0; b < k / 32; ++b, up += kBlockA) {
    ahead.at(b);
    __m512i t[M][2];
    for (int m = 0; m < M; ++m) t[m][0] = t[m][1] = _mm512_set1_epi32(-z * (s[m][2 * b] + s[m][2 * b + 1]));
    for (int g = 0; g < 8; ++g) {
      const __m512i w0 = _mm512_loadu_si512(up + g * kGroupBytes), w1 = _mm512_loadu_si512(up + g * kGroupBytes + 64);
      for (int m = 0; m < M; ++m) {
        const __m512i av = _mm512_set1_epi32(rd32(q[m] + 32 * b + 4 * g));
        t[m][0] = _mm512_dpbusd_epi32(t[m][0], w0, av);
        t[m][1] = _mm512_dpbusd_epi32(t[m][1], w1, av);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(up + 8 * kGroupBytes), d1 = _mm512_loadu_ps(up + 8 * kGroupBytes + 64);
    for (int m = 0; m < M; ++m) {
      const __m512 da = _mm512_set1_ps(d[m][b]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m][0]), _mm512_mul_ps(d0, da), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m][1]), _mm512_mul_ps(d1, da), acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(c + m * ldc, acc[m][0]);
    _mm512_storeu_ps(c + m * ldc + 16, acc[m][1]);
  }
}

// --- Q4_K, Q5_K, Q6_K, IQ4_XS: blocks of 256 with scales per 32 or 16 --------
// M activation rows (Q8_K-style: one f32 scale per 256) through an
// unpacked panel. Exact i32 sums, at most: Q4_K/Q5_K 8 * 63 * 32 * 31 * 127
// (below 2^26), the mins' 8 * 63 * 32 * 127; Q6_K 16 * 128 * 16 * 63 * 127
// (below 2^28), the offsets' 16 * 4096 * 16 * 127; IQ4_XS 8 * 32 * 32 * 241
// * 127 (below 2^28), the offsets' 8 * 4096 * 32 * 127: their difference
// stays below 2^31.
template <int T, int M>
void tile_k(const void* const* a, int k, const uint8_t* up, float* c, int ldc, const Ahead& ahead) {
  using L = KLayout<T>;
  const int8_t* q[M];
  const float* d[M];
  const int16_t* s[M];
  for (int m = 0; m < M; ++m) {
    q[m] = act_q(a[m]);
    d[m] = act_d(a[m], k);
    s[m] = act_s(a[m], k);
  }
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int b = 0; b < k / 256; ++b, up += L::kBlock) {
    ahead.at(b);
    __m512i sum[M][2], t[M][2];
    for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    for (int j = 0; j < L::G; ++j) {
      for (int m = 0; m < M; ++m) t[m][0] = t[m][1] = _mm512_setzero_si512();
      for (int g = 0; g < L::KG; ++g) {
        const uint8_t* wg = up + (L::KG * j + g) * kGroupBytes;
        const __m512i w0 = _mm512_loadu_si512(wg), w1 = _mm512_loadu_si512(wg + 64);
        for (int m = 0; m < M; ++m) {
          const __m512i av = _mm512_set1_epi32(rd32(q[m] + 256 * b + 4 * (L::KG * j + g)));
          t[m][0] = _mm512_dpbusd_epi32(t[m][0], w0, av);
          t[m][1] = _mm512_dpbusd_epi32(t[m][1], w1, av);
        }
      }
      const __m512i s0 = _mm512_loadu_si512(up + L::kSc + j * 4 * kCols);
      const __m512i s1 = _mm512_loadu_si512(up + L::kSc + j * 4 * kCols + 64);
      for (int m = 0; m < M; ++m) {
        sum[m][0] = _mm512_add_epi32(sum[m][0], _mm512_mullo_epi32(t[m][0], s0));
        sum[m][1] = _mm512_add_epi32(sum[m][1], _mm512_mullo_epi32(t[m][1], s1));
      }
    }
    // The coefficients against the activations' group sums, two groups a dword.
    for (int m = 0; m < M; ++m) t[m][0] = t[m][1] = _mm512_setzero_si512();
    for (int pr = 0; pr < L::G / 2; ++pr) {
      const __m512i m0 = _mm512_loadu_si512(up + L::kCoef + pr * 4 * kCols);
      const __m512i m1 = _mm512_loadu_si512(up + L::kCoef + pr * 4 * kCols + 64);
      for (int m = 0; m < M; ++m) {
        const __m512i sv = _mm512_set1_epi32(sum_pair<L::G>(s[m], b, pr));
        t[m][0] = _mm512_dpwssd_epi32(t[m][0], m0, sv);
        t[m][1] = _mm512_dpwssd_epi32(t[m][1], m1, sv);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(up + L::kD), d1 = _mm512_loadu_ps(up + L::kD + 64);
    for (int m = 0; m < M; ++m) {
      const __m512 da = _mm512_set1_ps(d[m][8 * b]);
      if constexpr (L::kSub) {
        sum[m][0] = _mm512_sub_epi32(sum[m][0], t[m][0]);
        sum[m][1] = _mm512_sub_epi32(sum[m][1], t[m][1]);
      }
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][0]), _mm512_mul_ps(d0, da), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][1]), _mm512_mul_ps(d1, da), acc[m][1]);
      if constexpr (!L::kSub) {
        const __m512 n0 = _mm512_loadu_ps(up + L::kDmin), n1 = _mm512_loadu_ps(up + L::kDmin + 64);
        acc[m][0] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(t[m][0]), _mm512_mul_ps(n0, da), acc[m][0]);
        acc[m][1] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(t[m][1]), _mm512_mul_ps(n1, da), acc[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(c + m * ldc, acc[m][0]);
    _mm512_storeu_ps(c + m * ldc + 16, acc[m][1]);
  }
}

// --- the panel calls ---------------------------------------------------------------
// Register tiles: 6 rows for the per-32 formats (12 f32 accumulators and
// 12 i32 block sums), 4 for the blocks of 256 (which keep a third set, the
// scaled sums of a block).
template <int T>
constexpr bool per256() {
  return T == EP_MOE_DTYPE_Q4_K || T == EP_MOE_DTYPE_Q5_K || T == EP_MOE_DTYPE_Q6_K || T == EP_MOE_DTYPE_IQ4_XS;
}
template <int T>
constexpr int tile_rows() {
  return per256<T>() ? 4 : 6;
}

template <int T, int M>
void tile_rows_of(const void* const* a, int k, const uint8_t* up, float* c, int ldc, const Ahead& ahead) {
  if constexpr (per256<T>()) tile_k<T, M>(a, k, up, c, ldc, ahead);
  else tile_a<T, M>(a, k, up, c, ldc, ahead);
}

template <int T, int... I>
constexpr std::array<TileFn, sizeof...(I)> tile_table(std::integer_sequence<int, I...>) {
  return {tile_rows_of<T, I + 1>...};
}

template <int T>
void qtile(int m, const void* const* a, int k, const void* tiles, float* c, int ldc, const void* next) {
  constexpr int R = tile_rows<T>();
  static constexpr std::array<TileFn, R> kTiles = tile_table<T>(std::make_integer_sequence<int, R>{});
  constexpr auto t = static_cast<ep_moe_dtype_t>(T);
  run_tiles<R>(kTiles.data(), m, a, k, tiles, c, ldc, next, kCols * quant_row_bytes(t, k), k / quant_block_elems(t));
}

}  // namespace

void qtiles_avx512vnni(QTileFn* tile) {
  tile[quant_index(EP_MOE_DTYPE_Q8_0)] = qtile<EP_MOE_DTYPE_Q8_0>;
  tile[quant_index(EP_MOE_DTYPE_Q4_0)] = qtile<EP_MOE_DTYPE_Q4_0>;
  tile[quant_index(EP_MOE_DTYPE_MXFP4)] = qtile<EP_MOE_DTYPE_MXFP4>;
  tile[quant_index(EP_MOE_DTYPE_Q4_K)] = qtile<EP_MOE_DTYPE_Q4_K>;
  tile[quant_index(EP_MOE_DTYPE_Q5_K)] = qtile<EP_MOE_DTYPE_Q5_K>;
  tile[quant_index(EP_MOE_DTYPE_Q6_K)] = qtile<EP_MOE_DTYPE_Q6_K>;
  tile[quant_index(EP_MOE_DTYPE_IQ4_XS)] = qtile<EP_MOE_DTYPE_IQ4_XS>;
}

}  // namespace cpu
}  // namespace ep_moe

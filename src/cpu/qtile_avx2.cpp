// AVX2 int8 tiles for block-format prefill (kernels.hpp's QTileFn; built
// with -mavx2 -mfma -mf16c), for the formats whose interleaved-row kernels
// spend much of each step taking the values apart: Q6_K, whose 6-bit values
// come from three places of a step (qgroups8.inc's q6_values), Q5_K,
// whose fifth bits come from a second load, and MXFP4, whose nibbles go
// through a table shuffle each.
//
// A panel's 16 weight rows are first unpacked to u8 (once per panel,
// however many activation rows then use it; qgroups_avx2.cpp's unpackers)
// in k-groups of 4 across the columns (qtile_layout.hpp, C = 16): a
// k-group is two 256-bit vectors of 4 consecutive elements of 8 weight
// rows each, so one broadcast activation dword feeds two maddubs. The
// interleaved-row kernels unpack each step again for every call of 4
// activation rows, and the Q6_K one's 4 rows' 16 running sums spill.
//
// maddubs multiplies u8 by s8 into i16 pairs, saturating, so k-groups share
// an i16 sum only as far as the values allow (kRun), and one madd by the
// group's scale (the i16 pair (s, s); MXFP4: ones) widens it to i32.
// Offsets (Q6_K's 32, MXFP4's 12) come off through the activations' sums,
// exactly; Q5_K's mins in f32, scaled by dmin. Every i32 bound is
// qtile_avx512vnni.cpp's.
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

constexpr int C = 16;  // the AVX2 table's panel rows (its nr)

inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// --- MXFP4: a scale per 32 ----------------------------------------------------
// M activation rows (Q8_0-style: one f32 scale per 32) through an unpacked
// panel: per block and column t = sum (w + 12) a - 12 sum a, exact in i32
// (w: the doubled E2M1 values). Values up to 24 make pairs of at most 6096,
// so 4 k-groups share an i16 sum. The f32 results stay in c, updated once
// a block.
template <int T, int M>
void tile_a(const void* const* a, int k, const uint8_t* up, float* c, int ldc, const Ahead& ahead) {
  static_assert(T == EP_MOE_DTYPE_MXFP4, "the per-32 tiles are MXFP4's");
  constexpr int z = 12, run = 4;
  constexpr size_t kGroup = 4 * C;
  const Acts<M> act(a, k);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < k / 32; ++b, up += kBlockAOf<C>) {
    ahead.at(b);
    __m256i tot[M][2];
    for (int m = 0; m < M; ++m) tot[m][0] = tot[m][1] = _mm256_set1_epi32(-z * (act.s[m][2 * b] + act.s[m][2 * b + 1]));
    for (int g0 = 0; g0 < 8; g0 += run) {
      __m256i t[M][2];
      for (int m = 0; m < M; ++m) t[m][0] = t[m][1] = _mm256_setzero_si256();
      for (int g = g0; g < g0 + run; ++g) {
        const __m256i w0 = load(up + g * kGroup), w1 = load(up + g * kGroup + 32);
        for (int m = 0; m < M; ++m) {
          const __m256i av = _mm256_set1_epi32(rd32(act.q[m] + 32 * b + 4 * g));
          t[m][0] = _mm256_add_epi16(t[m][0], _mm256_maddubs_epi16(w0, av));
          t[m][1] = _mm256_add_epi16(t[m][1], _mm256_maddubs_epi16(w1, av));
        }
      }
      for (int m = 0; m < M; ++m) {
        tot[m][0] = _mm256_add_epi32(tot[m][0], _mm256_madd_epi16(t[m][0], ones));
        tot[m][1] = _mm256_add_epi32(tot[m][1], _mm256_madd_epi16(t[m][1], ones));
      }
    }
    const auto* d = reinterpret_cast<const float*>(up + 8 * kGroup);
    for (int m = 0; m < M; ++m) {
      const __m256 da = _mm256_set1_ps(act.d[m][b]);
      for (int h = 0; h < 2; ++h) {
        float* cm = c + m * ldc + 8 * h;
        const __m256 v = b == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(cm);
        _mm256_storeu_ps(
            cm, _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[m][h]), _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), da), v));
      }
    }
  }
}

// --- Q5_K, Q6_K: blocks of 256 ----------------------------------------------------
// maddubs products a format's i16 sums hold (header): values up to 31
// (Q5_K) make pairs of at most 7874, 4 of them a sum; 63 (Q6_K) 16002, 2.
template <int T>
constexpr int kRun = T == EP_MOE_DTYPE_Q5_K ? 4 : 2;

// M activation rows (Q8_K-style: one f32 scale per 256) through an
// unpacked panel of Q5_K or Q6_K: c[i * ldc + j] for row i, column j <
// 16. Per block and column d sum_g s_g (sum q a), less the coefficients
// against the activations' group sums: Q6_K's 32 s_g taken off in i32,
// Q5_K's mins scaled by dmin in f32. Exact in i32
// (the bounds of qtile_avx512vnni.cpp's tile_k).
template <int T, int M>
void tile_k(const void* const* a, int k, const uint8_t* up, float* c, int ldc, const Ahead& ahead) {
  using L = KLayout<T, C>;
  const Acts<M> act(a, k);
  for (int b = 0; b < k / 256; ++b, up += L::kBlock) {
    ahead.at(b);
    __m256i sum[M][2];
    for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < L::G; ++j) {
      const uint8_t* sc = up + L::kSc + j * L::kGroup;
      for (int g0 = 0; g0 < L::KG; g0 += kRun<T>) {
        __m256i t[M][2];
        for (int m = 0; m < M; ++m) t[m][0] = t[m][1] = _mm256_setzero_si256();
        for (int g = g0; g < g0 + kRun<T>; ++g) {
          const uint8_t* wg = up + (L::KG * j + g) * L::kGroup;
          const __m256i w0 = load(wg), w1 = load(wg + 32);
          for (int m = 0; m < M; ++m) {
            const __m256i av = _mm256_set1_epi32(rd32(act.q[m] + 256 * b + 4 * (L::KG * j + g)));
            t[m][0] = _mm256_add_epi16(t[m][0], _mm256_maddubs_epi16(w0, av));
            t[m][1] = _mm256_add_epi16(t[m][1], _mm256_maddubs_epi16(w1, av));
          }
        }
        for (int m = 0; m < M; ++m) {
          sum[m][0] = _mm256_add_epi32(sum[m][0], _mm256_madd_epi16(t[m][0], load(sc)));
          sum[m][1] = _mm256_add_epi32(sum[m][1], _mm256_madd_epi16(t[m][1], load(sc + 32)));
        }
      }
    }
    // The coefficients against the activations' group sums, two groups a dword.
    __m256i off[M][2];
    for (int m = 0; m < M; ++m) off[m][0] = off[m][1] = _mm256_setzero_si256();
    for (int pr = 0; pr < L::G / 2; ++pr) {
      const __m256i k0 = load(up + L::kCoef + pr * L::kGroup), k1 = load(up + L::kCoef + pr * L::kGroup + 32);
      for (int m = 0; m < M; ++m) {
        const __m256i sv = _mm256_set1_epi32(sum_pair<L::G>(act.s[m], b, pr));
        off[m][0] = _mm256_add_epi32(off[m][0], _mm256_madd_epi16(k0, sv));
        off[m][1] = _mm256_add_epi32(off[m][1], _mm256_madd_epi16(k1, sv));
      }
    }
    const auto* d = reinterpret_cast<const float*>(up + L::kD);
    const auto* dmin = reinterpret_cast<const float*>(up + L::kDmin);
    for (int m = 0; m < M; ++m) {
      const __m256 da = _mm256_set1_ps(act.d[m][8 * b]);
      for (int h = 0; h < 2; ++h) {
        float* cm = c + m * ldc + 8 * h;
        __m256 v = b == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(cm);
        if constexpr (L::kSub) {
          v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[m][h], off[m][h])),
                              _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), da), v);
        } else {
          v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][h]), _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), da), v);
          v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off[m][h]), _mm256_mul_ps(_mm256_loadu_ps(dmin + 8 * h), da), v);
        }
        _mm256_storeu_ps(cm, v);
      }
    }
  }
}

// --- the panel calls -----------------------------------------------------------
// Register tiles of kTileRows activation rows: their 2 i32 sums each, the
// k-group's 2 weight vectors and the tile's i16 sums fill the 16 registers;
// the f32 results stay in c, updated once a block. (Block by block over
// every tile instead, an unpacked block staying in L1, was no faster: the
// panel comes from L2 at the rate the tiles take it.)
constexpr int kTileRows = 3;

template <int T>
constexpr bool per256() {
  return T == EP_MOE_DTYPE_Q5_K || T == EP_MOE_DTYPE_Q6_K;
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
  static constexpr std::array<TileFn, kTileRows> kTiles = tile_table<T>(std::make_integer_sequence<int, kTileRows>{});
  constexpr auto t = static_cast<ep_moe_dtype_t>(T);
  run_tiles<kTileRows>(kTiles.data(), m, a, k, tiles, c, ldc, next, C * quant_row_bytes(t, k),
                       k / quant_block_elems(t));
}

}  // namespace

// Not among them: Q4_K and Q4_0, whose group kernels take their nibbles
// apart in two instructions a load and which the tiles ran level with
// (t/c 0.8-1.1, and Q4_K's layer prefill the same with and without);
// Q8_0 and IQ4_XS, whose signed values need maddubs' sign trick per
// activation row either way.
void qtiles_avx2(QTileFn* tile) {
  tile[quant_index(EP_MOE_DTYPE_MXFP4)] = qtile<EP_MOE_DTYPE_MXFP4>;
  tile[quant_index(EP_MOE_DTYPE_Q5_K)] = qtile<EP_MOE_DTYPE_Q5_K>;
  tile[quant_index(EP_MOE_DTYPE_Q6_K)] = qtile<EP_MOE_DTYPE_Q6_K>;
}

}  // namespace cpu
}  // namespace ep_moe

// AVX2 int8 tiles for block-format prefill (kernels.hpp's QTileFn; built
// with -mavx2 -mfma -mf16c), for the formats whose interleaved-row kernels
// spend much of each step taking the values apart: Q6_K, whose 6-bit values
// come from three places of a step (qgroups8.inc's q6_values).
//
// A panel's 16 weight rows are first unpacked to u8 (once per panel,
// however many activation rows then use it; qgroups_avx2.cpp's unpackers)
// in k-groups of 4 across the columns (qtile_layout.hpp, C = 16): a
// k-group is two 256-bit vectors of 4 consecutive elements of 8 weight
// rows each, so one broadcast activation dword feeds two maddubs. The
// interleaved-row kernels unpack each step again for every call of 4
// activation rows, and their 4 rows' 16 running sums spill.
//
// maddubs multiplies u8 by s8 into i16 pairs, saturating: Q6_K's values as
// stored (0 .. 63) make a pair of at most 2 * 63 * 127 = 16002, so two
// k-groups (8 elements) share one i16 sum (32004), which one madd by the
// group's scale (the i16 pair (s, s)) widens to i32. The offset 32 comes off
// through the activations' sums of 16 (the coefficients 32 s), exactly:
// every i32 bound is qtile_avx512vnni.cpp's.
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

// M activation rows (Q8_K-style: one f32 scale per 256) through an
// unpacked Q6_K panel: c[i * ldc + j] for row i, column j < 16. Per block
// and column d sum_g s_g (sum q a) - d sum_g 32 s_g A_g, exact in i32.
template <int M>
void tile_q6k(const void* const* a, int k, const uint8_t* up, float* c, int ldc, const Ahead& ahead) {
  using L = KLayout<EP_MOE_DTYPE_Q6_K, C>;
  const Acts<M> act(a, k);
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(c + m * ldc, _mm256_setzero_ps());
    _mm256_storeu_ps(c + m * ldc + 8, _mm256_setzero_ps());
  }
  for (int b = 0; b < k / 256; ++b, up += L::kBlock) {
    ahead.at(b);
    __m256i sum[M][2];
    for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < L::G; ++j) {
      const __m256i s0 = load(up + L::kSc + j * L::kGroup), s1 = load(up + L::kSc + j * L::kGroup + 32);
      for (int gp = 0; gp < L::KG; gp += 2) {
        const uint8_t* wg = up + (L::KG * j + gp) * L::kGroup;
        const __m256i w00 = load(wg), w01 = load(wg + 32), w10 = load(wg + L::kGroup), w11 = load(wg + L::kGroup + 32);
        for (int m = 0; m < M; ++m) {
          const int8_t* q = act.q[m] + 256 * b + 4 * (L::KG * j + gp);
          const __m256i a0 = _mm256_set1_epi32(rd32(q)), a1 = _mm256_set1_epi32(rd32(q + 4));
          const __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(w00, a0), _mm256_maddubs_epi16(w10, a1));
          const __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(w01, a0), _mm256_maddubs_epi16(w11, a1));
          sum[m][0] = _mm256_add_epi32(sum[m][0], _mm256_madd_epi16(t0, s0));
          sum[m][1] = _mm256_add_epi32(sum[m][1], _mm256_madd_epi16(t1, s1));
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
    const __m256 d0 = _mm256_loadu_ps(reinterpret_cast<const float*>(up + L::kD));
    const __m256 d1 = _mm256_loadu_ps(reinterpret_cast<const float*>(up + L::kD + 32));
    for (int m = 0; m < M; ++m) {
      const __m256 da = _mm256_set1_ps(act.d[m][8 * b]);
      float* cm = c + m * ldc;
      _mm256_storeu_ps(cm, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[m][0], off[m][0])),
                                           _mm256_mul_ps(d0, da), _mm256_loadu_ps(cm)));
      _mm256_storeu_ps(cm + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[m][1], off[m][1])),
                                               _mm256_mul_ps(d1, da), _mm256_loadu_ps(cm + 8)));
    }
  }
}

// --- the panel calls -----------------------------------------------------------
// Register tiles of kTileRows activation rows: their 2 i32 sums each, the
// k-group pair's 4 weight vectors, the two scales and the products fill
// the 16 registers; the f32 results stay in c, updated once a block.
constexpr int kTileRows = 3;

using TileFn = void (*)(const void* const*, int, const uint8_t*, float*, int, const Ahead&);
template <int... I>
constexpr std::array<TileFn, sizeof...(I)> tile_table(std::integer_sequence<int, I...>) {
  return {tile_q6k<I + 1>...};
}

template <int T>
void qtile(int m, const void* const* a, int k, const void* tiles, float* c, int ldc, const void* next) {
  static constexpr std::array<TileFn, kTileRows> kTiles = tile_table(std::make_integer_sequence<int, kTileRows>{});
  const auto* up = static_cast<const uint8_t*>(tiles);
  // The next panel's lines, shared out over the register tiles.
  const size_t lines = (C * quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k) + 63) / 64;
  const int calls = (m + kTileRows - 1) / kTileRows;
  Ahead ahead;
  ahead.next = static_cast<const char*>(next);
  ahead.blocks = k / quant_block_elems(static_cast<ep_moe_dtype_t>(T));
  for (int i0 = 0, call = 0; i0 < m; i0 += kTileRows, ++call) {
    const int mm = m - i0 < kTileRows ? m - i0 : kTileRows;
    ahead.first = lines * static_cast<size_t>(call) / static_cast<size_t>(calls);
    ahead.count = lines * static_cast<size_t>(call + 1) / static_cast<size_t>(calls) - ahead.first;
    kTiles[static_cast<size_t>(mm - 1)](a + i0, k, up, c + static_cast<ptrdiff_t>(i0) * ldc, ldc, ahead);
  }
}

}  // namespace

void qtiles_avx2(QTileFn* tile) { tile[quant_index(EP_MOE_DTYPE_Q6_K)] = qtile<EP_MOE_DTYPE_Q6_K>; }

}  // namespace cpu
}  // namespace ep_moe

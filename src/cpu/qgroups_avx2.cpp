// The AVX2 table's block-format kernels: rows interleaved 8 at a time
// through maddubs (qgroups8.inc), for the AVX2 table and the AVX-512 ones
// where the CPU has no AVX512_VNNI; the unpacking of its panels for its
// int8 tiles (qtile_avx2.cpp); and the activation rows' quantizer of every
// x86 table (built with -mavx2 -mfma -mf16c).
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/qgroups.hpp"
#include "cpu/qtile_layout.hpp"

namespace ep_moe {
namespace cpu {

namespace {

// maddubs into i16 pairs (qgroups8.inc's dot_add).
struct Maddubs {
  static constexpr bool kVnni = false;
};

#include "cpu/qgroups8.inc"

// --- unpacking for the int8 tiles (qtile_layout.hpp, 16 columns) ------------
// A panel of two 8-row groups into the tiles' layout: group h's rows are
// columns 8 h .. 8 h + 7, the second half of each 64-byte piece.
constexpr int kTileCols = 2 * R;
inline void put(uint8_t* at, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), v); }

// Q5_K: the values (u8, 0 .. 31, the fifth bits joined), each group's
// scale as the i16 pair (s, s), the mins as i16 pairs (the coefficients),
// d and dmin.
void unpack_q5k(const void* panel, int k, void* out) {
  using L = KLayout<EP_MOE_DTYPE_Q5_K, kTileCols>;
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(EP_MOE_DTYPE_Q5_K, k);
  const __m256i m4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  for (int b = 0; b < k / 256; ++b, o += L::kBlock)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * R * rb + static_cast<size_t>(b) * GP::kQ5kBlock;
      uint8_t* oh = o + 4 * R * h;
      for (int ch = 0; ch < 4; ++ch)
        for (int v = 0; v < 8; ++v) {
          const __m256i w = load(g + GP::kQ5kQuants + 4 * R * (8 * ch + v));
          const __m256i qh = load(g + GP::kQ5kQh + 4 * R * v);
          const __m256i wl = _mm256_or_si256(_mm256_and_si256(w, m4), _mm256_and_si256(bit_to4(qh, 2 * ch), bit4));
          const __m256i wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4),
                                             _mm256_and_si256(bit_to4(qh, 2 * ch + 1), bit4));
          put(oh + (16 * ch + v) * L::kGroup, wl);
          put(oh + (16 * ch + 8 + v) * L::kGroup, wh);
        }
      const Scales sc = scales(g);
      for (int j = 0; j < L::G; ++j) put(oh + L::kSc + j * L::kGroup, pair16(group_scale(sc, j)));
      for (int pr = 0; pr < L::G / 2; ++pr) put(oh + L::kCoef + pr * L::kGroup, min_pair(sc, pr));
      _mm256_storeu_ps(reinterpret_cast<float*>(oh + L::kD), f16x8(g));
      _mm256_storeu_ps(reinterpret_cast<float*>(oh + L::kDmin), f16x8(g + GP::kQ4kDmin));
    }
}

// MXFP4: the doubled values + 12 (u8, 0 .. 24), the blocks' scales as f32.
void unpack_mxfp4(const void* panel, int k, void* out) {
  constexpr int T = EP_MOE_DTYPE_MXFP4;
  constexpr size_t kBlock = kBlockAOf<kTileCols>, kGroup = 4 * kTileCols;
  constexpr size_t gb = R * static_cast<size_t>(kBlockBytes<T>);
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)), _mm_set1_epi8(12)));
  for (int b = 0; b < k / 32; ++b, o += kBlock)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * R * rb + static_cast<size_t>(b) * gb;
      const uint8_t* qs = g + R * kScaleBytes<T>;
      uint8_t* oh = o + 4 * R * h;
      for (int v = 0; v < 4; ++v) {
        const __m256i w = load(qs + 4 * R * v);
        put(oh + v * kGroup, _mm256_shuffle_epi8(table, _mm256_and_si256(w, m4)));
        put(oh + (4 + v) * kGroup, _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(w, 4), m4)));
      }
      _mm256_storeu_ps(reinterpret_cast<float*>(oh + 8 * kGroup), scales32<T>(g));
    }
}

// Q6_K: the values as stored (u8, 0 .. 63), each group's scale as the i16
// pair (s, s) that madd takes, the coefficients 32 s as i16 pairs, d.
void unpack_q6k(const void* panel, int k, void* out) {
  using L = KLayout<EP_MOE_DTYPE_Q6_K, kTileCols>;
  const auto* p = static_cast<const uint8_t*>(panel);
  auto* o = static_cast<uint8_t*>(out);
  const size_t rb = quant_row_bytes(EP_MOE_DTYPE_Q6_K, k);
  for (int b = 0; b < k / 256; ++b, o += L::kBlock)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* g = p + static_cast<size_t>(h) * R * rb + static_cast<size_t>(b) * GP::kQ6kBlock;
      uint8_t* oh = o + 4 * R * h;
      for (int hh = 0; hh < 2; ++hh)
        for (int v = 0; v < 8; ++v) {
          __m256i x[4];
          q6_values(g, hh, v, x);
          for (int u = 0; u < 4; ++u) put(oh + (32 * hh + 8 * u + v) * L::kGroup, x[u]);
        }
      for (int j = 0; j < L::G; ++j) put(oh + L::kSc + j * L::kGroup, pair16(q6_scale(g, j)));
      for (int pr = 0; pr < L::G / 2; ++pr) put(oh + L::kCoef + pr * L::kGroup, q6_coef(g, pr));
      _mm256_storeu_ps(reinterpret_cast<float*>(oh + L::kD), f16x8(g));
    }
}

}  // namespace

// The activation rows' quantizer: the scalar quantizer's bytes, the same f32 multiply by 127 / amax and the
// same rounding (cvtps2dq, nearest even).
void quantize_act_avx2(const float* x, int64_t k, ActQuant aq, void* outp) {
  const int64_t kp = act_row_padded(k);
  auto* q = static_cast<int8_t*>(outp);
  auto* d = reinterpret_cast<float*>(static_cast<char*>(outp) + kp);
  auto* s = reinterpret_cast<int16_t*>(static_cast<char*>(outp) + kp + kp / 32 * 4);
  const int64_t bs = aq == ActQuant::Q8_K ? 256 : 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b0 = 0; b0 < kp; b0 += bs) {
    const int64_t end = b0 + bs < k ? b0 + bs : k;
    float amax = 0;
    int64_t i = b0;
    if (end - b0 == bs) {
      __m256 mx = _mm256_setzero_ps();
      for (; i < end; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      t = _mm_max_ss(t, _mm_movehdup_ps(t));
      amax = _mm_cvtss_f32(t);
    } else {
      for (; i < end; ++i) amax = amax > __builtin_fabsf(x[i]) ? amax : __builtin_fabsf(x[i]);
    }
    const float db = amax / 127.0f, id = db != 0.0f ? 127.0f / amax : 0.0f;
    if (end - b0 == bs) {
      const __m256 vid = _mm256_set1_ps(id);
      for (int64_t e = b0; e < end; e += 32) {
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e), vid));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e + 8), vid));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e + 16), vid));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + e + 24), vid));
        const __m256i p16a = _mm256_packs_epi32(i0, i1), p16b = _mm256_packs_epi32(i2, i3);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        // The packs interleave the 128-bit lanes: put the 4-byte groups back in order.
        const __m256i ord = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + e), ord);
      }
    } else {
      for (int64_t e = b0; e < b0 + bs; ++e)
        q[e] = e < k ? static_cast<int8_t>(_mm_cvtss_si32(_mm_set_ss(x[e] * id))) : 0;
    }
    for (int64_t j = b0 / 32; j < (b0 + bs) / 32; ++j) d[j] = db;
  }
  for (int64_t g = 0; g < kp / 16; ++g) {
    int sum = 0;
    for (int e = 0; e < 16; ++e) sum += q[16 * g + e];
    s[g] = static_cast<int16_t>(sum);
  }
}

void qgroups_avx2(QGemmFn* gemm) { set_qgroups8<Maddubs>(gemm); }

void qunpack_avx2(QUnpackFn* unpack) {
  unpack[quant_index(EP_MOE_DTYPE_MXFP4)] = unpack_mxfp4;
  unpack[quant_index(EP_MOE_DTYPE_Q5_K)] = unpack_q5k;
  unpack[quant_index(EP_MOE_DTYPE_Q6_K)] = unpack_q6k;
}

}  // namespace cpu
}  // namespace ep_moe

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

#include "cpu/qfused_rows.inc"

// Activation row q (k values) in the blocks' order: per 256, for s = 0..3
// the 32 values at 32 s, then the 32 at 128 + 32 s.
void permute_q2k(const int8_t* q, int k, int8_t* out) {
  for (int b = 0; b < k; b += 256)
    for (int s = 0; s < 4; ++s) {
      std::memcpy(out + b + 64 * s, q + b + 32 * s, 32);
      std::memcpy(out + b + 64 * s + 32, q + b + 128 + 32 * s, 32);
    }
}

// One block unpacked for the driver below: u[s] the values of vector s as
// u8, lsc[s] each group's scale in the 16-bit lanes of its 8 pairs of
// products, `mins` 16 int16 coefficients of the groups' activation sums,
// and the block's float factors: the row is
//   sum_blocks d_a (scale (sum_s madd(maddubs(u[s], q[s]), lsc[s])) - mscale (mins . asum)).
struct Unpacked {
  __m512i u[4], lsc[4];
  __m256i mins;
  float scale, mscale;
};

// 16-bit lanes 0-7 group 2 s, 8-15 2 s + 1, 16-23 8 + 2 s, 24-31 9 + 2 s.
struct LaneGroups {
  __m256i idx[4];
  LaneGroups() {
    for (int s = 0; s < 4; ++s) {
      alignas(32) uint8_t g[32];
      for (int l = 0; l < 32; ++l) g[l] = static_cast<uint8_t>((l < 16 ? 2 * s : 8 + 2 * s) + (l / 8) % 2);
      idx[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(g));
    }
  }
  // 16 byte scales (signed or not) into the lanes of each vector s.
  template <bool Signed>
  void spread(__m128i sc, __m512i* lsc) const {
    const __m256i sc2 = _mm256_broadcastsi128_si256(sc);  // vpshufb picks within each 128-bit half
    for (int s = 0; s < 4; ++s) {
      const __m256i b = _mm256_shuffle_epi8(sc2, idx[s]);
      lsc[s] = Signed ? _mm512_cvtepi8_epi16(b) : _mm512_cvtepu8_epi16(b);
    }
  }
};

// Q2_K (84 bytes: scales[16], qs[64], d, dmin): values 0..3 (at most
// 2 x 3 x 127 a maddubs pair), 4-bit scales, 4-bit mins times dmin.
struct Q2K {
  static constexpr ep_moe_dtype_t kType = EP_MOE_DTYPE_Q2_K;
  static constexpr size_t kBytes = 84;
  static void unpack(const uint8_t* blk, const LaneGroups& lg, Unpacked* o) {
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m512i two = _mm512_set1_epi8(3);
    const __m512i x = _mm512_loadu_si512(blk + 16);
    for (int s = 0; s < 4; ++s) o->u[s] = _mm512_and_si512(_mm512_srli_epi16(x, 2 * s), two);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    lg.spread<false>(_mm_and_si128(sc, nib), o->lsc);
    o->mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), nib));
    o->scale = f16at(blk + 80);
    o->mscale = f16at(blk + 82);
  }
};

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

// Q3_K (110 bytes: hmask[32], qs[64], scales[12], d): its values + 4 (0..7,
// the high bit set where hmask's bit is), the 4 taken off through the
// scales against the groups' activation sums; 6-bit signed scales.
struct Q3K {
  static constexpr ep_moe_dtype_t kType = EP_MOE_DTYPE_Q3_K;
  static constexpr size_t kBytes = 110;
  static void unpack(const uint8_t* blk, const LaneGroups& lg, Unpacked* o) {
    const __m512i two = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i x = _mm512_loadu_si512(blk + 32);
    // hmask bit s of byte i for elements 32 s + i, bit 4 + s for 128 + 32 s + i.
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(hm), _mm256_srli_epi16(hm, 4), 1);
    for (int s = 0; s < 4; ++s)
      o->u[s] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x, 2 * s), two),
                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, s), one), 2));
    const __m128i sc8 = q3k_scales(blk + 96);
    lg.spread<true>(sc8, o->lsc);
    o->mins = _mm256_cvtepi8_epi16(sc8);
    o->scale = f16at(blk + 108);
    o->mscale = 4.0f * o->scale;
  }
};

// M activation rows (a compile-time count, so that each row's
// accumulators stay in registers across the blocks).
template <class F, int M>
void unpacked_rows(const void* const* a, int k, const void* panel, int nr, float* c, int ldc) {
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
  static const LaneGroups lg;
  const size_t rb = static_cast<size_t>(k / 256) * F::kBytes;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* row = static_cast<const uint8_t*>(panel) + static_cast<size_t>(j) * rb;
    __m512 acc[M];
    __m256 macc[M];
    for (int i = 0; i < M; ++i) {
      acc[i] = _mm512_setzero_ps();
      macc[i] = _mm256_setzero_ps();
    }
    for (int b = 0; b < k / 256; ++b) {
      const uint8_t* blk = row + F::kBytes * static_cast<size_t>(b);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
      Unpacked w;
      F::unpack(blk, lg, &w);
      for (int i = 0; i < M; ++i) {
        const int8_t* q = perm.data() + static_cast<size_t>(i) * k + 256 * b;
        __m512i isum = _mm512_setzero_si512();
        // maddubs: pairs of products, then pairs of those times the
        // group's scale (vpmaddwd): int32 lanes of 4 values of one group.
        for (int s = 0; s < 4; ++s)
          isum = _mm512_add_epi32(
              isum, _mm512_madd_epi16(_mm512_maddubs_epi16(w.u[s], _mm512_loadu_si512(q + 64 * s)), w.lsc[s]));
        const float dai = da[i][8 * b];
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w.scale * dai), acc[i]);
        const __m256i mm =
            _mm256_madd_epi16(w.mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa[i] + 16 * b)));
        macc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(w.mscale * dai), macc[i]);
      }
    }
    for (int i = 0; i < M; ++i) c[i * ldc + j] = hsum(acc[i]) - hsum(macc[i]);
  }
}

// A format of this file as qfused_rows.inc's qgemm takes it.
template <class F>
struct Unpacking {
  static constexpr ep_moe_dtype_t kType = F::kType;
  template <int M>
  static void rows(const void* const* a, int k, const void* panel, int nr, float* c, int ldc) {
    unpacked_rows<F, M>(a, k, panel, nr, c, ldc);
  }
};

}  // namespace

void qfused_avx512vnni(QGemmFn* gemm) {
  install<Unpacking<Q2K>>(gemm);
  install<Unpacking<Q3K>>(gemm);
}

}  // namespace cpu
}  // namespace ep_moe

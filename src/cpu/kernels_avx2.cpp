// AVX2 + FMA + F16C tiles (built with -mavx2 -mfma -mf16c; called only
// when the CPU has them).
#include <immintrin.h>

#include <type_traits>

#include <cmath>

#include "common/dtype.hpp"
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

// Tiles of 3-6 rows over bf16 panels (k-pair order), in inline asm; the
// shared tile_m (kernels_x86.inc) calls bf16_tile_asm<M> for them.
//
// Why asm: with AVX2's 16 vector registers, six rows need twelve
// accumulators, two widened weight vectors, a broadcast and the odd-row
// mask, all sixteen. GCC 12 did not manage that allocation in the C++ loop:
// it rotated accumulators through the weight and broadcast registers (two
// or three register moves a k pair), reloaded the mask from the stack,
// and recomputed the prefetch address with a multiply, ~62 instructions
// around 24 FMAs; at five and four rows it still rotated them. (An empty
// asm keeping the broadcast live, used until this change, had stopped the
// worst of it: accumulators going to the stack every k pair.) Here row i
// sums in ymm(2i) and ymm(2i+1), the widened weights are ymm12-13, the
// broadcast ymm14 and the mask ymm15: 47 instructions a k pair at six
// rows. Every accumulator sees the same FMAs in the same order as the C++
// loop's, so the bits are the same.
//
// Why assembly: the compiler's version of this loop spills, and the
// hand-allocated one is faster for tiles of 4-6 rows, where the arithmetic
// binds; at 3 rows the weight stream binds and both are equal, but 3 rows
// stay here so that one loop serves every bf16 tile of 3-6 rows (the
// measurements are in the commit that introduced it).
//
// Operands: the row pointers a0..a5 and the panel w are offset to the end
// of the k pairs, and ix runs from -8 * pairs up to 0 (8 bytes of each row
// and 64 of the panel per pair), so the loop needs no end register; an odd
// k's last row is the even half of one more pair at ix = 0 (its partner in
// the panel is zero padding, and a[k] is not read). The rest are memory
// operands, so that the asm needs only ten general registers even at -O0
// with a frame pointer.
#define EPM_ROW(i, ea, eb, off)             \
  "vbroadcastss " off "(%[a" #i             \
  "],%[ix]), %%ymm14\n\t"                   \
  "vfmadd231ps %%ymm12, %%ymm14, %%ymm" #ea \
  "\n\t"                                    \
  "vfmadd231ps %%ymm13, %%ymm14, %%ymm" #eb "\n\t"
#define EPM_H3(off) EPM_ROW(0, 0, 1, off) EPM_ROW(1, 2, 3, off) EPM_ROW(2, 4, 5, off)
#define EPM_H4(off) EPM_H3(off) EPM_ROW(3, 6, 7, off)
#define EPM_H5(off) EPM_H4(off) EPM_ROW(4, 8, 9, off)
#define EPM_H6(off) EPM_H5(off) EPM_ROW(5, 10, 11, off)
#define EPM_Z(r) "vxorps %%xmm" #r ", %%xmm" #r ", %%xmm" #r "\n\t"
#define EPM_Z3 EPM_Z(0) EPM_Z(1) EPM_Z(2) EPM_Z(3) EPM_Z(4) EPM_Z(5)
#define EPM_Z4 EPM_Z3 EPM_Z(6) EPM_Z(7)
#define EPM_Z5 EPM_Z4 EPM_Z(8) EPM_Z(9)
#define EPM_Z6 EPM_Z5 EPM_Z(10) EPM_Z(11)
#define EPM_S(ea, eb) \
  "vmovups %%ymm" #ea \
  ", (%[c])\n\t"      \
  "vmovups %%ymm" #eb \
  ", 32(%[c])\n\t"    \
  "add %[ldc], %[c]\n\t"
#define EPM_S3 EPM_S(0, 1) EPM_S(2, 3) EPM_S(4, 5)
#define EPM_S4 EPM_S3 EPM_S(6, 7)
#define EPM_S5 EPM_S4 EPM_S(8, 9)
#define EPM_S6 EPM_S5 EPM_S(10, 11)
// Row k (even) of the pair at ix: the low halves shifted up; row k + 1
// (odd): the high halves, masked.
#define EPM_EVEN(H)                       \
  "vmovdqu (%[w],%[ix],8), %%ymm12\n\t"   \
  "vmovdqu 32(%[w],%[ix],8), %%ymm13\n\t" \
  "vpslld $16, %%ymm12, %%ymm12\n\t"      \
  "vpslld $16, %%ymm13, %%ymm13\n\t" H("")
#define EPM_ODD(H)                             \
  "vpand (%[w],%[ix],8), %%ymm15, %%ymm12\n\t" \
  "vpand 32(%[w],%[ix],8), %%ymm15, %%ymm13\n\t" H("4")
#define EPM_TILE(PF, H, Z, S) \
  Z "vpbroadcastd %[mask], %%ymm15\n\t"                                                 \
  "test %[ix], %[ix]\n\t" "jz 2f\n\t"                                                   \
  "1:\n\t" PF EPM_EVEN(H) EPM_ODD(H) "add $8, %[ix]\n\t" "jnz 1b\n\t"                   \
  "2:\n\t" "cmpq $0, %[odd]\n\t" "je 3f\n\t" EPM_EVEN(H)                                \
  "3:\n\t" S "vzeroupper\n\t"
#define EPM_OPERANDS                                                                                           \
  : [ix] "+r"(ix), [pf] "+r"(pf), [c] "+r"(c)                                                               \
  : [mask] "m"(mask), [odd] "m"(odd), [ldc] "m"(ldcb), [pfs] "m"(pfs), [w] "r"(w), [a0] "r"(r[0]),          \
    [a1] "r"(r[1]), [a2] "r"(r[2]), [a3] "r"(r[3]), [a4] "r"(r[4]), [a5] "r"(r[5])                          \
  : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
    "xmm13", "xmm14", "xmm15", "cc", "memory"
#define EPM_PF0            \
  "prefetcht0 (%[pf])\n\t" \
  "add %[pfs], %[pf]\n\t"
#define EPM_PF1            \
  "prefetcht1 (%[pf])\n\t" \
  "add %[pfs], %[pf]\n\t"
#define EPM_CASE(H, Z, S)                                             \
  if (!pf) asm volatile(EPM_TILE("", H, Z, S) EPM_OPERANDS);          \
  else if (l1) asm volatile(EPM_TILE(EPM_PF0, H, Z, S) EPM_OPERANDS); \
  else asm volatile(EPM_TILE(EPM_PF1, H, Z, S) EPM_OPERANDS)

namespace {
// Rows [0, M) of a bf16 tile into c, as the C++ tile_m<M, 1, l1> computes
// them: while it runs, pf (if not null) is prefetched, into L1 when l1,
// else into L2, advancing pf_stride bytes per k pair.
template <int M>
void bf16_tile_asm(const float* const* a, int k, const uint16_t* panel, float* c, int ldc, const char* pf,
                   int pf_stride, bool l1) {
  static_assert(M >= 3 && M <= 6, "the asm tiles have 3 to 6 rows");
  const int64_t pairs = k / 2;
  int64_t ix = -8 * pairs;
  const int64_t odd = k & 1, ldcb = static_cast<int64_t>(ldc) * 4, pfs = pf_stride;
  const int32_t mask = static_cast<int32_t>(0xFFFF0000u);
  const uint16_t* w = panel + pairs * 2 * NR;
  const char* r[6];
  for (int i = 0; i < 6; ++i) r[i] = reinterpret_cast<const char*>(a[i < M ? i : M - 1] + 2 * pairs);
  if constexpr (M == 3) {
    EPM_CASE(EPM_H3, EPM_Z3, EPM_S3);
  } else if constexpr (M == 4) {
    EPM_CASE(EPM_H4, EPM_Z4, EPM_S4);
  } else if constexpr (M == 5) {
    EPM_CASE(EPM_H5, EPM_Z5, EPM_S5);
  } else {
    EPM_CASE(EPM_H6, EPM_Z6, EPM_S6);
  }
}
}  // namespace
#undef EPM_ROW
#undef EPM_H3
#undef EPM_H4
#undef EPM_H5
#undef EPM_H6
#undef EPM_Z
#undef EPM_Z3
#undef EPM_Z4
#undef EPM_Z5
#undef EPM_Z6
#undef EPM_S
#undef EPM_S3
#undef EPM_S4
#undef EPM_S5
#undef EPM_S6
#undef EPM_EVEN
#undef EPM_ODD
#undef EPM_TILE
#undef EPM_OPERANDS
#undef EPM_PF0
#undef EPM_PF1
#undef EPM_CASE
#define EP_MOE_AVX2_BF16_ASM_TILES 1

#include "cpu/kernels_x86.inc"

// Row conversions (AVX2 + F16C; scalar tails from common/dtype.hpp).
namespace {
// Eight f32 values rounded to bf16 (to nearest, ties to even; a NaN stays
// a quiet NaN), each in the low half of a 32-bit lane, as f32_to_bf16 does.
// The NaN test is an unordered compare: one instruction instead of a mask
// and an integer compare. Like any f32 arithmetic it sets MXCSR's invalid
// flag for a signalling NaN; what the layer narrows (sums of FMAs, zeros)
// never is one.
inline __m256i bf16_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}
// 16 values to bf16 at dst: columns 0-7 in a and 8-15 in b, or, when
// `interleaved`, 0-3 and 8-11 in a and 4-7 and 12-15 in b (the order of
// sum_rows_avx2's widened bf16 rows), which is the order in which a
// lane-wise pack leaves them; else the pack's 64-bit blocks a0 b0 a1 b1
// are put back in order.
inline void store_bf16x16(uint16_t* dst, __m256 a, __m256 b, bool interleaved) {
  const __m256i p = _mm256_packus_epi32(bf16_lanes(a), bf16_lanes(b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), interleaved ? p : _mm256_permute4x64_epi64(p, 0xD8));
}
// 16 values a step, packed together and stored as one 32-byte vector, NaN
// found with a compare (faster than 8 a step or an integer NaN test). The
// same bits as f32_to_bf16 for every one of the 2^32 inputs (checked once,
// outside the tests; the unit test covers ties, denormals, infinities and
// both kinds of NaN).
void row_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16x16(dst + i, _mm256_loadu_ps(src + i), _mm256_loadu_ps(src + i + 8), false);
  if (i + 8 <= n) {
    const __m256i v = bf16_lanes(_mm256_loadu_ps(src + i));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);  // 64-bit blocks 0 and 2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(p));
    i += 8;
  }
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
void row_from_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_castsi256_ps(_mm256_slli_epi32(
                         _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16)));
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
void row_to_f16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
void row_from_f16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
// GEMM epilogues (AVX2 + FMA; scalar tails).
inline __m256 vexp(__m256 x) {  // as the AVX-512 one; 2^n by the exponent field
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
void silu_mul(const float* g, const float* u, float* out, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 s =
        _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), vexp(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
void axpy(float* dst, float w, const float* x, int n) {
  const __m256 wv = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(dst + i)));
  for (; i < n; ++i) dst[i] += w * x[i];
}
void scatter_add(float* acc, int64_t ldacc, const int32_t* rows, const float* w, const float* c, int ldc, int m,
                 int n) {
  for (int i = 0; i < m; ++i)
    if (w[i] != 0.0f)  // kernels.hpp: a row of weight 0 adds nothing
      axpy(acc + static_cast<int64_t>(rows[i]) * ldacc, w[i], c + static_cast<int64_t>(i) * ldc, n);
}
}  // namespace

// Kernels::sum_rows. 64 columns at a time, their sums in eight registers
// while every row is added, so no f32 row is written and read back per
// row, and narrowed (where out_dt is 16-bit) straight from the registers.
// (Widening each row into a buffer and adding that, then narrowing in a
// second pass, took about twice as long.) bf16 rows widen
// by interleaving with zeros, 16 values a load: the sums then hold
// columns 0-3 and 8-11 in one register and 4-7 and 12-15 in the next
// (each column's additions are unchanged), which is the order in which
// a lane-wise pack to bf16 wants them; f32 and f16 outputs put them back
// in column order.
void sum_rows_avx2(void* out, ep_moe_dtype_t out_dt, const float* init, const void* const* rows, int nrows,
                   ep_moe_dtype_t dt, int64_t col0, int64_t n) {
  const auto r16 = [rows](int q) { return static_cast<const uint16_t*>(rows[q]); };
  const auto r32 = [rows](int q) { return static_cast<const float*>(rows[q]); };
  const bool bf16 = dt == EP_MOE_DTYPE_BF16;
  float* const o32 = static_cast<float*>(out);
  uint16_t* const o16 = static_cast<uint16_t*>(out);
  // Eight values of row q from column j, in order (f32 and f16 rows).
  const auto load8 = [&](int q, int64_t j) {
    return dt == EP_MOE_DTYPE_F32
               ? _mm256_loadu_ps(r32(q) + col0 + j)
               : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r16(q) + col0 + j)));
  };
  // The sums of columns j .. j + 15 in a and b: in the interleaved order
  // above when `mixed`, else a holds j .. j + 7 and b the next eight.
  const auto store16 = [&](int64_t j, __m256 a, __m256 b, bool mixed) {
    if (out_dt == EP_MOE_DTYPE_BF16) return store_bf16x16(o16 + j, a, b, mixed);
    const __m256 lo = mixed ? _mm256_permute2f128_ps(a, b, 0x20) : a,
                 hi = mixed ? _mm256_permute2f128_ps(a, b, 0x31) : b;
    if (out_dt == EP_MOE_DTYPE_F32) {
      _mm256_storeu_ps(o32 + j, lo);
      _mm256_storeu_ps(o32 + j + 8, hi);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o16 + j),
                       _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o16 + j + 8),
                       _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  };
  int64_t j = 0;
  if (bf16) {
    const __m256i zero = _mm256_setzero_si256();
    for (; j + 64 <= n; j += 64) {
      __m256 s[8];
      int q = 0;
      if (init) {
        for (int b = 0; b < 4; ++b) {  // to the interleaved order
          const __m256 lo = _mm256_loadu_ps(init + j + 16 * b), hi = _mm256_loadu_ps(init + j + 16 * b + 8);
          s[2 * b] = _mm256_permute2f128_ps(lo, hi, 0x20);
          s[2 * b + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
      } else if (nrows > 0) {
        for (int b = 0; b < 4; ++b) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r16(0) + col0 + j + 16 * b));
          s[2 * b] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
          s[2 * b + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
        }
        q = 1;
      } else {
        for (auto& v : s) v = _mm256_setzero_ps();
      }
      for (; q < nrows; ++q) {
        const uint16_t* r = r16(q) + col0 + j;
        for (int b = 0; b < 4; ++b) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * b));
          s[2 * b] = _mm256_add_ps(s[2 * b], _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)));
          s[2 * b + 1] = _mm256_add_ps(s[2 * b + 1], _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)));
        }
      }
      for (int b = 0; b < 4; ++b) store16(j + 16 * b, s[2 * b], s[2 * b + 1], true);
    }
  } else {
    for (; j + 64 <= n; j += 64) {
      __m256 s[8];
      int q = 0;
      if (init) {
        for (int b = 0; b < 8; ++b) s[b] = _mm256_loadu_ps(init + j + 8 * b);
      } else if (nrows > 0) {
        for (int b = 0; b < 8; ++b) s[b] = load8(0, j + 8 * b);
        q = 1;
      } else {
        for (auto& v : s) v = _mm256_setzero_ps();
      }
      for (; q < nrows; ++q)
        for (int b = 0; b < 8; ++b) s[b] = _mm256_add_ps(s[b], load8(q, j + 8 * b));
      for (int b = 0; b < 4; ++b) store16(j + 16 * b, s[2 * b], s[2 * b + 1], false);
    }
  }
  if (j == n) return;
  // The tail (under 64 columns): summed by the portable code, narrowed by
  // this table's conversions.
  if (out_dt == EP_MOE_DTYPE_F32) {
    sum_rows_scalar(o32 + j, out_dt, init ? init + j : nullptr, rows, nrows, dt, col0 + j, n - j);
    return;
  }
  float tail[64];
  sum_rows_scalar(tail, EP_MOE_DTYPE_F32, init ? init + j : nullptr, rows, nrows, dt, col0 + j, n - j);
  if (out_dt == EP_MOE_DTYPE_BF16) row_to_bf16(tail, o16 + j, n - j);
  else row_to_f16(tail, o16 + j, n - j);
}

namespace {
Kernels make_avx2() {
  return [] {
    Kernels t{Isa::Avx2,
              NR,
              MR,
              {gemm<0>, gemm<1>, gemm<2>},
              nullptr,
              row_to_bf16,
              row_from_bf16,
              row_to_f16,
              row_from_f16,
              silu_mul,
              scatter_add,
              sum_rows_avx2,
              {gemv<0>, gemv<1>, gemv<2>},
              nullptr,
              {gemm_run<0>, gemm_run<1>, gemm_run<2>},
              {kRunRows<0>, kRunRows<1>, kRunRows<2>}};
    set_x86_block_kernels(t, false);
    return t;
  }();
}
}  // namespace

// With and without AVX-VNNI's block kernels (EP_MOE_CPU_ISA "-avxvnni", or
// a CPU without it): each built at its first use.
const Kernels& kernels_avx2() {
  if (has_avx_vnni()) {
    static const Kernels k = make_avx2();
    return k;
  }
  static const Kernels k = make_avx2();
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

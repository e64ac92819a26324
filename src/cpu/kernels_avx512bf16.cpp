// AVX-512 tiles plus the bf16 pair-dot tile (built with -mavx512bf16; called
// only when the CPU has AVX512_BF16).
#include <immintrin.h>

#include <type_traits>

#include <cstring>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#include "cpu/kernels_avx512.inc"

namespace {

// bf16 panels are stored in k-pair order (pack.hpp): the 32-bit word j of
// pair block k/2 holds (W[j][k], W[j][k + 1]), exactly the operand layout of
// vdpbf16ps, so two plain loads give columns 0..15 and 16..31.
template <int M, bool L1>
void dot_tile_m(const uint16_t* const* a, int k, const void* panel, float* c, int ldc, const char* pf, int pf_stride) {
  __m512 acc0[M], acc1[M];
  const uint16_t* ap[M];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    acc0[i] = _mm512_setzero_ps();
    acc1[i] = _mm512_setzero_ps();
    ap[i] = a[i];
  }
  const uint16_t* w = static_cast<const uint16_t*>(panel);
  int kk = 0;
  for (const char* n = pf; kk + 1 < k; kk += 2) {
    const uint16_t* q = w + static_cast<size_t>(kk) * NR;
    if (pf) {
      _mm_prefetch(n, L1 ? _MM_HINT_T0 : _MM_HINT_T1);
      if (pf_stride > 64) _mm_prefetch(n + 64, L1 ? _MM_HINT_T0 : _MM_HINT_T1);
      n += pf_stride;
    }
    // The empty asm keeps the two weight vectors in registers: without it
    // GCC loads each again for every row (2 * M loads a step instead of 2,
    // never folded into vdpbf16ps). About 1 % of decode and prefill time.
    __m512i l0 = _mm512_loadu_si512(q), l1 = _mm512_loadu_si512(q + 2 * LANES);
    asm("" : "+v"(l0), "+v"(l1));
    const __m512bh b0 = reinterpret_cast<__m512bh>(l0);
    const __m512bh b1 = reinterpret_cast<__m512bh>(l1);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      int32_t pair;
      std::memcpy(&pair, ap[i] + kk, 4);
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], av, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], av, b1);
    }
  }
  if (kk < k) {  // odd k: the last row; its pair partner in the panel is zero padding
    const uint16_t* q = w + static_cast<size_t>(kk) * NR;
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 2 * LANES));
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const int32_t pair = ap[i][kk];  // (a[kk], 0): nothing read past the row
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], av, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], av, b1);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc0[i]);
    _mm512_storeu_ps(c + i * ldc + LANES, acc1[i]);
  }
}

// The pair-dot tiles take up to 12 rows, not MR (8): 24 accumulators, the
// two weight vectors and a broadcast use 27 of the 32 zmm registers (GCC
// spills one general register, reloaded once per k step). Fewer tiles per
// panel: mixtral T=32's experts of 9-12 rows stream their panels once
// instead of twice, and prefill reads each panel from L2 fewer times.
// Alternated with 8 in one process (expert time): mixtral T=32 0.966-0.972,
// qwen3 T=512 0.962-0.971, mixtral T=512 0.949-0.994; qwen2-57b T=512
// 1.010-1.013 and the other decode rows within +-1 %. The bits do not
// depend on the tile: each accumulator sums its row over k in order.
constexpr int kDotRows = 12;

template <bool L1>
void dot_rows_of(int m, const uint16_t* const* a, int k, const void* panel, float* c, int ldc, const char* pf,
                 int pf_stride) {
  switch (m) {
    case 1: dot_tile_m<1, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 2: dot_tile_m<2, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 3: dot_tile_m<3, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 4: dot_tile_m<4, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 5: dot_tile_m<5, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 6: dot_tile_m<6, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 7: dot_tile_m<7, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 8: dot_tile_m<8, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 9: dot_tile_m<9, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 10: dot_tile_m<10, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 11: dot_tile_m<11, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    case 12: dot_tile_m<12, L1>(a, k, panel, c, ldc, pf, pf_stride); break;
    default: break;
  }
}

void dot_rows(int m, const uint16_t* const* a, int k, const void* panel, float* c, int ldc, const char* pf,
              int pf_stride, bool l1) {
  if (l1) dot_rows_of<true>(m, a, k, panel, c, ldc, pf, pf_stride);
  else dot_rows_of<false>(m, a, k, panel, c, ldc, pf, pf_stride);
}

// Any m, split into register tiles as gemm<> (for_row_tiles), except that
// two rows, like one, leave a following panel to the hardware prefetcher.
void dot_gemm(int m, const uint16_t* const* a, int k, const void* panel, float* c, int ldc, const void* next) {
  for_row_tiles<kDotRows, 3>(m, panel, panel_steps<1>(k), panel_step<1>(), next,
                             [&](int r0, int rows, const char* pf, int stride, bool l1) {
                               dot_rows(rows, a + r0, k, panel, c + static_cast<size_t>(r0) * ldc, ldc, pf, stride, l1);
                             });
}

// One row through two neighbouring panels at once: four accumulator
// chains; each column's sum in dot_tile_m<1>'s order (the same bits).
void dot_row_pair(const uint16_t* a, int k, const void* panel, size_t pb, float* c) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const uint16_t* w0 = static_cast<const uint16_t*>(panel);
  const uint16_t* w1 = reinterpret_cast<const uint16_t*>(static_cast<const char*>(panel) + pb);
  const auto step = [&](int kk, int32_t pair) {
    const size_t o = static_cast<size_t>(kk) * NR;
    const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
    acc[0] = _mm512_dpbf16_ps(acc[0], av, reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + o)));
    acc[1] = _mm512_dpbf16_ps(acc[1], av, reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + o + 2 * LANES)));
    acc[2] = _mm512_dpbf16_ps(acc[2], av, reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + o)));
    acc[3] = _mm512_dpbf16_ps(acc[3], av, reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + o + 2 * LANES)));
  };
  int kk = 0;
  for (; kk + 1 < k; kk += 2) {
    int32_t pair;
    std::memcpy(&pair, a + kk, 4);
    step(kk, pair);
  }
  if (kk < k) step(kk, a[kk]);  // (a[kk], 0): nothing read past the row
  _mm512_storeu_ps(c, acc[0]);
  _mm512_storeu_ps(c + LANES, acc[1]);
  _mm512_storeu_ps(c + NR, acc[2]);
  _mm512_storeu_ps(c + NR + LANES, acc[3]);
}

// GemvBf16Fn, as gemv<> (kernels_x86.inc).
void dot_gemv(const uint16_t* a, int k, const void* panel, int np, float* c, const void* next) {
  const size_t pb = static_cast<size_t>(panel_steps<1>(k)) * static_cast<size_t>(panel_step<1>());
  for_panel_pairs(
      panel, np, pb, NR, c, next, [&](const char* p, float* cj) { dot_row_pair(a, k, p, pb, cj); },
      [&](const char* p, float* cj, const void* nx) { dot_gemm(1, &a, k, p, cj, NR, nx); });
}

}  // namespace

namespace {
Kernels make_avx512bf16() {
  return [] {
    Kernels t{Isa::Avx512Bf16,
              NR,
              MR,
              {gemm<0>, gemm<1>, gemm<2>},
              dot_gemm,
              row_to_bf16,
              row_from_bf16,
              row_to_f16,
              row_from_f16,
              silu_mul,
              scatter_add,
              sum_rows_avx2,
              {gemv<0>, gemv<1>, gemv<2>},
              dot_gemv};
    set_x86_block_kernels(t, true);
    return t;
  }();
}
}  // namespace

// With and without AVX512_VNNI's block kernels, as kernels_avx512().
const Kernels& kernels_avx512bf16() {
  if (has_avx512_vnni()) {
    static const Kernels k = make_avx512bf16();
    return k;
  }
  static const Kernels k = make_avx512bf16();
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

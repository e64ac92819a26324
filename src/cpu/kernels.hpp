// GEMM micro-kernels over packed weight panels.
//
// A weight matrix W [N, K] (checkpoint orientation: out x in) is packed in
// panels of `nr` output columns, zero-padded past N (layouts in pack.hpp).
// A kernel computes, for m activation rows a[i] (K long),
//   c[i * ldc + j] = sum_k a[i][k] * W[p * nr + j][k],  j < nr,
// with f32 accumulation; 16-bit weights are widened in registers. Any m:
// rows go in blocks of `mr` (the register tile), each over all of k.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/quant.hpp"
#include "cpu/isa.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cpu {

// `next`: the panel the caller will use next (or null), prefetched into L2.
using GemmFn = void (*)(int m, const float* const* a, int k, const void* panel, float* c, int ldc, const void* next);
// The same over bf16 activation rows and bf16 panels, with bf16 pair dot
// products (AVX512_BF16): each product is exact in f32, the sums are f32.
using GemmBf16Fn = void (*)(int m, const uint16_t* const* a, int k, const void* panel, float* c, int ldc,
                            const void* next);

// One activation row through `np` consecutive panels of one packed weight
// (decode: one token for the expert): c[j * nr + col] for panel j. The
// same bits as `np` calls of GemmFn with m = 1; two panels at a time, so
// four accumulator chains run instead of two. `next`: as for GemmFn, the
// panel the caller uses after the last of them.
using GemvFn = void (*)(const float* a, int k, const void* panel, int np, float* c, const void* next);
using GemvBf16Fn = void (*)(const uint16_t* a, int k, const void* panel, int np, float* c, const void* next);

// m rows (2 <= m <= Kernels::run_rows[dtype]) through np consecutive panels:
// c[i * ldc + j * nr + col] for row i and panel j. The same bits as np
// GemmFn calls; two panels at a time, so each row has four accumulator
// chains instead of two (AVX2, where a 2-row tile waited on the FMA
// latency). `next`: as for GemvFn.
using GemmRunFn = void (*)(int m, const float* const* a, int k, const void* panel, int np, float* c, int ldc,
                           const void* next);

// Block-format weights (common/quant.hpp): m activation rows (quantized
// as act_quant_of(the weight's dtype) says, each act_row_bytes(k)) through
// one panel of nr rows of blocks, in the row layout the table's qil names
// for the format (pack.hpp):
//   c[i * ldc + j] = sum_k a_i[k] W[p * nr + j][k],  j < nr,
// as exact integer dot products of each block, scaled and summed in f32.
using QGemmFn = void (*)(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc,
                         const void* next);

// Block-format panels unpacked for the int8 tiles, a table's whole panel
// (nr weight rows: kQTileCols with AVX512-VNNI, qtile_avx512vnni.cpp; 16
// on AVX2, qtile_avx2.cpp) at a time: the weights as u8 in k-groups of 4
// across the panel's rows, with their scales per block (qtile_panel_bytes
// bytes for k elements a row; cpu/qtile_layout.hpp).
constexpr int kQTileCols = 32;
using QUnpackFn = void (*)(const void* panel, int k, void* out);
// m activation rows (as for QGemmFn) through an unpacked panel:
// c[i * ldc + j] for j < nr, the same exact integer sums per block as the
// block kernels' (summed in f32 in another order). `next`: the block
// panel the caller unpacks next (or null), prefetched into L2 over the
// call.
using QTileFn = void (*)(int m, const void* const* a, int k, const void* tiles, float* c, int ldc, const void* next);
// Bytes of an unpacked panel of `cols` rows of block format t (0 for
// dtypes that are not block formats): per 32 elements (Q8_0, Q4_0, MXFP4)
// 32 x cols u8 and cols f32 scales; per 256 (Q4_K, Q5_K, IQ4_XS: 8 groups
// of 32; Q6_K: 16 of 16) 256 x cols u8, groups x cols scales (a dword
// each) and i16 coefficients, cols f32 d and cols f32 dmin.
constexpr size_t qtile_panel_bytes(ep_moe_dtype_t t, int64_t k, int cols = kQTileCols) {
  const auto c = static_cast<size_t>(cols);
  switch (t) {
    case EP_MOE_DTYPE_Q8_0:
    case EP_MOE_DTYPE_Q4_0:
    case EP_MOE_DTYPE_MXFP4: return static_cast<size_t>(k / 32) * (32 * c + 4 * c);
    case EP_MOE_DTYPE_Q4_K:
    case EP_MOE_DTYPE_Q5_K:
    case EP_MOE_DTYPE_IQ4_XS: return static_cast<size_t>(k / 256) * (256 * c + (8 * 4 + 8 * 2 + 4 + 4) * c);
    case EP_MOE_DTYPE_Q6_K: return static_cast<size_t>(k / 256) * (256 * c + (16 * 4 + 16 * 2 + 4 + 4) * c);
    default: return 0;
  }
}

struct Kernels {
  Isa isa;
  int nr;                          // panel width (output columns per tile)
  int mr;                          // rows of the register tile
  GemmFn gemm[3];                  // by weight dtype: f32, bf16, f16
  GemmBf16Fn gemm_bf16 = nullptr;  // bf16 x bf16, where the CPU has it
  // Row conversions, every ISA, bit-identical to common/dtype.hpp's scalar
  // ones: f32 -> bf16 rounds to nearest even and keeps NaNs quiet NaNs;
  // f16 with the F16C/AVX-512 rounding (nearest even).
  void (*to_bf16)(const float* src, uint16_t* dst, int64_t n) = nullptr;
  void (*from_bf16)(const uint16_t* src, float* dst, int64_t n) = nullptr;
  void (*to_f16)(const float* src, uint16_t* dst, int64_t n) = nullptr;
  void (*from_f16)(const uint16_t* src, float* dst, int64_t n) = nullptr;
  // GEMM epilogue: out[i] = silu(gate[i]) * up[i] (exp by a polynomial
  // within 2 ulp of expf).
  void (*silu_mul)(const float* gate, const float* up, float* out, int n) = nullptr;
  // The weighted combine of m result rows: for i < m, j < n,
  // acc[rows[i] * ldacc + j] += w[i] * c[i * ldc + j] (rows in order). A
  // row of weight 0 adds nothing, not 0 x its values: the weight-0 skip
  // strategy parks other ranks' pairs on local experts with weight 0, and
  // a NaN or Inf there must not reach a token that never chose the expert.
  void (*scatter_add)(float* acc, int64_t ldacc, const int32_t* rows, const float* w, const float* c, int ldc, int m,
                      int n) = nullptr;
  // The unweighted combine of rows, summed in f32: for j < n, the sum
  // init[j] + r_0[col0 + j] + r_1[col0 + j] + ..., added left to right,
  // over the nrows rows r_q of dtype dt (f32, bf16 or f16) widened to f32;
  // with init null the sum starts from r_0, and with no rows either it is
  // 0. The same bits as widening each row and adding it in turn. Written to
  // out[j] in out_dt: f32 as summed, bf16 or f16 narrowed as this table's
  // to_bf16 / to_f16 would narrow the f32 sums (an f16 NaN's payload may
  // differ).
  void (*sum_rows)(void* out, ep_moe_dtype_t out_dt, const float* init, const void* const* rows, int nrows,
                   ep_moe_dtype_t dt, int64_t col0, int64_t n) = nullptr;
  // Where set (null: call gemm with m = 1 per panel).
  GemvFn gemv[3] = {nullptr, nullptr, nullptr};  // by weight dtype
  GemvBf16Fn gemv_bf16 = nullptr;                // with gemm_bf16
  // Where set, rows 2 .. run_rows of an expert go through gemm_run (both
  // by weight dtype; f32 activations only).
  GemmRunFn gemm_run[3] = {nullptr, nullptr, nullptr};
  int run_rows[3] = {1, 1, 1};
  // By quant_index of the weight's block format (every table has all).
  QGemmFn qgemm[kQuantTypes] = {};
  // Which block-format kernels qgemm holds, for logs and benches.
  const char* qname = "portable";
  // By quant_index: the row interleave of the panels this table's
  // block-format entries (qgemm, qunpack) read (pack.hpp's
  // PackedWeight::il; 0: rows one after another).
  int qil[kQuantTypes] = {};
  int32_t il_of(ep_moe_dtype_t t) const { return dtype_is_quant(t) ? qil[quant_index(t)] : 0; }
  // An f32 row into an activation row (quantize_act_row's bytes).
  void (*quantize_act)(const float* x, int64_t k, ActQuant aq, void* out) = nullptr;
  // Where set: block-format panels unpacked for the int8 tiles (a whole
  // panel of nr rows at a time), used for an expert's calls of at least
  // qtile_rows rows (by quant_index; 0: never).
  QUnpackFn qunpack[kQuantTypes] = {};
  QTileFn qtile[kQuantTypes] = {};
  int qtile_rows[kQuantTypes] = {};
  // Whether an expert's call of m rows on weights of block format `t`
  // takes the int8 tiles.
  bool tiles(ep_moe_dtype_t t, int64_t m) const {
    const int i = quant_index(t);
    return qtile[i] != nullptr && qtile_rows[i] > 0 && m >= qtile_rows[i];
  }

  // Whether an expert's m rows with weights of dtype w go through runs of
  // consecutive panels (gemv or gemv_bf16 for one row, gemm_run for 2 ..
  // run_rows) rather than gemm per panel; dot: on the bf16 pair-dot tiles,
  // which have the one-row run only.
  bool runs_rows(int64_t m, int w, bool dot) const {
    if (m == 1) return dot ? gemv_bf16 != nullptr : gemv[w] != nullptr;
    return !dot && m >= 2 && m <= run_rows[w] && gemm_run[w] != nullptr;
  }
};

const Kernels& kernels_for(Isa isa);

// The kernels a layer runs: kernels_for(detect_isa()), except that on a CPU
// with AVX512_BF16 the AVX-512 table (bf16 weights widened to f32, no
// pair-dot tiles) is taken when bf16_dot_time_ratio() is above 1, unless
// EP_MOE_CPU_ISA is set (read at every call). The ratio is measured once
// per process, at the first call that needs it.
const Kernels& layer_kernels();

// Time of the bf16 pair-dot tiles over that of the widening AVX-512 tiles
// on the same in-cache GEMM (48 rows, one panel, k = 512; the best of 7
// alternated rounds each, a few ms in all). 0 where
// the x86 kernels are not built. Call only on a CPU with AVX512_BF16.
double bf16_dot_time_ratio();

// Kernels::sum_rows of the AVX2 table, which the AVX-512 tables share (a
// combine reads a few rows per token; 256-bit vectors keep up with it),
// and the portable one (the generic table's; the AVX2 one's tail).
void sum_rows_avx2(void* out, ep_moe_dtype_t out_dt, const float* init, const void* const* rows, int nrows,
                   ep_moe_dtype_t dt, int64_t col0, int64_t n);
void sum_rows_scalar(void* out, ep_moe_dtype_t out_dt, const float* init, const void* const* rows, int nrows,
                     ep_moe_dtype_t dt, int64_t col0, int64_t n);

// The block-format kernels on rows one after another, the portable table's
// (qkernels_generic.cpp), a full table by quant_index.
void qkernels_generic(QGemmFn* out);
// Every block format on rows interleaved 16 at a time (pack.hpp's
// kGroupRows; qgroups_avx512vnni.cpp): the AVX-512 tables' qgemm and
// qunpack entries where the CPU has AVX512_VNNI. One 512-bit vpdpbusd
// takes 4 elements of 16 weight rows against 4 of one activation row.
void qgroups_avx512vnni(QGemmFn* gemm, QUnpackFn* unpack);
// Every block format on rows interleaved 8 at a time (pack.hpp's
// kGroupRows8; qgroups_avx2.cpp, maddubs): the AVX2 table's qgemm entries,
// and the AVX-512 ones' where the CPU has no AVX512_VNNI; with the AVX2
// activation quantizer, which every x86 table takes.
void qgroups_avx2(QGemmFn* gemm);
// The same kernels through AVX-VNNI's vpdpbusd (qgroups_avxvnni.cpp), which
// take their place where the CPU has AVX-VNNI (isa.hpp's has_avx_vnni).
void qgroups_avxvnni(QGemmFn* gemm);
// The same arithmetic through AVX512_VNNI's 256-bit vpdpbusd
// (qgroups8_evex.cpp; in ep_moe_internal only, for the tests and the
// qkernel bench: it checks qgroups_avxvnni's arithmetic on such a CPU).
void qgroups8_vnni_evex(QGemmFn* gemm);
void quantize_act_avx2(const float* x, int64_t k, ActQuant aq, void* out);
// An x86 table's block-format entries: the AVX2 activation quantizer, and
// qgemm from the 8-row kernels (through AVX-VNNI where the CPU has it,
// else with the AVX2 table's int8 tiles for some formats), or on the
// AVX-512 tables (avx512) where the CPU has AVX512_VNNI the 16-row kernels
// and the int8 tiles. The interleaved kernels run every row count at least
// as fast as widening the panels to f32 for the f32 tiles would (no table
// widens). The tiles' thresholds (qtile_rows) are where
// ep_moe_qkernel_bench's t/c column passes 1 against the table's own block
// kernels (k 768 and 2048); the AVX2 table's twice that (kernels.cpp).
void set_x86_block_kernels(Kernels& t, bool avx512);
// The int8 tiles (qtile_avx512vnni.cpp), by quant_index (their panels
// unpacked by qgroups_avx512vnni's qunpack entries).
void qtiles_avx512vnni(QTileFn* tile);
// The AVX2 table's int8 tiles (qtile_avx2.cpp: maddubs on panels of 16
// rows) and their unpackers (qgroups_avx2.cpp), for the formats where they
// pay: set by quant_index, the rest left null.
void qtiles_avx2(QTileFn* tile);
void qunpack_avx2(QUnpackFn* unpack);

// Block kernels that decode in registers for calls of few activation rows
// (qfused_avx512vnni.cpp: Q2_K, Q3_K; qfused_avx512vbmi.cpp: IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, where
// has_avx512_vbmi()), replacing the decoded-row entries that
// qdecoded_avx512vnni set (which they keep for larger calls).
void qfused_avx512vnni(QGemmFn* gemm);
void qfused_avx512vbmi(QGemmFn* gemm);
// The FP8_E4M3 block kernels (qfp8_avx2.cpp, qfp8_avx512.cpp; rows one
// after another): the AVX2 table's and the AVX-512 tables'.
QGemmFn qfp8_avx2();
QGemmFn qfp8_avx512();

// Per-ISA tables, defined in their own translation units.
const Kernels& kernels_generic();
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
const Kernels& kernels_avx512bf16();

}  // namespace cpu
}  // namespace ep_moe

// GGUF's block formats: their geometry, exact dequantization, ep_moe's own
// quantizers, and the int8 activation rows the CPU kernels take
// (docs/quantization.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ep_moe/ep_moe.h"

namespace ep_moe {

// The block formats are the contiguous ep_moe_dtype_t values
// EP_MOE_DTYPE_Q8_0 .. kQuantLast; each has one QuantTraits entry
// (quant.cpp's table, filled by dtype) that every other part reads.
constexpr ep_moe_dtype_t kQuantFirst = EP_MOE_DTYPE_Q8_0, kQuantLast = EP_MOE_DTYPE_FP8_E4M3;
constexpr int kQuantTypes = static_cast<int>(kQuantLast) - static_cast<int>(kQuantFirst) + 1;
constexpr bool dtype_is_quant(ep_moe_dtype_t t) { return t >= kQuantFirst && t <= kQuantLast; }
// Index of a block type in per-type tables: 0 .. kQuantTypes - 1.
constexpr int quant_index(ep_moe_dtype_t t) { return static_cast<int>(t) - static_cast<int>(kQuantFirst); }

// int8 activation rows (below): one f32 scale per 32 (Q8_0-style) or per
// 256 (Q8_K-style) elements.
enum class ActQuant : int { Q8_0 = 0, Q8_K = 1 };

// A block as exact small integers: element i is sc[i / 16] * v[i]
// (+ mn[i / 16] for the formats with offsets), the same f32 value bit for
// bit as the format's dequantization (every product is exact: an f16 scale
// times integers of at most 13 bits in all). The formats without their own
// vector kernels are computed from this form (cpu/qdecoded.hpp).
struct DecodedBlock {
  int8_t v[256];
  float sc[16];
  float mn[16];
};

// Everything one block format is, in one place.
struct QuantTraits {
  ep_moe_dtype_t dtype;
  const char* name;       // ep_moe's lower-case name ("q4_k"): dtype_name, bench and demo options
  const char* gguf_name;  // GGUF's ("Q4_K")
  int gguf_type;          // GGUF's ggml_type number
  int block_elems, block_bytes;
  ActQuant act;  // the activation rows its kernels take
  // One block into f32, as GGUF defines the format (bit for bit what
  // gguf.quants gives).
  void (*dequant)(const uint8_t* b, float* y);
  // block_elems finite floats into one valid block (quantize_row).
  void (*quant)(const float* x, uint8_t* b);
  // The decoded form (null for the formats with kernels of their own).
  void (*decode)(const uint8_t* b, DecodedBlock* out);
  bool has_min;  // whether decode's mn is used
  // Whether its x86 kernels read rows interleaved in groups (pack.hpp's
  // kGroupRows); else its panels keep rows one after another.
  bool grouped;
};
// The entry of a block format (null for any other value).
const QuantTraits* quant_traits(ep_moe_dtype_t t);
// The block format GGUF numbers `type` (-1: none ep_moe computes on).
int quant_dtype_of_gguf(int type);

// Elements and bytes of one block (1 and the element size for float types).
int quant_block_elems(ep_moe_dtype_t t);
int quant_block_bytes(ep_moe_dtype_t t);
// Bytes of a row of n elements (n a multiple of the block's elements).
inline size_t quant_row_bytes(ep_moe_dtype_t t, int64_t n) {
  return static_cast<size_t>(n / quant_block_elems(t)) * static_cast<size_t>(quant_block_bytes(t));
}

// n elements (a multiple of the block's) of blocks at src into f32, as
// GGUF defines each format (bit for bit what gguf.quants gives).
void dequantize_row(ep_moe_dtype_t t, const void* src, float* dst, int64_t n);
// One element of a row of blocks.
float dequantize_at(ep_moe_dtype_t t, const void* row, int64_t i);

// n floats (a multiple of the block's elements; finite) into blocks. Q8_0,
// Q4_0 and MXFP4 as ggml's reference quantizers; the other GGUF formats by
// one round-to-nearest pass per block with scales from its sub-blocks'
// ranges, the grid formats (IQ1-IQ3) onto the nearest grid point; FP8 with
// one scale per 128 from the largest magnitude (valid blocks of the format,
// without llama.cpp's search for the scales that minimise the error: for
// weights ep_moe quantizes itself, the benchmark's and the demo's, not for
// a checkpoint's, which come quantized).
void quantize_row(ep_moe_dtype_t t, const float* src, void* dst, int64_t n);

// --- int8 activation rows ------------------------------------------------
// The kernels take activation rows quantized once per forward, as GGUF
// does: Q8_K-style (one f32 scale per 256 elements) for the K formats and
// IQ4_XS, Q8_0-style (one per 32) for Q8_0, Q4_0 and MXFP4. A row of k
// elements, kp = k rounded up to 256, is
//   int8 q[kp] | f32 d[kp / 32] | int16 s[kp / 16]
// with d the scale of each 32 elements (a Q8_K row repeats its block's)
// and s the sum of each 16 q (the formats with offsets or mins use them);
// elements past k are 0. A block's d = amax / 127 and q = x / d rounded to
// nearest, ties to even (what cvtps2dq does); d = 0 when amax is 0.
ActQuant act_quant_of(ep_moe_dtype_t weight);
inline int64_t act_row_padded(int64_t k) { return (k + 255) / 256 * 256; }
inline size_t act_row_bytes(int64_t k) {
  const auto kp = static_cast<size_t>(act_row_padded(k));
  return kp + kp / 32 * 4 + kp / 16 * 2;
}
inline const int8_t* act_q(const void* row) { return static_cast<const int8_t*>(row); }
inline const float* act_d(const void* row, int64_t k) {
  return reinterpret_cast<const float*>(static_cast<const char*>(row) + act_row_padded(k));
}
inline const int16_t* act_s(const void* row, int64_t k) {
  const int64_t kp = act_row_padded(k);
  return reinterpret_cast<const int16_t*>(static_cast<const char*>(row) + kp + kp / 32 * 4);
}
// The portable quantizer (the vector ones give the same bytes).
void quantize_act_row(const float* x, int64_t k, ActQuant aq, void* out);

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0 .. 7) from a
// block's 12 scale bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m);

// FP8 E4M3FN: the value of each code (NaN for S.1111.111), and the code
// nearest to a finite float (ties to even, saturated at +-448).
float e4m3_value(uint8_t code);
uint8_t e4m3_code(float x);
inline bool e4m3_nan(uint8_t code) { return (code & 0x7F) == 0x7F; }
// The first fault of `rows` rows of FP8_E4M3 blocks (cols elements each):
// a non-finite scale or a NaN code, as "row R, column C: ..."; empty if
// none.
std::string fp8_fault(const void* rows_data, int64_t rows, int64_t cols);

// Tables of the non-linear formats.
extern const int8_t kIq4nlValues[16];  // IQ4_NL / IQ4_XS
extern const int8_t kMxfp4Values[16];  // E2M1, doubled
// MXFP4's E8M0 scale, halved (the doubled values take it): 2^(e - 128).
float e8m0_half(uint8_t e);

}  // namespace ep_moe

// Packing of checkpoint-orientation weights into the panels the tiles read.
#pragma once

#include "common/source.hpp"

#include <cstdint>

#include "common/quant.hpp"
#include "cpu/aligned.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cpu {

// Element (kk, j) of a panel nr columns wide, in elements from its start:
// k order (f32, f16) or k-pair order (bf16; see PackedWeight).
inline size_t panel_index(bool pairs, int32_t kk, int32_t j, int32_t nr) {
  return pairs ? static_cast<size_t>(kk >> 1) * 2 * static_cast<size_t>(nr) + 2 * static_cast<size_t>(j) + (kk & 1)
               : static_cast<size_t>(kk) * static_cast<size_t>(nr) + static_cast<size_t>(j);
}

// A packed [N, K] weight for Y = X W^T (kernels.hpp). Panel p holds rows
// p*nr .. p*nr+nr-1 of W (zero past N). Inside a panel, f32 and f16 are in
// k order: W[p*nr + j][k] at k*nr + j. bf16 is in k-pair order, the operand
// layout of bf16 pair dot products: at (k/2)*2*nr + 2*j + k%2, with k padded
// to even with zeros; widening kernels split the pairs with a shift and a mask.
//
// A block-format weight (GGUF Q8_0 ... MXFP4, common/quant.hpp) keeps its
// blocks' bytes: panel p is rows p*nr .. p*nr+nr-1 of W, each row k /
// block-elements blocks (zero blocks past N, which are zeros in every
// format). With il == 0 the rows lie one after another, so a kernel
// streams a panel row by row. With il == kGroupRows or kGroupRows8 (the
// layout Kernels::qil names) each il rows are interleaved: see kGroupRows.
struct PackedWeight {
  int32_t n = 0, k = 0, nr = 0;
  int32_t il = 0;  // rows interleaved in groups of il (0: none)
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_F32;
  AlignedBuffer data;

  bool empty() const { return n == 0; }
  int32_t panels() const { return nr ? (n + nr - 1) / nr : 0; }
  bool pairs() const { return dtype == EP_MOE_DTYPE_BF16; }
  bool quant() const { return dtype_is_quant(dtype); }
  int32_t k_stored() const { return pairs() ? (k + 1) & ~1 : k; }
  size_t panel_elems() const { return static_cast<size_t>(k_stored()) * static_cast<size_t>(nr); }
  // Bytes of one row of a block-format weight.
  size_t row_bytes() const { return quant_row_bytes(dtype, k); }
  size_t panel_bytes() const;
  // Element (kk, j) of a panel, in elements from the panel's start.
  size_t index(int32_t kk, int32_t j) const { return panel_index(pairs(), kk, j, nr); }
  const void* panel(int32_t p) const;
  size_t bytes() const { return data.size(); }
};

// Rows interleaved R at a time (PackedWeight::il == R: kGroupRows = 16 on
// the AVX-512 tables of a CPU with AVX512_VNNI, kGroupRows8 = 8 on the
// other x86 tables; every block format): the same bytes as R rows, moved so that one load of 4 R bytes
// (a 512-bit vector for 16, 256-bit for 8) holds 4 consecutive elements of
// each of the R rows, and one load the R rows' scales. A group is the
// rows' blocks in order, R blocks' bytes a block index:
//   Q4_K: the R rows' d (f16), their dmin (f16), word 0 of their 12 scale
//   bytes (u32), word 1, word 2, then the 128 bytes of quants as 32 dwords
//   a row;
//   Q5_K: as Q4_K, with their qh (8 dwords a row) between the scale words
//   and the quants;
//   Q6_K: the R rows' d (f16), their 16 int8 scales (4 dwords a row), their
//   ql (32 dwords a row), their qh (16 dwords a row); in groups of 8 rows
//   ql and qh step by step instead (GroupParts::q6k_ql, q6k_qh);
//   IQ4_XS: the R rows' d (f16), their scales_h (u16), their scales_l
//   (u32), their qs (32 dwords a row);
//   Q8_0, Q4_0, MXFP4: the R rows' scales (f16 d; MXFP4's e8m0 byte), then
//   their quants (32 bytes; 16);
// the dwords of each part side by side: dword w of row l at R w + l.
// GroupParts<R> names the parts' offsets and a block index's bytes.
constexpr int32_t kGroupRows = 16, kGroupRows8 = 8;
template <int R>
struct GroupParts {
  static constexpr size_t kQ4kBlock = R * 144, kQ4kDmin = R * 2, kQ4kWords = R * 4, kQ4kQuants = R * 16;
  static constexpr size_t kQ5kBlock = R * 176, kQ5kQh = R * 16, kQ5kQuants = R * 48;
  static constexpr size_t kIq4Block = R * 136, kIq4ScalesH = R * 2, kIq4ScalesL = R * 4, kIq4Quants = R * 8;
  static constexpr size_t kQ6kBlock = R * 210, kQ6kScales = R * 2, kQ6kQl = R * 18, kQ6kQh = R * 146;
  // Q6_K's ql dword w and qh dword w (row 0's; row l's 4 l on). In groups of
  // 16 rows ql's 32 dwords, then qh's 16 (kQ6kQh). In groups of 8, step by
  // step in the order the AVX2 kernels read them, so that their decode
  // streams each block front to back: step s = 8 h + v (h = 0, 1; v = 0 ..
  // 7) holds ql dword 16 h + v, ql dword 16 h + 8 + v and qh dword s, at
  // kQ6kQl + kQ6kStep s.
  static constexpr size_t kQ6kStep = 12 * R;
  static constexpr size_t q6k_ql(size_t w) {
    return R == 8 ? kQ6kQl + kQ6kStep * (8 * (w / 16) + w % 8) + 4 * R * (w % 16 / 8) : kQ6kQl + 4 * R * w;
  }
  static constexpr size_t q6k_qh(size_t w) { return R == 8 ? kQ6kQl + kQ6kStep * w + 8 * R : kQ6kQh + 4 * R * w; }
};
// Whether format t has that layout.
bool groups_rows(ep_moe_dtype_t t);
// Row `lane` of a group of il interleaved rows of format t, k elements,
// from / to a row of blocks.
void group_put(ep_moe_dtype_t t, int il, uint8_t* group, int lane, const uint8_t* row, int32_t k);
void group_get(ep_moe_dtype_t t, int il, const uint8_t* group, int lane, uint8_t* row, int32_t k);

// dst becomes a copy of src (shape, dtype and bytes).
void copy_packed(PackedWeight& dst, const PackedWeight& src);

// Packs an [n, k] window of `src` (converted to `dtype`; into a block
// format: copied when `src` is in it, else quantized with quantize_row;
// from one: dequantized). il: the block-format rows' interleave
// (Kernels::il_of(dtype): 0, or kGroupRows or kGroupRows8 for a format
// that groups_rows, with nr a multiple of 2 il).
void pack(PackedWeight& out, const Source& src, int32_t n, int32_t k, int32_t nr, ep_moe_dtype_t dtype, int32_t il = 0);

// Gate and up ([inter, k] windows each) are packed interleaved: panel p
// holds gate rows p*h .. p*h+h-1 in columns [0, h) and the same up rows in
// [h, 2h), h = nr / 2, so a tile yields matching gate/up values for the
// fused activation. The packed matrix has n = 2 * ceil(inter / h) * h.
// init_gate_up allocates it (zeroed); pack_gate_up_half fills the gate
// (half 0) or the up (half 1) columns, so the two may arrive separately.
void init_gate_up(PackedWeight& out, int32_t inter, int32_t k, int32_t nr, ep_moe_dtype_t dtype, int32_t il = 0);
void pack_gate_up_half(PackedWeight& out, const Source& src, int half, int32_t inter);

// The inverse, for moving weights between ranks: raw elements (in the
// weight's dtype, so nothing is rounded twice).
// Row r of a plain packed [n, k] weight: k elements (a block-format
// weight's: its blocks).
void unpack_row(const PackedWeight& w, int32_t r, void* dst);
// Column c of a plain packed [n, k] weight: n elements (not for block
// formats).
void unpack_col(const PackedWeight& w, int32_t c, void* dst);
// Row r of the gate (half 0) or up (half 1) of a gate/up pair: k elements
// (a block-format weight's: its blocks).
void unpack_gate_up_row(const PackedWeight& w, int half, int32_t r, void* dst);

}  // namespace cpu
}  // namespace ep_moe

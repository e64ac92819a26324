#include "cpu/pack.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"

namespace ep_moe {
namespace cpu {

size_t PackedWeight::panel_bytes() const {
  return quant() ? static_cast<size_t>(nr) * row_bytes() : panel_elems() * dtype_size(dtype);
}

const void* PackedWeight::panel(int32_t p) const { return data.data<char>() + static_cast<size_t>(p) * panel_bytes(); }

void copy_packed(PackedWeight& dst, const PackedWeight& src) {
  dst.n = src.n;
  dst.k = src.k;
  dst.nr = src.nr;
  dst.il = src.il;
  dst.dtype = src.dtype;
  dst.data.resize(src.data.size());
  if (src.data.size()) std::memcpy(dst.data.data(), src.data.data(), src.data.size());
}

bool groups_rows(ep_moe_dtype_t t) { return dtype_is_quant(t) && quant_traits(t)->grouped; }

namespace {
// Each (group offset, row offset, bytes) piece of row `lane`'s block b in a
// group of R rows, in the layout pack.hpp states; f(group_at, row_at, n).
template <int R, class F>
void group_pieces(ep_moe_dtype_t t, size_t lane, int32_t k, F f) {
  using P = GroupParts<R>;
  const size_t bb = static_cast<size_t>(quant_block_bytes(t)), gb = R * bb;
  for (int32_t b = 0; b < k / quant_block_elems(t); ++b) {
    const size_t g = gb * static_cast<size_t>(b), r = bb * static_cast<size_t>(b);
    if (t == EP_MOE_DTYPE_Q4_K || t == EP_MOE_DTYPE_Q5_K) {
      const bool five = t == EP_MOE_DTYPE_Q5_K;
      f(g + 2 * lane, r, 2);
      f(g + P::kQ4kDmin + 2 * lane, r + 2, 2);
      for (size_t w = 0; w < 3; ++w) f(g + P::kQ4kWords + 4 * (R * w + lane), r + 4 + 4 * w, 4);
      for (size_t w = 0; five && w < 8; ++w) f(g + P::kQ5kQh + 4 * (R * w + lane), r + 16 + 4 * w, 4);
      const size_t qg = five ? P::kQ5kQuants : P::kQ4kQuants, qr = five ? 48 : 16;
      for (size_t w = 0; w < 32; ++w) f(g + qg + 4 * (R * w + lane), r + qr + 4 * w, 4);
      continue;
    }
    if (t == EP_MOE_DTYPE_IQ4_XS) {
      f(g + 2 * lane, r, 2);
      f(g + P::kIq4ScalesH + 2 * lane, r + 2, 2);
      f(g + P::kIq4ScalesL + 4 * lane, r + 4, 4);
      for (size_t w = 0; w < 32; ++w) f(g + P::kIq4Quants + 4 * (R * w + lane), r + 8 + 4 * w, 4);
      continue;
    }
    if (t == EP_MOE_DTYPE_Q6_K) {
      f(g + 2 * lane, r + 208, 2);
      for (size_t w = 0; w < 4; ++w) f(g + P::kQ6kScales + 4 * (R * w + lane), r + 192 + 4 * w, 4);
      for (size_t w = 0; w < 32; ++w) f(g + P::q6k_ql(w) + 4 * lane, r + 4 * w, 4);
      for (size_t w = 0; w < 16; ++w) f(g + P::q6k_qh(w) + 4 * lane, r + 128 + 4 * w, 4);
      continue;
    }
    const size_t sb = t == EP_MOE_DTYPE_MXFP4 ? 1 : 2;
    f(g + sb * lane, r, sb);
    for (size_t w = 0; w < (bb - sb) / 4; ++w) f(g + R * sb + 4 * (R * w + lane), r + sb + 4 * w, 4);
  }
}
template <class F>
void group_pieces(ep_moe_dtype_t t, int il, int lane, int32_t k, F f) {
  const auto l = static_cast<size_t>(lane);
  if (il == kGroupRows8) group_pieces<kGroupRows8>(t, l, k, f);
  else group_pieces<kGroupRows>(t, l, k, f);
}
}  // namespace

void group_put(ep_moe_dtype_t t, int il, uint8_t* group, int lane, const uint8_t* row, int32_t k) {
  group_pieces(t, il, lane, k, [&](size_t g, size_t r, size_t n) { std::memcpy(group + g, row + r, n); });
}

void group_get(ep_moe_dtype_t t, int il, const uint8_t* group, int lane, uint8_t* row, int32_t k) {
  group_pieces(t, il, lane, k, [&](size_t g, size_t r, size_t n) { std::memcpy(row + r, group + g, n); });
}

namespace {
inline float src_at(const Source& s, int64_t r, int64_t c) { return source_at(s, r, c); }

void alloc(PackedWeight& out, int32_t n, int32_t k, int32_t nr, ep_moe_dtype_t dtype, int32_t il) {
  // Callers pass Kernels::il_of(dtype), which holds these.
  if (il != 0 && ((il != kGroupRows && il != kGroupRows8) || !groups_rows(dtype) || nr % (2 * il) != 0))
    throw Error(EP_MOE_ERR_INTERNAL, "row interleave " + std::to_string(il) + " for " + dtype_name(dtype) +
                                         " panels of " + std::to_string(nr) + " rows");
  out.n = n;
  out.k = k;
  out.nr = nr;
  out.il = il;
  out.dtype = dtype;
  out.data.resize(static_cast<size_t>(out.panels()) * out.panel_bytes());
  std::memset(out.data.data(), 0, out.data.size());
}

// Same dtype: raw element copies (the value round trip through f32 is
// exact, so this only saves the conversions).
template <class T>
void put_row_raw(PackedWeight& out, int32_t p, int32_t j, const Source& s, int64_t row) {
  T* dst = static_cast<T*>(const_cast<void*>(out.panel(p)));
  const T* src = static_cast<const T*>(s.data);
  if (!s.transposed) {
    const T* r = src + (s.row0 + row) * s.ld + s.col0;
    for (int32_t kk = 0; kk < out.k; ++kk) dst[out.index(kk, j)] = r[kk];
  } else {
    const T* c = src + s.col0 * s.ld + s.row0 + row;
    for (int32_t kk = 0; kk < out.k; ++kk) dst[out.index(kk, j)] = c[kk * s.ld];
  }
}

// Row j of panel p of a block-format weight from source row `row`: its
// blocks copied (the same format, window on whole blocks) or quantized.
void put_quant_row(PackedWeight& out, int32_t p, int32_t j, const Source& s, int64_t row) {
  auto* panel = static_cast<uint8_t*>(const_cast<void*>(out.panel(p)));
  const size_t rb = out.row_bytes();
  std::vector<uint8_t> tmp(out.il ? rb : 0);
  uint8_t* dst = out.il ? tmp.data() : panel + static_cast<size_t>(j) * rb;
  if (s.dtype == out.dtype) {  // col0 on a block boundary
    std::memcpy(dst, static_cast<const char*>(source_row(s, row)) + quant_row_bytes(s.dtype, s.col0), rb);
  } else {
    std::vector<float> x(static_cast<size_t>(out.k));
    source_row_f32(s, row, out.k, x.data());
    quantize_row(out.dtype, x.data(), dst, out.k);
  }
  if (out.il)
    group_put(out.dtype, out.il, panel + static_cast<size_t>(j / out.il * out.il) * rb, j % out.il, dst, out.k);
}

// Writes source row `row` into column j of panel p.
void put_row(PackedWeight& out, int32_t p, int32_t j, const Source& s, int64_t row) {
  if (out.quant()) return put_quant_row(out, p, j, s, row);
  if (dtype_is_quant(s.dtype)) {
    std::vector<float> x(static_cast<size_t>(out.k));
    source_row_f32(s, row, out.k, x.data());
    char* dst = static_cast<char*>(const_cast<void*>(out.panel(p)));
    for (int32_t kk = 0; kk < out.k; ++kk) store_elem(dst, out.dtype, static_cast<int64_t>(out.index(kk, j)), x[kk]);
    return;
  }
  if (s.dtype == out.dtype) {
    if (dtype_size(s.dtype) == 4) return put_row_raw<uint32_t>(out, p, j, s, row);
    return put_row_raw<uint16_t>(out, p, j, s, row);
  }
  char* dst = static_cast<char*>(const_cast<void*>(out.panel(p)));
  for (int32_t kk = 0; kk < out.k; ++kk)
    store_elem(dst, out.dtype, static_cast<int64_t>(out.index(kk, j)), src_at(s, row, kk));
}
// Source rows [row, row + count) into columns [j, j + count) of panel p. A
// transposed source of the same dtype has those rows contiguous in each of
// its stored rows: one copy per k instead of `count` strided passes (in
// k-pair order, one pass per pair of stored rows).
void put_rows(PackedWeight& out, int32_t p, int32_t j, const Source& s, int64_t row, int32_t count) {
  if (s.transposed && s.dtype == out.dtype && out.pairs()) {
    uint16_t* dst = static_cast<uint16_t*>(const_cast<void*>(out.panel(p)));
    const uint16_t* src = static_cast<const uint16_t*>(s.data) + s.col0 * s.ld + s.row0 + row;
    for (int32_t kk = 0; kk < out.k; ++kk) {
      uint16_t* d = dst + out.index(kk, j);
      const uint16_t* r = src + kk * s.ld;
      for (int32_t i = 0; i < count; ++i) d[2 * i] = r[i];
    }
    return;
  }
  if (s.transposed && s.dtype == out.dtype) {
    const size_t es = dtype_size(s.dtype);
    char* dst = static_cast<char*>(const_cast<void*>(out.panel(p))) + static_cast<size_t>(j) * es;
    const char* src = static_cast<const char*>(s.data) + static_cast<size_t>(s.col0 * s.ld + s.row0 + row) * es;
    for (int32_t kk = 0; kk < out.k; ++kk)
      std::memcpy(dst + static_cast<size_t>(kk) * out.nr * es, src + static_cast<size_t>(kk * s.ld) * es,
                  static_cast<size_t>(count) * es);
    return;
  }
  for (int32_t i = 0; i < count; ++i) put_row(out, p, j + i, s, row + i);
}
}  // namespace

void pack(PackedWeight& out, const Source& src, int32_t n, int32_t k, int32_t nr, ep_moe_dtype_t dtype, int32_t il) {
  alloc(out, n, k, nr, dtype, il);
  for (int32_t p = 0; p * nr < n; ++p) put_rows(out, p, 0, src, static_cast<int64_t>(p) * nr, std::min(nr, n - p * nr));
}

void init_gate_up(PackedWeight& out, int32_t inter, int32_t k, int32_t nr, ep_moe_dtype_t dtype, int32_t il) {
  const int32_t h = nr / 2;
  alloc(out, (inter + h - 1) / h * nr, k, nr, dtype, il);
}

void pack_gate_up_half(PackedWeight& out, const Source& src, int half, int32_t inter) {
  const int32_t h = out.nr / 2;
  for (int32_t p = 0; p * h < inter; ++p)
    put_rows(out, p, half * h, src, static_cast<int64_t>(p) * h, std::min(h, inter - p * h));
}

namespace {
template <class T>
void copy_panel_col_t(const PackedWeight& w, int32_t p, int32_t j, void* dst) {
  const T* src = static_cast<const T*>(w.panel(p));
  T* d = static_cast<T*>(dst);
  for (int32_t kk = 0; kk < w.k; ++kk) d[kk] = src[w.index(kk, j)];
}

void copy_panel_col(const PackedWeight& w, int32_t p, int32_t j, void* dst) {
  if (w.quant()) {
    const auto* panel = static_cast<const uint8_t*>(w.panel(p));
    if (w.il)
      group_get(w.dtype, w.il, panel + static_cast<size_t>(j / w.il * w.il) * w.row_bytes(), j % w.il,
                static_cast<uint8_t*>(dst), w.k);
    else std::memcpy(dst, panel + static_cast<size_t>(j) * w.row_bytes(), w.row_bytes());
    return;
  }
  if (dtype_size(w.dtype) == 4) copy_panel_col_t<uint32_t>(w, p, j, dst);
  else copy_panel_col_t<uint16_t>(w, p, j, dst);
}
}  // namespace

void unpack_row(const PackedWeight& w, int32_t r, void* dst) { copy_panel_col(w, r / w.nr, r % w.nr, dst); }

void unpack_gate_up_row(const PackedWeight& w, int half, int32_t r, void* dst) {
  const int32_t h = w.nr / 2;
  copy_panel_col(w, r / h, half * h + r % h, dst);
}

void unpack_col(const PackedWeight& w, int32_t c, void* dst) {
  if (w.pairs()) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int32_t r = 0; r < w.n; ++r) d[r] = static_cast<const uint16_t*>(w.panel(r / w.nr))[w.index(c, r % w.nr)];
    return;
  }
  const size_t es = dtype_size(w.dtype);
  char* d = static_cast<char*>(dst);
  for (int32_t p = 0; p < w.panels(); ++p) {
    const int32_t rows = std::min(w.nr, w.n - p * w.nr);
    std::memcpy(d + static_cast<size_t>(p) * w.nr * es,
                static_cast<const char*>(w.panel(p)) + static_cast<size_t>(c) * w.nr * es,
                static_cast<size_t>(rows) * es);
  }
}

}  // namespace cpu
}  // namespace ep_moe

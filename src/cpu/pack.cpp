#include "cpu/pack.hpp"

#include <algorithm>
#include <cstring>

#include "common/dtype.hpp"

namespace ep_moe {
namespace cpu {

const void* PackedWeight::panel(int32_t p) const {
  return data.data<char>() + static_cast<size_t>(p) * panel_elems() * dtype_size(dtype);
}

float source_at(const Source& s, int64_t r, int64_t c) {
  const int64_t i = s.transposed ? (s.col0 + c) * s.ld + s.row0 + r : (s.row0 + r) * s.ld + s.col0 + c;
  return load_elem(s.data, s.dtype, i);
}

namespace {
inline float src_at(const Source& s, int64_t r, int64_t c) { return source_at(s, r, c); }

void alloc(PackedWeight& out, int32_t n, int32_t k, int32_t nr, ep_moe_dtype_t dtype) {
  out.n = n;
  out.k = k;
  out.nr = nr;
  out.dtype = dtype;
  const int32_t panels = (n + nr - 1) / nr;
  out.data.resize(static_cast<size_t>(panels) * static_cast<size_t>(k) * static_cast<size_t>(nr) * dtype_size(dtype));
  std::memset(out.data.data(), 0, out.data.size());
}

// Writes source row `row` into column j of panel p.
void put_row(PackedWeight& out, int32_t p, int32_t j, const Source& s, int64_t row) {
  char* dst = static_cast<char*>(const_cast<void*>(out.panel(p)));
  for (int32_t kk = 0; kk < out.k; ++kk)
    store_elem(dst, out.dtype, static_cast<int64_t>(kk) * out.nr + j, src_at(s, row, kk));
}
}  // namespace

void pack(PackedWeight& out, const Source& src, int32_t n, int32_t k, int32_t nr, ep_moe_dtype_t dtype) {
  alloc(out, n, k, nr, dtype);
  for (int32_t r = 0; r < n; ++r) put_row(out, r / nr, r % nr, src, r);
}

void init_gate_up(PackedWeight& out, int32_t inter, int32_t k, int32_t nr, ep_moe_dtype_t dtype) {
  const int32_t h = nr / 2;
  alloc(out, (inter + h - 1) / h * nr, k, nr, dtype);
}

void pack_gate_up_half(PackedWeight& out, const Source& src, int half, int32_t inter) {
  const int32_t h = out.nr / 2;
  for (int32_t r = 0; r < inter; ++r) put_row(out, r / h, half * h + r % h, src, r);
}

namespace {
void copy_panel_col(const PackedWeight& w, int32_t p, int32_t j, void* dst) {
  const size_t es = dtype_size(w.dtype);
  const char* src = static_cast<const char*>(w.panel(p)) + static_cast<size_t>(j) * es;
  char* d = static_cast<char*>(dst);
  for (int32_t kk = 0; kk < w.k; ++kk) std::memcpy(d + static_cast<size_t>(kk) * es, src + static_cast<size_t>(kk) * w.nr * es, es);
}
}  // namespace

void unpack_row(const PackedWeight& w, int32_t r, void* dst) { copy_panel_col(w, r / w.nr, r % w.nr, dst); }

void unpack_gate_up_row(const PackedWeight& w, int half, int32_t r, void* dst) {
  const int32_t h = w.nr / 2;
  copy_panel_col(w, r / h, half * h + r % h, dst);
}

void unpack_col(const PackedWeight& w, int32_t c, void* dst) {
  const size_t es = dtype_size(w.dtype);
  char* d = static_cast<char*>(dst);
  for (int32_t p = 0; p < w.panels(); ++p) {
    const int32_t rows = std::min(w.nr, w.n - p * w.nr);
    std::memcpy(d + static_cast<size_t>(p) * w.nr * es,
                static_cast<const char*>(w.panel(p)) + static_cast<size_t>(c) * w.nr * es, static_cast<size_t>(rows) * es);
  }
}

}  // namespace cpu
}  // namespace ep_moe

// A view of a caller's matrix in any float dtype (rows, columns, an offset
// window, transposed storage): what weight packing and uploads read from.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {

// Element (r, c) is data[(row0 + r) * ld + col0 + c], or, when
// `transposed`, data[(col0 + c) * ld + row0 + r].
struct Source {
  const void* data;
  ep_moe_dtype_t dtype;
  int64_t ld;
  int64_t row0 = 0, col0 = 0;
  bool transposed = false;
  // Values dequantized from blocks (the shared expert's units in a
  // re-placement): held in a float type, never quantized again.
  bool dequantized = false;
};

// A block-format view (common/quant.hpp) is never transposed: its stored
// rows are the logical rows, `ld` elements (whole blocks) each, and col0
// sits on a block boundary wherever blocks are copied as they are.

// The first byte of stored row `r` of the view (row0 counted).
inline const void* source_row(const Source& s, int64_t r) {
  const size_t row =
      dtype_is_quant(s.dtype) ? quant_row_bytes(s.dtype, s.ld) : static_cast<size_t>(s.ld) * dtype_size(s.dtype);
  return static_cast<const char*>(s.data) + static_cast<size_t>(s.row0 + r) * row;
}

// Element (r, c) of the view, widened to f32 (a block format's decodes its
// whole block: read rows with dequantize_row where speed matters).
inline float source_at(const Source& s, int64_t r, int64_t c) {
  if (dtype_is_quant(s.dtype)) return dequantize_at(s.dtype, source_row(s, r), s.col0 + c);
  const int64_t i = s.transposed ? (s.col0 + c) * s.ld + s.row0 + r : (s.row0 + r) * s.ld + s.col0 + c;
  return load_elem(s.data, s.dtype, i);
}

// Row `r` of the view, `n` elements, widened to f32 at dst (a block
// format's whole stored row dequantized once, then the window).
inline void source_row_f32(const Source& s, int64_t r, int64_t n, float* dst) {
  if (dtype_is_quant(s.dtype)) {
    std::vector<float> whole(static_cast<size_t>(s.ld));
    dequantize_row(s.dtype, source_row(s, r), whole.data(), s.ld);
    std::memcpy(dst, whole.data() + s.col0, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < n; ++c) dst[c] = source_at(s, r, c);
}

// Which weight of a layer a backend stores (layer/backend.hpp). Gate and
// up are rows [0, I) and [I, 2I) of one [2I, H] matrix per expert; the
// bias parts are f32 vectors (one row).
enum class WeightPart {
  ExpertGateUp,
  ExpertDown,
  SharedGateUp,
  SharedDown,
  Router,
  Bias,        // the score-correction bias [E]
  SharedGate,  // the shared expert's sigmoid gate [H]
  ExpertGateBias,
  ExpertUpBias,
  ExpertDownBias,
  RouterBias,
};

}  // namespace ep_moe

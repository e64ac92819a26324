// A view of a caller's matrix in any float dtype (rows, columns, an offset
// window, transposed storage): what weight packing and uploads read from.
#pragma once

#include <cstdint>

#include "common/dtype.hpp"
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
};

// Element (r, c) of the view, widened to f32.
inline float source_at(const Source& s, int64_t r, int64_t c) {
  const int64_t i = s.transposed ? (s.col0 + c) * s.ld + s.row0 + r : (s.row0 + r) * s.ld + s.col0 + c;
  return load_elem(s.data, s.dtype, i);
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

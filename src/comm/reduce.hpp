// Element-wise sums used by every CPU-side collective: f32/bf16/f16 add in
// f32, integers add exactly.
#pragma once

#include <cstddef>

#include "ep_moe/ep_moe.h"

namespace ep_moe {

// dst[i] = sum over s of srcs[s][offset + i] for i in [0, n), summed in the
// order of `srcs` (so every caller gets bit-identical results).
void sum_into(void* dst, const void* const* srcs, int num_srcs, size_t offset, size_t n, ep_moe_dtype_t dtype);

}  // namespace ep_moe

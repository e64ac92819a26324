// GEMM micro-kernels over packed weight panels.
//
// A weight matrix W [N, K] (checkpoint orientation: out x in) is packed in
// panels of `nr` output columns: panel p holds W[p*nr + j][k] at k*nr + j,
// zero-padded past N. A tile computes, for up to `mr` activation rows
// a[i] (f32, K long),  c[i*nr + j] = sum_k a[i][k] * panel[k*nr + j]
// with f32 accumulation; 16-bit weights are widened in registers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/isa.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cpu {

using TileFn = void (*)(int m, const float* const* a, int k, const void* panel, float* c);
// The same over bf16 activation rows and bf16 panels, with bf16 pair dot
// products (AVX512_BF16): each product is exact in f32, the sums are f32.
using TileBf16Fn = void (*)(int m, const uint16_t* const* a, int k, const void* panel, float* c);

struct Kernels {
  Isa isa;
  int nr;  // panel width (output columns per tile)
  int mr;  // most rows per tile
  TileFn tile[3];  // by weight dtype: f32, bf16, f16
  TileBf16Fn tile_bf16 = nullptr;  // bf16 x bf16, where the CPU has it
  // f32 -> bf16, round to nearest even (with tile_bf16).
  void (*to_bf16)(const float* src, uint16_t* dst, int64_t n) = nullptr;
};

const Kernels& kernels_for(Isa isa);

// Per-ISA tables, defined in their own translation units.
const Kernels& kernels_generic();
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
const Kernels& kernels_avx512bf16();

}  // namespace cpu
}  // namespace ep_moe

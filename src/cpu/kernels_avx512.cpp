// AVX-512 tiles (built with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c;
// called only when the CPU has them).
#include <immintrin.h>

#include <initializer_list>
#include <type_traits>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#include "cpu/kernels_avx512.inc"

const Kernels& kernels_avx512() {
  // The block-format kernels on 256-bit vectors: VNNI's where the CPU has
  // it, else AVX2's (maddubs), which every AVX-512 CPU runs.
  static const Kernels k = [] {
    Kernels t{Isa::Avx512,
              NR,
              MR,
              {gemm<0>, gemm<1>, gemm<2>},
              nullptr,
              row_to_bf16,
              row_from_bf16,
              row_to_f16,
              row_from_f16,
              silu_mul,
              scatter_add,
              sum_rows_avx2,
              {gemv<0>, gemv<1>, gemv<2>},
              nullptr};
    if (has_avx512_vnni()) qkernels_avx512vnni(t.qgemm);
    else qkernels_avx2(t.qgemm);
    t.quantize_act = quantize_act_avx2;
    // Prefill rows of the formats with a scale per 32 elements widen their
    // panels for the f32 tiles from the row count where that beats the
    // block kernels (ep_moe_qkernel_bench's w/c column on these tables).
    qdequant_avx2(t.qdequant);
    for (ep_moe_dtype_t q : {EP_MOE_DTYPE_Q8_0, EP_MOE_DTYPE_Q4_0, EP_MOE_DTYPE_MXFP4})
      t.qdequant_rows[quant_index(q)] = 32;
    return t;
  }();
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

// AVX-512 tiles (built with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c;
// called only when the CPU has them).
#include <immintrin.h>

#include <type_traits>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#include "cpu/kernels_avx512.inc"

const Kernels& kernels_avx512() {
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
    set_x86_block_kernels(t, true);
    return t;
  }();
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

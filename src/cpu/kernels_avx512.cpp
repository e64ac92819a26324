// AVX-512 tiles (built with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c;
// called only when the CPU has them).
#include <immintrin.h>

#include <type_traits>

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#include "cpu/kernels_avx512.inc"

namespace {
Kernels make_avx512() {
  return [] {
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
}
}  // namespace

// One table with AVX512_VNNI's block kernels, one without (EP_MOE_CPU_ISA
// "-vnni", or a CPU without it): each built at its first use.
const Kernels& kernels_avx512() {
  if (has_avx512_vnni()) {
    static const Kernels k = make_avx512();
    return k;
  }
  static const Kernels k = make_avx512();
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

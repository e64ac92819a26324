// AVX512-VNNI block-format kernels (kernels.hpp's QGemmFn; built with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c, called
// only when the CPU has AVX512_VNNI): qkernels_x86.inc on 256-bit vectors
// with vpdpbusd / vpdpwssd in place of maddubs + madd + add. The AVX-512
// tables take them where the CPU has VNNI; their results are the AVX2
// kernels' bit for bit (the same exact i32 sums, the same f32 steps).
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

#define EP_MOE_QK_VNNI 1
#define EP_MOE_QK_TABLE qkernels_avx512vnni
#include "cpu/qkernels_x86.inc"

}  // namespace cpu
}  // namespace ep_moe

// The B side of ep_moe_ab_bench: src/cpu/kernels_avx512.cpp built again,
// its table renamed, with EP_MOE_AB_VARIANT_DIR (when set) searched before
// src/ for its quoted includes, so that a changed copy of cpu/kernels_x86.inc,
// cpu/kernels_avx512.inc or cpu/kernels_avx512.cpp there is what B runs.
// Without it, B is A built twice (an A/A run: the noise floor).
#include "ab_variant_qgroups.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {
const Kernels& kernels_avx512_ab_variant();
}  // namespace cpu
}  // namespace ep_moe

// Its block-format entries are the variant's (ab_variant_qgroups.cpp).
#define kernels_avx512 kernels_avx512_ab_variant
#define set_x86_block_kernels set_x86_block_kernels_ab_variant
#include "cpu/kernels_avx512.cpp"
#undef set_x86_block_kernels
#undef kernels_avx512

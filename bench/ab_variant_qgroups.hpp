// ep_moe_ab_bench's B side of the block-format kernels: the B tables
// (ab_variant_avx2.cpp, ab_variant_avx512.cpp) call this where the
// library's tables call set_x86_block_kernels, so that their qgemm entries
// and activation quantizer come from the variant's cpu/qgroups_*.cpp,
// cpu/qgroups8.inc and cpu/qgroups.hpp (ab_variant_qgroups_*.cpp).
#pragma once

#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {
void set_x86_block_kernels_ab_variant(Kernels& t, bool avx512);
}  // namespace cpu
}  // namespace ep_moe

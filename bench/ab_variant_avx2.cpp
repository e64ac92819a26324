// The AVX2 B side of ep_moe_ab_bench: src/cpu/kernels_avx2.cpp built again,
// its table (and sum_rows_avx2, which it defines for every x86 table)
// renamed, with EP_MOE_AB_VARIANT_DIR (when set) searched before src/ for
// its quoted includes, so that a changed copy of cpu/kernels_x86.inc or
// cpu/kernels_avx2.cpp there is what B runs. Without it, B is A built
// twice (an A/A run: the noise floor). The names are changed before
// cpu/kernels.hpp is read, so its declarations name the renamed ones. Its
// block-format entries are the variant's (ab_variant_qgroups.cpp).
#define kernels_avx2 kernels_avx2_ab_variant
#define sum_rows_avx2 sum_rows_avx2_ab_variant
#define set_x86_block_kernels set_x86_block_kernels_ab_variant
#include "cpu/kernels_avx2.cpp"
#undef set_x86_block_kernels
#undef sum_rows_avx2
#undef kernels_avx2

// ep_moe_ab_bench's B side: src/cpu/qgroups_avx2.cpp (the 8-row maddubs
// kernels, the tiles' unpackers and the activation quantizer) built again under other names,
// its quoted includes (cpu/qgroups8.inc, cpu/qgroups.hpp) looked up in
// EP_MOE_AB_VARIANT_DIR first. Renamed before cpu/kernels.hpp is read.
#define qgroups_avx2 qgroups_avx2_ab_variant
#define quantize_act_avx2 quantize_act_avx2_ab_variant
#define qunpack_avx2 qunpack_avx2_ab_variant
#include "cpu/qgroups_avx2.cpp"
#undef qunpack_avx2
#undef quantize_act_avx2
#undef qgroups_avx2

// ep_moe_ab_bench's B side: src/cpu/qgroups_avx512vnni.cpp (the 16-row
// kernels and unpackers) built again under another name, its quoted
// includes looked up in EP_MOE_AB_VARIANT_DIR first.
#define qgroups_avx512vnni qgroups_avx512vnni_ab_variant
#include "cpu/qgroups_avx512vnni.cpp"
#undef qgroups_avx512vnni

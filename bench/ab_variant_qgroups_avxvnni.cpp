// ep_moe_ab_bench's B side: src/cpu/qgroups_avxvnni.cpp (the 8-row kernels
// through AVX-VNNI) built again under another name, its quoted includes
// looked up in EP_MOE_AB_VARIANT_DIR first.
#define qgroups_avxvnni qgroups_avxvnni_ab_variant
#include "cpu/qgroups_avxvnni.cpp"
#undef qgroups_avxvnni

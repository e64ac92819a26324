// Run-time choice of the CPU kernels. The library is built for baseline
// x86-64; the AVX2 and AVX-512 kernels live in their own translation units
// and are called only when the CPU has the instructions.
#pragma once

namespace ep_moe {
namespace cpu {

enum class Isa : int { Generic = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3 };

// What this CPU supports, lowered by the environment variable
// EP_MOE_CPU_ISA=generic|avx2|avx512|avx512bf16 (never raised above the
// hardware).
Isa detect_isa();
const char* isa_name(Isa isa);

// Whether the CPU has AVX512_VNNI (with AVX-512 F/BW/VL): the AVX-512
// tables' block-format kernels then use it (rows interleaved 16 at a time,
// and the int8 tiles), else AVX2's (8 at a time). Not lowered by
// EP_MOE_CPU_ISA, which runs without it by naming avx2.
bool has_avx512_vnni();
// Whether the CPU has AVX-VNNI (the VEX vpdpbusd on 256 bits, with AVX2):
// the 8-row block kernels then use it (qgroups_avxvnni.cpp) where the
// table has no AVX512_VNNI. Not lowered by EP_MOE_CPU_ISA either (generic
// runs without it).
bool has_avx_vnni();

}  // namespace cpu
}  // namespace ep_moe

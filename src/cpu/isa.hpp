// Run-time choice of the CPU kernels. The library is built for baseline
// x86-64; the AVX2 and AVX-512 kernels live in their own translation units
// and are called only when the CPU has the instructions.
#pragma once

#include <cstddef>

namespace ep_moe {
namespace cpu {

enum class Isa : int { Generic = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3 };

// What this CPU supports, lowered by the environment variable
// EP_MOE_CPU_ISA=generic|avx2|avx512|avx512bf16 (never raised above the
// hardware; `amx` names no lower level, see matrix_engine_policy()),
// optionally followed by features to leave out one at a time, so that one
// machine runs every table it can: ",-vnni" (AVX512_VNNI: the AVX-512
// tables then take the 8-row block kernels), ",-vbmi" (AVX512_VBMI) and
// ",-avxvnni" (AVX-VNNI),
// e.g. EP_MOE_CPU_ISA=avx512,-vnni. Read at every call.
Isa detect_isa();
const char* isa_name(Isa isa);

// Whether the CPU has AVX512_VNNI (with AVX-512 F/BW/VL) and
// EP_MOE_CPU_ISA does not leave it out ("-vnni"): the AVX-512 tables'
// block-format kernels then use it (rows interleaved 16 at a time, and the
// int8 tiles), else AVX2's (8 at a time).
bool has_avx512_vnni();
// Whether has_avx512_vnni() and the CPU has AVX512_VBMI (byte permutes,
// vpmultishiftqb) and EP_MOE_CPU_ISA does not leave it out ("-vbmi"): the
// AVX-512 tables then decode IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S in registers (qfused_avx512vbmi.cpp).
bool has_avx512_vbmi();
// Whether the CPU has AVX-VNNI (the VEX vpdpbusd on 256 bits, with AVX2)
// and EP_MOE_CPU_ISA does not leave it out ("-avxvnni"): the 8-row block
// kernels then use it (qgroups_avxvnni.cpp) where the table has no
// AVX512_VNNI.
bool has_avx_vnni();

// How far ahead of its reads a block kernel's decode stream prefetches
// (cpu/qgroups.hpp's Stream), in bytes: 3 KiB on AMD CPUs before Zen 4
// (family 17h, and 19h's Zen 3 models), whose PREFETCHT1 fills L1 as T0
// does, so that every line in flight holds one of L1's few miss buffers;
// 6 KiB elsewhere, where T1 stops at L2, which keeps more misses in
// flight. Read once (cached).
size_t decode_prefetch_bytes();
// The rule itself, for a CPU's vendor (AMD or not), family and model as
// CPUID leaf 1 gives them (extended fields added).
size_t decode_prefetch_bytes_for(bool amd, unsigned family, unsigned model);

// Whether this thread may run AMX-BF16 tiles: the CPU has AMX-TILE and
// AMX-BF16 (CPUID 7.0 EDX bits 24 and 22), the OS saves the tile state
// (XCR0 bits 17 and 18), and Linux granted the process the tile data
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once; the
// kernel refuses it where the signal stack is too small for the state).
// Not lowered by EP_MOE_CPU_ISA: matrix_engine_policy() reads that.
bool has_amx();

// Whether the layers use a matrix engine for prefill (cpu/matrix_engine.hpp),
// from the environment:
// - EP_MOE_MATRIX_ENGINE=off: never; =onednn: oneDNN's engine whatever ISA
//   oneDNN runs on (on a CPU without AMX, for tests and benchmarks); unset
//   or =auto: oneDNN's engine where the CPU has AMX (has_amx()).
// - EP_MOE_CPU_ISA naming a level below `amx` (generic, avx2, avx512,
//   avx512bf16) forbids it in auto; `amx` allows it (the default).
// An unknown EP_MOE_MATRIX_ENGINE value reads as auto.
enum class EnginePolicy : int { Off = 0, Amx = 1, Force = 2 };
EnginePolicy matrix_engine_policy();

}  // namespace cpu
}  // namespace ep_moe

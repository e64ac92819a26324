// qgroups8.inc's VNNI policy through AVX512_VNNI's 256-bit (EVEX)
// vpdpbusd, which computes what AVX-VNNI's VEX one does: so a CPU with
// AVX512_VNNI and AVX512VL checks the arithmetic of qgroups_avxvnni.cpp,
// whose instructions only an AVX-VNNI CPU runs (tests/unit/test_quant.cpp),
// and ep_moe_qkernel_bench times it. Built with the AVX-512 tables' flags
// into ep_moe_internal only (src/CMakeLists.txt): no table of the library
// takes 8-row kernels where the CPU has AVX512_VNNI.
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/qgroups.hpp"

namespace ep_moe {
namespace cpu {

namespace {

struct EvexVnni {
  static constexpr bool kVnni = true;
  static __m256i dot(__m256i acc, __m256i w, __m256i a) { return _mm256_dpbusd_epi32(acc, w, a); }
};

#include "cpu/qgroups8.inc"

}  // namespace

void qgroups8_vnni_evex(QGemmFn* gemm) { set_qgroups8<EvexVnni>(gemm); }

}  // namespace cpu
}  // namespace ep_moe

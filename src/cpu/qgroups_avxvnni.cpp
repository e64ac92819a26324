// The AVX2 table's block-format kernels on a CPU with AVX-VNNI (Alder
// Lake and later clients, Sierra Forest and other E-core Xeons, Zen 5):
// rows interleaved 8 at a time (qgroups8.inc) through the VEX vpdpbusd,
// one instruction where maddubs took two or three (built with -mavx2
// -mfma -mf16c -mavxvnni; called only where isa.cpp's has_avx_vnni()).
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

// AVX-VNNI's vpdpbusd on 256 bits (qgroups8.inc's dot_add).
struct VexVnni {
  static constexpr bool kVnni = true;
  static __m256i dot(__m256i acc, __m256i w, __m256i a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
};

#include "cpu/qgroups8.inc"

}  // namespace

void qgroups_avxvnni(QGemmFn* gemm) { set_qgroups8<VexVnni>(gemm); }

}  // namespace cpu
}  // namespace ep_moe

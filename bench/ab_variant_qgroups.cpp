// ep_moe_ab_bench's B side of the block-format kernels: the library's
// choice (kernels.cpp's set_x86_block_kernels: interleave, name, int8
// tiles and their row thresholds), then the qgemm entries and the
// activation quantizer replaced by the variant's builds of the same ISA's
// group kernels, and the unpackers the library set by the variant's (of
// the 16-row panels with AVX512_VNNI, else the AVX2 ones). The int8 tiles
// (qtile_*.cpp) and the choice itself stay the library's on both sides.
#include "ab_variant_qgroups.hpp"

#include "cpu/isa.hpp"

namespace ep_moe {
namespace cpu {

void qgroups_avx2_ab_variant(QGemmFn* gemm);
void qunpack_avx2_ab_variant(QUnpackFn* unpack);
void quantize_act_avx2_ab_variant(const float* x, int64_t k, ActQuant aq, void* out);
void qgroups_avxvnni_ab_variant(QGemmFn* gemm);
void qgroups_avx512vnni_ab_variant(QGemmFn* gemm, QUnpackFn* unpack);

void set_x86_block_kernels_ab_variant(Kernels& t, bool avx512) {
  set_x86_block_kernels(t, avx512);
  t.quantize_act = quantize_act_avx2_ab_variant;
  if (avx512 && has_avx512_vnni()) qgroups_avx512vnni_ab_variant(t.qgemm, t.qunpack);
  else if (has_avx_vnni()) qgroups_avxvnni_ab_variant(t.qgemm);
  else qgroups_avx2_ab_variant(t.qgemm);
  if (!(avx512 && has_avx512_vnni())) {
    QUnpackFn unpack[kQuantTypes] = {};
    qunpack_avx2_ab_variant(unpack);
    for (int i = 0; i < kQuantTypes; ++i)
      if (t.qunpack[i]) t.qunpack[i] = unpack[i];
  }
}

}  // namespace cpu
}  // namespace ep_moe

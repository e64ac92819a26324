#include "cpu/kernels.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "common/dtype.hpp"
#include "cpu/best_ratio.hpp"
#include "cpu/pack.hpp"
#include "cpu/qdecoded.hpp"

namespace ep_moe {
namespace cpu {

const Kernels& kernels_for(Isa isa) {
#if defined(EP_MOE_X86_KERNELS)
  switch (isa) {
    case Isa::Avx512Bf16: return kernels_avx512bf16();
    case Isa::Avx512: return kernels_avx512();
    case Isa::Avx2: return kernels_avx2();
    case Isa::Generic: break;
  }
#else
  (void)isa;
#endif
  return kernels_generic();
}

#if defined(EP_MOE_X86_KERNELS)
void set_x86_block_kernels(Kernels& t, bool avx512) {
  const bool vnni = avx512 && has_avx512_vnni();
  t.quantize_act = quantize_act_avx2;
  t.qgemm[quant_index(EP_MOE_DTYPE_FP8_E4M3)] = avx512 ? qfp8_avx512() : qfp8_avx2();
  // Every block format on interleaved rows: 8 a group with AVX2's maddubs
  // or AVX-VNNI's vpdpbusd, 16 with AVX512_VNNI.
  // The formats computed through their decoded form keep their rows one
  // after another (qdecoded.hpp).
  for (int i = 0; i < kQuantTypes; ++i)
    t.qil[i] = groups_rows(static_cast<ep_moe_dtype_t>(static_cast<int>(kQuantFirst) + i))
                   ? (vnni ? kGroupRows : kGroupRows8)
                   : 0;
  if (!vnni) {
    const bool avx_vnni = has_avx_vnni();
    if (avx_vnni) qgroups_avxvnni(t.qgemm);
    else qgroups_avx2(t.qgemm);
    qdecoded_avx2(t.qgemm);
    t.qname = avx_vnni ? "avx-vnni, 8 interleaved rows" : "avx2 maddubs, 8 interleaved rows";
    // The AVX2 table's maddubs tiles (panels of 16 rows), where its group
    // kernels are maddubs too: measured only against those. In cache they
    // pass the group kernels at ~8 rows (Q6_K), ~12-16 (Q5_K) and ~16
    // (MXFP4); in a layer, an expert with that few rows spends most of its
    // time streaming its panels from memory, which unpacking them first
    // does not shorten (the layer at 4 rows an expert ran as fast or
    // faster with twice these thresholds).
    if (!avx512 && !avx_vnni) {
      t.qname = "avx2 maddubs, 8 interleaved rows, int8 tiles";
      qtiles_avx2(t.qtile);
      qunpack_avx2(t.qunpack);
      t.qtile_rows[quant_index(EP_MOE_DTYPE_MXFP4)] = 32;
      t.qtile_rows[quant_index(EP_MOE_DTYPE_Q5_K)] = 24;
      t.qtile_rows[quant_index(EP_MOE_DTYPE_Q6_K)] = 16;
    }
    return;
  }
  t.qname = "avx512-vnni, 16 interleaved rows, int8 tiles";
  qtiles_avx512vnni(t.qtile);
  qgroups_avx512vnni(t.qgemm, t.qunpack);
  qdecoded_avx512vnni(t.qgemm);
  qfused_avx512vnni(t.qgemm);  // Q2_K, Q3_K decode rows in registers (larger calls keep the decoded rows)
  if (has_avx512_vbmi()) qfused_avx512vbmi(t.qgemm);  // IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S the same way
  // The interleaved-row kernels hold level with the tiles to ~8 rows
  // (Q6_K, Q5_K), ~12 (IQ4_XS), ~24 (MXFP4, Q4_K) or ~64 (Q8_0, Q4_0).
  t.qtile_rows[quant_index(EP_MOE_DTYPE_Q8_0)] = 64;
  t.qtile_rows[quant_index(EP_MOE_DTYPE_Q4_0)] = 64;
  t.qtile_rows[quant_index(EP_MOE_DTYPE_MXFP4)] = 24;
  t.qtile_rows[quant_index(EP_MOE_DTYPE_IQ4_XS)] = 12;
  t.qtile_rows[quant_index(EP_MOE_DTYPE_Q4_K)] = 32;
  t.qtile_rows[quant_index(EP_MOE_DTYPE_Q5_K)] = 12;
  t.qtile_rows[quant_index(EP_MOE_DTYPE_Q6_K)] = 8;
}

double bf16_dot_time_ratio() {
  // One bf16 panel (k = 512: 32 KiB) and 48 rows, in L1/L2: the tiles'
  // compute rate, which is what prefill is held to; decode streams its
  // weights from memory either way.
  const Kernels& dot = kernels_avx512bf16();
  const Kernels& wide = kernels_avx512();
  constexpr int kRows = 48, kDepth = 512, kCalls = 4;
  const int nr = dot.nr;
  std::vector<uint16_t> panel(static_cast<size_t>(kDepth) * static_cast<size_t>(nr));
  std::vector<uint16_t> rows16(static_cast<size_t>(kRows) * kDepth);
  std::vector<float> rows32(rows16.size()), c(static_cast<size_t>(kRows) * static_cast<size_t>(nr));
  // Small finite values ((i % 17 - 8) / 16: exact in bf16).
  const auto value = [](size_t i) { return static_cast<float>(static_cast<int>(i % 17) - 8) / 16.0f; };
  for (size_t i = 0; i < panel.size(); ++i) panel[i] = f32_to_bf16(value(i * 7 + 3));
  for (size_t i = 0; i < rows16.size(); ++i) {
    rows32[i] = value(i);
    rows16[i] = f32_to_bf16(rows32[i]);
  }
  const uint16_t* a16[kRows];
  const float* a32[kRows];
  for (int r = 0; r < kRows; ++r) {
    a16[r] = rows16.data() + static_cast<size_t>(r) * kDepth;
    a32[r] = rows32.data() + static_cast<size_t>(r) * kDepth;
  }
  return best_ratio(
      [&] {
        for (int i = 0; i < kCalls; ++i) dot.gemm_bf16(kRows, a16, kDepth, panel.data(), c.data(), nr, nullptr);
      },
      [&] {
        for (int i = 0; i < kCalls; ++i)
          wide.gemm[EP_MOE_DTYPE_BF16](kRows, a32, kDepth, panel.data(), c.data(), nr, nullptr);
      });
}
#else
double bf16_dot_time_ratio() { return 0.0; }
#endif

const Kernels& layer_kernels() {
  const Isa isa = detect_isa();
  // Named by EP_MOE_CPU_ISA (a level, not `amx`): taken as it is. Otherwise the pair-dot tiles
  // run only where they beat widening bf16 to f32 FMAs: on some CPUs with
  // AVX512_BF16 the pair dot products are twice the FMA rate, on others
  // half of it (docs/benchmarks.md's tables say which), so it is timed.
  const char* named = std::getenv("EP_MOE_CPU_ISA");
  if (isa == Isa::Avx512Bf16 && (!named || std::strncmp(named, "amx", 3) == 0)) {
    static const bool dot_slower = bf16_dot_time_ratio() > 1.0;  // once per process
    if (dot_slower) return kernels_for(Isa::Avx512);
  }
  return kernels_for(isa);
}

}  // namespace cpu
}  // namespace ep_moe

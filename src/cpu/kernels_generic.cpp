// Portable tiles: plain loops the compiler can vectorise for the baseline ISA.
#include "common/dtype.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {
constexpr int NR = 16;
constexpr int MR = 4;

template <class W>
inline float load_w(const W* p, int idx);
template <>
inline float load_w<float>(const float* p, int idx) { return p[idx]; }
template <>
inline float load_w<uint16_t>(const uint16_t* p, int idx) { return bf16_to_f32(p[idx]); }

template <class W, bool IsF16>
void tile(int m, const float* const* a, int k, const void* panel, float* c) {
  const W* b = static_cast<const W*>(panel);
  float acc[MR][NR] = {};
  for (int kk = 0; kk < k; ++kk) {
    float bv[NR];
    for (int j = 0; j < NR; ++j) {
      if constexpr (IsF16) bv[j] = f16_to_f32(reinterpret_cast<const uint16_t*>(b)[kk * NR + j]);
      else bv[j] = load_w<W>(b, kk * NR + j);
    }
    for (int i = 0; i < m; ++i) {
      const float av = a[i][kk];
      for (int j = 0; j < NR; ++j) acc[i][j] += av * bv[j];
    }
  }
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < NR; ++j) c[i * NR + j] = acc[i][j];
}
}  // namespace

const Kernels& kernels_generic() {
  static const Kernels k{Isa::Generic, NR, MR, {tile<float, false>, tile<uint16_t, false>, tile<uint16_t, true>}};
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

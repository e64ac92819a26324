// Portable tiles: plain loops the compiler can vectorise for the baseline ISA.
#include <cmath>

#include "common/dtype.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"

namespace ep_moe {
namespace cpu {

namespace {
constexpr int NR = 16;
constexpr int MR = 4;

// Weight element (k, j) of a panel (layouts in pack.hpp).
template <int WT>
inline float load_w(const void* panel, int kk, int j) {
  const size_t i = panel_index(WT == 1, kk, j, NR);
  if constexpr (WT == 0) return static_cast<const float*>(panel)[i];
  else if constexpr (WT == 1) return bf16_to_f32(static_cast<const uint16_t*>(panel)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(panel)[i]);
}

template <int WT>
void gemm(int m, const float* const* a, int k, const void* panel, float* c, int ldc, const void* /*next*/) {
  for (int r0 = 0; r0 < m; r0 += MR) {
    const int mm = m - r0 < MR ? m - r0 : MR;
    float acc[MR][NR] = {};
    for (int kk = 0; kk < k; ++kk) {
      float bv[NR];
      for (int j = 0; j < NR; ++j) bv[j] = load_w<WT>(panel, kk, j);
      for (int i = 0; i < mm; ++i) {
        const float av = a[r0 + i][kk];
        for (int j = 0; j < NR; ++j) acc[i][j] += av * bv[j];
      }
    }
    for (int i = 0; i < mm; ++i)
      for (int j = 0; j < NR; ++j) c[static_cast<size_t>(r0 + i) * ldc + j] = acc[i][j];
  }
}
void row_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
void row_from_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
void row_to_f16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
void row_from_f16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
void silu_mul(const float* g, const float* u, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
void axpy(float* dst, float w, const float* x, int n) {
  for (int i = 0; i < n; ++i) dst[i] += w * x[i];
}
void scatter_add(float* acc, int64_t ldacc, const int32_t* rows, const float* w, const float* c, int ldc, int m,
                 int n) {
  for (int i = 0; i < m; ++i)
    if (w[i] != 0.0f)  // kernels.hpp: a row of weight 0 adds nothing
      axpy(acc + static_cast<int64_t>(rows[i]) * ldacc, w[i], c + static_cast<int64_t>(i) * ldc, n);
}
}  // namespace

void sum_rows_scalar(void* out, ep_moe_dtype_t out_dt, const float* init, const void* const* rows, int nrows,
                     ep_moe_dtype_t dt, int64_t col0, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const auto at = [&](int q) {
      const int64_t c = col0 + j;
      if (dt == EP_MOE_DTYPE_F32) return static_cast<const float*>(rows[q])[c];
      const uint16_t v = static_cast<const uint16_t*>(rows[q])[c];
      return dt == EP_MOE_DTYPE_BF16 ? bf16_to_f32(v) : f16_to_f32(v);
    };
    int q = 0;
    float v = 0.0f;
    if (init) v = init[j];
    else if (nrows > 0) v = at(q++);
    for (; q < nrows; ++q) v += at(q);
    if (out_dt == EP_MOE_DTYPE_F32) static_cast<float*>(out)[j] = v;
    else static_cast<uint16_t*>(out)[j] = out_dt == EP_MOE_DTYPE_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}

const Kernels& kernels_generic() {
  static const Kernels k = [] {
    Kernels t{Isa::Generic,
              NR,
              MR,
              {gemm<0>, gemm<1>, gemm<2>},
              nullptr,
              row_to_bf16,
              row_from_bf16,
              row_to_f16,
              row_from_f16,
              silu_mul,
              scatter_add,
              sum_rows_scalar};
    qkernels_generic(t.qgemm);
    t.quantize_act = quantize_act_row;
    return t;
  }();
  return k;
}

}  // namespace cpu
}  // namespace ep_moe

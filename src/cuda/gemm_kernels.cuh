// The grouped expert GEMM kernels (the synchronisation-free path and the
// fallback where cuBLASLt offers no algorithm), the gated activation and
// the gate/up GEMM fused with it.
#pragma once

#include "cuda/device_common.cuh"

namespace ep_moe {
namespace cuda {
namespace {

// ------------------------------------------------------------ activation ---

__device__ __forceinline__ float activate(int act, float g) {
  switch (act) {
    case EP_MOE_ACT_GELU: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    case EP_MOE_ACT_GELU_TANH: {
      const float u = 0.79788456080286536f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.0f + tanhf(u));
    }
    default: return g / (1.0f + expf(-g));
  }
}

// a[r, j] = act(h[r, j]) * h[r, I + j] for r < rows.
template <class G>
__global__ void act_kernel(const float* h, G* a, int64_t rows, int64_t I, int act) {
  const int64_t n = rows * I;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, j = i - r * I;
    const float* hr = h + r * 2 * I;
    a[i] = cvt<G>(activate(act, hr[j]) * hr[I + j]);
  }
}

// ---------------------------------------------------------- grouped GEMM ---

// out[r, j] = in[r, :] . W_l[j, :] for the rows of each group l: [off[l],
// off[l+1]) when `pad` is 0, else [l*pad, l*pad + cnt[l]); one group of
// `rows` rows when `off` is null. Each warp computes two output columns at
// a time (sharing the loads of the rows), kRows rows at a time, so each
// weight row is read from memory once per kRows rows (what small decode
// batches need); a block covers 16 * kPasses columns, so that blocks are
// few enough for their launch not to dominate yet enough to fill the GPU.
// acc0[q] / acc1[q] = this lane's part of rows rb+q of `in` dotted with
// weight rows w0 / w1 (q < nr); the caller sums them over the warp.
template <class G, int VEC, int kRows>
__device__ __forceinline__ void dot_rows2(const G* w0, const G* w1, const G* in, int64_t rb, int nr, int Kd, int lane,
                                          float* acc0, float* acc1) {
#pragma unroll
  for (int q = 0; q < kRows; ++q) acc0[q] = acc1[q] = 0.0f;
#pragma unroll 2
  for (int c = lane * VEC; c < Kd; c += 32 * VEC) {
    float a[VEC], b[VEC];
    ld_vec<G, VEC>(w0 + c, a);
    ld_vec<G, VEC>(w1 + c, b);
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      if (q < nr) {
        float xv[VEC];
        ld_vec<G, VEC>(in + (rb + q) * Kd + c, xv);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          acc0[q] = fmaf(a[v], xv[v], acc0[q]);
          acc1[q] = fmaf(b[v], xv[v], acc1[q]);
        }
      }
    }
  }
}

// Rows [r0, r1) of group l: [off[l], off[l+1]) when `pad` is 0, else
// [l*pad, l*pad + cnt[l]); [0, rows) when `off` is null.
__device__ __forceinline__ void group_rows(const int32_t* off, const int* cnt, int64_t pad, int64_t rows, int l,
                                           int64_t* r0, int64_t* r1) {
  *r0 = 0;
  *r1 = rows;
  if (off && pad == 0) {
    *r0 = off[l];
    *r1 = off[l + 1];
  } else if (pad > 0) {
    *r0 = l * pad;
    *r1 = *r0 + cnt[l];
  }
}

template <class G, int VEC, int kRows>
__global__ void __launch_bounds__(256)
    grouped_gemm_kernel(const G* in, const G* W, int64_t w_stride, float* out, const int32_t* off, const int* cnt,
                        int64_t pad, int64_t rows, int N, int Kd, int kPasses) {
  constexpr int kCols = 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int l = blockIdx.y;
  int64_t r0, r1;
  group_rows(off, cnt, pad, rows, l, &r0, &r1);
  if (r0 >= r1) return;
  const G* Wl = W + l * w_stride;
  for (int pass = 0; pass < kPasses; ++pass) {
    const int j0 = ((static_cast<int>(blockIdx.x) * kPasses + pass) * warps + warp) * kCols;
    if (j0 >= N) break;
    const bool two = j0 + 1 < N;
    const G* w0 = Wl + static_cast<int64_t>(j0) * Kd;
    const G* w1 = two ? w0 + Kd : w0;
    for (int64_t rb = r0; rb < r1; rb += kRows) {
      const int nr = r1 - rb < kRows ? static_cast<int>(r1 - rb) : kRows;
      float acc0[kRows], acc1[kRows];
      dot_rows2<G, VEC, kRows>(w0, w1, in, rb, nr, Kd, lane, acc0, acc1);
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        const float s0 = warp_sum(acc0[q]), s1 = warp_sum(acc1[q]);
        if (lane == 0 && q < nr) {
          out[(rb + q) * N + j0] = s0;
          if (two) out[(rb + q) * N + j0 + 1] = s1;
        }
      }
    }
  }
}

// The gate/up GEMM fused with the activation: each warp takes gate row j
// and up row j of W_l ([2I, Kd]) together and writes a[r, j] = act(gate) * up
// in the GEMM type, so the f32 gate/up rows never reach memory.
template <class G, int VEC, int kRows>
__global__ void __launch_bounds__(256) grouped_gated_kernel(const G* in, const G* W, int64_t w_stride, G* out,
                                                            const int32_t* off, int I, int Kd, int act, int kPasses) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int l = blockIdx.y;
  int64_t r0, r1;
  group_rows(off, nullptr, 0, 0, l, &r0, &r1);
  if (r0 >= r1) return;
  const G* Wl = W + l * w_stride;
  for (int pass = 0; pass < kPasses; ++pass) {
    const int j = (static_cast<int>(blockIdx.x) * kPasses + pass) * warps + warp;
    if (j >= I) break;
    const G* wg = Wl + static_cast<int64_t>(j) * Kd;
    const G* wu = Wl + static_cast<int64_t>(I + j) * Kd;
    for (int64_t rb = r0; rb < r1; rb += kRows) {
      const int nr = r1 - rb < kRows ? static_cast<int>(r1 - rb) : kRows;
      float acc0[kRows], acc1[kRows];
      dot_rows2<G, VEC, kRows>(wg, wu, in, rb, nr, Kd, lane, acc0, acc1);
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        const float g = warp_sum(acc0[q]), u = warp_sum(acc1[q]);
        if (lane == 0 && q < nr) out[(rb + q) * I + j] = cvt<G>(activate(act, g) * u);
      }
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace ep_moe

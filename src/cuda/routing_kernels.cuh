// The routing kernel: scores, grouped top-k and the top-k choice of each
// token on the device, as the CPU router (core/routing.cpp) computes them.
#pragma once

#include "cuda/device_common.cuh"

namespace ep_moe {
namespace cuda {
namespace {

// --------------------------------------------------------------- routing ---

struct RouteArgs {
  int E, K, G, TG;
  bool sigmoid, renorm;
  const float* bias;
  float scale;
};

// One block per token: scores in shared memory, grouped top-k, top-k by K
// block-wide argmax rounds (ties to the lower index, as the CPU router).
template <class L>
__global__ void route_kernel(const L* logits, RouteArgs a, int32_t* ids, float* weights, int* err) {
  extern __shared__ float sm[];
  float* sc = sm;         // [E] scores
  float* sel = sm + a.E;  // [E] selection values
  float* gs = sel + a.E;  // [G] group scores
  __shared__ float red[32];
  __shared__ int redi[32];
  __shared__ int chosen[64];
  const int64_t t = blockIdx.x;
  const L* row = logits + t * a.E;
  float mx = -INFINITY;
  int nan = 0;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) {
    const float v = ld(row, e);
    nan |= isnan(v);
    sc[e] = v;
    mx = fmaxf(mx, v);
  }
  nan = __syncthreads_or(nan);
  mx = block_max(mx, red);
  if (nan || (!a.sigmoid && isinf(mx))) {
    if (threadIdx.x == 0) set_error(err, nan ? kErrNanLogit : kErrInfLogits, t);
    for (int k = threadIdx.x; k < a.K; k += blockDim.x) {
      ids[t * a.K + k] = -1;
      weights[t * a.K + k] = 0.0f;
    }
    return;
  }
  float part = 0.0f;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) {
    const float s = a.sigmoid ? 1.0f / (1.0f + expf(-sc[e])) : expf(sc[e] - mx);
    sc[e] = s;
    part += s;
  }
  if (!a.sigmoid) {
    const float sum = block_sum(part, red);
    for (int e = threadIdx.x; e < a.E; e += blockDim.x) sc[e] /= sum;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) sel[e] = sc[e] + (a.bias ? a.bias[e] : 0.0f);
  __syncthreads();
  if (a.G > 0) {
    const int per = a.E / a.G;
    for (int g = threadIdx.x; g < a.G; g += blockDim.x) {
      const float* v = sel + g * per;
      if (a.bias) {  // sum of the two best (DeepSeek-V3)
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int i = 0; i < per; ++i) {
          if (v[i] > b1) {
            b2 = b1;
            b1 = v[i];
          } else if (v[i] > b2) {
            b2 = v[i];
          }
        }
        gs[g] = per >= 2 ? b1 + b2 : b1;
      } else {
        float b = -INFINITY;
        for (int i = 0; i < per; ++i) b = fmaxf(b, v[i]);
        gs[g] = b;
      }
    }
    __syncthreads();
    // Keep topk_group groups: mark them NaN in gs as they are taken.
    for (int i = 0; i < a.TG; ++i) {
      const int g = block_argmax(gs, a.G, red, redi);
      __syncthreads();
      if (threadIdx.x == 0) gs[g] = NAN;
      __syncthreads();
    }
    for (int e = threadIdx.x; e < a.E; e += blockDim.x)
      if (!isnan(gs[e / per])) sel[e] = -INFINITY;
    __syncthreads();
  }
  for (int k = 0; k < a.K; ++k) {
    const int e = block_argmax(sel, a.E, red, redi);
    __syncthreads();
    if (threadIdx.x == 0) {
      chosen[k] = e;
      sel[e] = NAN;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int k = 0; k < a.K; ++k) sum += sc[chosen[k]];
    for (int k = 0; k < a.K; ++k) {
      float w = sc[chosen[k]];
      if (a.renorm) w = sum > 0.0f ? w / sum : 0.0f;
      ids[t * a.K + k] = chosen[k];
      weights[t * a.K + k] = w * a.scale;
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace ep_moe

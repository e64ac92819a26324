// Data movement: token rows into expert order (and converted), the shared
// gate, the weighted combine back into token order, and the packing of
// rows for the DP gather and the all-to-all.
#pragma once

#include "cuda/device_common.cuh"

namespace ep_moe {
namespace cuda {
namespace {

// ------------------------------------------------------- data movement ---

// Rows of `src` (token order) into expert order, converted to the GEMM
// type: one block per (token, k) pair, to the position the plan gave it.
template <class A, class G>
__global__ void permute_kernel(const A* src, const int32_t* pair_pos, int K, int64_t H, G* dst) {
  const int64_t i = blockIdx.x;
  const int32_t pos = pair_pos[i];
  if (pos < 0) return;
  const A* s = src + (i / K) * H;
  G* d = dst + static_cast<int64_t>(pos) * H;
  constexpr int V = 16 / sizeof(G);
  if (std::is_same<A, G>::value && H % V == 0) {  // rows 16-byte aligned: raw 16-byte copies
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (int64_t c = threadIdx.x; c < H / V; c += blockDim.x) d4[c] = s4[c];
    return;
  }
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) d[c] = cvt<G>(ld(s, c));
}

template <class A, class G>
__global__ void convert_kernel(const A* src, G* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = cvt<G>(ld(src, i));
}

// gs[t] = sigmoid(hidden[t] . gate), one block per token.
template <class A>
__global__ void shared_gate_kernel(const A* x, const float* gate, int64_t H, float* gs) {
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) s += ld(x, t * H + c) * gate[c];
  s = block_sum(s, red);
  if (threadIdx.x == 0) gs[t] = 1.0f / (1.0f + expf(-s));
}

// out[t] = sum_k w[t,k] y[pos[t,k]] (+ gs[t] ys[t - s0] for s0 <= t < s1),
// one block per row; the k order is fixed, so the sum is the same whatever
// the row positions. pair_pos NULL: no routed pairs.
template <class A, int V>
__global__ void combine_kernel(const float* y, const int32_t* pair_pos, const float* pair_w, int K, const float* ys,
                               const float* gs, int64_t s0, int64_t s1, int64_t H, A* out) {
  const int64_t t = blockIdx.x;
  __shared__ int32_t pos[64];
  __shared__ float wt[64];
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    pos[k] = pair_pos ? pair_pos[t * K + k] : -1;
    wt[k] = pair_pos ? pair_w[t * K + k] : 0.0f;
  }
  __syncthreads();
  const bool shared = ys != nullptr && t >= s0 && t < s1;
  const float g = shared && gs ? gs[t - s0] : 1.0f;
  // V consecutive columns per thread (16-byte loads of y when V = 4).
  for (int64_t c = threadIdx.x * V; c < H; c += static_cast<int64_t>(blockDim.x) * V) {
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    for (int k = 0; k < K; ++k) {
      if (pos[k] < 0) continue;
      const float* yr = y + static_cast<int64_t>(pos[k]) * H + c;
      if constexpr (V == 4) {
        const float4 q = *reinterpret_cast<const float4*>(yr);
        acc[0] += wt[k] * q.x;
        acc[1] += wt[k] * q.y;
        acc[2] += wt[k] * q.z;
        acc[3] += wt[k] * q.w;
      } else {
        acc[0] += wt[k] * yr[0];
      }
    }
    if (shared) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += g * ys[(t - s0) * H + c + v];
    }
#pragma unroll
    for (int v = 0; v < V; ++v) out[t * H + c + v] = cvt<A>(acc[v]);
  }
}

// Packed rows [hidden (act dtype) | K ids | K weights], row_bytes apart, the
// ids at ids_off (4-byte aligned; DeviceLayerDesc, from the layer).
template <class A>
__global__ void pack_rows_kernel(char* out, int64_t rows, int64_t valid, size_t row_bytes, size_t ids_off,
                                 const A* hidden, const int32_t* ids, const float* w, const int32_t* tok,
                                 const int32_t* dest, const int32_t* row_dest, int64_t H, int K) {
  const int64_t j = blockIdx.x;
  if (j >= rows) return;
  char* row = out + j * static_cast<int64_t>(row_bytes);
  A* x = reinterpret_cast<A*>(row);
  int32_t* rid = reinterpret_cast<int32_t*>(row + ids_off);
  float* rw = reinterpret_cast<float*>(rid + K);
  if (j >= valid) {
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) x[c] = cvt<A>(0.0f);
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      rid[k] = -1;
      rw[k] = 0.0f;
    }
    return;
  }
  const int64_t t = tok ? tok[j] : j;
  const A* src = hidden + t * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) x[c] = src[c];
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const bool mine = dest == nullptr || dest[t * K + k] == row_dest[j];
    rid[k] = mine ? ids[t * K + k] : -1;
    rw[k] = w[t * K + k];
  }
}

template <class A>
__global__ void unpack_rows_kernel(const char* in, int64_t rows, size_t row_bytes, size_t ids_off, A* x, int32_t* ids,
                                   float* w, int64_t H, int K) {
  const int64_t j = blockIdx.x;
  if (j >= rows) return;
  const char* row = in + j * static_cast<int64_t>(row_bytes);
  const A* rx = reinterpret_cast<const A*>(row);
  const int32_t* rid = reinterpret_cast<const int32_t*>(row + ids_off);
  const float* rw = reinterpret_cast<const float*>(rid + K);
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) x[j * H + c] = rx[c];
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    ids[j * K + k] = rid[k];
    w[j * K + k] = rw[k];
  }
}

// All-to-all: each own token's shared output plus its returned rows, summed
// in f32 in the order they were sent.
template <class A>
__global__ void sum_returned_kernel(A* out, const A* own, const A* ret, const int32_t* off, const int32_t* idx,
                                    int64_t H) {
  const int64_t t = blockIdx.x;
  const int32_t b = off[t], e = off[t + 1];
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = own ? ld(own, t * H + c) : 0.0f;
    for (int32_t q = b; q < e; ++q) acc += ld(ret, static_cast<int64_t>(idx[q]) * H + c);
    out[t * H + c] = cvt<A>(acc);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace ep_moe

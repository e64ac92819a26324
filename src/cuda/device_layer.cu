// The CUDA backend of the MoE layer (see device_layer.hpp): kernels for
// routing, the plan, permutation, activation and combine; cuBLASLt for the
// expert GEMMs; a grouped kernel that reads the per-expert counts on the
// device for the synchronisation-free (graph-capturable) path.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "cuda/device_layer.hpp"

namespace ep_moe {
namespace cuda {
namespace {

// ---------------------------------------------------------------- errors ---

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the layer stays usable
  if (e == cudaErrorMemoryAllocation) fail(EP_MOE_ERR_OUT_OF_MEMORY, "CUDA: %s: %s", what, cudaGetErrorString(e));
  fail(EP_MOE_ERR_DEVICE, "CUDA: %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

void check_launch(const char* what) { check(cudaGetLastError(), what); }

void check_lt(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  if (s == CUBLAS_STATUS_ALLOC_FAILED) fail(EP_MOE_ERR_OUT_OF_MEMORY, "cuBLASLt: %s: allocation failed", what);
  fail(EP_MOE_ERR_DEVICE, "cuBLASLt: %s failed with status %d", what, static_cast<int>(s));
}

// Makes `device` current for the scope and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != prev_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// ---------------------------------------------------------- element I/O ---

__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const __half* p, int64_t i) { return __half2float(p[i]); }

template <class T>
__device__ __forceinline__ T cvt(float v);
template <>
__device__ __forceinline__ float cvt<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half cvt<__half>(float v) {
  return __float2half_rn(v);
}

// VEC consecutive elements starting at p (16 bytes, aligned) as floats.
template <class T, int VEC>
__device__ __forceinline__ void ld_vec(const T* p, float* out) {
  if constexpr (VEC == 1) {
    out[0] = ld(p, 0);
  } else {
    static_assert(sizeof(T) * VEC == 16, "16-byte vectors");
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = ld(e, i);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.0f;
  for (int i = 0; i < nw; ++i) r += scratch[i];
  return r;
}

__device__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int i = 0; i < nw; ++i) r = fmaxf(r, scratch[i]);
  return r;
}

// Index of the largest value of v[0, n), ties to the lower index; NaN
// entries (already taken) are skipped. Returns n when every entry is NaN.
__device__ int block_argmax(const float* v, int n, float* sv, int* si) {
  float best = -INFINITY;
  int bi = n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float x = v[i];
    if (isnan(x)) continue;
    if (bi == n || x > best || (x == best && i < bi)) {
      best = x;
      bi = i;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi != n && (bi == n || ob > best || (ob == best && oi < bi))) {
      best = ob;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = bi;
  }
  __syncthreads();
  best = -INFINITY;
  bi = n;
  for (int w = 0; w < nw; ++w) {
    const int oi = si[w];
    const float ob = sv[w];
    if (oi != n && (bi == n || ob > best || (ob == best && oi < bi))) {
      best = ob;
      bi = oi;
    }
  }
  return bi;
}

// Error codes the kernels leave in the meta block (first one wins).
enum : int { kErrNone = 0, kErrNanLogit = 1, kErrInfLogits = 2, kErrBadId = 3, kErrBadWeight = 4 };

__device__ void set_error(int* err, int code, int64_t where) {
  if (atomicCAS(err, 0, code) == 0) err[1] = static_cast<int>(where);
}

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

// ------------------------------------------------------------------ plan ---

struct PlanArgs {
  int64_t pairs;  // T * K
  int K, E, rank, my_begin, n_local;
  bool weight_zero, assigned;
  const int32_t* rep_begin;
  const int32_t* rep_slots;
  const int32_t* slot_rank;
  const int32_t* g2l;        // assigned rows: global id -> local slot
  unsigned long long* load;  // [E] real pairs computed here (the load window)
};

// meta: [0, n_local) counts, [n_local] skipped, [n_local+1] error code,
// [n_local+2] error position, [n_local+3] active experts.
// Pair i's local slot (-1: none) and weight; counts skipped pairs, errors
// and the load window in the meta block and a.load.
__device__ int plan_pair(const PlanArgs& a, const int32_t* ids, const float* w, int64_t i, int* meta, float* weight) {
  const int64_t t = i / a.K;
  const int k = static_cast<int>(i % a.K);
  const int32_t e = ids[i];
  float wt = w[i];
  int l = -1;
  bool real = true;
  if (e < 0 || e >= a.E) {
    // -1: a padding row, a token the router rejected (its error is already
    // set), or (assigned rows) a pair sent to another rank.
    if (e != -1) set_error(meta + a.n_local + 1, kErrBadId, i);
  } else if (!isfinite(wt)) {
    set_error(meta + a.n_local + 1, kErrBadWeight, i);
  } else if (a.assigned) {
    l = a.g2l[e];
    if (l < 0) set_error(meta + a.n_local + 1, kErrBadId, i);
  } else {
    const int b = a.rep_begin[e], n = a.rep_begin[e + 1] - b;
    const int slot = n == 1 ? a.rep_slots[b] : a.rep_slots[b + static_cast<int>((t + k) % n)];
    if (a.slot_rank[slot] == a.rank) {
      l = slot - a.my_begin;
    } else if (a.weight_zero && a.n_local > 0) {
      l = e % a.n_local;  // computed anyway with weight 0 (the seed's strategy)
      wt = 0.0f;
      real = false;
    } else {
      atomicAdd(meta + a.n_local, 1);
    }
  }
  if (l >= 0 && real) atomicAdd(a.load + e, 1ull);
  *weight = wt;
  return l;
}

__global__ void plan_count_kernel(PlanArgs a, const int32_t* ids, const float* w, int32_t* pair_local, float* pair_w,
                                  int* meta) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= a.pairs) return;
  float wt;
  const int l = plan_pair(a, ids, w, i, meta, &wt);
  pair_local[i] = l;
  pair_w[i] = wt;
  if (l >= 0) atomicAdd(meta + l, 1);
}

// Exclusive scan of c[0, n) by one block into out (and out2 when set);
// returns the total to every thread. Each thread sums a run of entries, the
// runs' totals are scanned with warp shuffles (the warps' totals by warp 0).
__device__ int block_scan(const int* c, int n, int32_t* out, int32_t* out2, int* active_out) {
  __shared__ int warp_total[32];
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int b = threadIdx.x * per, e = min(n, b + per);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  int s = 0, active = 0;
  for (int l = b; l < e; ++l) {
    s += c[l];
    active += c[l] > 0;
  }
  int incl = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  __syncthreads();
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int t = lane < nw ? warp_total[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += v;
    }
    if (lane < nw) warp_total[lane] = t;  // inclusive over warps
  }
  __syncthreads();
  int run = incl - s + (warp > 0 ? warp_total[warp - 1] : 0);
  for (int l = b; l < e; ++l) {
    out[l] = run;
    if (out2) out2[l] = run;
    run += c[l];
  }
  if (active && active_out) atomicAdd(active_out, active);
  return warp_total[nw - 1];
}

// The whole plan of a small batch in one block (the synchronisation-free
// path): slots and weights per pair, counts in shared memory, offsets, and
// positions (in slots of `pad` rows each when pad > 0).
__global__ void plan_small_kernel(PlanArgs a, const int32_t* ids, const float* w, int32_t* pair_local, float* pair_w,
                                  int32_t* pair_pos, int* meta, int32_t* offsets, int64_t pad) {
  extern __shared__ int smem[];
  int* count = smem;               // [n_local]
  int* cursor = smem + a.n_local;  // [n_local]
  for (int l = threadIdx.x; l < a.n_local; l += blockDim.x) count[l] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < a.pairs; i += blockDim.x) {
    float wt;
    const int l = plan_pair(a, ids, w, i, meta, &wt);
    pair_local[i] = l;
    pair_w[i] = wt;
    if (l >= 0) atomicAdd(count + l, 1);
  }
  __syncthreads();
  const int total = block_scan(count, a.n_local, offsets, cursor, meta + a.n_local + 3);
  for (int l = threadIdx.x; l < a.n_local; l += blockDim.x) {
    meta[l] = count[l];
    if (pad > 0) cursor[l] = static_cast<int>(l * pad);
  }
  if (threadIdx.x == 0) offsets[a.n_local] = total;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < a.pairs; i += blockDim.x) {
    const int l = pair_local[i];  // written by this block before the barrier
    pair_pos[i] = l >= 0 ? atomicAdd(cursor + l, 1) : -1;
  }
}

// One block: offsets = exclusive scan of the counts; cursors start there.
__global__ void plan_scan_kernel(int n_local, int* meta, int32_t* offsets, int32_t* cursor) {
  const int total = block_scan(meta, n_local, offsets, cursor, meta + n_local + 3);
  if (threadIdx.x == 0) offsets[n_local] = total;
}

// Plans of at most this many pairs run in one block (plan_small_kernel).
constexpr int64_t kSmallPlanPairs = 8192;

// Padded layout: local slot l's rows start at l * pad.
__global__ void padded_cursor_kernel(int n_local, int64_t pad, int32_t* cursor) {
  for (int l = blockIdx.x * blockDim.x + threadIdx.x; l < n_local; l += gridDim.x * blockDim.x)
    cursor[l] = static_cast<int32_t>(l * pad);
}

__global__ void plan_fill_kernel(int64_t pairs, const int32_t* pair_local, int32_t* cursor, int32_t* pair_pos) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= pairs) return;
  const int l = pair_local[i];
  pair_pos[i] = l >= 0 ? atomicAdd(cursor + l, 1) : -1;
}

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

// ------------------------------------------------------------- helpers ---

cudaDataType_t cuda_type(ep_moe_dtype_t d) {
  switch (d) {
    case EP_MOE_DTYPE_BF16: return CUDA_R_16BF;
    case EP_MOE_DTYPE_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

template <class F>
void with_type(ep_moe_dtype_t d, F&& f) {
  switch (d) {
    case EP_MOE_DTYPE_BF16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
    case EP_MOE_DTYPE_F16: f(static_cast<__half*>(nullptr)); break;
    default: f(static_cast<float*>(nullptr)); break;
  }
}

int grid_for(int64_t n, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

int alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % static_cast<uintptr_t>(a) != 0) a >>= 1;
  return a;
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (p) (void)cudaFree(p);
  }
  void alloc(size_t n, const char* what) {
    if (n == 0) return;
    check(cudaMalloc(&p, n), what);
    bytes = n;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// ---------------------------------------------------------------- layer ---

enum class Gemm : int { GateUp = 0, Down = 1, SharedGateUp = 2, SharedDown = 3, Router = 4 };

class CudaLayer final : public DeviceLayer {
 public:
  explicit CudaLayer(const DeviceLayerDesc& d);
  ~CudaLayer() override;

  void upload(Part part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
              bool src_on_device) override;
  bool begin(void* stream) override;
  void route(const DeviceForward& f, int32_t* ids, float* w) override;
  void compute(const DeviceRows& rows, void* stream) override;
  void check_route(void* stream) override;
  void pack_rows(void* out, int64_t rows, int64_t valid, const void* hidden, const int32_t* ids, const float* w,
                 const int32_t* tok, const int32_t* dest, const int32_t* row_dest, void* stream) override;
  void unpack_rows(const void* in, int64_t rows, void* x, int32_t* ids, float* w, void* stream) override;
  void sum_returned(void* out, const void* own, const void* ret, const int32_t* off, const int32_t* idx, int64_t tokens,
                    void* stream) override;
  size_t row_bytes() const override { return row_bytes_; }
  void* buffer(Buf b) override { return buf(b).p; }
  size_t buffer_bytes(Buf b) const override { return const_cast<CudaLayer*>(this)->buf(b).bytes; }
  void copy(void* dst, const void* src, size_t bytes, void* stream) override {
    if (bytes == 0) return;
    DeviceGuard g(d_.device);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync");
  }
  void sync(void* stream) override {
    DeviceGuard g(d_.device);
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  }
  DeviceStats stats() override;
  int64_t weight_bytes() const override { return weight_bytes_; }
  void read_load(int64_t* out) override {
    DeviceGuard g(d_.device);
    check(cudaDeviceSynchronize(), "wait for the forwards");  // their streams are the caller's
    static_assert(sizeof(unsigned long long) == sizeof(int64_t), "64-bit counts");
    check(cudaMemcpy(out, load_.p, static_cast<size_t>(d_.num_experts) * 8, cudaMemcpyDeviceToHost), "read load");
  }
  void reset_load() override {
    DeviceGuard g(d_.device);
    check(cudaMemset(load_.p, 0, static_cast<size_t>(d_.num_experts) * 8), "reset load");
    check(cudaDeviceSynchronize(), "reset load");
  }
  void extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) override;
  void copy_expert_from(const DeviceLayer& src, int32_t src_slot, int32_t dst_slot) override;
  void copy_router_from(const DeviceLayer& src) override;
  void* scratch(size_t bytes) override {
    if (bytes > scratch_.bytes) {
      DeviceGuard g(d_.device);
      if (scratch_.p) check(cudaFree(scratch_.p), "cudaFree");
      scratch_.p = nullptr;
      scratch_.bytes = 0;
      scratch_.alloc(bytes, "staging scratch");
    }
    return scratch_.p;
  }
  int pointer_device(const void* p) const override;
  int device_ordinal() const override { return d_.device; }
  void download(void* dst, const void* src, size_t bytes) const override {
    DeviceGuard g(d_.device);
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "read device buffer");
  }

 private:
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
  };
  Buffer& buf(Buf b) { return bufs_[static_cast<int>(b)]; }
  // Y[n, N] = X[n, Kd] W^T in f32 through cuBLASLt; false when it offers no
  // algorithm for these shapes and alignments (the caller falls back).
  // batch > 1: `batch` groups of n rows each, strided (weights N Kd apart,
  // rows n Kd, results n N).
  bool lt_gemm(Gemm kind, ep_moe_dtype_t dt, const void* W, const void* X, float* Y, int64_t n, int N, int Kd,
               cudaStream_t s, int batch);
  // The same for groups of rows, with per-group weights; `off` on the
  // device (null: one group of `rows` rows).
  // (`cnt`, `pad`: group l's rows are [l pad, l pad + cnt[l]) when pad > 0.)
  // `rows_hint`: the expected rows per group, which picks the tile shape.
  void grouped_gemm(ep_moe_dtype_t dt, const void* X, const void* W, int64_t w_stride, float* Y, const int32_t* off,
                    const int* cnt, int64_t pad, int groups, int64_t rows, int N, int Kd, cudaStream_t s,
                    int64_t rows_hint);
  void act(const float* h, void* a, int64_t rows, int64_t I, cudaStream_t s);
  // The experts' gate/up GEMM with the activation fused: rows of X (groups
  // by `off`) -> A [rows, I] in the GEMM type.
  void grouped_gated(const void* X, void* A, const int32_t* off, int groups, int I, int Kd, cudaStream_t s,
                     int64_t rows_hint);
  void check_errors(const int* hm);

  DeviceLayerDesc d_;
  ep_moe_dtype_t gdt_;  // GEMM operand type: the weight dtype
  size_t ges_;          // its size
  size_t row_bytes_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t mm_ = nullptr;
  DevBuf lt_ws_;
  using AlgoKey = std::tuple<int, int, int, int64_t, int>;  // kind, dtype, alignment, rows, batch
  std::map<AlgoKey, std::pair<bool, cublasLtMatmulAlgo_t>> algos_;

  // Weights.
  DevBuf w_gu_, w_down_, s_gu_, s_down_, router_, bias_, s_gate_;
  int64_t weight_bytes_ = 0;
  // Placement tables.
  DevBuf rep_begin_, rep_slots_, slot_rank_, g2l_;
  DevBuf load_;     // [E] pairs computed here (the load window)
  DevBuf scratch_;  // host data over a device communicator (re-placement)
  // Workspace of compute(), sized for max_rows.
  DevBuf pair_local_, pair_w_, pair_pos_, offsets_, cursor_, meta_;
  DevBuf xperm_, h_, a_, y_, xs_, hs_, as_, ys_, gs_, xf_, logits_;
  // Workspace of the distributed flows (buffer()).
  DevBuf flow_[12];
  Buffer bufs_[14];
  void* staging_[2] = {nullptr, nullptr};
  int* host_meta_ = nullptr;  // pinned copy of meta_ + offsets_
  cudaEvent_t ev_[4] = {};    // start, routed+permuted, experts, combined
  cudaEvent_t ev_meta_ = nullptr;
  bool capturing_ = false, have_stats_ = false, have_times_ = false;
  int64_t last_shared_rows_ = 0, cap_rows_ = 0;
  DeviceStats last_;
  int64_t last_rows_ = 0;
  size_t meta_ints_ = 0;
};

CudaLayer::CudaLayer(const DeviceLayerDesc& d) : d_(d), gdt_(d.weight_dtype), ges_(dtype_size(d.weight_dtype)) {
  DeviceGuard g(d.device);
  check_lt(cublasLtCreate(&lt_), "cublasLtCreate");
  check_lt(cublasLtMatmulDescCreate(&mm_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(mm_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "set TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(mm_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "set TRANSB");
  lt_ws_.alloc(32u << 20, "cuBLASLt workspace");

  const int64_t H = d.hidden, I = d.inter, S = d.shared_count, L = d.num_local, E = d.num_experts, K = d.top_k;
  const int64_t T = d.max_tokens, R = std::max(d.max_rows, T), P = R * K;
  const size_t aes = dtype_size(d.act_dtype);
  row_bytes_ = d.row_bytes;
  w_gu_.alloc(static_cast<size_t>(L * 2 * I * H) * ges_, "expert gate/up weights");
  w_down_.alloc(static_cast<size_t>(L * H * I) * ges_, "expert down weights");
  s_gu_.alloc(static_cast<size_t>(2 * S * H) * ges_, "shared gate/up weights");
  s_down_.alloc(static_cast<size_t>(H * S) * ges_, "shared down weights");
  router_.alloc(static_cast<size_t>(E * H) * 4, "router weight");
  if (d.use_bias) bias_.alloc(static_cast<size_t>(E) * 4, "score bias");
  if (d.shared_gate) s_gate_.alloc(static_cast<size_t>(H) * 4, "shared expert gate");
  weight_bytes_ =
      static_cast<int64_t>(w_gu_.bytes + w_down_.bytes + s_gu_.bytes + s_down_.bytes + bias_.bytes + s_gate_.bytes);

  auto upload_table = [](DevBuf& b, const std::vector<int32_t>& v) {
    b.alloc(std::max<size_t>(v.size(), 1) * 4, "placement table");
    if (!v.empty()) check(cudaMemcpy(b.p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload tables");
  };
  upload_table(rep_begin_, d.replica_begin);
  upload_table(rep_slots_, d.replica_slots);
  upload_table(slot_rank_, d.slot_rank);
  upload_table(g2l_, d.global_to_local);
  load_.alloc(static_cast<size_t>(E) * 8, "load counts");
  check(cudaMemset(load_.p, 0, load_.bytes), "clear load counts");

  const auto sz = [](int64_t n) { return static_cast<size_t>(std::max<int64_t>(n, 1)); };
  pair_local_.alloc(sz(P) * 4, "workspace");
  pair_w_.alloc(sz(P) * 4, "workspace");
  pair_pos_.alloc(sz(P) * 4, "workspace");
  offsets_.alloc(sz(L + 1) * 4, "workspace");
  cursor_.alloc(sz(L) * 4, "workspace");
  meta_ints_ = static_cast<size_t>(L + 4);
  meta_.alloc(meta_ints_ * 4, "workspace");
  // The expert rows: room for the pairs plus half again, so that the padded
  // (one call per GEMM) layout fits when the experts' counts are uneven, and
  // for slots of sync_free_tokens rows per local expert (decode), the latter
  // capped at 256 MiB of rows (beyond it decode uses the grouped kernel).
  const int64_t row_cost = H * static_cast<int64_t>(ges_) + 2 * I * 4 + I * static_cast<int64_t>(ges_) + H * 4;
  const int64_t slot_rows =
      std::min<int64_t>(L * std::min<int64_t>(d.sync_free_tokens, R), (int64_t{256} << 20) / row_cost);
  cap_rows_ = std::max<int64_t>(P + P / 2, slot_rows);
  xperm_.alloc(sz(cap_rows_ * H) * ges_, "workspace");
  h_.alloc(sz(cap_rows_ * 2 * I) * 4, "workspace");
  a_.alloc(sz(cap_rows_ * I) * ges_, "workspace");
  y_.alloc(sz(cap_rows_ * H) * 4, "workspace");
  if (S > 0) {
    xs_.alloc(sz(R * H) * ges_, "workspace");
    hs_.alloc(sz(R * 2 * S) * 4, "workspace");
    as_.alloc(sz(R * S) * ges_, "workspace");
    ys_.alloc(sz(R * H) * 4, "workspace");
    if (d.shared_gate) gs_.alloc(sz(R) * 4, "workspace");
  }
  xf_.alloc(sz(T * H) * 4, "workspace");
  logits_.alloc(sz(T * E) * 4, "workspace");

  // The distributed flows' buffers.
  const std::pair<Buf, size_t> sizes[] = {
      {Buf::Ids, sz(T * K) * 4},
      {Buf::Weights, sz(T * K) * 4},
      {Buf::SendRows, d.max_send_rows > 0 ? sz(d.max_send_rows) * row_bytes_ : 0},
      {Buf::RecvRows, d.max_rows > 0 ? sz(d.max_rows) * row_bytes_ : 0},
      {Buf::AllX, d.max_rows > 0 ? sz(d.max_rows * H) * aes : 0},
      {Buf::AllIds, d.max_rows > 0 ? sz(d.max_rows * K) * 4 : 0},
      {Buf::AllW, d.max_rows > 0 ? sz(d.max_rows * K) * 4 : 0},
      {Buf::Partial, d.max_rows > 0 ? sz(d.max_rows * H) * aes : 0},
      {Buf::Own, d.max_rows > 0 ? sz(T * H) * aes : 0},
      {Buf::RetRecv, d.max_ret_rows > 0 ? sz(d.max_ret_rows * H) * aes : 0},
      {Buf::Index, d.max_index > 0 ? sz(d.max_index) * 4 : 0},
  };
  int i = 0;
  for (const auto& p : sizes) {
    flow_[i].alloc(p.second, "workspace");
    buf(p.first) = Buffer{flow_[i].p, flow_[i].bytes};
    ++i;
  }
  if (d.staging_bytes > 0) {
    for (int k = 0; k < 2; ++k) check(cudaMallocHost(&staging_[k], d.staging_bytes), "pinned staging buffer");
    buf(Buf::StageIn) = Buffer{staging_[0], d.staging_bytes};
    buf(Buf::StageOut) = Buffer{staging_[1], d.staging_bytes};
  }
  check(cudaMallocHost(reinterpret_cast<void**>(&host_meta_), (meta_ints_ + 2 * static_cast<size_t>(L) + 1) * 4),
        "pinned host buffer");
  for (auto& e : ev_) check(cudaEventCreate(&e), "cudaEventCreate");
  check(cudaEventCreateWithFlags(&ev_meta_, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaDeviceSynchronize(), "layer setup");
}

CudaLayer::~CudaLayer() {
  DeviceGuard g(d_.device);
  for (auto& e : ev_)
    if (e) (void)cudaEventDestroy(e);
  if (ev_meta_) (void)cudaEventDestroy(ev_meta_);
  if (host_meta_) (void)cudaFreeHost(host_meta_);
  for (void* p : staging_)
    if (p) (void)cudaFreeHost(p);
  if (mm_) (void)cublasLtMatmulDescDestroy(mm_);
  if (lt_) (void)cublasLtDestroy(lt_);
}

int CudaLayer::pointer_device(const void* p) const {
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  if (at.type == cudaMemoryTypeManaged) return d_.device;
  return at.type == cudaMemoryTypeDevice ? at.device : -1;
}

void CudaLayer::upload(Part part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
                       bool src_on_device) {
  DeviceGuard g(d_.device);
  const int64_t H = d_.hidden, I = d_.inter;
  char* dst = nullptr;
  ep_moe_dtype_t ddt = gdt_;
  switch (part) {
    case Part::ExpertGateUp: dst = w_gu_.as<char>() + (slot * 2 * I + row0) * H * static_cast<int64_t>(ges_); break;
    case Part::ExpertDown: dst = w_down_.as<char>() + slot * H * I * static_cast<int64_t>(ges_); break;
    case Part::SharedGateUp: dst = s_gu_.as<char>() + row0 * H * static_cast<int64_t>(ges_); break;
    case Part::SharedDown: dst = s_down_.as<char>(); break;
    case Part::Router:
      dst = router_.as<char>();
      ddt = EP_MOE_DTYPE_F32;
      break;
    case Part::Bias:
      dst = bias_.as<char>();
      ddt = EP_MOE_DTYPE_F32;
      break;
    case Part::SharedGate:
      dst = s_gate_.as<char>();
      ddt = EP_MOE_DTYPE_F32;
      break;
  }
  if (dst == nullptr || rows <= 0 || cols <= 0) return;
  const size_t des = dtype_size(ddt), ses = dtype_size(src.dtype);
  const size_t row_bytes = static_cast<size_t>(cols) * des;
  if (!src.transposed && src.dtype == ddt) {  // straight copy, host or device
    const char* s0 = static_cast<const char*>(src.data) + (src.row0 * src.ld + src.col0) * static_cast<int64_t>(ses);
    check(cudaMemcpy2D(dst, row_bytes, s0, static_cast<size_t>(src.ld) * ses, row_bytes, static_cast<size_t>(rows),
                       src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice),
          "weight upload");
    // A device-to-device cudaMemcpy may return before the copy is done; the
    // caller may reuse its buffer once set_weight returns.
    if (src_on_device) check(cudaDeviceSynchronize(), "weight upload");
    return;
  }
  // Other layouts: the source span to the host (when on the device), then
  // converted on the host, row by row, and copied up.
  Source hs = src;
  std::vector<char> span;
  if (src_on_device) {
    const int64_t first = src.transposed ? src.col0 * src.ld + src.row0 : src.row0 * src.ld + src.col0;
    const int64_t last = src.transposed ? (src.col0 + cols - 1) * src.ld + src.row0 + rows - 1
                                        : (src.row0 + rows - 1) * src.ld + src.col0 + cols - 1;
    span.resize(static_cast<size_t>(last - first + 1) * ses);
    check(cudaMemcpy(span.data(), static_cast<const char*>(src.data) + first * static_cast<int64_t>(ses), span.size(),
                     cudaMemcpyDeviceToHost),
          "weight download");
    // Rebase so that (row0, col0) lands on span[0].
    hs.data = span.data() - first * static_cast<int64_t>(ses);
  }
  std::vector<char> stage(static_cast<size_t>(rows) * row_bytes);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) store_elem(stage.data(), ddt, r * cols + c, source_at(hs, r, c));
  check(cudaMemcpy(dst, stage.data(), stage.size(), cudaMemcpyHostToDevice), "weight upload");
}

bool CudaLayer::lt_gemm(Gemm kind, ep_moe_dtype_t dt, const void* W, const void* X, float* Y, int64_t n, int N, int Kd,
                        cudaStream_t s, int batch) {
  const int align = std::min({alignment_of(W), alignment_of(X), alignment_of(Y)});
  const AlgoKey key{static_cast<int>(kind), static_cast<int>(dt), align, n, batch};
  const cudaDataType_t ct = cuda_type(dt);
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  struct Layouts {
    cublasLtMatrixLayout_t* l[3];
    ~Layouts() {
      for (auto* p : l)
        if (*p) (void)cublasLtMatrixLayoutDestroy(*p);
    }
  } guard{{&la, &lb, &lc}};
  check_lt(cublasLtMatrixLayoutCreate(&la, ct, static_cast<uint64_t>(Kd), static_cast<uint64_t>(N), Kd), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&lb, ct, static_cast<uint64_t>(Kd), static_cast<uint64_t>(n), Kd), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, static_cast<uint64_t>(N), static_cast<uint64_t>(n), N),
           "layout D");
  if (batch > 1) {  // one strided batch: group g at W + g N Kd, X + g n Kd, Y + g n N
    const int32_t bc = batch;
    const int64_t sa = static_cast<int64_t>(N) * Kd, sb = n * Kd, sc = n * N;
    for (auto& [l, st] : {std::pair<cublasLtMatrixLayout_t, int64_t>{la, sa}, {lb, sb}, {lc, sc}}) {
      check_lt(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc), "batch");
      check_lt(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st, sizeof st),
               "batch stride");
    }
  }
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    cublasLtMatmulPreference_t pref = nullptr;
    check_lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
    const uint64_t ws = lt_ws_.bytes;
    const uint32_t al = static_cast<uint32_t>(align);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof al);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof al);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof al);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof al);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, mm_, la, lb, lc, lc, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    const bool ok = st == CUBLAS_STATUS_SUCCESS && found > 0;
    it = algos_.emplace(key, std::make_pair(ok, ok ? res.algo : cublasLtMatmulAlgo_t{})).first;
  }
  if (!it->second.first) return false;
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(lt_, mm_, &alpha, W, la, X, lb, &beta, Y, lc, Y, lc, &it->second.second, lt_ws_.p,
                          lt_ws_.bytes, s),
           "cublasLtMatmul");
  return true;
}

void CudaLayer::grouped_gemm(ep_moe_dtype_t dt, const void* X, const void* W, int64_t w_stride, float* Y,
                             const int32_t* off, const int* cnt, int64_t pad, int groups, int64_t rows, int N, int Kd,
                             cudaStream_t s, int64_t rows_hint) {
  if (groups <= 0) return;
  // Few rows per group: one pass (more blocks) and 4-row tiles; more rows:
  // 16-row tiles, so each weight row streams from memory once.
  const bool many = rows_hint > 6;
  const int passes = rows_hint > 2 ? 2 : 1;
  const dim3 grid(static_cast<unsigned>((N + 16 * passes - 1) / (16 * passes)), static_cast<unsigned>(groups));
  const bool vec = (Kd * static_cast<int64_t>(dtype_size(dt))) % 16 == 0 && alignment_of(X) >= 16 &&
                   alignment_of(W) >= 16 && (w_stride * static_cast<int64_t>(dtype_size(dt))) % 16 == 0;
  with_type(dt, [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = 16 / sizeof(G);
    const G* x = static_cast<const G*>(X);
    const G* w = static_cast<const G*>(W);
    if (vec && many)
      grouped_gemm_kernel<G, V, 16><<<grid, 256, 0, s>>>(x, w, w_stride, Y, off, cnt, pad, rows, N, Kd, passes);
    else if (vec)
      grouped_gemm_kernel<G, V, 4><<<grid, 256, 0, s>>>(x, w, w_stride, Y, off, cnt, pad, rows, N, Kd, passes);
    else grouped_gemm_kernel<G, 1, 4><<<grid, 256, 0, s>>>(x, w, w_stride, Y, off, cnt, pad, rows, N, Kd, passes);
  });
  check_launch("grouped GEMM kernel");
}

void CudaLayer::grouped_gated(const void* X, void* A, const int32_t* off, int groups, int I, int Kd, cudaStream_t s,
                              int64_t rows_hint) {
  if (groups <= 0) return;
  const bool many = rows_hint > 6;
  const int passes = rows_hint > 2 ? 2 : 1;
  const dim3 grid(static_cast<unsigned>((I + 8 * passes - 1) / (8 * passes)), static_cast<unsigned>(groups));
  const int64_t w_stride = 2 * static_cast<int64_t>(I) * Kd;
  const bool vec = (Kd * static_cast<int64_t>(ges_)) % 16 == 0 && alignment_of(X) >= 16 && alignment_of(w_gu_.p) >= 16;
  with_type(gdt_, [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = 16 / sizeof(G);
    const G* x = static_cast<const G*>(X);
    const G* w = w_gu_.as<G>();
    G* a = static_cast<G*>(A);
    if (vec && many)
      grouped_gated_kernel<G, V, 16><<<grid, 256, 0, s>>>(x, w, w_stride, a, off, I, Kd, d_.activation, passes);
    else if (vec)
      grouped_gated_kernel<G, V, 4><<<grid, 256, 0, s>>>(x, w, w_stride, a, off, I, Kd, d_.activation, passes);
    else grouped_gated_kernel<G, 1, 4><<<grid, 256, 0, s>>>(x, w, w_stride, a, off, I, Kd, d_.activation, passes);
  });
  check_launch("grouped gate/up kernel");
}

void CudaLayer::act(const float* h, void* a, int64_t rows, int64_t I, cudaStream_t s) {
  if (rows <= 0 || I <= 0) return;
  with_type(gdt_, [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    act_kernel<G><<<grid_for(rows * I, 256), 256, 0, s>>>(h, static_cast<G*>(a), rows, I, d_.activation);
  });
  check_launch("activation kernel");
}

bool CudaLayer::begin(void* stream) {
  DeviceGuard g(d_.device);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &cs), "cudaStreamIsCapturing");
  capturing_ = cs != cudaStreamCaptureStatusNone;
  have_stats_ = have_times_ = false;
  last_ = DeviceStats{};
  last_rows_ = 0;
  // The meta block (counts, errors) starts each forward cleared: routing
  // writes its errors there, the plan its counts.
  check(cudaMemsetAsync(meta_.p, 0, meta_ints_ * 4, static_cast<cudaStream_t>(stream)), "clear counts");
  return capturing_;
}

void CudaLayer::route(const DeviceForward& f, int32_t* ids, float* w) {
  DeviceGuard guard(d_.device);
  const auto s = static_cast<cudaStream_t>(f.stream);
  const int64_t T = f.tokens, H = d_.hidden, K = d_.top_k, E = d_.num_experts;
  if (T == 0) return;
  const int L = d_.num_local;
  int* meta = meta_.as<int>();  // routing errors land there (cleared by begin())
  if (f.own_router || f.router_logits) {
    RouteArgs ra{static_cast<int>(E),
                 static_cast<int>(K),
                 d_.num_group,
                 d_.topk_group,
                 d_.sigmoid,
                 d_.renormalize,
                 d_.use_bias ? bias_.as<float>() : nullptr,
                 d_.scale};
    const size_t route_smem = static_cast<size_t>(2 * E + std::max(d_.num_group, 1)) * 4;
    const void* logits = f.router_logits;
    ep_moe_dtype_t ldt = d_.router_dtype;
    if (f.own_router) {
      with_type(d_.act_dtype, [&](auto* tag) {
        using A = std::remove_pointer_t<decltype(tag)>;
        convert_kernel<A, float>
            <<<grid_for(T * H, 256), 256, 0, s>>>(static_cast<const A*>(f.hidden), xf_.as<float>(), T * H);
      });
      check_launch("convert kernel");
      if (!lt_gemm(Gemm::Router, EP_MOE_DTYPE_F32, router_.p, xf_.p, logits_.as<float>(), T, static_cast<int>(E),
                   static_cast<int>(H), s, 1))
        grouped_gemm(EP_MOE_DTYPE_F32, xf_.p, router_.p, 0, logits_.as<float>(), nullptr, nullptr, 0, 1, T,
                     static_cast<int>(E), static_cast<int>(H), s, T);
      logits = logits_.p;
      ldt = EP_MOE_DTYPE_F32;
    }
    with_type(ldt, [&](auto* tag) {
      using Lg = std::remove_pointer_t<decltype(tag)>;
      route_kernel<Lg>
          <<<static_cast<unsigned>(T), 128, route_smem, s>>>(static_cast<const Lg*>(logits), ra, ids, w, meta + L + 1);
    });
    check_launch("routing kernel");
  } else {
    check(cudaMemcpyAsync(ids, f.topk_ids, static_cast<size_t>(T * K) * 4, cudaMemcpyDeviceToDevice, s),
          "copy topk_ids");
    check(cudaMemcpyAsync(w, f.topk_weights, static_cast<size_t>(T * K) * 4, cudaMemcpyDeviceToDevice, s),
          "copy topk_weights");
  }
}

void CudaLayer::check_route(void* stream) {
  DeviceGuard g(d_.device);
  const auto s = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(host_meta_, meta_.p, meta_ints_ * 4, cudaMemcpyDeviceToHost, s), "read routing errors");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  check_errors(host_meta_);
}

void CudaLayer::check_errors(const int* hm) {
  const int L = d_.num_local;
  const int64_t K = d_.top_k;
  const int err = hm[L + 1];
  if (err == kErrNone) return;
  const long long where = hm[L + 2];
  switch (err) {
    case kErrNanLogit: fail(EP_MOE_ERR_INVALID_ARGUMENT, "router_logits of token %lld hold a NaN", where);
    case kErrInfLogits:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "router_logits of token %lld are infinite: softmax is undefined", where);
    case kErrBadId:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_ids[token %lld, slot %lld] is outside [0, %d)", where / K, where % K,
           d_.num_experts);
    default:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_weights[token %lld, slot %lld] is not finite", where / K, where % K);
  }
}

void CudaLayer::compute(const DeviceRows& r, void* stream) {
  DeviceGuard guard(d_.device);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = r.n, H = d_.hidden, I = d_.inter, S = d_.shared_count, K = d_.top_k;
  const int L = d_.num_local;
  const int64_t P = r.ids ? n * K : 0;
  const bool sync_free = capturing_ || n <= d_.sync_free_tokens;
  if (r.ids) {
    last_.sync_free = sync_free ? 1 : 0;
    last_rows_ = n;
  }
  if (n == 0) {
    if (r.ids) have_stats_ = true;
    return;
  }
  const bool timed = !capturing_ && r.ids != nullptr;
  if (timed) check(cudaEventRecord(ev_[0], s), "cudaEventRecord");
  int* meta = meta_.as<int>();
  int32_t* offsets = offsets_.as<int32_t>();
  const ep_moe_dtype_t adt = d_.act_dtype;
  const int64_t s0 = S > 0 ? std::max<int64_t>(0, r.shared_begin) : 0;
  const int64_t s1 = S > 0 ? std::min<int64_t>(n, r.shared_end) : 0;
  const int64_t sn = std::max<int64_t>(0, s1 - s0);

  // Plan: counts per local slot and their offsets. On the synchronising
  // path the counts come to the host here; when the experts' row counts are
  // even enough, each expert gets a slot of `pad` rows and each GEMM is one
  // strided-batched cuBLASLt call instead of one call per expert.
  int64_t pad = 0;
  const int32_t* hoff = nullptr;
  if (P > 0) {
    PlanArgs pa{P,
                static_cast<int>(K),
                d_.num_experts,
                d_.ep_rank,
                d_.my_slot_begin,
                L,
                d_.weight_zero,
                r.assigned,
                rep_begin_.as<int32_t>(),
                rep_slots_.as<int32_t>(),
                slot_rank_.as<int32_t>(),
                g2l_.as<int32_t>(),
                load_.as<unsigned long long>()};
    if (sync_free && !d_.weight_zero && L > 0 && L * n <= cap_rows_) {
      // No counts on the host, but no expert gets more than n rows (a
      // token picks an expert once): when most experts are likely active
      // (uniform routing: 1 - (1 - K/E)^n of them), a slot of n rows each
      // and one strided-batched cuBLASLt call per GEMM read each expert's
      // weights once at full speed; with few active experts the grouped
      // kernel, which skips the idle ones, reads less.
      const double active = 1.0 - std::pow(1.0 - static_cast<double>(K) / d_.num_experts, static_cast<double>(n));
      if (active >= 0.5) pad = n;
    }
    if (sync_free && P <= kSmallPlanPairs && L > 0) {
      // The whole plan in one block (one launch instead of four).
      plan_small_kernel<<<1, 512, static_cast<size_t>(2 * L) * 4, s>>>(
          pa, r.ids, r.w, pair_local_.as<int32_t>(), pair_w_.as<float>(), pair_pos_.as<int32_t>(), meta, offsets, pad);
      check_launch("plan kernel");
    } else {
      plan_count_kernel<<<grid_for(P, 256), 256, 0, s>>>(pa, r.ids, r.w, pair_local_.as<int32_t>(), pair_w_.as<float>(),
                                                         meta);
      check_launch("plan kernel");
      if (L > 0) {
        // A warp per 32 slots, up to 1024 threads (then several slots each).
        const int threads = std::min(1024, (L + 31) / 32 * 32);
        plan_scan_kernel<<<1, threads, 0, s>>>(L, meta, offsets, cursor_.as<int32_t>());
        check_launch("plan scan kernel");
      } else {
        check(cudaMemsetAsync(offsets, 0, 4, s), "clear offsets");
      }
      if (!sync_free) {
        // The one synchronisation: the per-expert counts (and any input error).
        int* hm = host_meta_;
        int32_t* ho = host_meta_ + meta_ints_;
        check(cudaMemcpyAsync(hm, meta, meta_ints_ * 4, cudaMemcpyDeviceToHost, s), "read counts");
        check(cudaMemcpyAsync(ho, offsets, static_cast<size_t>(L + 1) * 4, cudaMemcpyDeviceToHost, s), "read offsets");
        check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
        check_errors(hm);
        hoff = ho;
        int64_t most = 0;
        for (int l = 0; l < L; ++l) most = std::max<int64_t>(most, hoff[l + 1] - hoff[l]);
        const int64_t used = hoff[L];
        if (L > 1 && most > 0 && L * most <= cap_rows_ && L * most <= 2 * used) {
          pad = most;
          int32_t* starts = ho + L + 1;
          for (int l = 0; l < L; ++l) starts[l] = static_cast<int32_t>(l * pad);
          check(cudaMemcpyAsync(cursor_.p, starts, static_cast<size_t>(L) * 4, cudaMemcpyHostToDevice, s),
                "padded slots");
        }
      } else if (pad > 0) {
        padded_cursor_kernel<<<grid_for(L, 256), 256, 0, s>>>(L, pad, cursor_.as<int32_t>());
        check_launch("padded slots");
      }
      plan_fill_kernel<<<grid_for(P, 256), 256, 0, s>>>(P, pair_local_.as<int32_t>(), cursor_.as<int32_t>(),
                                                        pair_pos_.as<int32_t>());
      check_launch("plan fill kernel");
    }
  }
  with_type(adt, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    const A* x = static_cast<const A*>(r.x);
    with_type(gdt_, [&](auto* tg) {
      using G = std::remove_pointer_t<decltype(tg)>;
      if (P > 0)
        permute_kernel<A, G><<<static_cast<unsigned>(P), 128, 0, s>>>(x, pair_pos_.as<int32_t>(), static_cast<int>(K),
                                                                      H, xperm_.as<G>());
      if (sn > 0) convert_kernel<A, G><<<grid_for(sn * H, 256), 256, 0, s>>>(x + s0 * H, xs_.as<G>(), sn * H);
      if (d_.shared_gate && sn > 0)
        shared_gate_kernel<A>
            <<<static_cast<unsigned>(sn), 128, 0, s>>>(x + s0 * H, s_gate_.as<float>(), H, gs_.as<float>());
    });
  });
  check_launch("permute kernels");
  if (timed) check(cudaEventRecord(ev_[1], s), "cudaEventRecord");

  // Routed experts.
  const int64_t wgu_stride = 2 * I * H, wd_stride = H * I;
  const int gu_n = static_cast<int>(2 * I), h_n = static_cast<int>(H), i_n = static_cast<int>(I);
  // Rows an active expert is expected to get (the grouped kernel's shape).
  const int64_t hint = L > 0 ? (P + L * d_.ep_size - 1) / (static_cast<int64_t>(L) * d_.ep_size) : P;
  if (P > 0 && sync_free && pad == 0) {
    grouped_gated(xperm_.p, a_.p, offsets, L, i_n, h_n, s, hint);
    grouped_gemm(gdt_, a_.p, w_down_.p, wd_stride, y_.as<float>(), offsets, nullptr, 0, L, 0, h_n, i_n, s, hint);
  } else if (P > 0 && pad > 0) {
    if (!lt_gemm(Gemm::GateUp, gdt_, w_gu_.p, xperm_.p, h_.as<float>(), pad, gu_n, h_n, s, L))
      grouped_gemm(gdt_, xperm_.p, w_gu_.p, wgu_stride, h_.as<float>(), nullptr, meta, pad, L, 0, gu_n, h_n, s, hint);
    act(h_.as<float>(), a_.p, L * pad, I, s);
    if (!lt_gemm(Gemm::Down, gdt_, w_down_.p, a_.p, y_.as<float>(), pad, h_n, i_n, s, L))
      grouped_gemm(gdt_, a_.p, w_down_.p, wd_stride, y_.as<float>(), nullptr, meta, pad, L, 0, h_n, i_n, s, hint);
  } else if (P > 0) {
    const char* xp = xperm_.as<char>();
    const char* ap = a_.as<char>();
    bool lt_ok = true;
    for (int l = 0; l < L && lt_ok; ++l) {
      const int64_t m = hoff[l + 1] - hoff[l];
      if (m == 0) continue;
      lt_ok =
          lt_gemm(Gemm::GateUp, gdt_, w_gu_.as<char>() + l * wgu_stride * static_cast<int64_t>(ges_),
                  xp + hoff[l] * H * static_cast<int64_t>(ges_), h_.as<float>() + hoff[l] * 2 * I, m, gu_n, h_n, s, 1);
    }
    if (!lt_ok)
      grouped_gemm(gdt_, xperm_.p, w_gu_.p, wgu_stride, h_.as<float>(), offsets, nullptr, 0, L, 0, gu_n, h_n, s, hint);
    act(h_.as<float>(), a_.p, hoff[L], I, s);
    lt_ok = true;
    for (int l = 0; l < L && lt_ok; ++l) {
      const int64_t m = hoff[l + 1] - hoff[l];
      if (m == 0) continue;
      lt_ok = lt_gemm(Gemm::Down, gdt_, w_down_.as<char>() + l * wd_stride * static_cast<int64_t>(ges_),
                      ap + hoff[l] * I * static_cast<int64_t>(ges_), y_.as<float>() + hoff[l] * H, m, h_n, i_n, s, 1);
    }
    if (!lt_ok)
      grouped_gemm(gdt_, a_.p, w_down_.p, wd_stride, y_.as<float>(), offsets, nullptr, 0, L, 0, h_n, i_n, s, hint);
  }
  // Shared expert shard on its rows (their count is known on the host).
  if (sn > 0) {
    if (!lt_gemm(Gemm::SharedGateUp, gdt_, s_gu_.p, xs_.p, hs_.as<float>(), sn, static_cast<int>(2 * S),
                 static_cast<int>(H), s, 1))
      grouped_gemm(gdt_, xs_.p, s_gu_.p, 0, hs_.as<float>(), nullptr, nullptr, 0, 1, sn, static_cast<int>(2 * S),
                   static_cast<int>(H), s, sn);
    act(hs_.as<float>(), as_.p, sn, S, s);
    if (!lt_gemm(Gemm::SharedDown, gdt_, s_down_.p, as_.p, ys_.as<float>(), sn, static_cast<int>(H),
                 static_cast<int>(S), s, 1))
      grouped_gemm(gdt_, as_.p, s_down_.p, 0, ys_.as<float>(), nullptr, nullptr, 0, 1, sn, static_cast<int>(H),
                   static_cast<int>(S), s, sn);
  }
  if (timed) check(cudaEventRecord(ev_[2], s), "cudaEventRecord");

  // Combine into the output rows (act dtype).
  with_type(adt, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    const float* ysp = sn > 0 ? ys_.as<float>() : nullptr;
    const float* gsp = d_.shared_gate && sn > 0 ? gs_.as<float>() : nullptr;
    const int32_t* pp = P > 0 ? pair_pos_.as<int32_t>() : nullptr;
    if (H % 4 == 0)  // rows of y are then 16-byte aligned
      combine_kernel<A, 4><<<static_cast<unsigned>(n), 128, 0, s>>>(
          y_.as<float>(), pp, pair_w_.as<float>(), static_cast<int>(K), ysp, gsp, s0, s1, H, static_cast<A*>(r.out));
    else
      combine_kernel<A, 1><<<static_cast<unsigned>(n), 128, 0, s>>>(
          y_.as<float>(), pp, pair_w_.as<float>(), static_cast<int>(K), ysp, gsp, s0, s1, H, static_cast<A*>(r.out));
  });
  check_launch("combine kernel");
  if (timed) {
    check(cudaEventRecord(ev_[3], s), "cudaEventRecord");
    check(cudaMemcpyAsync(host_meta_, meta, meta_ints_ * 4, cudaMemcpyDeviceToHost, s), "read counts");
    check(cudaEventRecord(ev_meta_, s), "cudaEventRecord");
    have_stats_ = have_times_ = true;
    last_shared_rows_ = sn;
  }
}

void CudaLayer::pack_rows(void* out, int64_t rows, int64_t valid, const void* hidden, const int32_t* ids,
                          const float* w, const int32_t* tok, const int32_t* dest, const int32_t* row_dest,
                          void* stream) {
  if (rows <= 0) return;
  DeviceGuard g(d_.device);
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    pack_rows_kernel<A><<<static_cast<unsigned>(rows), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<char*>(out), rows, valid, row_bytes_, d_.ids_off, static_cast<const A*>(hidden), ids, w, tok, dest,
        row_dest, d_.hidden, d_.top_k);
  });
  check_launch("pack kernel");
}

void CudaLayer::unpack_rows(const void* in, int64_t rows, void* x, int32_t* ids, float* w, void* stream) {
  if (rows <= 0) return;
  DeviceGuard g(d_.device);
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    unpack_rows_kernel<A><<<static_cast<unsigned>(rows), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const char*>(in), rows, row_bytes_, d_.ids_off, static_cast<A*>(x), ids, w, d_.hidden, d_.top_k);
  });
  check_launch("unpack kernel");
}

void CudaLayer::sum_returned(void* out, const void* own, const void* ret, const int32_t* off, const int32_t* idx,
                             int64_t tokens, void* stream) {
  if (tokens <= 0) return;
  DeviceGuard g(d_.device);
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    sum_returned_kernel<A><<<static_cast<unsigned>(tokens), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<A*>(out), static_cast<const A*>(own), static_cast<const A*>(ret), off, idx, d_.hidden);
  });
  check_launch("return-sum kernel");
}

void CudaLayer::extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) {
  if (n <= 0) return;
  DeviceGuard g(d_.device);
  const int64_t H = d_.hidden;
  const int64_t rows = slot >= 0 ? d_.inter : d_.shared_count;  // gate rows (up follows)
  const char* gu = slot >= 0 ? w_gu_.as<char>() + slot * 2 * rows * H * static_cast<int64_t>(ges_) : s_gu_.as<char>();
  const char* dn = slot >= 0 ? w_down_.as<char>() + slot * H * rows * static_cast<int64_t>(ges_) : s_down_.as<char>();
  const size_t row = static_cast<size_t>(H) * ges_, nn = static_cast<size_t>(n);
  std::vector<char> gate(nn * row), up(nn * row), down(static_cast<size_t>(H) * nn * ges_);
  check(cudaMemcpy(gate.data(), gu + j0 * static_cast<int64_t>(row), gate.size(), cudaMemcpyDeviceToHost),
        "read units");
  check(cudaMemcpy(up.data(), gu + (rows + j0) * static_cast<int64_t>(row), up.size(), cudaMemcpyDeviceToHost),
        "read units");
  // Columns j0 .. j0+n of down [H, rows]: one strided copy.
  check(cudaMemcpy2D(down.data(), nn * ges_, dn + j0 * static_cast<int64_t>(ges_), static_cast<size_t>(rows) * ges_,
                     nn * ges_, static_cast<size_t>(H), cudaMemcpyDeviceToHost),
        "read units");
  for (size_t j = 0; j < nn; ++j) {
    uint8_t* u = out + j * 3 * row;
    std::memcpy(u, gate.data() + j * row, row);
    std::memcpy(u + row, up.data() + j * row, row);
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(u + 2 * row + static_cast<size_t>(h) * ges_, down.data() + (static_cast<size_t>(h) * nn + j) * ges_,
                  ges_);
  }
}

void CudaLayer::copy_expert_from(const DeviceLayer& src, int32_t src_slot, int32_t dst_slot) {
  DeviceGuard g(d_.device);
  const auto& o = static_cast<const CudaLayer&>(src);
  const size_t gu = static_cast<size_t>(2) * d_.inter * d_.hidden * ges_,
               dn = static_cast<size_t>(d_.hidden) * d_.inter * ges_;
  check(cudaMemcpy(w_gu_.as<char>() + dst_slot * gu, o.w_gu_.as<char>() + src_slot * gu, gu, cudaMemcpyDeviceToDevice),
        "copy expert");
  check(cudaMemcpy(w_down_.as<char>() + dst_slot * dn, o.w_down_.as<char>() + src_slot * dn, dn,
                   cudaMemcpyDeviceToDevice),
        "copy expert");
  check(cudaDeviceSynchronize(), "copy expert");  // done before the old layer can be freed
}

void CudaLayer::copy_router_from(const DeviceLayer& src) {
  DeviceGuard g(d_.device);
  const auto& o = static_cast<const CudaLayer&>(src);
  check(cudaMemcpy(router_.p, o.router_.p, router_.bytes, cudaMemcpyDeviceToDevice), "copy router");
  check(cudaDeviceSynchronize(), "copy router");
}

DeviceStats CudaLayer::stats() {
  if (!have_stats_ || last_rows_ == 0) return last_;
  DeviceGuard g(d_.device);
  check(cudaEventSynchronize(ev_meta_), "cudaEventSynchronize");
  const int L = d_.num_local;
  DeviceStats st = last_;
  st.local_pairs = 0;
  for (int l = 0; l < L; ++l) st.local_pairs += host_meta_[l];
  st.skipped = host_meta_[L];
  st.active = host_meta_[L + 3];
  if (have_times_) {
    float ms[3] = {0, 0, 0};
    for (int i = 0; i < 3; ++i) check(cudaEventElapsedTime(&ms[i], ev_[i], ev_[i + 1]), "cudaEventElapsedTime");
    st.permute_ns = static_cast<int64_t>(ms[0] * 1e6);
    st.expert_ns = static_cast<int64_t>(ms[1] * 1e6);
    st.combine_ns = static_cast<int64_t>(ms[2] * 1e6);
    const int64_t H = d_.hidden;
    // As on the CPU: rows the permutation wrote, rows the combine read.
    st.permute_bytes = (st.local_pairs + last_shared_rows_) * H * static_cast<int64_t>(ges_);
    st.combine_bytes = (st.local_pairs + last_shared_rows_) * H * 4;
  }
  last_ = st;
  have_stats_ = false;
  return st;
}

}  // namespace

std::unique_ptr<DeviceLayer> create_device_layer(const DeviceLayerDesc& d) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    fail(EP_MOE_ERR_UNSUPPORTED, "no CUDA device is available (%s)",
         e != cudaSuccess ? cudaGetErrorString(e) : "the device count is 0");
  }
  if (d.device < 0 || d.device >= n)
    fail(EP_MOE_ERR_INVALID_ARGUMENT, "device %d does not exist: %d CUDA device(s) visible", d.device, n);
  return std::make_unique<CudaLayer>(d);
}

}  // namespace cuda
}  // namespace ep_moe

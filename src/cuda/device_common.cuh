// What the CUDA layer's files share: error checks, the device guard, device
// buffers and type dispatch on the host; element loads and stores, warp and
// block reductions and the kernels' error codes on the device. Device code
// is in an anonymous namespace: each file that launches kernels compiles
// its own copy (no relocatable device code).
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cuda {

// ---------------------------------------------------------------- errors ---

inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the layer stays usable
  if (e == cudaErrorMemoryAllocation) fail(EP_MOE_ERR_OUT_OF_MEMORY, "CUDA: %s: %s", what, cudaGetErrorString(e));
  fail(EP_MOE_ERR_DEVICE, "CUDA: %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

inline void check_lt(cublasStatus_t s, const char* what) {
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

// ------------------------------------------------------------- helpers ---

inline cudaDataType_t cuda_type(ep_moe_dtype_t d) {
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

inline int grid_for(int64_t n, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

inline int alignment_of(const void* p) {
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

namespace {

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

}  // namespace
}  // namespace cuda
}  // namespace ep_moe

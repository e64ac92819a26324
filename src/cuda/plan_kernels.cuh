// The plan kernels: which (token, k) pairs are this rank's, their counts
// per local slot, offsets, and each pair's row in expert order.
#pragma once

#include "cuda/device_common.cuh"

namespace ep_moe {
namespace cuda {
namespace {

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

}  // namespace
}  // namespace cuda
}  // namespace ep_moe

// The CUDA layer's expert GEMMs (cuda_layer.cuh): cuBLASLt with cached
// algorithms, the grouped kernels where it offers none or where the
// per-expert counts stay on the device, and the gated activation.
#include <algorithm>
#include <map>
#include <tuple>

#include "cuda/cuda_layer.cuh"
#include "cuda/gemm_kernels.cuh"

namespace ep_moe {
namespace cuda {

// The routed experts' GEMMs: the grouped kernels on the sync-free path
// without padded slots, strided-batched cuBLASLt calls with them, one call
// per non-empty expert otherwise (the host knows the offsets, `hoff`);
// the grouped kernel wherever cuBLASLt offers no algorithm.
void CudaLayer::routed_experts(cudaStream_t s, int64_t P, int64_t pad, bool sync_free, const int32_t* hoff) {
  if (P == 0) return;
  const int64_t H = d_.hidden, I = d_.inter;
  const int L = d_.num_local;
  int* meta = meta_.as<int>();
  const int32_t* offsets = offsets_.as<int32_t>();
  const int64_t wgu_stride = 2 * I * H, wd_stride = H * I;
  const int gu_n = static_cast<int>(2 * I), h_n = static_cast<int>(H), i_n = static_cast<int>(I);
  // Rows an active expert is expected to get (the grouped kernel's shape).
  const int64_t hint = L > 0 ? (P + L * d_.ep_size - 1) / (static_cast<int64_t>(L) * d_.ep_size) : P;
  if (sync_free && pad == 0) {
    grouped_gated(xperm_.p, a_.p, offsets, L, i_n, h_n, s, hint);
    grouped_gemm(gdt_, a_.p, w_down_.p, wd_stride, y_.as<float>(), offsets, nullptr, 0, L, 0, h_n, i_n, s, hint);
  } else if (pad > 0) {
    if (!lt_gemm(Gemm::GateUp, gdt_, w_gu_.p, xperm_.p, h_.as<float>(), pad, gu_n, h_n, s, L))
      grouped_gemm(gdt_, xperm_.p, w_gu_.p, wgu_stride, h_.as<float>(), nullptr, meta, pad, L, 0, gu_n, h_n, s, hint);
    act(h_.as<float>(), a_.p, L * pad, I, s);
    if (!lt_gemm(Gemm::Down, gdt_, w_down_.p, a_.p, y_.as<float>(), pad, h_n, i_n, s, L))
      grouped_gemm(gdt_, a_.p, w_down_.p, wd_stride, y_.as<float>(), nullptr, meta, pad, L, 0, h_n, i_n, s, hint);
  } else {
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
}

// The shared expert's shard on its sn rows (their count is known on the host).
void CudaLayer::shared_expert(cudaStream_t s, int64_t sn) {
  if (sn <= 0) return;
  const int64_t H = d_.hidden, S = d_.shared_count;
  if (!lt_gemm(Gemm::SharedGateUp, gdt_, s_gu_.p, xs_.p, hs_.as<float>(), sn, static_cast<int>(2 * S),
               static_cast<int>(H), s, 1))
    grouped_gemm(gdt_, xs_.p, s_gu_.p, 0, hs_.as<float>(), nullptr, nullptr, 0, 1, sn, static_cast<int>(2 * S),
                 static_cast<int>(H), s, sn);
  act(hs_.as<float>(), as_.p, sn, S, s);
  if (!lt_gemm(Gemm::SharedDown, gdt_, s_down_.p, as_.p, ys_.as<float>(), sn, static_cast<int>(H), static_cast<int>(S),
               s, 1))
    grouped_gemm(gdt_, as_.p, s_down_.p, 0, ys_.as<float>(), nullptr, nullptr, 0, 1, sn, static_cast<int>(H),
                 static_cast<int>(S), s, sn);
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

}  // namespace cuda
}  // namespace ep_moe

// The CUDA layer's speed, as ratios to baselines measured in the same run:
//  - expert GEMMs (routed + shared, from the layer's phase times) in TFLOP/s
//    against one dense cuBLASLt GEMM pair of the same shapes and FLOPs;
//  - permutation and combine in GB/s (bytes read + written) against a
//    device-to-device copy;
//  - decode: the activated experts' weight bytes over the forward time
//    (graph replay) against the same copy bandwidth;
//  - whole-layer time per preset at T in {1, 32, 512, 4096} (direct calls,
//    and graph replays where the forward is synchronisation-free).
// One rank of each preset's default EP size (rank 0's experts, the whole
// batch: the all-gather flow). Writes JSON to --json or $OUT/cuda_bench.json.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.hpp"
#include "ep_moe/ep_moe.h"
#include "cli.hpp"
#include "presets.hpp"

namespace {

#define LT(call)                                                                                                 \
  do {                                                                                                           \
    cublasStatus_t s_ = (call);                                                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                           \
      std::fprintf(stderr, "cuBLASLt error %d at %s:%d: %s\n", static_cast<int>(s_), __FILE__, __LINE__, #call); \
      std::exit(1);                                                                                              \
    }                                                                                                            \
  } while (0)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The median ms of `n` calls of `run` on stream s (after `warm` untimed).
template <class Run>
double median_ms(cudaStream_t s, int n, int warm, Run&& run) {
  cudaEvent_t e0, e1;
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < n + warm; ++i) {
    CU(cudaEventRecord(e0, s));
    if (!run()) break;
    CU(cudaEventRecord(e1, s));
    CU(cudaEventSynchronize(e1));
    float ms = 0;
    CU(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= warm) t.push_back(ms);
  }
  CU(cudaEventDestroy(e0));
  CU(cudaEventDestroy(e1));
  return median(t);
}

// Random bf16 device buffer (uniform in [-a, a)).
void* random_bf16(size_t n, float a, uint64_t seed) {
  std::vector<__nv_bfloat16> h(n);
  presets::Rng r(seed, 1);
  for (auto& x : h) x = __float2bfloat16(r.uniform(a));
  void* d = nullptr;
  CU(cudaMalloc(&d, n * 2));
  CU(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

// Device-to-device copy bandwidth, bytes read + written, best of 10.
double copy_gbs(cudaStream_t s) {
  const size_t n = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CU(cudaMalloc(&a, n));
  CU(cudaMalloc(&b, n));
  CU(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));
  double best = 0;
  for (int i = 0; i < 12; ++i) {
    CU(cudaEventRecord(e0, s));
    CU(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
    CU(cudaEventRecord(e1, s));
    CU(cudaEventSynchronize(e1));
    float ms = 0;
    CU(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) best = std::max(best, 2.0 * static_cast<double>(n) / (ms * 1e-3) / 1e9);
  }
  CU(cudaFree(a));
  CU(cudaFree(b));
  return best;
}

// Y[m, n] = X[m, k] W[n, k]^T, bf16 in, f32 out: cuBLASLt, median ms.
class Dense {
 public:
  Dense() {
    LT(cublasLtCreate(&lt_));
    LT(cublasLtMatmulDescCreate(&mm_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(mm_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT(cublasLtMatmulDescSetAttribute(mm_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CU(cudaMalloc(&ws_, ws_bytes_));
  }
  ~Dense() {
    cudaFree(ws_);
    cublasLtMatmulDescDestroy(mm_);
    cublasLtDestroy(lt_);
  }
  // Median ms of `reps` runs of the listed GEMMs back to back.
  double time(const std::vector<std::array<int64_t, 3>>& shapes, cudaStream_t s, int reps) {
    struct G {
      void *x, *w, *y;
      cublasLtMatrixLayout_t la, lb, lc;
      cublasLtMatmulAlgo_t algo;
    };
    std::vector<G> gs;
    for (const auto& sh : shapes) {
      const int64_t m = sh[0], n = sh[1], k = sh[2];
      G g{};
      g.x = random_bf16(static_cast<size_t>(m * k), 1.0f, 3);
      g.w = random_bf16(static_cast<size_t>(n * k), 0.05f, 4);
      CU(cudaMalloc(&g.y, static_cast<size_t>(m * n) * 4));
      LT(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, k, n, k));
      LT(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, k, m, k));
      LT(cublasLtMatrixLayoutCreate(&g.lc, CUDA_R_32F, n, m, n));
      cublasLtMatmulPreference_t pref;
      LT(cublasLtMatmulPreferenceCreate(&pref));
      LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes_,
                                              sizeof ws_bytes_));
      cublasLtMatmulHeuristicResult_t r;
      int found = 0;
      LT(cublasLtMatmulAlgoGetHeuristic(lt_, mm_, g.la, g.lb, g.lc, g.lc, pref, 1, &r, &found));
      cublasLtMatmulPreferenceDestroy(pref);
      if (!found) {
        std::fprintf(stderr, "no cuBLASLt algorithm for %lld x %lld x %lld\n", static_cast<long long>(m),
                     static_cast<long long>(n), static_cast<long long>(k));
        std::exit(1);
      }
      g.algo = r.algo;
      gs.push_back(g);
    }
    const float alpha = 1.0f, beta = 0.0f;
    const double ms = median_ms(s, reps, 3, [&] {
      for (auto& g : gs)
        LT(cublasLtMatmul(lt_, mm_, &alpha, g.w, g.la, g.x, g.lb, &beta, g.y, g.lc, g.y, g.lc, &g.algo, ws_, ws_bytes_,
                          s));
      return true;
    });
    for (auto& g : gs) {
      cudaFree(g.x);
      cudaFree(g.w);
      cudaFree(g.y);
      cublasLtMatrixLayoutDestroy(g.la);
      cublasLtMatrixLayoutDestroy(g.lb);
      cublasLtMatrixLayoutDestroy(g.lc);
    }
    return ms;
  }

 private:
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t mm_ = nullptr;
  void* ws_ = nullptr;
  uint64_t ws_bytes_ = 32u << 20;
};

struct Row {
  std::string preset;
  int ep = 1, T = 0;
  int64_t pairs = 0, active = 0;
  int sync_free = 0;
  double forward_ms = 0, graph_ms = -1;
  double expert_ms = 0, permute_ms = 0, combine_ms = 0;
  double expert_tflops = 0, dense_tflops = 0;
  double permute_gbs = 0, combine_gbs = 0, stream_gbs = 0;
};

int64_t attr(ep_moe_layer_t* l, ep_moe_layer_attr_t a) {
  int64_t v = 0;
  ep_moe_layer_get_attr(&v, l, a);
  return v;
}

// The preset's layer on device 0 (rank 0 of its default EP size), its
// weights random bf16 (every local expert the same buffers); null, with
// the reason printed, on failure.
ep_moe_layer_t* make_layer(const presets::Model& m, ep_moe_expert_map_t* map, int max_t) {
  const int H = m.hidden, I = m.intermediate, E = m.experts;
  ep_moe_layer_config_t lc =
      presets::layer_config(m, m.shared_intermediate, EP_MOE_DTYPE_BF16, EP_MOE_DTYPE_BF16, max_t, 0);
  lc.device = 0;
  ep_moe_layer_t* layer = nullptr;
  if (!map || ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) != EP_MOE_OK) {
    std::fprintf(stderr, "%s: %s\n", m.name, ep_moe_last_error());
    return nullptr;
  }
  // Weights: device buffers of bf16, copied into each local expert's slot.
  const float a_in = std::sqrt(3.0f / static_cast<float>(H)), a_dn = std::sqrt(3.0f / static_cast<float>(I));
  void* gu = random_bf16(static_cast<size_t>(2) * I * H, a_in, 11);
  void* dn = random_bf16(static_cast<size_t>(H) * I, a_dn, 12);
  bool ok = true;
  for (int e = 0; e < E && ok; ++e) {
    int32_t local = 0;
    ep_moe_expert_map_is_local(&local, map, e);
    if (!local) continue;
    ok =
        ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_GATE_UP, e, gu, EP_MOE_DTYPE_BF16, 2 * I, H) ==
            EP_MOE_OK &&
        ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_DOWN, e, dn, EP_MOE_DTYPE_BF16, H, I) == EP_MOE_OK;
  }
  CU(cudaFree(gu));
  CU(cudaFree(dn));
  const int Is = m.shared_intermediate;
  if (ok && Is > 0) {
    const float a_sd = std::sqrt(3.0f / static_cast<float>(Is));
    void* sg = random_bf16(static_cast<size_t>(Is) * H, a_in, 13);
    void* sd = random_bf16(static_cast<size_t>(H) * Is, a_sd, 14);
    ok = ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SHARED_GATE, -1, sg, EP_MOE_DTYPE_BF16, Is, H) ==
             EP_MOE_OK &&
         ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SHARED_UP, -1, sg, EP_MOE_DTYPE_BF16, Is, H) ==
             EP_MOE_OK &&
         ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SHARED_DOWN, -1, sd, EP_MOE_DTYPE_BF16, H, Is) ==
             EP_MOE_OK;
    CU(cudaFree(sg));
    CU(cudaFree(sd));
    std::vector<float> g;
    presets::fill(g, static_cast<size_t>(H), 5, 5, a_in);
    if (ok && m.shared_gate)
      ok = ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, g.data(), EP_MOE_DTYPE_F32, 1,
                                   H) == EP_MOE_OK;
  }
  if (ok && m.bias) {
    std::vector<float> b;
    presets::fill(b, static_cast<size_t>(E), 6, 6, 0.05f);
    ok = ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SCORE_BIAS, -1, b.data(), EP_MOE_DTYPE_F32, 1, E) ==
         EP_MOE_OK;
  }
  if (!ok || attr(layer, EP_MOE_LAYER_ATTR_READY) != 1) {
    std::fprintf(stderr, "%s: weights: %s\n", m.name, ep_moe_layer_last_error(layer));
    ep_moe_layer_destroy(layer);
    return nullptr;
  }
  return layer;
}

// The forward of `a` captured into a CUDA graph and replayed: median ms,
// or -1 where the capture failed (printed).
double graph_ms(ep_moe_layer_t* layer, const ep_moe_forward_args_t& a, cudaStream_t s, int reps, const char* name) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  double ms = -1;
  CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const ep_moe_status_t rc = ep_moe_layer_forward(layer, &a);
  CU(cudaStreamEndCapture(s, &g));
  if (rc == EP_MOE_OK) {
    CU(cudaGraphInstantiate(&ge, g, 0));
    ms = median_ms(s, 3 * reps, 5, [&] {
      CU(cudaGraphLaunch(ge, s));
      return true;
    });
    CU(cudaGraphExecDestroy(ge));
  } else {
    std::fprintf(stderr, "%s T=%lld: capture: %s\n", name, static_cast<long long>(a.num_tokens),
                 ep_moe_layer_last_error(layer));
  }
  CU(cudaGraphDestroy(g));
  return ms;
}

// One row: the layer's forward of T tokens timed, its phases from the
// layer's attributes, and the baselines of the same shapes. False (printed)
// where the forward failed.
bool measure_row(ep_moe_layer_t* layer, const presets::Model& m, int T, const void* hidden, const float* logits,
                 void* out, cudaStream_t s, int reps, Dense& dense, Row* r) {
  const int H = m.hidden, I = m.intermediate;
  const int64_t S = attr(layer, EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE);
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = T;
  a.hidden = hidden;
  a.router_logits = logits;
  a.out = out;
  a.stream = s;
  bool failed = false;
  const int n = T >= 4096 ? std::max(5, reps / 2) : reps;
  r->forward_ms = median_ms(s, n, 2, [&] {
    if (ep_moe_layer_forward(layer, &a) == EP_MOE_OK) return true;
    std::fprintf(stderr, "%s T=%d: %s\n", m.name, T, ep_moe_layer_last_error(layer));
    failed = true;
    return false;
  });
  if (failed) return false;
  r->preset = m.name;
  r->ep = m.default_ep;
  r->T = T;
  r->pairs = attr(layer, EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS);
  r->active = attr(layer, EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS);
  r->sync_free = static_cast<int>(attr(layer, EP_MOE_LAYER_ATTR_LAST_SYNC_FREE));
  r->permute_ms = static_cast<double>(attr(layer, EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS)) * 1e-6;
  r->expert_ms = static_cast<double>(attr(layer, EP_MOE_LAYER_ATTR_LAST_EXPERT_NS)) * 1e-6;
  r->combine_ms = static_cast<double>(attr(layer, EP_MOE_LAYER_ATTR_LAST_COMBINE_NS)) * 1e-6;
  const double flops = 2.0 * static_cast<double>(r->pairs) * 3.0 * H * I + 2.0 * T * 3.0 * H * static_cast<double>(S);
  r->expert_tflops = flops / (r->expert_ms * 1e-3) / 1e12;
  // The same FLOPs as dense GEMMs: all routed rows against one expert's
  // shapes, plus the shared expert's.
  std::vector<std::array<int64_t, 3>> shapes;
  if (r->pairs > 0) {
    shapes.push_back({r->pairs, 2 * I, H});
    shapes.push_back({r->pairs, H, I});
  }
  if (S > 0) {
    shapes.push_back({T, 2 * S, H});
    shapes.push_back({T, H, S});
  }
  const double dense_ms = shapes.empty() ? 0 : dense.time(shapes, s, 10);
  r->dense_tflops = dense_ms > 0 ? flops / (dense_ms * 1e-3) / 1e12 : 0;
  // Bytes read + written by each phase.
  const double moved_rows = static_cast<double>(r->pairs) + (S > 0 ? T : 0);
  r->permute_gbs = moved_rows * H * (2.0 + 2.0) / (r->permute_ms * 1e-3) / 1e9;
  r->combine_gbs = (moved_rows * H * 4.0 + T * H * 2.0) / (r->combine_ms * 1e-3) / 1e9;
  // Graph replay where the forward is synchronisation-free.
  if (r->sync_free == 1) r->graph_ms = graph_ms(layer, a, s, reps, m.name);
  const double weight_bytes =
      static_cast<double>(r->active) * 3.0 * H * I * 2.0 + 3.0 * H * static_cast<double>(S) * 2.0;
  const double best_ms = r->graph_ms > 0 ? std::min(r->graph_ms, r->forward_ms) : r->forward_ms;
  r->stream_gbs = weight_bytes / (best_ms * 1e-3) / 1e9;
  return true;
}

// Every token count of one preset: a row each, printed as it comes.
bool run_preset(const presets::Model& m, const std::vector<int>& tokens, cudaStream_t s, int reps, Dense& dense,
                std::vector<Row>* rows) {
  const int max_t = *std::max_element(tokens.begin(), tokens.end());
  const int H = m.hidden, E = m.experts;
  ep_moe_expert_map_t* map = presets::linear_map(m.default_ep, 0, E);
  ep_moe_layer_t* layer = make_layer(m, map, max_t);
  if (!layer) {
    ep_moe_expert_map_destroy(map);
    return false;
  }
  void* hidden = random_bf16(static_cast<size_t>(max_t) * H, 1.0f, 21);
  void* out = nullptr;
  CU(cudaMalloc(&out, static_cast<size_t>(max_t) * H * 2));
  float* logits = nullptr;
  {
    std::vector<float> lg;
    presets::fill(lg, static_cast<size_t>(max_t) * E, 7, 7, 4.0f);
    CU(cudaMalloc(&logits, lg.size() * 4));
    CU(cudaMemcpy(logits, lg.data(), lg.size() * 4, cudaMemcpyHostToDevice));
  }
  bool ok = true;
  for (int T : tokens) {
    Row r;
    if (!measure_row(layer, m, T, hidden, logits, out, s, reps, dense, &r)) {
      ok = false;
      break;
    }
    rows->push_back(r);
    std::printf(
        "%-15s T=%-5d pairs=%-6lld forward %.3f ms graph %.3f ms | expert %.3f ms %.0f TFLOP/s (dense %.0f) "
        "| permute %.3f ms %.0f GB/s combine %.3f ms %.0f GB/s | weights %.0f GB/s\n",
        m.name, T, static_cast<long long>(r.pairs), r.forward_ms, r.graph_ms, r.expert_ms, r.expert_tflops,
        r.dense_tflops, r.permute_ms, r.permute_gbs, r.combine_ms, r.combine_gbs, r.stream_gbs);
    std::fflush(stdout);
  }
  CU(cudaFree(hidden));
  CU(cudaFree(out));
  CU(cudaFree(logits));
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  return ok;
}

void write_json(const std::string& path, const char* device, double copy, double peak_tflops,
                const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return;
  std::fprintf(f, "{\"device\": \"%s\", \"copy_gbs\": %.1f, \"dense_peak_tflops\": %.1f, \"rows\": [\n", device, copy,
               peak_tflops);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "  {\"preset\": \"%s\", \"ep\": %d, \"tokens\": %d, \"local_pairs\": %lld, \"active_experts\": %lld, "
                 "\"sync_free\": %d, \"forward_ms\": %.4f, \"graph_ms\": %.4f, \"permute_ms\": %.4f, "
                 "\"expert_ms\": %.4f, \"combine_ms\": %.4f, \"expert_tflops\": %.2f, \"dense_tflops\": %.2f, "
                 "\"permute_gbs\": %.1f, \"combine_gbs\": %.1f, \"weight_stream_gbs\": %.1f}%s\n",
                 r.preset.c_str(), r.ep, r.T, static_cast<long long>(r.pairs), static_cast<long long>(r.active),
                 r.sync_free, r.forward_ms, r.graph_ms, r.permute_ms, r.expert_ms, r.combine_ms, r.expert_tflops,
                 r.dense_tflops, r.permute_gbs, r.combine_gbs, r.stream_gbs, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
}

// The short table, last: each phase as a fraction of its baseline.
void print_table(const std::vector<Row>& rows, double copy, double peak_tflops) {
  std::printf("\n%-15s %5s %9s %9s %8s %7s %8s %8s %8s\n", "preset (EP)", "T", "fwd ms", "graph ms", "GEMM/dn",
              "perm/cp", "comb/cp", "wts/cp", "path");
  for (const Row& r : rows) {
    const std::string p = r.preset + " (" + std::to_string(r.ep) + ")";
    std::printf("%-15s %5d %9.3f %9.3f %7.0f%% %6.0f%% %7.0f%% %7.0f%% %8s\n", p.c_str(), r.T, r.forward_ms, r.graph_ms,
                r.dense_tflops > 0 ? 100.0 * r.expert_tflops / r.dense_tflops : 0.0, 100.0 * r.permute_gbs / copy,
                100.0 * r.combine_gbs / copy, 100.0 * r.stream_gbs / copy, r.sync_free ? "syncfree" : "cuBLASLt");
  }
  std::printf("baselines (same run): D2D copy %.0f GB/s, dense bf16 GEMM %.0f TFLOP/s\n", copy, peak_tflops);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> names = {"qwen3-30b-a3b", "qwen2-57b-a14b", "mixtral-8x7b", "deepseek-v3"};
  std::vector<int> tokens = {1, 32, 512, 4096};
  std::string json_path;
  if (const char* o = std::getenv("OUT")) json_path = std::string(o) + "/cuda_bench.json";
  int reps = 20;
  std::string preset;
  cli::Parser args("ep_moe_cuda_bench [options]",
                   "The CUDA layer on one GPU, as tests/gpu/run.sh runs it (JSON goes to "
                   "$OUT/cuda_bench.json when OUT is set).");
  args.option("--preset", &preset, "one model (default: all)", "NAME")
      .list("--tokens", &tokens, "token counts (default 1,32,512,4096)", 1, 1 << 20)
      .option("--reps", &reps, "repetitions per row (default 20, at least 3)", 3, 1 << 20)
      .option("--json", &json_path, "write the rows as JSON", "FILE");
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (!preset.empty()) names = {preset};
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop;
  CU(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy = copy_gbs(s);
  Dense dense;
  const double big_ms = dense.time({{{8192, 8192, 8192}}}, s, 10);
  const double peak_tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 / (big_ms * 1e-3) / 1e12;
  std::printf("device: %s, %d SMs; D2D copy %.0f GB/s (read+write); dense bf16 GEMM 8192^3 %.0f TFLOP/s\n", prop.name,
              prop.multiProcessorCount, copy, peak_tflops);

  std::vector<Row> rows;
  for (const std::string& name : names) {
    const presets::Model* m = presets::find(name);
    if (!m) {
      std::fprintf(stderr, "unknown preset %s\n", name.c_str());
      return 2;
    }
    if (!run_preset(*m, tokens, s, reps, dense, &rows)) return 1;
  }
  if (!json_path.empty()) write_json(json_path, prop.name, copy, peak_tflops, rows);
  print_table(rows, copy, peak_tflops);
  return 0;
}

// ep_moe_gemm_engines: which GEMM engine should run the CPU expert FFNs?
//
// The expert GEMMs are C[M, N] = A[M, K] * W[N, K]^T with W an expert's
// gate_up ([2I, H]) or down ([H, I]) matrix and M the pairs routed to that
// expert (1 in decode, tens in prefill). This measures, on those shapes and
// in the same run, ep_moe's packed-panel tiles against OpenBLAS
// (cblas_sgemm / cblas_sbgemm) and oneDNN (matmul, weights reordered once
// into its preferred layout, as ep_moe packs them once), f32 and bf16, with
// the same number of threads, rotating through enough weight copies that the
// caches hold none of them, each engine checked against a double-precision
// product; and, for bf16, ep_moe's matrix engine (cpu/matrix_engine.hpp:
// oneDNN's brgemm reading ep_moe's own panels in place, one call per pool
// thread, as the expert FFN calls it). Built only when both libraries are
// found.
#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.hpp"
#include "cli.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/matrix_engine.hpp"
#include "cpu/pack.hpp"
#include "cpu/thread_pool.hpp"
#include "oneapi/dnnl/dnnl.hpp"

extern "C" char* openblas_get_corename(void);
extern "C" void openblas_set_num_threads(int);
// Looked up at run time: OpenBLAS builds without BUILD_BFLOAT16 (Debian's)
// lack it.
using SbgemmFn = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, blasint, blasint, blasint, float,
                          const uint16_t*, blasint, const uint16_t*, blasint, float, float*, blasint);

namespace {

using Clock = std::chrono::steady_clock;
namespace cpu = ep_moe::cpu;
using ep_moe::Source;

struct Shape {
  const char* name;
  int n, k;
};

// Runs fn(copy) over rotating copies for at least `seconds`; mean seconds per call.
template <class F>
double time_it(int copies, double seconds, F&& fn) {
  fn(0);  // warm-up
  int calls = 0;
  const auto t0 = Clock::now();
  double dt = 0;
  do {
    fn(calls % copies);
    ++calls;
    dt = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (dt < seconds || calls < 3);
  return dt / calls;
}

using Run = std::function<void(int)>;  // one product on weight copy c

// What every measurement shares: the options, ep_moe's kernels and pool,
// OpenBLAS's bf16 entry (or none), the matrix engine (or none), oneDNN's.
struct Setup {
  int threads = 2;
  double seconds = 0.3;
  bool quick = false;  // qwen3 shapes, 32 MiB of weight copies: a smoke run
  const cpu::Kernels* kern = nullptr;
  std::unique_ptr<cpu::ThreadPool> pool;
  SbgemmFn sbgemm = nullptr;
  std::unique_ptr<cpu::MatrixEngine> engine;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  bool said_no_dnnl[2] = {false, false};
};

// The engines' setup, printed as the run's header.
void set_up(Setup& st) {
  openblas_set_num_threads(st.threads);
  st.kern = &cpu::layer_kernels();                          // the kernels a layer takes here
  st.pool = std::make_unique<cpu::ThreadPool>(st.threads);  // ep_moe's kernels run on the layer's pool
  st.sbgemm = reinterpret_cast<SbgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sbgemm"));
  if (!st.sbgemm)
    std::printf("this OpenBLAS has no cblas_sbgemm (built without BUILD_BFLOAT16): no OpenBLAS bf16 rows\n");
  std::printf("threads %d; ep_moe kernels %s; OpenBLAS core %s; oneDNN %d.%d\n", st.threads,
              cpu::isa_name(st.kern->isa), openblas_get_corename(), dnnl_version()->major, dnnl_version()->minor);
  // The matrix engine on every depth below, whatever ISA oneDNN runs here.
  setenv("EP_MOE_BACKEND_DIR", EP_MOE_MODULE_DIR, 0);
  cpu::MatrixEngineDesc ed;
  ed.threads = st.threads;
  ed.nr = st.kern->nr;
  ed.tile_panels = std::max(1, 256 / st.kern->nr);
  ed.depths = {2048, 768, 7168};
  ed.need_amx = false;
  std::string why;
  st.engine = cpu::make_matrix_engine(ed, &why);
  if (st.engine) std::printf("matrix engine: %s\n", st.engine->name().c_str());
  else std::printf("no matrix engine: %s\n", why.c_str());
}

// Copies of one shape's weights, enough that they exceed any cache
// (>= 256 MiB in all): f32 or bf16 row-major, and packed as ep_moe packs them.
struct Copies {
  int n = 0;
  std::vector<std::vector<float>> wf;  // f32 weights (emptied for bf16)
  std::vector<std::vector<uint16_t>> wb;
  std::vector<cpu::PackedWeight> packed;
};

Copies make_copies(const Setup& st, int N, int K, bool bf16, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t es = bf16 ? 2 : 4;
  const size_t budget = static_cast<size_t>(st.quick ? 32 : 256) << 20;
  Copies w;
  w.n = static_cast<int>(std::max<size_t>(2, budget / (static_cast<size_t>(N) * K * es) + 1));
  w.wf.resize(static_cast<size_t>(w.n));
  w.wb.resize(static_cast<size_t>(w.n));
  w.packed.resize(static_cast<size_t>(w.n));
  for (size_t c = 0; c < static_cast<size_t>(w.n); ++c) {
    auto& f = w.wf[c];
    f.resize(static_cast<size_t>(N) * K);
    for (auto& x : f) x = nd(rng) * 0.02f;
    if (bf16) {
      w.wb[c].resize(f.size());
      for (size_t i = 0; i < f.size(); ++i) w.wb[c][i] = ep_moe::f32_to_bf16(f[i]);
      cpu::pack(w.packed[c], Source{w.wb[c].data(), EP_MOE_DTYPE_BF16, K}, N, K, st.kern->nr, EP_MOE_DTYPE_BF16);
      std::vector<float>().swap(f);  // only the bf16 copy is needed
    } else {
      cpu::pack(w.packed[c], Source{f.data(), EP_MOE_DTYPE_F32, K}, N, K, st.kern->nr, EP_MOE_DTYPE_F32);
    }
  }
  return w;
}

// One product C[M, N] = A[M, K] W[N, K]^T: its activations (f32, and as
// bf16), the output every engine writes.
struct Case {
  int M = 0, N = 0, K = 0;
  bool bf16 = false;
  const Copies* w = nullptr;
  std::vector<float> a, cbuf;
  std::vector<uint16_t> ab;
};

// ep_moe: panels split over the threads, up to 64 rows per call (as the
// expert FFN calls it).
Run ep_moe_run(const Setup& st, Case& cs) {
  return [&st, &cs](int c) {
    const cpu::Kernels& kern = *st.kern;
    const bool dot = cs.bf16 && kern.gemm_bf16;
    const cpu::PackedWeight& w = cs.w->packed[static_cast<size_t>(c)];
    const int panels = w.panels(), threads = st.threads, M = cs.M, N = cs.N, K = cs.K;
    st.pool->parallel_for(static_cast<size_t>(threads), [&](size_t ti, int) {
      const int t = static_cast<int>(ti);
      constexpr int kRows = 64;
      std::vector<float> tile(static_cast<size_t>(kRows) * kern.nr);
      const float* rows[kRows];
      const uint16_t* rows16[kRows];
      const int p_end = panels * (t + 1) / threads;
      for (int p = panels * t / threads; p < p_end; ++p)
        for (int r0 = 0; r0 < M; r0 += kRows) {
          const void* next = p + 1 < p_end ? w.panel(p + 1) : nullptr;
          const int m = std::min(kRows, M - r0);
          for (int i = 0; i < m; ++i) {
            rows[i] = cs.a.data() + static_cast<size_t>(r0 + i) * K;
            rows16[i] = cs.ab.data() + static_cast<size_t>(r0 + i) * K;
          }
          if (dot) kern.gemm_bf16(m, rows16, K, w.panel(p), tile.data(), kern.nr, next);
          else kern.gemm[w.dtype](m, rows, K, w.panel(p), tile.data(), kern.nr, next);
          const int cols = std::min(kern.nr, N - p * kern.nr);
          for (int i = 0; i < m; ++i)
            std::memcpy(cs.cbuf.data() + static_cast<size_t>(r0 + i) * N + static_cast<size_t>(p) * kern.nr,
                        tile.data() + static_cast<size_t>(i) * kern.nr, static_cast<size_t>(cols) * 4);
        }
    });
  };
}

// OpenBLAS; none for bf16 where it has no cblas_sbgemm.
Run blas_run(const Setup& st, Case& cs) {
  if (cs.bf16 && !st.sbgemm) return nullptr;
  return [&st, &cs](int c) {
    const auto cu = static_cast<size_t>(c);
    if (cs.bf16)
      st.sbgemm(CblasRowMajor, CblasNoTrans, CblasTrans, cs.M, cs.N, cs.K, 1.0f, cs.ab.data(), cs.K,
                cs.w->wb[cu].data(), cs.K, 0.0f, cs.cbuf.data(), cs.N);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, cs.M, cs.N, cs.K, 1.0f, cs.a.data(), cs.K,
                  cs.w->wf[cu].data(), cs.K, 0.0f, cs.cbuf.data(), cs.N);
  };
}

// oneDNN matmul: src [M, K], weights [K, N] (from W [N, K] row-major:
// strides {1, K}), reordered once into the layout it prefers. Where this
// CPU has no kernel for the type (bf16 without AVX-512 in oneDNN 2.6), the
// primitive cannot be created: none (said once per type).
Run dnnl_run(Setup& st, Case& cs) {
  using dt = dnnl::memory::data_type;
  const dt wt = cs.bf16 ? dt::bf16 : dt::f32;
  const dnnl::memory::desc src_md({cs.M, cs.K}, wt, dnnl::memory::format_tag::ab);
  const dnnl::memory::desc w_any({cs.K, cs.N}, wt, dnnl::memory::format_tag::any);
  const dnnl::memory::desc w_plain({cs.K, cs.N}, wt, dnnl::memory::dims{1, cs.K});
  const dnnl::memory::desc dst_md({cs.M, cs.N}, dt::f32, dnnl::memory::format_tag::ab);
  dnnl::matmul mm;
  std::vector<dnnl::memory> wmem;
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, w_any, dst_md), st.eng);  // oneDNN 2.x API
    mm = dnnl::matmul(pd);
    for (size_t c = 0; c < static_cast<size_t>(cs.w->n); ++c) {
      void* raw = cs.bf16 ? static_cast<void*>(const_cast<uint16_t*>(cs.w->wb[c].data()))
                          : static_cast<void*>(const_cast<float*>(cs.w->wf[c].data()));
      dnnl::memory plain(w_plain, st.eng, raw);
      dnnl::memory re(pd.weights_desc(), st.eng);
      dnnl::reorder(plain, re).execute(st.strm, plain, re);
      wmem.push_back(re);
    }
    st.strm.wait();
  } catch (const dnnl::error&) {
    if (!st.said_no_dnnl[cs.bf16]) {
      const char* t = cs.bf16 ? "bf16" : "f32";
      std::printf("oneDNN has no %s matmul on this CPU: no oneDNN %s rows\n", t, t);
      st.said_no_dnnl[cs.bf16] = true;
    }
    return nullptr;
  }
  dnnl::memory src(src_md, st.eng, cs.bf16 ? static_cast<void*>(cs.ab.data()) : static_cast<void*>(cs.a.data()));
  dnnl::memory dst(dst_md, st.eng, cs.cbuf.data());
  return [&st, mm, wmem, src, dst](int c) {
    mm.execute(st.strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wmem[static_cast<size_t>(c)]}, {DNNL_ARG_DST, dst}});
    st.strm.wait();
  };
}

// The matrix engine: whole tiles of columns split over the pool's threads,
// rows in calls of its most (each padded up to its next row count: the
// activations hold room for that), bf16 only; none where it cannot run.
Run engine_run(const Setup& st, Case& cs) {
  cpu::MatrixEngine* engine = st.engine.get();
  if (!cs.bf16 || !engine || engine->shape_of(cs.K) < 0 || cs.N % engine->tile_cols() != 0) return nullptr;
  auto ap = std::make_shared<std::vector<uint16_t>>(static_cast<size_t>(cs.M + engine->max_rows()) * cs.K, 0);
  std::memcpy(ap->data(), cs.ab.data(), cs.ab.size() * 2);
  auto etile = std::make_shared<std::vector<std::vector<float>>>(static_cast<size_t>(st.threads));
  for (auto& v : *etile) v.resize(static_cast<size_t>(engine->max_rows()) * engine->tile_cols());
  return [&st, &cs, engine, ap, etile](int c) {
    const cpu::PackedWeight& w = cs.w->packed[static_cast<size_t>(c)];
    const int cols = engine->tile_cols(), tiles = cs.N / cols, shape = engine->shape_of(cs.K), threads = st.threads;
    const int rows_max = static_cast<int>(engine->max_rows());
    st.pool->parallel_for(static_cast<size_t>(threads), [&](size_t ti, int) {
      const int t = static_cast<int>(ti);
      float* tile = (*etile)[ti].data();
      for (int j = tiles * t / threads; j < tiles * (t + 1) / threads; ++j)
        for (int r0 = 0; r0 < cs.M; r0 += rows_max) {
          const int m = std::min(rows_max, cs.M - r0);
          engine->gemm(shape, m, ap->data() + static_cast<size_t>(r0) * cs.K, w.panel(j * cols / st.kern->nr), tile, t);
          for (int i = 0; i < m; ++i)
            std::memcpy(cs.cbuf.data() + static_cast<size_t>(r0 + i) * cs.N + static_cast<size_t>(j) * cols,
                        tile + static_cast<size_t>(i) * cols, static_cast<size_t>(cols) * 4);
        }
    });
  };
}

// Every engine must compute the product of copy 0: checked on three rows
// against a double-precision dot product of the same (rounded) operands,
// which depends on no engine. Returns the mismatches (each printed).
int check_engines(Case& cs, const std::vector<std::pair<const char*, Run>>& runs) {
  const int N = cs.N, K = cs.K;
  const int check_rows[3] = {0, cs.M / 2, cs.M - 1};
  std::vector<double> ref(3 * static_cast<size_t>(N));
  double scale = 1e-30;
  for (int r = 0; r < 3; ++r)
    for (int n = 0; n < N; ++n) {
      double d = 0;
      for (int k = 0; k < K; ++k) {
        const size_t ai = static_cast<size_t>(check_rows[r]) * K + k, wi = static_cast<size_t>(n) * K + k;
        d += static_cast<double>(cs.a[ai]) * (cs.bf16 ? ep_moe::bf16_to_f32(cs.w->wb[0][wi]) : cs.w->wf[0][wi]);
      }
      ref[static_cast<size_t>(r) * N + n] = d;
      scale = std::max(scale, std::fabs(d));
    }
  int mismatches = 0;
  for (const auto& [what, run] : runs) {
    if (!run) continue;
    std::fill(cs.cbuf.begin(), cs.cbuf.end(), std::nan(""));
    run(0);
    double err = 0;
    for (int r = 0; r < 3; ++r)
      for (int n = 0; n < N; ++n) {
        const double e =
            std::fabs(cs.cbuf[static_cast<size_t>(check_rows[r]) * N + n] - ref[static_cast<size_t>(r) * N + n]);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
      }
    if (err / scale > 1e-4) {  // f32 accumulation of exact (or f32) products
      std::printf("MISMATCH %s vs the double-precision reference: %g\n", what, err / scale);
      ++mismatches;
    }
  }
  return mismatches;
}

// One row: shape x dtype x M, every engine timed and checked; returns the
// mismatches.
int measure_case(Setup& st, const Shape& sh, const Copies& w, bool bf16, int M, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Case cs;
  cs.M = M;
  cs.N = sh.n;
  cs.K = sh.k;
  cs.bf16 = bf16;
  cs.w = &w;
  cs.a.resize(static_cast<size_t>(M) * sh.k);
  cs.cbuf.resize(static_cast<size_t>(M) * sh.n);
  for (auto& x : cs.a) x = nd(rng);
  // With bf16 weights, a holds bf16 values too, so the engines that take
  // f32 activations (ep_moe's widening kernels) and those that take bf16
  // ones multiply the same numbers.
  cs.ab.resize(cs.a.size());
  for (size_t i = 0; i < cs.a.size(); ++i) {
    cs.ab[i] = ep_moe::f32_to_bf16(cs.a[i]);
    if (bf16) cs.a[i] = ep_moe::bf16_to_f32(cs.ab[i]);
  }
  const double flops = 2.0 * M * sh.n * sh.k;
  const Run ours = ep_moe_run(st, cs), blas = blas_run(st, cs), onednn = dnnl_run(st, cs), eng = engine_run(st, cs);
  const auto time = [&](const Run& r) { return r ? time_it(w.n, st.seconds, r) : std::nan(""); };
  const double t_ours = time(ours), t_blas = time(blas), t_dnnl = time(onednn), t_engine = time(eng);
  const int mismatches =
      check_engines(cs, {{"ep_moe", ours}, {"OpenBLAS", blas}, {"oneDNN", onednn}, {"matrix engine", eng}});
  // An engine that could not run this type shows "-".
  const auto col = [](double v, const char* fmt) {
    char b[32];
    if (std::isnan(v)) std::snprintf(b, sizeof b, "%s", "-");
    else std::snprintf(b, sizeof b, fmt, v);
    return std::string(b);
  };
  std::printf("%-16s %-5s %5d %9.1f %9s %9s %9s %9s %9s %9s\n", sh.name, bf16 ? "bf16" : "f32", M, flops / t_ours / 1e9,
              col(flops / t_blas / 1e9, "%.1f").c_str(), col(flops / t_dnnl / 1e9, "%.1f").c_str(),
              col(flops / t_engine / 1e9, "%.1f").c_str(), col(t_ours / t_blas, "%.2fx").c_str(),
              col(t_ours / t_dnnl, "%.2fx").c_str(), col(t_ours / t_engine, "%.2fx").c_str());
  std::fflush(stdout);
  return mismatches;
}

}  // namespace

int main(int argc, char** argv) {
  Setup st;
  cli::Parser args("ep_moe_gemm_engines [options]", "ep_moe's tiles against OpenBLAS and oneDNN on the expert shapes.");
  args.option("--threads", &st.threads, "threads (default 2)", 1, 1024)
      .option("--seconds", &st.seconds, "seconds per measurement (default 0.3)", 0, 3600)
      .flag("--quick", &st.quick, "qwen3 shapes, 32 MiB of weight copies: a smoke run");
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  setenv("OMP_NUM_THREADS", std::to_string(st.threads).c_str(), 1);  // oneDNN's OpenMP, before its first use
  set_up(st);
  std::printf("%-16s %-5s %5s %9s %9s %9s %9s %9s %9s %9s\n", "shape", "dtype", "M", "ep_moe", "openblas", "onednn",
              "engine", "ob/ep", "dnnl/ep", "eng/ep");
  const Shape shapes[] = {{"qwen3 gate_up", 1536, 2048},
                          {"qwen3 down", 2048, 768},
                          {"deepseek gate_up", 4096, 7168},
                          {"deepseek down", 7168, 2048}};
  std::mt19937 rng(7);
  int mismatches = 0;
  for (const Shape& sh : shapes) {
    if (st.quick && std::strncmp(sh.name, "qwen3", 5) != 0) continue;
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      const Copies w = make_copies(st, sh.n, sh.k, bf16 != 0, rng);
      for (int M : {1, 8, 32, 128, 512}) mismatches += measure_case(st, sh, w, bf16 != 0, M, rng);
    }
  }
  std::printf(
      "(columns: GFLOP/s; ob/ep, dnnl/ep and eng/ep > 1 mean that engine is faster than ep_moe's tiles; engine: "
      "ep_moe's matrix engine on the same panels)\n");
  return mismatches == 0 ? 0 : 1;
}

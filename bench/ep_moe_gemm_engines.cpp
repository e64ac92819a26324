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
#include <memory>
#include <random>
#include <string>
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

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  double seconds = 0.3;
  bool quick = false;  // qwen3 shapes, 32 MiB of weight copies: a smoke run
  cli::Parser args("ep_moe_gemm_engines [options]", "ep_moe's tiles against OpenBLAS and oneDNN on the expert shapes.");
  args.option("--threads", &threads, "threads (default 2)", 1, 1024)
      .option("--seconds", &seconds, "seconds per measurement (default 0.3)", 0, 3600)
      .flag("--quick", &quick, "qwen3 shapes, 32 MiB of weight copies: a smoke run");
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  openblas_set_num_threads(threads);
  setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);  // oneDNN's OpenMP, before its first use
  const cpu::Kernels& kern = cpu::layer_kernels();                // the kernels a layer takes here
  cpu::ThreadPool pool(threads);  // ep_moe's kernels run on the layer's pool, as in a forward
  const auto sbgemm = reinterpret_cast<SbgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sbgemm"));
  if (!sbgemm) std::printf("this OpenBLAS has no cblas_sbgemm (built without BUILD_BFLOAT16): no OpenBLAS bf16 rows\n");
  std::printf("threads %d; ep_moe kernels %s; OpenBLAS core %s; oneDNN %d.%d\n", threads, cpu::isa_name(kern.isa),
              openblas_get_corename(), dnnl_version()->major, dnnl_version()->minor);
  // The matrix engine on every depth below, whatever ISA oneDNN runs here.
  setenv("EP_MOE_BACKEND_DIR", EP_MOE_MODULE_DIR, 0);
  cpu::MatrixEngineDesc ed;
  ed.threads = threads;
  ed.nr = kern.nr;
  ed.tile_panels = std::max(1, 256 / kern.nr);
  ed.depths = {2048, 768, 7168};
  ed.need_amx = false;
  std::string why;
  const std::unique_ptr<cpu::MatrixEngine> engine = cpu::make_matrix_engine(ed, &why);
  if (engine) std::printf("matrix engine: %s\n", engine->name().c_str());
  else std::printf("no matrix engine: %s\n", why.c_str());
  std::printf("%-16s %-5s %5s %9s %9s %9s %9s %9s %9s %9s\n", "shape", "dtype", "M", "ep_moe", "openblas", "onednn",
              "engine", "ob/ep", "dnnl/ep", "eng/ep");

  const Shape shapes[] = {{"qwen3 gate_up", 1536, 2048},
                          {"qwen3 down", 2048, 768},
                          {"deepseek gate_up", 4096, 7168},
                          {"deepseek down", 7168, 2048}};
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);

  int mismatches = 0;
  bool said_no_dnnl[2] = {false, false};
  for (const Shape& sh : shapes) {
    if (quick && std::strncmp(sh.name, "qwen3", 5) != 0) continue;
    const int N = sh.n, K = sh.k;
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      const size_t es = bf16 ? 2 : 4;
      // Enough copies that they exceed any cache (>= 256 MiB in all).
      const size_t budget = static_cast<size_t>(quick ? 32 : 256) << 20;
      const int copies = static_cast<int>(std::max<size_t>(2, budget / (static_cast<size_t>(N) * K * es) + 1));
      std::vector<std::vector<float>> wf(static_cast<size_t>(copies));
      std::vector<std::vector<uint16_t>> wb(static_cast<size_t>(copies));
      std::vector<cpu::PackedWeight> packed(static_cast<size_t>(copies));
      for (int c = 0; c < copies; ++c) {
        auto& w = wf[static_cast<size_t>(c)];
        w.resize(static_cast<size_t>(N) * K);
        for (auto& x : w) x = nd(rng) * 0.02f;
        if (bf16) {
          wb[static_cast<size_t>(c)].resize(w.size());
          for (size_t i = 0; i < w.size(); ++i) wb[static_cast<size_t>(c)][i] = ep_moe::f32_to_bf16(w[i]);
          cpu::pack(packed[static_cast<size_t>(c)], Source{wb[static_cast<size_t>(c)].data(), EP_MOE_DTYPE_BF16, K}, N,
                    K, kern.nr, EP_MOE_DTYPE_BF16);
        } else {
          cpu::pack(packed[static_cast<size_t>(c)], Source{w.data(), EP_MOE_DTYPE_F32, K}, N, K, kern.nr,
                    EP_MOE_DTYPE_F32);
        }
        if (bf16) std::vector<float>().swap(w);  // only the bf16 copy is needed
      }
      for (int M : {1, 8, 32, 128, 512}) {
        std::vector<float> a(static_cast<size_t>(M) * K), cbuf(static_cast<size_t>(M) * N);
        for (auto& x : a) x = nd(rng);
        // With bf16 weights, a holds bf16 values too, so the engines that
        // take f32 activations (ep_moe's widening kernels) and those that
        // take bf16 ones multiply the same numbers.
        std::vector<uint16_t> ab(a.size());
        for (size_t i = 0; i < a.size(); ++i) {
          ab[i] = ep_moe::f32_to_bf16(a[i]);
          if (bf16) a[i] = ep_moe::bf16_to_f32(ab[i]);
        }
        const double flops = 2.0 * M * N * K;

        // ep_moe: panels split over the threads, up to 64 rows per call (as
        // the expert FFN calls it).
        const bool dot = bf16 && kern.gemm_bf16;
        auto ours = [&](int c) {
          const cpu::PackedWeight& w = packed[static_cast<size_t>(c)];
          const int panels = w.panels();
          pool.parallel_for(static_cast<size_t>(threads), [&](size_t ti, int) {
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
                  rows[i] = a.data() + static_cast<size_t>(r0 + i) * K;
                  rows16[i] = ab.data() + static_cast<size_t>(r0 + i) * K;
                }
                if (dot) kern.gemm_bf16(m, rows16, K, w.panel(p), tile.data(), kern.nr, next);
                else kern.gemm[w.dtype](m, rows, K, w.panel(p), tile.data(), kern.nr, next);
                const int cols = std::min(kern.nr, N - p * kern.nr);
                for (int i = 0; i < m; ++i)
                  std::memcpy(cbuf.data() + static_cast<size_t>(r0 + i) * N + static_cast<size_t>(p) * kern.nr,
                              tile.data() + static_cast<size_t>(i) * kern.nr, static_cast<size_t>(cols) * 4);
              }
          });
        };
        const double t_ours = time_it(copies, seconds, ours);

        auto blas = [&](int c) {
          if (bf16)
            sbgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, ab.data(), K,
                   wb[static_cast<size_t>(c)].data(), K, 0.0f, cbuf.data(), N);
          else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a.data(), K,
                        wf[static_cast<size_t>(c)].data(), K, 0.0f, cbuf.data(), N);
        };
        const double t_blas = bf16 && !sbgemm ? std::nan("") : time_it(copies, seconds, blas);

        // oneDNN matmul: src [M, K], weights [K, N] (from W [N, K] row-major:
        // strides {1, K}), reordered once into the layout it prefers. Where
        // this CPU has no kernel for the type (bf16 without AVX-512 in
        // oneDNN 2.6), the primitive cannot be created: no oneDNN row.
        using dt = dnnl::memory::data_type;
        const dt wt = bf16 ? dt::bf16 : dt::f32;
        dnnl::memory::desc src_md({M, K}, wt, dnnl::memory::format_tag::ab);
        dnnl::memory::desc w_any({K, N}, wt, dnnl::memory::format_tag::any);
        dnnl::memory::desc w_plain({K, N}, wt, dnnl::memory::dims{1, K});
        dnnl::memory::desc dst_md({M, N}, dt::f32, dnnl::memory::format_tag::ab);
        dnnl::matmul mm;
        std::vector<dnnl::memory> wmem;
        bool have_dnnl = true;
        try {
          dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, w_any, dst_md), eng);  // oneDNN 2.x API
          mm = dnnl::matmul(pd);
          for (int c = 0; c < copies; ++c) {
            void* raw = bf16 ? static_cast<void*>(wb[static_cast<size_t>(c)].data())
                             : static_cast<void*>(wf[static_cast<size_t>(c)].data());
            dnnl::memory plain(w_plain, eng, raw);
            dnnl::memory re(pd.weights_desc(), eng);
            dnnl::reorder(plain, re).execute(strm, plain, re);
            wmem.push_back(re);
          }
          strm.wait();
        } catch (const dnnl::error&) {
          have_dnnl = false;
          if (!said_no_dnnl[bf16]) {
            std::printf("oneDNN has no %s matmul on this CPU: no oneDNN %s rows\n", bf16 ? "bf16" : "f32",
                        bf16 ? "bf16" : "f32");
            said_no_dnnl[bf16] = true;
          }
        }
        dnnl::memory src(src_md, eng, bf16 ? static_cast<void*>(ab.data()) : static_cast<void*>(a.data()));
        dnnl::memory dst(dst_md, eng, cbuf.data());
        auto onednn = [&](int c) {
          mm.execute(strm,
                     {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wmem[static_cast<size_t>(c)]}, {DNNL_ARG_DST, dst}});
          strm.wait();
        };
        const double t_dnnl = have_dnnl ? time_it(copies, seconds, onednn) : std::nan("");

        // The matrix engine: whole tiles of columns split over the pool's
        // threads, rows in calls of its most (each padded up to its next
        // row count: a holds room for that), bf16 only.
        const bool have_engine = bf16 && engine && engine->shape_of(K) >= 0 && N % engine->tile_cols() == 0;
        std::vector<uint16_t> ap;
        std::vector<std::vector<float>> etile(static_cast<size_t>(threads));
        if (have_engine) {
          ap.assign(static_cast<size_t>(M + engine->max_rows()) * K, 0);
          std::memcpy(ap.data(), ab.data(), ab.size() * 2);
          for (auto& v : etile) v.resize(static_cast<size_t>(engine->max_rows()) * engine->tile_cols());
        }
        auto by_engine = [&](int c) {
          const cpu::PackedWeight& w = packed[static_cast<size_t>(c)];
          const int cols = engine->tile_cols(), tiles = N / cols, shape = engine->shape_of(K);
          pool.parallel_for(static_cast<size_t>(threads), [&](size_t ti, int) {
            const int t = static_cast<int>(ti);
            float* tile = etile[ti].data();
            for (int j = tiles * t / threads; j < tiles * (t + 1) / threads; ++j)
              for (int r0 = 0; r0 < M; r0 += static_cast<int>(engine->max_rows())) {
                const int m = std::min(static_cast<int>(engine->max_rows()), M - r0);
                engine->gemm(shape, m, ap.data() + static_cast<size_t>(r0) * K, w.panel(j * cols / kern.nr), tile, t);
                for (int i = 0; i < m; ++i)
                  std::memcpy(cbuf.data() + static_cast<size_t>(r0 + i) * N + static_cast<size_t>(j) * cols,
                              tile + static_cast<size_t>(i) * cols, static_cast<size_t>(cols) * 4);
              }
          });
        };
        const double t_engine = have_engine ? time_it(copies, seconds, by_engine) : std::nan("");
        // Every engine must compute the product of copy 0: checked on three
        // rows against a double-precision dot product of the same (rounded)
        // operands, which depends on no engine.
        {
          const int check_rows[3] = {0, M / 2, M - 1};
          std::vector<double> ref(3 * static_cast<size_t>(N));
          double scale = 1e-30;
          for (int r = 0; r < 3; ++r)
            for (int n = 0; n < N; ++n) {
              double d = 0;
              for (int k = 0; k < K; ++k) {
                const size_t ai = static_cast<size_t>(check_rows[r]) * K + k, wi = static_cast<size_t>(n) * K + k;
                d += static_cast<double>(a[ai]) * (bf16 ? ep_moe::bf16_to_f32(wb[0][wi]) : wf[0][wi]);
              }
              ref[static_cast<size_t>(r) * N + n] = d;
              scale = std::max(scale, std::fabs(d));
            }
          const auto check = [&](const char* what, auto&& run) {
            std::fill(cbuf.begin(), cbuf.end(), std::nan(""));
            run(0);
            double err = 0;
            for (int r = 0; r < 3; ++r)
              for (int n = 0; n < N; ++n) {
                const double e =
                    std::fabs(cbuf[static_cast<size_t>(check_rows[r]) * N + n] - ref[static_cast<size_t>(r) * N + n]);
                err = std::isnan(e) ? INFINITY : std::max(err, e);
              }
            if (err / scale > 1e-4) {  // f32 accumulation of exact (or f32) products
              std::printf("MISMATCH %s vs the double-precision reference: %g\n", what, err / scale);
              ++mismatches;
            }
          };
          check("ep_moe", ours);
          if (!std::isnan(t_blas)) check("OpenBLAS", blas);
          if (have_dnnl) check("oneDNN", onednn);
          if (have_engine) check("matrix engine", by_engine);
        }

        // An engine that could not run this type shows "-".
        const auto col = [](double v, const char* fmt) {
          char b[32];
          if (std::isnan(v)) std::snprintf(b, sizeof b, "%s", "-");
          else std::snprintf(b, sizeof b, fmt, v);
          return std::string(b);
        };
        std::printf("%-16s %-5s %5d %9.1f %9s %9s %9s %9s %9s %9s\n", sh.name, bf16 ? "bf16" : "f32", M,
                    flops / t_ours / 1e9, col(flops / t_blas / 1e9, "%.1f").c_str(),
                    col(flops / t_dnnl / 1e9, "%.1f").c_str(), col(flops / t_engine / 1e9, "%.1f").c_str(),
                    col(t_ours / t_blas, "%.2fx").c_str(), col(t_ours / t_dnnl, "%.2fx").c_str(),
                    col(t_ours / t_engine, "%.2fx").c_str());
        std::fflush(stdout);
      }
    }
  }
  std::printf(
      "(columns: GFLOP/s; ob/ep, dnnl/ep and eng/ep > 1 mean that engine is faster than ep_moe's tiles; engine: "
      "ep_moe's matrix engine on the same panels)\n");
  return mismatches == 0 ? 0 : 1;
}

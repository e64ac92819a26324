// ep_moe_ab_bench: a change to the CPU expert path measured against the
// code before it in one process. This VM class's memory bandwidth and
// peaks move by 10-30 % between runs and within one, so separate runs of
// two builds cannot show a change of a few per cent. Here the library's
// FfnRunner (the layer's expert path) on its AVX-512 or AVX2 tiles (A) and
// a second build of both (B: bench/ab_variant_ffn.cpp, and
// bench/ab_variant_avx512.cpp or bench/ab_variant_avx2.cpp with the block
// formats' group kernels of bench/ab_variant_qgroups*.cpp, each taking
// its sources from the directory given to CMake as EP_MOE_AB_VARIANT_DIR
// where that has them: cpu/ffn.cpp, cpu/kernels_x86.inc, cpu/qgroups8.inc,
// cpu/qgroups.hpp, ...) run the
// same expert jobs, alternating in blocks (ABBA order), over weights
// rotated through more experts than the caches hold. It first checks that
// both give the same bits (a change that keeps each sum's order keeps
// them), then prints each side's median time and the median and range of
// the per-pair B/A ratios.
//
// Float weights are widened in the tiles (f32 activations, as a layer with
// f32 or f16 activations runs them; bf16 weights too); block formats
// (--dtype q4_k, ...: the weights quantized at pack) run their group
// kernels (or, past a table's row threshold, the library's int8 tiles on
// both sides) on activations quantized per row. Uses the library's
// internals, not its C API.
//
//   ep_moe_ab_bench [--isa avx512|avx2] [--hidden H] [--inter I]
//                   [--dtype f32|bf16|f16|q4_k|...] [--rows r1,r2,...] [--experts E]
//                   [--pool P] [--shared-inter S] [--shared-rows R]
//                   [--batch T] [--threads N] [--blocks B]
//                   [--block-seconds T] [--require-same-bits]
// --isa: which tiles (default: AVX-512 where the CPU has it, else AVX2);
// --rows: rows per expert (1..512), cycled over the E experts of one pass
// (default 32, 32 experts: about qwen3-30b-a3b T=512 on an EP-4 rank);
// --pool: distinct experts the passes rotate through (default 2 E, so every
// pass reads weights from memory); --shared-inter: a shared expert of that
// intermediate size (0: none) over --shared-rows rows (default: as many as
// the largest expert; a shared expert sees every token of the batch);
// --batch: tokens in the batch (default 0: every expert reads the same
// rows, tokens 0 .. rows - 1, so the activations and the accumulator stay
// in L2); with T > 0 each expert reads its own rows, drawn at random from
// T tokens (in token order, as routing hands them over), and the shared
// expert all T (unless --shared-rows says fewer), as in a layer's forward.
//
// Typical use: copy src/cpu/kernels_x86.inc (or ffn.cpp, ...) to DIR/cpu/,
// change it, then
//   cmake -B build/ab --preset release -DEP_MOE_AB_VARIANT_DIR=DIR
//   cmake --build build/ab --target ep_moe_ab_bench
//   build/ab/bench/ep_moe_ab_bench --hidden 4096 --inter 14336 --rows 128 --experts 2 --pool 3
// A decode change to a block format's kernels (copies of cpu/qgroups8.inc
// ... in DIR/cpu/): one row an expert, a pool far larger than the caches,
//   build/ab/bench/ep_moe_ab_bench --dtype q4_k --rows 1 --experts 8 --pool 128 --blocks 60 --block-seconds 0.2
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/ffn.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/thread_pool.hpp"
#include "ab_variant_ffn.hpp"
#include "cli.hpp"
#include "common/quant.hpp"
#include "presets.hpp"

namespace ep_moe {
namespace cpu {
const Kernels& kernels_avx512_ab_variant();
const Kernels& kernels_avx2_ab_variant();
}  // namespace cpu
}  // namespace ep_moe

using namespace ep_moe;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxRows = 512;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void fill_normal(std::vector<float>& v, std::mt19937& rng, float sd) {
  std::normal_distribution<float> nd(0.0f, sd);
  for (float& x : v) x = nd(rng);
}

struct Options {
  int hidden = 2048, inter = 768, experts = 32, pool_n = 0, shared = 0, shared_rows = 0, threads = 2, blocks = 8,
      batch = 0;
  double block_s = 0.5;
  bool require_same = false;
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_F32;
  std::vector<int> rows{32};
  std::string isa;
};

// The command line into o, checked: -1 to run, else the exit status.
int parse_options(int argc, char** argv, Options& o) {
  cli::Parser args(
      "ep_moe_ab_bench [options]",
      "A change to the tiles, the block-format kernels or the expert path (FfnRunner) against the code before "
      "it, alternated in one process.");
  args.custom("--isa", "I", "avx512 or avx2 (default: the best this CPU has)",
              [&o](const std::string& v, std::string* err) {
                o.isa = v;
                if (v != "avx512" && v != "avx2") *err = "takes avx512 or avx2";
                return err->empty();
              })
      .option("--hidden", &o.hidden, "hidden size (default 2048)", 1, 1 << 16)
      .option("--inter", &o.inter, "intermediate size (default 768)", 1, 1 << 18)
      .option("--experts", &o.experts, "experts of a step (default 32)", 1, 1 << 16)
      .option("--pool", &o.pool_n, "experts the steps pick from (default 2 x --experts)", 0, 1 << 20)
      .option("--shared-inter", &o.shared, "shared expert intermediate size (default 0: none)", 0, 1 << 18)
      .option("--shared-rows", &o.shared_rows, "rows of the shared expert", 0, kMaxRows)
      .option("--batch", &o.batch, "rows of a step (default 0: the largest --rows)", 0, 1 << 20)
      .option("--threads", &o.threads, "threads (default 2)", 1, 1024)
      .option("--blocks", &o.blocks, "alternated blocks (default 8)", 1, 1 << 20)
      .option("--block-seconds", &o.block_s, "seconds per block (default 0.5)", 1e-6, 3600)
      .custom("--dtype", "D", "weights: f32 (default), bf16, f16 or a block format (q4_k, q8_0, ...)",
              [&o](const std::string& v, std::string* err) {
                if (!presets::parse_dtype(v, &o.dtype, true)) *err = "takes f32, bf16, f16 or a block format";
                return err->empty();
              })
      .list("--rows", &o.rows, "rows per expert (default 32)", 1, kMaxRows)
      .flag("--require-same-bits", &o.require_same, "fail unless both sides give the same bits");
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (o.pool_n <= 0) o.pool_n = 2 * o.experts;
  bool ok = o.hidden > 0 && o.inter > 0 && o.experts > 0 && o.pool_n >= o.experts && o.shared >= 0 &&
            o.shared_rows >= 0 && o.shared_rows <= kMaxRows && o.threads > 0 && o.blocks > 0 && o.block_s > 0 &&
            !o.rows.empty();
  for (int r : o.rows) ok = ok && r >= 1 && r <= kMaxRows && (o.batch == 0 || r <= o.batch);
  ok = ok && o.batch >= 0 && (o.batch == 0 || o.shared_rows <= o.batch);
  if (!ok) {
    std::fprintf(stderr,
                 "need positive --hidden, --inter, --experts, --threads, --blocks, --block-seconds, "
                 "--pool >= --experts, --shared-inter >= 0, --shared-rows and --rows of 1..%d, and --batch >= 0, "
                 "when set no fewer than any --rows or --shared-rows\n",
                 kMaxRows);
    return 2;
  }
  const ep_moe_dtype_t dt = o.dtype;
  if (dtype_is_quant(dt) && (o.hidden % quant_block_elems(dt) != 0 || o.inter % quant_block_elems(dt) != 0 ||
                             (o.shared > 0 && o.shared % quant_block_elems(dt) != 0))) {
    std::fprintf(stderr, "%s needs --hidden, --inter and --shared-inter multiples of %d\n", presets::dtype_name(dt),
                 static_cast<int>(quant_block_elems(dt)));
    return 2;
  }
  return -1;
}

// An expert's gate/up and down from [inter, hidden] gate and up and a
// [hidden, inter] down (f32), packed for k's tiles in dt.
void pack_expert(const cpu::Kernels& k, ep_moe_dtype_t dt, int inter, int hidden, const std::vector<float>& gate,
                 const std::vector<float>& up, const std::vector<float>& down, cpu::PackedWeight* gu,
                 cpu::PackedWeight* dn) {
  cpu::init_gate_up(*gu, inter, hidden, k.nr, dt, k.il_of(dt));
  cpu::pack_gate_up_half(*gu, Source{gate.data(), EP_MOE_DTYPE_F32, hidden}, 0, inter);
  cpu::pack_gate_up_half(*gu, Source{up.data(), EP_MOE_DTYPE_F32, hidden}, 1, inter);
  cpu::pack(*dn, Source{down.data(), EP_MOE_DTYPE_F32, inter}, hidden, inter, k.nr, dt, k.il_of(dt));
}

// With --batch, each expert's own rows: a random draw of rows[e %
// rows.size()] of the batch's tokens (in order), and a weight for each.
void draw_rows(const std::vector<int>& rows, int experts, const std::vector<int32_t>& token, std::mt19937& rng,
               std::vector<std::vector<int32_t>>* tok_of, std::vector<std::vector<float>>* w_of) {
  std::uniform_real_distribution<float> ud(0.1f, 1.0f);
  tok_of->assign(static_cast<size_t>(experts), {});
  w_of->assign(static_cast<size_t>(experts), {});
  std::vector<int32_t> all(token);
  for (size_t e = 0; e < tok_of->size(); ++e) {
    const int r = rows[e % rows.size()];
    std::shuffle(all.begin(), all.end(), rng);
    (*tok_of)[e].assign(all.begin(), all.begin() + r);
    std::sort((*tok_of)[e].begin(), (*tok_of)[e].end());
    for (int i = 0; i < r; ++i) (*w_of)[e].push_back(ud(rng));
  }
}

// ABBA blocks of `blocks` pairs: pair i times A then B, or B then A, in
// turn (so a drift within a pair favours neither side on average), each
// side running pass(side) (0: A, 1: B) for at least block_s seconds.
// Each side's mean ms a pass per pair.
template <class Pass>
void time_abba(int blocks, double block_s, Pass&& pass, std::vector<double>* ta, std::vector<double>* tb) {
  for (int b = 0; b < blocks; ++b) {
    double t[2] = {0, 0};
    for (int h = 0; h < 2; ++h) {
      const int side = h ^ (b & 1);
      const auto start = Clock::now();
      int n = 0;
      double el = 0;
      do {
        pass(side);
        ++n;
        el = std::chrono::duration<double>(Clock::now() - start).count();
      } while (el < block_s);
      t[side] = el / n * 1e3;
    }
    ta->push_back(t[0]);
    tb->push_back(t[1]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const int rc = parse_options(argc, argv, o); rc >= 0) return rc;
  const int hidden = o.hidden, inter = o.inter, experts = o.experts, pool_n = o.pool_n, shared = o.shared,
            shared_rows = o.shared_rows, threads = o.threads, batch = o.batch;
  const ep_moe_dtype_t dtype = o.dtype;
  const std::vector<int>& rows = o.rows;
  const cpu::Isa have = cpu::detect_isa();
  const bool use512 = o.isa.empty() ? have >= cpu::Isa::Avx512 : o.isa == "avx512";
  const cpu::Isa need = use512 ? cpu::Isa::Avx512 : cpu::Isa::Avx2;
  if (have < need) {
    std::printf("ep_moe_ab_bench: this CPU has no %s (EP_MOE_CPU_ISA may lower what it has); skipped\n",
                cpu::isa_name(need));
    return 0;
  }
  const cpu::Kernels& ka = use512 ? cpu::kernels_avx512() : cpu::kernels_avx2();
  const cpu::Kernels& kb = use512 ? cpu::kernels_avx512_ab_variant() : cpu::kernels_avx2_ab_variant();

  std::mt19937 rng(20261202u);
  int t_rows = batch;
  for (int e = 0; e < experts; ++e) t_rows = std::max(t_rows, rows[static_cast<size_t>(e) % rows.size()]);
  if (shared_rows > 0) t_rows = std::max(t_rows, shared_rows);
  const int s_rows = shared_rows > 0 ? shared_rows : t_rows;  // the shared expert's: tokens 0 .. s_rows - 1
  // One random matrix per role, packed into every expert of the pool (the
  // bytes each pass reads are the same; their addresses are not).
  std::vector<float> gate(static_cast<size_t>(inter) * hidden), up(gate.size()), down(gate.size());
  fill_normal(gate, rng, 0.05f);
  fill_normal(up, rng, 0.05f);
  fill_normal(down, rng, 0.05f);
  std::vector<cpu::PackedWeight> gu(static_cast<size_t>(pool_n)), dn(static_cast<size_t>(pool_n));
  for (int e = 0; e < pool_n; ++e) pack_expert(ka, dtype, inter, hidden, gate, up, down, &gu[e], &dn[e]);
  cpu::PackedWeight sgu, sdn;
  if (shared > 0) {
    std::vector<float> sg(static_cast<size_t>(shared) * hidden), su(sg.size()), sd(sg.size());
    fill_normal(sg, rng, 0.05f);
    fill_normal(su, rng, 0.05f);
    fill_normal(sd, rng, 0.05f);
    pack_expert(ka, dtype, shared, hidden, sg, su, sd, &sgu, &sdn);
  }
  std::vector<float> x(static_cast<size_t>(t_rows) * hidden);
  fill_normal(x, rng, 1.0f);
  std::vector<int32_t> token(static_cast<size_t>(t_rows));
  std::vector<float> weight(static_cast<size_t>(t_rows));
  std::uniform_real_distribution<float> ud(0.1f, 1.0f);
  for (int i = 0; i < t_rows; ++i) {
    token[static_cast<size_t>(i)] = i;
    weight[static_cast<size_t>(i)] = ud(rng);
  }
  std::vector<std::vector<int32_t>> tok_of;
  std::vector<std::vector<float>> w_of;
  if (batch > 0) draw_rows(rows, experts, token, rng, &tok_of, &w_of);
  int64_t chunk = shared > 0 ? s_rows : 0;
  double flops = shared > 0 ? 6.0 * hidden * static_cast<double>(shared) * s_rows : 0.0;
  for (int e = 0; e < experts; ++e) {
    const int r = rows[static_cast<size_t>(e) % rows.size()];
    chunk += r;
    flops += 6.0 * hidden * static_cast<double>(inter) * r;
  }
  const int32_t max_inter = std::max(inter, shared);
  cpu::ThreadPool pool(threads);
  cpu::FfnRunner ra(ka, hidden, max_inter, chunk, false);
  cpu::AbVariantFfn rb(kb, hidden, max_inter, chunk, false);
  ra.reserve_jobs(static_cast<size_t>(experts) + 1);
  rb.reserve_jobs(static_cast<size_t>(experts) + 1);
  // The activation rows' quantized copies (and the int8 tiles' room) for a block format.
  ra.reserve_quant(threads, dtype);
  rb.reserve_quant(threads, dtype);
  std::vector<cpu::ExpertJob> jobs;
  const auto jobs_from = [&](int first) {
    jobs.clear();
    for (int e = 0; e < experts; ++e) {
      const auto w = static_cast<size_t>((first + e) % pool_n);
      const auto ei = static_cast<size_t>(e);
      jobs.push_back(cpu::ExpertJob{&gu[w], &dn[w], inter, batch > 0 ? tok_of[ei].data() : token.data(),
                                    batch > 0 ? w_of[ei].data() : weight.data(), rows[ei % rows.size()]});
    }
    if (shared > 0) jobs.push_back(cpu::ExpertJob{&sgu, &sdn, shared, token.data(), weight.data(), s_rows});
  };
  std::vector<float> acc_a(x.size()), acc_b(x.size());
  jobs_from(0);
  ra.run(pool, jobs, x.data(), hidden, acc_a.data(), hidden, cpu::Act::Silu);
  rb.run(pool, jobs, x.data(), hidden, acc_b.data(), hidden, cpu::Act::Silu);
  const bool same = std::memcmp(acc_a.data(), acc_b.data(), acc_a.size() * sizeof(float)) == 0;
  const double pass_mb =
      (static_cast<double>(sgu.bytes() + sdn.bytes()) + experts * static_cast<double>(gu[0].bytes() + dn[0].bytes())) /
      1e6;
  std::printf("ep_moe_ab_bench: %s tiles, hidden %d inter %d %s, %d experts of rows", cpu::isa_name(need), hidden,
              inter, presets::dtype_name(dtype), experts);
  for (size_t i = 0; i < rows.size(); ++i) std::printf("%s%d", i ? "," : " ", rows[i]);
  std::printf(" (%.0f MB a pass, %d in the pool)", pass_mb, pool_n);
  if (batch > 0) std::printf(", each drawn from a batch of %d", batch);
  if (shared > 0) std::printf(", shared %d over %d rows", shared, s_rows);
  std::printf(", %d threads\nbits: %s\n", threads, same ? "the same" : "DIFFERENT");

  std::vector<double> ta, tb, ratio;
  int rot = 0;
  time_abba(
      o.blocks, o.block_s,
      [&](int side) {
        jobs_from(rot);
        rot = (rot + experts) % pool_n;
        if (side) rb.run(pool, jobs, x.data(), hidden, acc_a.data(), hidden, cpu::Act::Silu);
        else ra.run(pool, jobs, x.data(), hidden, acc_a.data(), hidden, cpu::Act::Silu);
      },
      &ta, &tb);
  for (size_t i = 0; i < ta.size(); ++i) ratio.push_back(tb[i] / ta[i]);
  const double ma = median(ta), mb = median(tb);
  // GB/s: the pass's weight bytes over its time (what decode is held to).
  std::printf(
      "A %.3f ms (%.1f GFLOP/s, %.1f GB/s)  B %.3f ms (%.1f GFLOP/s, %.1f GB/s)  B/A median %.3f, range %.3f-%.3f "
      "over %d pairs\n",
      ma, flops / ma / 1e6, pass_mb / ma, mb, flops / mb / 1e6, pass_mb / mb, median(ratio),
      *std::min_element(ratio.begin(), ratio.end()), *std::max_element(ratio.begin(), ratio.end()), o.blocks);
  std::printf("pairs:");
  for (double r : ratio) std::printf(" %.3f", r);
  std::printf("\n");
  return o.require_same && !same ? 1 : 0;
}

// ep_moe_bench: the CPU expert path of one EP rank, for model presets, a
// token sweep and both strategies for non-local pairs (skip vs the seed's
// weight-0), reported against this machine's own measured peaks.
//
// One rank of an EP group is simulated exactly: its expert map says which
// experts it holds, the layer runs without a communicator (partial-sum
// mode), so the time is this rank's routing + expert work + combine; the
// layer's own phase attributes give the expert time alone.
//
// A second part runs the all-to-all flow on in-process ranks (one thread
// each) and reports the layer's permutation and combine rates against
// memcpy of the same bytes by as many concurrent threads, same run.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "machine_peaks.hpp"
#include "cli.hpp"
#include "feed.hpp"
#include "presets.hpp"
#include "report.hpp"

namespace {

using bench_feed::alternate;
using bench_feed::Batches;
using bench_feed::Feed;
using bench_feed::forward_batch;
using bench_feed::make_batches;
using bench_report::DispatchRow;
using bench_report::DtypeRatio;
using bench_report::JsonMachine;
using bench_report::median_of;
using bench_report::RatioRow;
using bench_report::Row;
using bench_report::run_dispatch;
using bench_report::write_json;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::string> presets = {"qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"};
  std::vector<int> tokens = {1, 8, 64, 512};
  std::vector<int> strategies = {EP_MOE_SKIP_TOKENS, EP_MOE_SKIP_WEIGHT_ZERO};
  int threads = 0;  // 0: all hardware threads
  int ep = 0;       // 0: the preset's default
  // Weight dtypes, one set of rows each (compared in the same run), and the
  // activations' (-1: the weights' for float types, bf16 for block formats).
  std::vector<ep_moe_dtype_t> dtypes = {EP_MOE_DTYPE_BF16};
  // Per entry of dtypes: the routed experts' down in another block format
  // ("iq2_xxs+q3_k"), or -1.
  std::vector<int> downs = {-1};
  // --engine: the matrix engine setting of each variant (EP_MOE_MATRIX_ENGINE
  // at its layers' creation; "": the environment's), the variants being
  // every dtype under every setting, dtype by dtype (one each without
  // --engine).
  std::vector<std::string> engine_list;
  std::vector<std::string> engines;  // per entry of dtypes, after expansion
  // The dtype column's width: the longest label, at least 6.
  int label_width() const {
    size_t w = 6;
    for (size_t i = 0; i < dtypes.size(); ++i) w = std::max(w, label(i).size());
    return static_cast<int>(w);
  }
  std::string label(size_t i) const {
    std::string d = presets::dtype_name(dtypes[i]);
    if (i < downs.size() && downs[i] >= 0)
      d += std::string("+") + presets::dtype_name(static_cast<ep_moe_dtype_t>(downs[i]));
    return i < engines.size() && !engines[i].empty() ? d + "/" + engines[i] : d;
  }
  int act = -1;
  ep_moe_dtype_t act_of(ep_moe_dtype_t w) const {
    if (act >= 0) return static_cast<ep_moe_dtype_t>(act);
    return w == EP_MOE_DTYPE_F32 || w == EP_MOE_DTYPE_F16 ? w : EP_MOE_DTYPE_BF16;
  }
  double min_time = 0.5, peak_time = 1.0;
  int bw_mb = 1024;
  int dispatch_ranks = 0;  // 0: hardware threads; -1: skip the dispatch part
  int ratio_rounds = 16;   // alternated rounds of the weight-0 / skip comparison (0: none)
  std::string json;
  // --checkpoint: one layer of a real checkpoint (its shape, routing and
  // weights; rank 0 of --ep reads only its experts) instead of the presets.
  std::string checkpoint;
  int layer = -1;  // -1: the first MoE layer
};

// Every row's %bw is against the bandwidth measured right before and after
// it (kLocalBwSeconds each): a VM's bandwidth can move by 2x within a run,
// and a row held to a probe taken minutes earlier reads as bound by the
// wrong roof. Rows of at most kLocalBwTokens tokens stream weights: they
// are also measured again when the two probes disagree (below).
constexpr int kLocalBwTokens = 64;
constexpr double kLocalBwSeconds = 0.25;
// A VM's read bandwidth can jump between states within seconds. A
// streaming row whose two probes differ by more than this fraction of the
// higher ran across such a jump: it is measured
// again, up to kRowAttempts times in all, and flagged when no attempt was
// steady (`~` after %bw, "bw_steady": false in the JSON).
constexpr double kBwJump = 0.15;
constexpr int kRowAttempts = 3;
// Compute-bound rows (T > kLocalBwTokens) are held to their peak measured
// again right before and after them (the higher of the two, each over
// o.peak_time capped at kLocalPeakSeconds): the best-of-8-windows peak
// still moves by a few per cent over minutes.
constexpr double kLocalPeakSeconds = 0.5;

const char* dtype_name(ep_moe_dtype_t d) { return presets::dtype_name(d); }

// Bytes a weight element takes in memory (block formats: their bytes per
// element, scales included).
double bytes_per_weight(ep_moe_dtype_t d) {
  int64_t elems = 1, bytes = 4;
  ep_moe_dtype_block(&elems, &bytes, d);
  return static_cast<double>(bytes) / static_cast<double>(elems);
}

// The skip-strategy row of preset at T tokens in dtype (label), or null.
const Row* skip_row(const std::vector<Row>& rows, const std::string& preset, int T, const std::string& dtype) {
  for (const Row& r : rows)
    if (r.strategy == "skip" && r.preset == preset && r.tokens == T && r.dtype == dtype) return &r;
  return nullptr;
}

// Where both skip rows at q's tokens are bound by the bandwidth: q's
// weight-bytes ratio (from the rows) and its alternated speedup per byte.
void per_byte(const std::vector<Row>& rows, DtypeRatio* q) {
  const Row* rb = skip_row(rows, q->preset, q->tokens, q->base);
  const Row* ro = skip_row(rows, q->preset, q->tokens, q->dtype);
  if (!rb || !ro || rb->compute_bound() || ro->compute_bound() || rb->weight_bytes <= 0 || q->expert <= 0) return;
  q->bytes = ro->weight_bytes / rb->weight_bytes;
  q->stream = q->expert * q->bytes;
}

// The baseline layer (dtype base_i) against another dtype's, alternated at
// T tokens: the ratios of the baseline's times to the other's. False: a
// forward failed.
bool alternate_dtypes(const Options& o, const presets::Model& m, const std::string& name, int T, ep_moe_layer_t* base,
                      ep_moe_layer_t* other, size_t base_i, size_t other_i, DtypeRatio* q) {
  q->preset = name;
  q->tokens = T;
  q->base = o.label(base_i);
  q->dtype = o.label(other_i);
  if (!base || !other) return true;
  Feed fb(m, T, o.act_of(o.dtypes[base_i])), fo(m, T, o.act_of(o.dtypes[other_i]));
  ep_moe_layer_t* const layers[2] = {base, other};
  Feed* const feeds[2] = {&fb, &fo};
  return alternate(o.min_time / 4, o.ratio_rounds, layers, feeds, 0, q);
}
// What a row's %peak is against: the f32 FMA peak, the bf16 pair-dot one
// (bf16 weights and activations on the bf16 pair-dot tiles), or the int8
// one of the block formats' multiply (vpdpbusd on the AVX-512 tables of a
// VNNI CPU, vpmaddubsw on the other x86 tables).
enum class PeakKind { Fma, Bf16Dot, Int8Dot, Int8Maddubs };
constexpr int kPeakKinds = 4;
const char* const kPeakKindNames[kPeakKinds] = {"f32fma", "bf16dot", "int8dot", "int8maddubs"};

// The peak of `kind` on `threads` threads, over about `seconds` (GFLOP/s or
// GOP/s; 0 where the CPU lacks the instruction); the FMA's ISA into *isa.
double measure_peak(PeakKind kind, int threads, double seconds, const char** isa) {
  switch (kind) {
    case PeakKind::Bf16Dot: return bench::bf16_dot_peak_gflops(threads, seconds);
    case PeakKind::Int8Dot: return bench::int8_dot_peak_gops(threads, seconds);
    case PeakKind::Int8Maddubs: return bench::int8_maddubs_peak_gops(threads, seconds);
    case PeakKind::Fma: break;
  }
  return bench::fma_peak_gflops(threads, seconds, isa);
}

// What one row of the table measures needs: the run's options, bandwidth
// and probe, and the layer's preset, strategy and dtypes.
struct RowContext {
  const Options& o;
  const presets::Model* m;
  std::string name;
  int ep, threads, strategy;
  ep_moe_dtype_t wdt, act;
  double bw;
  bench::ReadBandwidth& bw_probe;
  PeakKind peak_of;
  double row_peak;                    // the GFLOP/s %peak is against (when not measured around the row)
  double expert_bytes, shared_bytes;  // a local expert's weights, the shared shard's
  int64_t shard;
  std::string label;  // the variant's: dtype, and /engine with --engine
};

// One row: T tokens through `layer` for at least --min-time, with the
// bandwidth (and, for compute rows, the peak) measured around it; printed.
// False: a forward failed.
bool measure_row(const RowContext& cx, ep_moe_layer_t* layer, int T, Row* out) {
  const Options& o = cx.o;
  const presets::Model* m = cx.m;
  const std::string& name = cx.name;
  const int ep = cx.ep, threads = cx.threads;
  const double bw = cx.bw, row_peak = cx.row_peak, expert_bytes = cx.expert_bytes, shared_bytes = cx.shared_bytes;
  const int64_t shard = cx.shard;
  bench::ReadBandwidth& bw_probe = cx.bw_probe;
  Feed feed(*m, T, cx.act);
  const Batches& batches = feed.batches;
  ep_moe_forward_args_t& a = feed.a;
  int64_t pairs_sum = 0, active_sum = 0, expert_ns_sum = 0;
  std::vector<double> times;
  // The bandwidth of this moment, not of the start of the run (this
  // VM's moves by tens of per cent); weight-streaming rows are run
  // again when it moved during them.
  const bool local_bw = o.min_time > 0;
  const bool bw_retry = local_bw && T <= kLocalBwTokens;
  double row_bw = bw, bw_before = 0, bw_after = 0;
  // Compute rows: the peak of this moment, as row_bw is for streaming ones.
  const bool local_peak = T > kLocalBwTokens && o.min_time > 0;
  const double peak_s = std::min(o.peak_time, kLocalPeakSeconds);
  const auto row_peak_now = [&] {
    const char* unused = nullptr;
    return measure_peak(cx.peak_of, threads, peak_s, &unused);
  };
  const double peak_before = local_peak ? row_peak_now() : 0.0;
  bool steady = true;
  int attempt = 0;
  while (attempt < kRowAttempts) {
    ++attempt;
    pairs_sum = active_sum = expert_ns_sum = 0;
    times.clear();
    if (local_bw) bw_before = bw_probe.measure(kLocalBwSeconds);
    const auto start = Clock::now();
    for (int it = 0;; ++it) {
      double dt = 0;
      int64_t ens = 0;
      if (!forward_batch(layer, a, batches, it, &dt, &ens)) return false;
      if (it > 0 || o.min_time <= 0) {  // the first call warms up
        times.push_back(dt);
        int64_t v = 0;
        ep_moe_layer_get_attr(&v, layer, EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS);
        pairs_sum += v;
        ep_moe_layer_get_attr(&v, layer, EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS);
        active_sum += v;
        expert_ns_sum += ens;
      }
      const double total = std::chrono::duration<double>(Clock::now() - start).count();
      if (times.size() >= 3 && total >= o.min_time) break;
      if (!times.empty() && total >= 10 * o.min_time) break;  // very slow rows: a few samples
    }
    if (!local_bw) break;
    bw_after = bw_probe.measure(kLocalBwSeconds);
    row_bw = std::max(bw_before, bw_after);
    steady = std::fabs(bw_before - bw_after) <= kBwJump * row_bw;
    if (steady || !bw_retry) break;
  }
  const double peak_after = local_peak ? row_peak_now() : 0.0;
  // Work varies a little between batches: use mean work over mean time.
  double t = 0;
  for (double x : times) t += x;
  t /= static_cast<double>(times.size());
  Row& r = *out;
  r.preset = name;
  r.dtype = cx.label;
  r.strategy = cx.strategy == EP_MOE_SKIP_TOKENS ? "skip" : "weight0";
  r.ep = ep;
  r.tokens = T;
  r.threads = threads;
  r.iters = static_cast<int>(times.size());
  const double n_samples = static_cast<double>(times.size());
  r.local_pairs = static_cast<int64_t>(std::llround(static_cast<double>(pairs_sum) / n_samples));
  r.active_experts = static_cast<int64_t>(std::llround(static_cast<double>(active_sum) / n_samples));
  const double mean_pairs = static_cast<double>(pairs_sum) / n_samples;
  const double mean_active = static_cast<double>(active_sum) / n_samples;
  const double flops =
      6.0 * m->hidden * (mean_pairs * m->intermediate + static_cast<double>(T) * static_cast<double>(shard));
  r.ms = t * 1e3;
  r.expert_ms = static_cast<double>(expert_ns_sum) / n_samples / 1e6;
  r.tokens_per_s = T / t;
  r.gflops = flops / t / 1e9;
  r.row_peak = local_peak ? std::max(peak_before, peak_after) : row_peak;
  r.peak_before = peak_before;
  r.peak_after = peak_after;
  r.gflops_frac = r.gflops / r.row_peak;
  r.peak_kind = kPeakKindNames[static_cast<int>(cx.peak_of)];
  r.flops = flops;
  r.weight_bytes = mean_active * expert_bytes + shared_bytes;
  r.weight_gbs = r.weight_bytes / t / 1e9;
  r.row_bw = row_bw;
  r.bw_before = bw_before;
  r.bw_after = bw_after;
  r.bw_steady = steady;
  r.attempts = attempt;
  r.weight_frac = r.weight_gbs / row_bw;
  std::printf("%-14s %-*s %4d %6d %-7s %9.3f %9.3f %11.1f %9.1f %5.1f%% %7.1f %9.1f %6.1f %5.1f%%%c %5s %6lld %6lld\n",
              name.c_str(), o.label_width(), r.dtype.c_str(), ep, T, r.strategy.c_str(), r.ms, r.expert_ms,
              r.tokens_per_s, r.gflops, 100 * r.gflops_frac, r.row_peak, r.weight_gbs, r.row_bw, 100 * r.weight_frac,
              steady ? ' ' : '~', r.compute_bound() ? "pk" : "bw", static_cast<long long>(r.local_pairs),
              static_cast<long long>(r.active_experts));
  std::fflush(stdout);
  return true;
}

// Reads the command line into `o`: cli::Parser::kRun to go on, else the
// exit code.
int parse_options(int argc, char** argv, Options* op) {
  Options& o = *op;
  cli::Parser args("ep_moe_bench [options]",
                   "The expert path, its permutation and combine, against this machine's peaks measured in the same "
                   "run (docs/benchmarks.md says what each column means).");
  args.list("--preset", &o.presets, "models (qwen3-30b-a3b, qwen2-57b-a14b, deepseek-v3, mixtral-8x7b)")
      .list("--tokens", &o.tokens, "token counts per forward (default 1,8,64,512)", 1, 1 << 20)
      .custom("--strategy", "S,S", "skip and/or weight0 (default both)",
              [&o](const std::string& v, std::string* err) {
                o.strategies.clear();
                for (const auto& s : cli::split(v)) {
                  if (s == "skip") o.strategies.push_back(EP_MOE_SKIP_TOKENS);
                  else if (s == "weight0") o.strategies.push_back(EP_MOE_SKIP_WEIGHT_ZERO);
                  else *err = "unknown strategy " + s;
                }
                return err->empty() && !o.strategies.empty();
              })
      .option("--ep", &o.ep, "EP size to simulate (default 0: the preset's)", 0, 4096)
      .option("--threads", &o.threads, "threads of the rank (default 0: all hardware threads)", 0, 1024)
      .custom("--dtype", "D,D",
              "weight dtypes, rows of each in one run and compared at the end (the first is the baseline): f32, "
              "bf16 (default), f16, a block format (q8_0, q4_k, q2_k, iq2_xxs, ..., fp8: float weights "
              "quantized by ep_moe), or two: gate/up+down (iq2_xxs+q3_k: DeepSeek-R1 UD-IQ2_XXS's layout)",
              [&o](const std::string& v, std::string* err) {
                o.dtypes.clear();
                o.downs.clear();
                for (const auto& d : cli::split(v)) {
                  ep_moe_dtype_t t;
                  int down = -1;
                  if (!presets::parse_layout(d, &t, &down)) {
                    *err = "unknown dtype " + d + " (" + presets::dtype_list(true) + ")";
                    return false;
                  }
                  o.dtypes.push_back(t);
                  o.downs.push_back(down);
                }
                return !o.dtypes.empty();
              })
      .custom("--engine", "E,E",
              "matrix engine settings, each a variant of every dtype (rows and alternated ratios as for --dtype): "
              "auto (the default: oneDNN where the CPU has AMX), off, onednn (on whatever ISA oneDNN runs); "
              "set as EP_MOE_MATRIX_ENGINE when the variant's layers are made",
              [&o](const std::string& v, std::string* err) {
                o.engine_list.clear();
                for (const auto& e : cli::split(v)) {
                  if (e != "auto" && e != "off" && e != "onednn") {
                    *err = "unknown engine " + e;
                    return false;
                  }
                  o.engine_list.push_back(e);
                }
                return !o.engine_list.empty();
              })
      .custom("--act-dtype", "D",
              "activations: f32, bf16 or f16 (default: the weights' float type; bf16 for block formats)",
              [&o](const std::string& v, std::string* err) {
                ep_moe_dtype_t t;
                if (!presets::parse_dtype(v, &t)) {
                  *err = "takes f32, bf16 or f16";
                  return false;
                }
                o.act = t;
                return true;
              })
      .option("--min-time", &o.min_time, "seconds per measurement (default 0.5)", 0, 3600)
      .option("--peak-time", &o.peak_time,
              "seconds per peak measurement at the start (default 1.0); rows of more than 64 tokens measure theirs "
              "again, at most 0.5",
              0, 3600)
      .option("--bw-mb", &o.bw_mb, "buffer for the bandwidth peak, MiB (default 1024)", 1, 1 << 20)
      .custom("--dispatch-ranks", "N",
              "in-process ranks of the permutation/combine part (default: hardware threads; 0 skips it)",
              [&o](const std::string& v, std::string* err) {
                long long n = 0;
                if (!cli::to_int(v, 0, 4096, &n, err)) return false;
                o.dispatch_ranks = n == 0 ? -1 : static_cast<int>(n);
                return true;
              })
      .option("--ratio-rounds", &o.ratio_rounds,
              "rounds of the alternated weight-0 / skip comparison, each a block of forwards of either strategy "
              "(default 16; 0 skips it)",
              0, 1 << 20)
      .option("--json", &o.json, "also write the results as JSON", "PATH")
      .option("--checkpoint", &o.checkpoint,
              "one layer of a real checkpoint (safetensors or GGUF) instead of the presets: its shape, routing and "
              "weights (random tokens and logits); no dispatch part",
              "PATH")
      .option("--layer", &o.layer, "with --checkpoint: the MoE layer (default: the first)", 0, INT_MAX);
  const int rc = args.parse(argc, argv);
  if (rc == cli::Parser::kRun && !o.engine_list.empty()) {  // every dtype under every engine setting
    std::vector<ep_moe_dtype_t> dts;
    std::vector<int> downs;
    for (size_t i = 0; i < o.dtypes.size(); ++i)
      for (const std::string& e : o.engine_list) {
        dts.push_back(o.dtypes[i]);
        downs.push_back(o.downs[i]);
        o.engines.push_back(e);
      }
    o.dtypes = dts;
    o.downs = downs;
  }
  return rc;
}

// The weight dtypes against the first, row by row (skip strategy) and
// alternated, in this run.
void print_dtype_ratios(const Options& o, const std::vector<Row>& rows, const std::vector<DtypeRatio>& dratios) {
  std::printf(
      "\nweight dtypes against %s, the same preset and tokens in this run (forward time, expert time, "
      "GFLOP/s; %%bw and bound of each row above):\n",
      o.label(0).c_str());
  for (const Row& r : rows) {
    if (r.strategy != "skip" || r.dtype == o.label(0)) continue;
    if (const Row* b = skip_row(rows, r.preset, r.tokens, o.label(0)))
      std::printf("%-14s T=%-5d %s / %s: speed %.2fx (%.3f vs %.3f ms), expert time %.2fx, GFLOP/s %.2fx\n",
                  r.preset.c_str(), r.tokens, r.dtype.c_str(), b->dtype.c_str(), b->ms / r.ms, r.ms, b->ms,
                  b->expert_ms / r.expert_ms, r.gflops / b->gflops);
  }
  if (!dratios.empty())
    std::printf(
        "alternated (%d rounds of a block of forwards of each, at least %.3f s each; the median of the rounds' "
        "ratios of mean times, and their range: the same moments for both, so the machine's drift cancels):\n",
        o.ratio_rounds, o.min_time / 4);
  for (const DtypeRatio& q : dratios) {
    std::printf("%-14s T=%-5d %s / %s alternated: speed %.2fx in expert time (%.2f-%.2f), forward time %.2fx",
                q.preset.c_str(), q.tokens, q.dtype.c_str(), q.base.c_str(), q.expert, q.expert_min, q.expert_max,
                q.forward);
    if (q.stream > 0)
      std::printf("; %.3fx the weight bytes, so %.2fx the weight GB/s of %s", q.bytes, q.stream, q.base.c_str());
    std::printf("\n");
  }
}

// This machine's peaks (by PeakKind) and read bandwidth, measured at the
// start of the run.
struct Machine {
  std::string cpu;
  int threads = 0;
  const char* fma_isa = "";
  double peaks[kPeakKinds] = {};
  double bw = 0;
  double peak(PeakKind k) const { return peaks[static_cast<int>(k)]; }
};

// Measures them (the bandwidth with `probe`) and prints them, with what
// the table's %peak, %bw and bound are against.
void measure_machine(const Options& o, bench::ReadBandwidth& probe, Machine* mc) {
  std::printf("CPU: %s\nmeasuring this machine's peaks with %d thread(s)...\n", mc->cpu.c_str(), mc->threads);
  for (int i = 0; i < kPeakKinds; ++i)
    mc->peaks[i] = measure_peak(static_cast<PeakKind>(i), mc->threads, o.peak_time, &mc->fma_isa);
  mc->bw = probe.measure(o.peak_time);
  if (const double p = mc->peak(PeakKind::Bf16Dot); p > 0)
    std::printf("bf16 dot-product peak (avx512bf16): %.1f GFLOP/s\n", p);
  if (const double p = mc->peak(PeakKind::Int8Dot); p > 0)
    std::printf("int8 dot-product peak (avx512vnni): %.1f GOP/s\n", p);
  if (const double p = mc->peak(PeakKind::Int8Maddubs); p > 0)
    std::printf("int8 multiply peak (avx2 maddubs): %.1f GOP/s\n", p);
  std::printf("f32 FMA peak (%s): %.1f GFLOP/s   read bandwidth (%d MiB buffer): %.1f GB/s\n", mc->fma_isa,
              mc->peak(PeakKind::Fma), o.bw_mb, mc->bw);
  std::printf(
      "%%peak is against rowPk: the bf16 dot-product peak for bf16 weights and activations on the bf16 "
      "kernels, the int8 dot-product peak for block-format weights on the AVX-512 "
      "kernels of a VNNI CPU, the maddubs peak for block-format weights on the other x86 kernels, "
      "else the f32 FMA peak; for T > %d measured again just "
      "before and just after the row (the "
      "higher of the two), else the one above\n",
      kLocalBwTokens);
  std::printf(
      "%%bw is against rowBW: the read bandwidth measured again just before and just after the row (the "
      "higher of the two); a row whose two probes differ by more than %.0f %% is marked ~, and for T <= %d "
      "measured again first, up to %d times\n",
      100 * kBwJump, kLocalBwTokens, kRowAttempts);
  std::printf(
      "bound names what binds the row by the roofline, the larger of %%peak and %%bw: bw (the read bandwidth) "
      "or pk (the peak)\n");
}

const char* const kIsaNames[] = {"generic", "avx2", "avx512", "avx512bf16"};
const char* isa_label(int64_t isa) { return isa >= 0 && isa <= 3 ? kIsaNames[isa] : "?"; }

// The CPU kernels every layer of this process takes, as a small layer
// reports them (-1: none could be made); printed. On AVX512_BF16 the
// pair-dot tiles are timed against widening at the first layer's creation.
int64_t layer_kernels(const Options& o, const Machine& mc) {
  int64_t isa = -1;
  if (ep_moe_expert_map_t* map = presets::linear_map(1, 0, 2)) {
    ep_moe_layer_config_t lc;
    ep_moe_layer_config_init(&lc);
    lc.hidden_size = lc.intermediate_size = 64;
    lc.num_experts = 2;
    lc.top_k = 1;
    lc.weight_dtype = lc.act_dtype = o.act_of(o.dtypes[0]);
    lc.num_threads = 1;
    ep_moe_layer_t* probe = nullptr;
    if (ep_moe_layer_create(&probe, &lc, map, nullptr, nullptr) == EP_MOE_OK)
      ep_moe_layer_get_attr(&isa, probe, EP_MOE_LAYER_ATTR_CPU_ISA);
    ep_moe_layer_destroy(probe);
    ep_moe_expert_map_destroy(map);
  }
  const bool isa_named = std::getenv("EP_MOE_CPU_ISA") != nullptr;
  std::printf("layer kernels: %s%s\n\n", isa_label(isa),
              isa_named ? " (named by EP_MOE_CPU_ISA)"
              : isa == 2 && mc.peak(PeakKind::Bf16Dot) > 0
                  ? " (this CPU's bf16 pair dot products timed slower than widening bf16 to f32 FMAs: bf16 rows are "
                    "held to the FMA peak)"
                  : "");
  return isa;
}

// EP_MOE_MATRIX_ENGINE as the environment had it at the start, and as each
// variant's layers are made.
struct EngineEnv {
  bool set = std::getenv("EP_MOE_MATRIX_ENGINE") != nullptr;
  std::string value = set ? std::getenv("EP_MOE_MATRIX_ENGINE") : "";
  // Variant i's setting (--engine), else the environment's.
  void apply(const Options& o, size_t i) const {
    const std::string e = i < o.engines.size() ? o.engines[i] : "";
    if (e == "auto" || (e.empty() && !set)) unsetenv("EP_MOE_MATRIX_ENGINE");
    else setenv("EP_MOE_MATRIX_ENGINE", e.empty() ? value.c_str() : e.c_str(), 1);
  }
};

// What the runs of one preset share.
struct Run {
  const Options& o;
  const Machine& mc;
  bench::ReadBandwidth& probe;
  const presets::CheckpointLayer& ckl;
  const EngineEnv& engine;
  int max_tokens;
};

// A layer of model m on rank 0 of EP ep, its weights loaded: random ones
// in wdt, or the checkpoint's; its weight dtype into *lw. Null: it failed
// (printed).
ep_moe_layer_t* make_layer(const Run& run, const presets::Model& m, int ep, int strategy, ep_moe_dtype_t wdt,
                           ep_moe_dtype_t act, ep_moe_dtype_t* lw, int down = -1) {
  ep_moe_expert_map_t* map = presets::linear_map(ep, 0, m.experts);
  if (!map) {
    std::fprintf(stderr, "map: %s\n", ep_moe_last_error());
    return nullptr;
  }
  ep_moe_layer_config_t lc = presets::layer_config(m, m.shared_intermediate, wdt, act, run.max_tokens, run.mc.threads);
  if (run.ckl.ck) {  // the file's semantics and weight dtype; the activations' dtype of the options
    lc = run.ckl.config;
    lc.act_dtype = act;
    lc.max_tokens = run.max_tokens;
    lc.num_threads = run.mc.threads;
  }
  lc.skip_mode = strategy;
  *lw = static_cast<ep_moe_dtype_t>(lc.weight_dtype);
  ep_moe_layer_t* layer = nullptr;
  if (ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) != EP_MOE_OK) {
    std::fprintf(stderr, "layer: %s\n", ep_moe_last_error());
    ep_moe_expert_map_destroy(map);
    return nullptr;
  }
  std::string err;
  if (!run.ckl.ck) err = presets::load_random_weights(layer, map, m, m.shared_intermediate, 1, down);
  else if (ep_moe_layer_load(layer, run.ckl.ck, run.ckl.layer) != EP_MOE_OK) err = ep_moe_layer_last_error(layer);
  ep_moe_expert_map_destroy(map);
  if (!err.empty()) {
    std::fprintf(stderr, "weights: %s\n", err.c_str());
    ep_moe_layer_destroy(layer);
    return nullptr;
  }
  return layer;
}

// What measure_row needs of `layer` (variant di of preset `name`, its
// weights in lw).
RowContext row_context(const Run& run, const presets::Model* m, const std::string& name, int ep, int strategy,
                       ep_moe_layer_t* layer, ep_moe_dtype_t lw, size_t di) {
  const Options& o = run.o;
  const Machine& mc = run.mc;
  const ep_moe_dtype_t act = o.act_of(o.dtypes[di]);
  int64_t shard = 0, isa = 0;
  ep_moe_layer_get_attr(&isa, layer, EP_MOE_LAYER_ATTR_CPU_ISA);
  ep_moe_layer_get_attr(&shard, layer, EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE);
  // The bf16 kernels run bf16 weights with bf16 activations on pair dot
  // products: their peak is the dot-product peak. A block format's shared
  // expert is held in it where this rank's shard (rank 0's, from column 0)
  // is whole blocks, else in f32.
  const bool dot = isa == 3 && lw == EP_MOE_DTYPE_BF16 && act == EP_MOE_DTYPE_BF16 && mc.peak(PeakKind::Bf16Dot) > 0;
  // Block formats run on int8 products (src/cpu/kernels.cpp,
  // set_x86_block_kernels): vpdpbusd on the AVX-512 tables of a VNNI CPU,
  // maddubs on the other x86 tables.
  int64_t block = 1, block_bytes = 0;
  if (ep_moe_dtype_block(&block, &block_bytes, lw) != EP_MOE_OK) block = 1;
  const bool vnni = isa >= 2 && mc.peak(PeakKind::Int8Dot) > 0 && block > 1;
  const bool maddubs = !vnni && isa >= 1 && mc.peak(PeakKind::Int8Maddubs) > 0 && block > 1;
  const PeakKind peak_of = dot       ? PeakKind::Bf16Dot
                           : vnni    ? PeakKind::Int8Dot
                           : maddubs ? PeakKind::Int8Maddubs
                                     : PeakKind::Fma;
  const double shared_size = bytes_per_weight(lw) >= 2.0 || shard % block == 0 ? bytes_per_weight(lw) : 4.0;
  // The routed experts' down in its own format where the layout names one.
  const ep_moe_dtype_t down_of = o.downs[di] >= 0 ? static_cast<ep_moe_dtype_t>(o.downs[di]) : lw;
  return RowContext{o,
                    m,
                    name,
                    ep,
                    mc.threads,
                    strategy,
                    lw,
                    act,
                    mc.bw,
                    run.probe,
                    peak_of,
                    mc.peak(peak_of),
                    m->hidden * m->intermediate * (2.0 * bytes_per_weight(lw) + bytes_per_weight(down_of)),
                    3.0 * m->hidden * static_cast<double>(shard) * shared_size,
                    shard,
                    o.label(di)};
}

// The results of the run, in the order they are printed.
struct Results {
  std::vector<Row> rows;
  std::vector<RatioRow> ratios;
  std::vector<DtypeRatio> dratios;
  std::vector<DispatchRow> drows;
};

// The weight-0 / skip comparison the issue asks for, at each token count,
// of variant di of preset `name` (by: its skip and weight-0 layers): of the
// two rows, and alternated. The rows ran seconds to minutes apart, and
// this VM's peaks move by 15 % over such spans, so their ratio carries that
// drift; the alternated rounds put both strategies into the same moments.
// False: a forward failed.
bool strategy_ratios(const Options& o, const presets::Model& m, const std::string& name, int ep, size_t di,
                     ep_moe_layer_t* const (&by)[2], Results* res) {
  for (int T : o.tokens) {
    RatioRow q;
    q.preset = name + " " + o.label(di);
    q.ep = ep;
    q.tokens = T;
    const Row* rs = nullptr;
    const Row* rw = nullptr;
    for (const auto& r : res->rows)
      if (r.preset == name && r.tokens == T && r.ep == ep && r.dtype == o.label(di))
        (r.strategy == "skip" ? rs : rw) = &r;
    if (rs && rw) {
      q.rows_expert = rw->expert_ms / rs->expert_ms;
      q.rows_forward = rw->ms / rs->ms;
      const double sk = rs->roofline_s(rs->row_bw, rs->row_peak);
      if (sk > 0) q.work = rw->roofline_s(rs->row_bw, rs->row_peak) / sk;
    }
    if (o.ratio_rounds > 0) {
      Feed feed(m, T, o.act_of(o.dtypes[di]));
      Feed* const feeds[2] = {&feed, &feed};
      if (!alternate(o.min_time / 4, o.ratio_rounds, by, feeds, 1, &q)) return false;
    }
    res->ratios.push_back(q);
  }
  return true;
}

void print_strategy_ratios(const Options& o, const std::vector<RatioRow>& ratios) {
  std::printf("\n");
  if (!ratios.empty() && o.ratio_rounds > 0)
    std::printf(
        "weight-0 / skip, of the two rows above and alternated (%d rounds of a block of forwards of each "
        "strategy, at least %.3f s each; the median of the rounds' ratios of mean times, and their range):\n",
        o.ratio_rounds, o.min_time / 4);
  for (const auto& q : ratios) {
    std::printf("%-14s T=%-5d weight-0 / skip: expert time %.2fx, forward time %.2fx", q.preset.c_str(), q.tokens,
                q.rows_expert, q.rows_forward);
    if (q.rounds > 0)
      std::printf("; alternated: expert time %.2fx (%.2f-%.2f), forward time %.2fx", q.expert, q.expert_min,
                  q.expert_max, q.forward);
    else if (o.ratio_rounds > 0) std::printf("; alternated: none (the skip rank had no local pair in any round)");
    if (q.rounds > 0 && q.rounds < o.ratio_rounds)
      std::printf(" [%d of %d rounds: in the others the skip rank had no local pair]", q.rounds, o.ratio_rounds);
    if (q.work > 0) std::printf("; by the rows' work (roofline) %.2fx", q.work);
    std::printf("\n");
  }
}

// Every variant of preset `name`: each strategy's rows, the weight-0 /
// skip ratios, then each dtype alternated against the first. 0, or the
// exit code of a failure (printed).
int run_preset(const Run& run, const std::string& name, Results* res) {
  const Options& o = run.o;
  // Each variant's skip layer, kept for the alternated comparison of dtypes.
  std::vector<ep_moe_layer_t*> skip_layers(o.dtypes.size(), nullptr);
  const auto release = [&] {
    for (ep_moe_layer_t* l : skip_layers) ep_moe_layer_destroy(l);
  };
  const presets::Model* m = run.ckl.ck ? &run.ckl.model : presets::find(name);
  if (!m) {
    std::fprintf(stderr, "unknown preset %s\n", name.c_str());
    return 2;
  }
  const int ep = o.ep > 0 ? o.ep : m->default_ep;
  for (size_t di = 0; di < o.dtypes.size(); ++di) {
    run.engine.apply(o, di);
    // The variant's layers by strategy (skip, weight-0), kept for the
    // alternated comparison.
    ep_moe_layer_t* by[2] = {nullptr, nullptr};
    const auto fail = [&] {
      for (ep_moe_layer_t* l : by) ep_moe_layer_destroy(l);
      release();
      return 1;
    };
    for (int strategy : o.strategies) {
      if (strategy == EP_MOE_SKIP_WEIGHT_ZERO && ep == 1) continue;  // nothing is non-local
      ep_moe_dtype_t lw = o.dtypes[di];
      ep_moe_layer_t* layer = make_layer(run, *m, ep, strategy, o.dtypes[di], o.act_of(o.dtypes[di]), &lw, o.downs[di]);
      if (!layer) return fail();
      ep_moe_layer_t*& kept = by[strategy == EP_MOE_SKIP_TOKENS ? 0 : 1];
      ep_moe_layer_destroy(kept);  // a strategy named twice: its last layer is kept
      kept = layer;
      const RowContext cx = row_context(run, m, name, ep, strategy, layer, lw, di);
      if (strategy == EP_MOE_SKIP_TOKENS) {
        int64_t engine = 0;
        ep_moe_layer_get_attr(&engine, layer, EP_MOE_LAYER_ATTR_MATRIX_ENGINE);
        std::printf("(%s %s: matrix engine %s)\n", name.c_str(), o.label(di).c_str(),
                    engine == 2   ? "oneDNN on AMX"
                    : engine == 1 ? "oneDNN without AMX"
                                  : "none");
      }
      for (int T : o.tokens) {
        Row r;
        if (!measure_row(cx, layer, T, &r)) return fail();
        res->rows.push_back(r);
      }
    }
    if (by[0] && by[1] && !strategy_ratios(o, *m, name, ep, di, by, res)) return fail();
    skip_layers[di] = by[0];
    ep_moe_layer_destroy(by[1]);
  }
  if (o.dtypes.size() > 1 && o.ratio_rounds > 0) {
    for (int T : o.tokens)
      for (size_t di = 1; di < o.dtypes.size(); ++di) {
        DtypeRatio q;
        if (!alternate_dtypes(o, *m, name, T, skip_layers[0], skip_layers[di], 0, di, &q)) {
          release();
          return 1;
        }
        per_byte(res->rows, &q);
        res->dratios.push_back(q);
      }
  }
  release();
  return 0;
}

// Permutation and combine of the all-to-all flow against memcpy, on
// `threads` in-process ranks (fewer than 2: not run). False: it failed
// (printed).
bool dispatch_part(const Options& o, int threads, Results* res) {
  const int dranks = o.dispatch_ranks > 0 ? o.dispatch_ranks : o.dispatch_ranks < 0 ? 0 : threads;
  if (dranks < 2) return true;
  // memcpy from memory, GB/s per thread with dranks threads copying
  const double mem_cpy = bench::memcpy_gbs_per_thread(dranks, std::max(0.5, o.peak_time), size_t{128} << 20);
  if (mem_cpy <= 0) {
    std::fprintf(stderr, "dispatch part: no memory for %d memcpy buffers of 2 x 128 MiB\n", dranks);
    return false;
  }
  std::printf(
      "\npermutation / combine: all-to-all dispatch, %d in-process ranks x 1 thread, %s rows; GB/s per rank "
      "against memcpy by %d concurrent threads: of the same bytes (memcpy, %%cpy: in cache when they fit) and "
      "from memory (%%mem: 128 MiB buffers, %.2f GB/s per thread); experts shrunk to intermediate 16, "
      "which fwd_us (a whole forward) includes\n",
      dranks, dtype_name(o.act_of(o.dtypes[0])), dranks, mem_cpy);
  std::printf("%-14s %6s %6s %10s %9s %9s %6s %6s %10s %9s %9s %6s %6s %10s\n", "preset", "ranks", "tokens", "perm_MB",
              "GB/s", "memcpy", "%cpy", "%mem", "comb_MB", "GB/s", "memcpy", "%cpy", "%mem", "fwd_us");
  for (const auto& name : o.presets) {
    const presets::Model* m = presets::find(name);
    for (int T : o.tokens) {
      DispatchRow d;
      const std::string err = run_dispatch(*m, dranks, T, o.act_of(o.dtypes[0]), std::max(0.2, o.min_time / 2), &d);
      if (!err.empty()) {
        std::fprintf(stderr, "dispatch part: %s\n", err.c_str());
        return false;
      }
      d.memory_gbs = mem_cpy;
      std::printf("%-14s %6d %6d %10.3f %9.2f %9.2f %5.1f%% %5.0f%% %10.3f %9.2f %9.2f %5.1f%% %5.0f%% %10.1f\n",
                  name.c_str(), d.ranks, d.tokens, d.permute_mb, d.permute_gbs, d.permute_base_gbs,
                  100 * d.permute_gbs / std::max(1e-9, d.permute_base_gbs),
                  100 * d.permute_gbs / std::max(1e-9, mem_cpy), d.combine_mb, d.combine_gbs, d.combine_base_gbs,
                  100 * d.combine_gbs / std::max(1e-9, d.combine_base_gbs),
                  100 * d.combine_gbs / std::max(1e-9, mem_cpy), d.forward_us);
      std::fflush(stdout);
      res->drows.push_back(d);
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const int rc = parse_options(argc, argv, &o); rc != cli::Parser::kRun) return rc;
  const EngineEnv engine;
  presets::CheckpointLayer ckl;
  if (!o.checkpoint.empty()) {
    if (!presets::open_checkpoint_layer(o.checkpoint, o.layer, &ckl)) return 1;
    o.presets = {"checkpoint"};
    o.dispatch_ranks = -1;
  }
  Machine mc;
  mc.cpu = bench::cpu_description();
  mc.threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  bench::ReadBandwidth probe(mc.threads, o.bw_mb);
  measure_machine(o, probe, &mc);
  const int64_t layer_isa = layer_kernels(o, mc);
  std::printf("%-14s %-*s %4s %6s %-7s %9s %9s %11s %9s %6s %7s %9s %6s %6s %6s %7s %6s\n", "preset", o.label_width(),
              "dtype", "ep", "tokens", "strat", "ms", "expert_ms", "tokens/s", "GFLOP/s", "%peak", "rowPk", "wGB/s",
              "rowBW", "%bw", "bound", "pairs", "active");
  const Run run{o, mc, probe, ckl, engine, *std::max_element(o.tokens.begin(), o.tokens.end())};
  Results res;
  for (const auto& name : o.presets)
    if (const int rc = run_preset(run, name, &res); rc != 0) return rc;
  print_strategy_ratios(o, res.ratios);
  if (o.dtypes.size() > 1) print_dtype_ratios(o, res.rows, res.dratios);
  if (!dispatch_part(o, mc.threads, &res)) return 1;
  if (!o.json.empty()) {
    std::vector<std::string> labels;
    for (size_t i = 0; i < o.dtypes.size(); ++i) labels.push_back(o.label(i));
    const JsonMachine jm{mc.cpu,
                         mc.threads,
                         mc.fma_isa,
                         mc.peak(PeakKind::Fma),
                         mc.peak(PeakKind::Bf16Dot),
                         mc.peak(PeakKind::Int8Dot),
                         mc.peak(PeakKind::Int8Maddubs),
                         mc.bw,
                         isa_label(layer_isa)};
    if (!write_json(o.json, labels, jm, res.rows, res.ratios, res.dratios, res.drows)) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::printf("\nwrote %s\n", o.json.c_str());
  }
  return 0;
}

// ep_moe_stream_bench: where the CPU expert path's decode time goes between
// the machine's read bandwidth and FfnRunner (phases A and B as a forward
// runs them), over the same weights in the same process. Five variants
// alternate in short blocks, because this VM's read bandwidth moves between
// states within seconds and separate runs cannot be compared:
//   probe      the read-bandwidth probe ep_moe_bench holds decode rows to;
//   read       a plain read of the weights' bytes through the thread pool,
//              each thread its half (fork, join and a static split);
//   flat       the tile kernels over every expert panel, the panels copied
//              back to back into one buffer;
//   tiles      the same calls on the experts' own buffers;
//   FfnRunner  the layer's expert path (activation, combine, scheduling).
// For decode-like jobs (a few rows per expert) every pass is bound by
// reading the weights; each step down the list shows what one more part
// costs. The tiles are the ones the layer runs on this CPU: the bf16
// dot-product tiles on bf16 rows where the CPU has them (AVX512_BF16),
// else the widening tiles on f32 rows (AVX2, AVX-512 without BF16, the
// portable fallback), each expert's rows through the calls FfnRunner
// makes (gemv / gemm_run runs where the kernels have them). Uses the
// library's internals, not its C API. With --dtype a GGUF block format
// the weights are blocks (quantized once by ep_moe and copied to every
// expert) and the tiles are the block kernels on int8 activation rows.
//   ep_moe_stream_bench [--experts E] [--hidden H] [--inter I] [--dtype D]
//                       [--rows r1,r2,...] [--threads N] [--blocks B]
//                       [--block-seconds S] [--bw-mb M] [--per-forward N]
// --rows: rows per expert (1..64), cycled over the experts (default
// 2,1,3,2,5,1,4,6, about qwen3-30b-a3b T=32 on an EP-4 rank); --bw-mb: the
// probe's buffer (default 1024).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/aligned.hpp"
#include "cpu/ffn.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/thread_pool.hpp"
#include "cli.hpp"
#include "common/quant.hpp"
#include "machine_peaks.hpp"
#include "presets.hpp"

using namespace ep_moe;
using Clock = std::chrono::steady_clock;

namespace {

// Most rows per expert: the kernel pass keeps its row pointers on the stack.
constexpr int kMaxRows = 64;

// Small normal bf16 values (no NaNs or denormals): the contents do not
// matter to the timing, only that they are ordinary numbers.
std::vector<uint16_t> random_bf16(size_t n) {
  std::vector<uint16_t> v(n);
  uint32_t s = 12345;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<uint16_t>(0x3c00u + ((s >> 24) & 0x7fu) + ((s >> 16) & 0x8000u));
  }
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Options {
  int experts = 28, hidden = 2048, inter = 768, blocks = 20, bw_mb = 1024, per_forward = 0;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double block_s = 0.25;
  std::vector<int> rows_pattern = {2, 1, 3, 2, 5, 1, 4, 6};
  ep_moe_dtype_t wdt = EP_MOE_DTYPE_BF16;
};

// cli::Parser::kRun when the options are good, else the exit code.
int parse_options(int argc, char** argv, Options* o) {
  cli::Parser args("ep_moe_stream_bench [options]",
                   "The expert path against its own tiles and a plain read of the same weights, each as a fraction "
                   "of the read probe in the same moment.");
  args.option("--experts", &o->experts, "experts streamed (default 28)", 1, 1 << 16)
      .option("--per-forward", &o->per_forward,
              "experts per FfnRunner run: the pass is that many runs of so many experts each, as decode runs a "
              "few experts per forward (default: all in one run)",
              1, 1 << 16)
      .option("--hidden", &o->hidden, "hidden size (default 2048)", 2, 1 << 16)
      .option("--inter", &o->inter, "intermediate size (default 768)", 2, 1 << 18)
      .option("--threads", &o->threads, "threads (default: all hardware threads)", 1, 1024)
      .option("--blocks", &o->blocks, "alternated measurement blocks (default 20)", 1, 1 << 20)
      .option("--bw-mb", &o->bw_mb, "buffer of the read probe, MiB (default 1024)", 1, 1 << 20)
      .option("--block-seconds", &o->block_s, "seconds per block (default 0.25)", 1e-6, 3600)
      .list("--rows", &o->rows_pattern, "the rows per expert of successive steps (default 2,1,3,2,5,1,4,6)", 1,
            kMaxRows)
      .custom("--dtype", "D", "weights: bf16 (default) or a GGUF block format (q4_k, q8_0, ...)",
              [o](const std::string& v, std::string* err) {
                if (presets::parse_dtype(v, &o->wdt, true) && (o->wdt == EP_MOE_DTYPE_BF16 || dtype_is_quant(o->wdt)))
                  return true;
                *err = "not bf16 or a block format: " + v;
                return false;
              });
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (dtype_is_quant(o->wdt) && (o->hidden % 256 != 0 || o->inter % 256 != 0)) {
    std::fprintf(stderr, "block formats need --hidden and --inter multiples of 256\n");
    return 2;
  }
  return cli::Parser::kRun;
}

// Each expert's gate/up and down packed into their own buffers, as the
// layer loads them (one random source serves every matrix; block formats
// are quantized once, slow, and the first expert's blocks copied).
void pack_experts(const Options& o, const cpu::Kernels& kern, std::vector<cpu::PackedWeight>* gate_up,
                  std::vector<cpu::PackedWeight>* down) {
  const int nr = kern.nr, il = kern.il_of(o.wdt);
  const std::vector<uint16_t> src = random_bf16(static_cast<size_t>(o.hidden) * static_cast<size_t>(o.inter));
  gate_up->resize(static_cast<size_t>(o.experts));
  down->resize(static_cast<size_t>(o.experts));
  for (size_t e = 0; e < gate_up->size(); ++e) {
    if (dtype_is_quant(o.wdt) && e > 0) {
      cpu::copy_packed((*gate_up)[e], (*gate_up)[0]);
      cpu::copy_packed((*down)[e], (*down)[0]);
      continue;
    }
    cpu::init_gate_up((*gate_up)[e], o.inter, o.hidden, nr, o.wdt, il);
    for (int half = 0; half < 2; ++half)
      cpu::pack_gate_up_half((*gate_up)[e], Source{src.data(), EP_MOE_DTYPE_BF16, o.hidden}, half, o.inter);
    cpu::pack((*down)[e], Source{src.data(), EP_MOE_DTYPE_BF16, o.inter}, o.hidden, o.inter, nr, o.wdt, il);
  }
}

// Expert e takes rows_pattern[e % size] token rows out of T tokens.
struct Jobs {
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<float>> weights;
  std::vector<cpu::ExpertJob> jobs;  // pointing into rows and weights
  int64_t pairs = 0;
};
void make_jobs(const Options& o, int T, std::vector<cpu::PackedWeight>& gate_up, std::vector<cpu::PackedWeight>& down,
               Jobs* out) {
  out->rows.resize(static_cast<size_t>(o.experts));
  out->weights.resize(static_cast<size_t>(o.experts));
  std::mt19937 rng(7);
  for (int e = 0; e < o.experts; ++e) {
    const auto ue = static_cast<size_t>(e);
    const int m = o.rows_pattern[ue % o.rows_pattern.size()];
    std::vector<int32_t> toks(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) toks[static_cast<size_t>(t)] = t;
    std::shuffle(toks.begin(), toks.end(), rng);
    toks.resize(static_cast<size_t>(m));
    std::sort(toks.begin(), toks.end());
    out->rows[ue] = std::move(toks);
    out->weights[ue].assign(static_cast<size_t>(m), 0.125f);
    cpu::ExpertJob j;
    j.gate_up = &gate_up[ue];
    j.down = &down[ue];
    j.inter = o.inter;
    j.rows = out->rows[ue].data();
    j.weights = out->weights[ue].data();
    j.n = m;
    out->jobs.push_back(j);
    out->pairs += m;
  }
}

// The int8 activation rows of the block kernels (gate/up: k = hidden, from
// x; down: k = inter), as FfnRunner quantizes them.
struct QuantRows {
  std::vector<std::vector<uint8_t>> xq, hq;
  const void* x[kMaxRows] = {};
  const void* h[kMaxRows] = {};
};
void make_quant_rows(const Options& o, int rows, const std::vector<float>& x, QuantRows* q) {
  const std::vector<float> hrow(static_cast<size_t>(o.inter), 0.5f);
  const ActQuant aq = act_quant_of(o.wdt);
  q->xq.resize(static_cast<size_t>(rows));
  q->hq.resize(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    const auto ur = static_cast<size_t>(r);
    q->xq[ur].resize(act_row_bytes(o.hidden));
    q->hq[ur].resize(act_row_bytes(o.inter));
    quantize_act_row(x.data() + ur * static_cast<size_t>(o.hidden), o.hidden, aq, q->xq[ur].data());
    quantize_act_row(hrow.data(), o.inter, aq, q->hq[ur].data());
    q->x[r] = q->xq[ur].data();
    q->h[r] = q->hq[ur].data();
  }
}

// One panel of an expert's weight with the expert's rows: a call of the
// kernel pass.
struct Rows {
  const uint16_t* rows16;  // m rows of k elements, `ld` apart (bf16 tiles)
  const float* rows32;     // the same in f32 (widening tiles)
  int ld;
};
struct Item {
  const cpu::PackedWeight* w;
  int32_t p;
  int m;
  Rows rows;
};
// Every expert's gate/up panels (rows x), then every expert's down panels
// (rows h).
std::vector<Item> make_items(const Jobs& jobs, const std::vector<cpu::PackedWeight>& gate_up,
                             const std::vector<cpu::PackedWeight>& down, Rows x, Rows h) {
  std::vector<Item> items;
  for (const auto* ws : {&gate_up, &down})
    for (size_t e = 0; e < ws->size(); ++e)
      for (int32_t p = 0; p < (*ws)[e].panels(); ++p)
        items.push_back(Item{&(*ws)[e], p, static_cast<int>(jobs.jobs[e].n), ws == &gate_up ? x : h});
  return items;
}

// The kernels alone: every expert's gate/up then down panels with the
// expert's rows, each thread a contiguous share of the experts' panels
// (by bytes), through the calls FfnRunner makes (a run of one expert's
// panels through gemv or gemm_run for experts of 1 .. run_rows rows,
// where the kernels have them; else gemm per panel), the next panel
// prefetched as FfnRunner's calls do; no activation, no combine.
struct TilePass {
  const cpu::Kernels& kern;
  const std::vector<Item>& items;
  const QuantRows& q;
  ep_moe_dtype_t wdt;
  bool dot;  // bf16 dot-product tiles on bf16 rows (else widening on f32)
  int hidden;
  std::vector<size_t> at;   // at[i]: the bytes of the panels before item i
  std::vector<size_t> cut;  // thread t's items: [cut[t], cut[t + 1]), equal bytes each

  TilePass(const cpu::Kernels& k, const std::vector<Item>& it, const QuantRows& qr, ep_moe_dtype_t w, bool d, int h,
           int threads)
      : kern(k), items(it), q(qr), wdt(w), dot(d), hidden(h), at(it.size() + 1, 0) {
    for (size_t i = 0; i < items.size(); ++i) at[i + 1] = at[i] + items[i].w->panel_bytes();
    const double all = bytes();
    cut.assign(static_cast<size_t>(threads) + 1, items.size());
    cut[0] = 0;
    for (size_t i = 0, t = 1; i < items.size() && t < static_cast<size_t>(threads); ++i)
      if (static_cast<double>(at[i + 1]) >= all * static_cast<double>(t) / threads) cut[t++] = i + 1;
  }
  // Every expert's weights, once a pass.
  double bytes() const { return static_cast<double>(at.back()); }
  bool quant() const { return dtype_is_quant(wdt); }
  // Panels a call for an item of m rows: a run where FfnRunner makes one
  // (Kernels::runs_rows; as many as its c tile holds), else 1.
  int run_cap(int m) const {
    return !quant() && kern.runs_rows(m, static_cast<int>(EP_MOE_DTYPE_BF16), dot) ? kMaxRows * 32 / (kern.nr * m) : 1;
  }
  // Thread t's share, where panel(i) is item i's panel.
  template <class Panel>
  void share(size_t t, Panel panel) const {
    constexpr int kBf16 = static_cast<int>(EP_MOE_DTYPE_BF16);
    const int nr = kern.nr;
    const size_t b = cut[t], e = cut[t + 1];
    const uint16_t* a16[kMaxRows];
    const float* a32[kMaxRows];
    alignas(64) float c[kMaxRows * 32];
    for (size_t i = b; i < e;) {
      const Item& it = items[i];
      // The run: the items that follow with the same weight's next panels.
      size_t j = i + 1;
      const auto cap = static_cast<size_t>(run_cap(it.m));
      while (j < e && j - i < cap && items[j].w == it.w && items[j].p == items[j - 1].p + 1) ++j;
      const void* next = j < e ? panel(j) : nullptr;
      const auto np = static_cast<int>(j - i);
      for (int r = 0; r < it.m; ++r) {
        a16[r] = it.rows.rows16 + static_cast<size_t>(r) * static_cast<size_t>(it.rows.ld);
        a32[r] = it.rows.rows32 + static_cast<size_t>(r) * static_cast<size_t>(it.rows.ld);
      }
      if (quant())
        kern.qgemm[quant_index(wdt)](it.m, it.w->k == hidden ? q.x : q.h, it.w->k, panel(i), nr, c, nr, next);
      else if (cap > 1 && it.m == 1 && dot) kern.gemv_bf16(a16[0], it.w->k, panel(i), np, c, next);
      else if (cap > 1 && it.m == 1) kern.gemv[kBf16](a32[0], it.w->k, panel(i), np, c, next);
      else if (cap > 1) kern.gemm_run[kBf16](it.m, a32, it.w->k, panel(i), np, c, np * nr, next);
      else if (dot) kern.gemm_bf16(it.m, a16, it.w->k, panel(i), c, nr, next);
      else kern.gemm[kBf16](it.m, a32, it.w->k, panel(i), c, nr, next);
      i = j;
    }
  }
};

constexpr int kVariants = 5;  // the probe, then the passes

// The alternated blocks: in each, the probe and every pass (run_pass(v),
// v = 1 .. 4, repeated for block_s seconds), the first one rotating; each
// pass's GB/s (bytes[v] a run) and its fraction of the probe, then medians.
template <class Pass>
void measure(const Options& o, bench::ReadBandwidth& probe, const double (&bytes)[kVariants], Pass&& run_pass) {
  const char* names[] = {"probe", "read", "flat", "tiles", "FfnRunner"};
  for (int v = 1; v < kVariants; ++v) run_pass(v);  // warm up
  std::printf("GB/s of each pass, and in brackets its fraction of the probe in the same block\n");
  std::printf("block  %6s  %15s  %15s  %15s  %15s  %s\n", names[0], names[1], names[2], names[3], names[4],
              "FfnRunner/tiles");
  std::vector<double> gb[kVariants], frac[kVariants], ratios;
  for (int b = 0; b < o.blocks; ++b) {
    double gbs[kVariants];
    for (int ph = 0; ph < kVariants; ++ph) {
      const int v = (ph + b) % kVariants;  // which one goes first rotates
      if (v == 0) {
        gbs[0] = probe.measure(o.block_s);
        continue;
      }
      double t = 0;
      int n = 0;
      const auto start = Clock::now();
      while (n < 2 || std::chrono::duration<double>(Clock::now() - start).count() < o.block_s) {
        const auto t0 = Clock::now();
        run_pass(v);
        t += std::chrono::duration<double>(Clock::now() - t0).count();
        ++n;
      }
      gbs[v] = bytes[v] * n / t / 1e9;
    }
    std::printf("%5d  %6.1f", b, gbs[0]);
    for (int v = 0; v < kVariants; ++v) {
      gb[v].push_back(gbs[v]);
      frac[v].push_back(gbs[v] / std::max(1e-9, gbs[0]));
      if (v > 0) std::printf("  %6.1f (%5.1f%%)", gbs[v], 100 * gbs[v] / std::max(1e-9, gbs[0]));
    }
    ratios.push_back(gbs[4] / gbs[3]);
    std::printf("  %15.3f\n", gbs[4] / gbs[3]);
  }
  std::printf("medians over the blocks: probe %.1f GB/s", median(gb[0]));
  for (int v = 1; v < kVariants; ++v) std::printf(", %s %.1f (%.1f%%)", names[v], median(gb[v]), 100 * median(frac[v]));
  std::printf("; FfnRunner/tiles %.3f (min %.3f, max %.3f)\n", median(ratios),
              *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const int rc = parse_options(argc, argv, &o); rc != cli::Parser::kRun) return rc;
  const int hidden = o.hidden, inter = o.inter;
  const bool quant = dtype_is_quant(o.wdt);
  const cpu::Kernels& kern = cpu::layer_kernels();  // the kernels a layer takes here
  // With bf16 dot-product tiles (AVX512_BF16) the passes run them on bf16
  // rows, as the layer does with bf16 activations; without them (AVX2,
  // AVX-512 without BF16) the tiles widen the bf16 weights and keep f32
  // rows, as the layer does there.
  const bool dot = !quant && kern.gemm_bf16 != nullptr;

  std::vector<cpu::PackedWeight> gate_up, down;
  pack_experts(o, kern, &gate_up, &down);
  const int max_rows = *std::max_element(o.rows_pattern.begin(), o.rows_pattern.end());
  const int T = std::max(32, max_rows);
  Jobs jobs;
  make_jobs(o, T, gate_up, down, &jobs);
  std::vector<float> x(static_cast<size_t>(T) * hidden, 0.5f), acc(static_cast<size_t>(T) * hidden, 0.0f);
  std::vector<uint16_t> x16(static_cast<size_t>(T) * hidden, 0x3f00);

  cpu::ThreadPool pool(o.threads);
  cpu::FfnRunner ffn(kern, hidden, inter, jobs.pairs, dot);
  QuantRows q;
  if (quant) {
    ffn.reserve_quant(pool.size(), o.wdt);
    make_quant_rows(o, max_rows, x, &q);
  }
  const int use = pool.size();

  std::vector<uint16_t> hrows(static_cast<size_t>(max_rows) * static_cast<size_t>(inter + 32), 0x3f00);
  std::vector<float> hrows32(hrows.size(), 0.5f);
  const std::vector<Item> items =
      make_items(jobs, gate_up, down, {x16.data(), x.data(), hidden}, {hrows.data(), hrows32.data(), inter + 32});
  const TilePass tiles(kern, items, q, o.wdt, dot, hidden, use);
  const auto& at = tiles.at;
  const double bytes = tiles.bytes();
  auto tile_pass = [&](auto panel) {
    pool.parallel_for(static_cast<size_t>(use), [&](size_t t, int) { tiles.share(t, panel); });
  };
  // The same items with their panels back to back in one buffer: what the
  // experts' separate buffers (and the boundaries between them) cost.
  AlignedBuffer flat(at.back());
  for (size_t i = 0; i < items.size(); ++i)
    std::memcpy(flat.data<char>() + at[i], items[i].w->panel(items[i].p), at[i + 1] - at[i]);
  // A plain read of that buffer through the pool, each thread its half:
  // what any pass can reach after fork, join and the split of the work.
  std::vector<uint64_t> sink(static_cast<size_t>(use) * 8, 0);  // a cache line per thread
  // The probe's own read loop (bench::sum_words) over 64-byte lines.
  const size_t read_bytes = at.back() / 64 * 64;
  auto plain_read = [&] {
    const size_t lines = read_bytes / 64;
    pool.parallel_for(static_cast<size_t>(use), [&](size_t t, int) {
      const size_t b = lines * t / use * 64, e = lines * (t + 1) / use * 64;
      sink[t * 8] += bench::sum_words(reinterpret_cast<const uint64_t*>(flat.data<char>() + b), (e - b) / 8);
    });
  };
  // The experts in runs of --per-forward (consecutive experts, so every
  // pass still reads each expert once).
  std::vector<std::vector<cpu::ExpertJob>> runs;
  const size_t per_run = o.per_forward > 0 ? static_cast<size_t>(o.per_forward) : jobs.jobs.size();
  for (size_t b = 0; b < jobs.jobs.size(); b += per_run)
    runs.emplace_back(jobs.jobs.begin() + static_cast<std::ptrdiff_t>(b),
                      jobs.jobs.begin() + static_cast<std::ptrdiff_t>(std::min(jobs.jobs.size(), b + per_run)));
  auto layer_path = [&] {
    for (const auto& run : runs) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      ffn.run(pool, run, x.data(), hidden, acc.data(), hidden, cpu::Act::Silu, x16.data(), hidden);
    }
  };

  std::printf("CPU: %s\n", bench::cpu_description().c_str());
  std::printf(
      "%d experts (H %d, I %d, rows per expert %d..%d, %lld pairs), %.1f MB of %s weights per pass, "
      "%d threads, %s %s tiles\n",
      o.experts, hidden, inter, *std::min_element(o.rows_pattern.begin(), o.rows_pattern.end()), max_rows,
      static_cast<long long>(jobs.pairs), bytes / 1e6, presets::dtype_name(o.wdt), pool.size(), cpu::isa_name(kern.isa),
      quant ? "block"
      : dot ? "bf16 dot-product"
            : "widening");
  // The read bandwidth, measured in every block as ep_moe_bench measures
  // it next to each decode row: the figure %bw there is against.
  bench::ReadBandwidth probe(use, o.bw_mb);
  if (probe.measure(0.01) <= 0) {
    std::fprintf(stderr, "could not allocate the probe's %d MB buffer (--bw-mb)\n", o.bw_mb);
    return 1;
  }
  const double pass_bytes[kVariants] = {0, static_cast<double>(read_bytes), bytes, bytes, bytes};
  measure(o, probe, pass_bytes, [&](int v) {
    if (v == 1) plain_read();
    else if (v == 2) tile_pass([&](size_t i) { return static_cast<const void*>(flat.data<char>() + at[i]); });
    else if (v == 3) tile_pass([&](size_t i) { return items[i].w->panel(items[i].p); });
    else layer_path();
  });
  return 0;
}

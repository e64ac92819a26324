// ep_moe_qkernel_bench: the block-format kernels (Kernels::qgemm) alone, on
// every ISA table this CPU runs, so that the expert path's quantized figures
// (ep_moe_bench --dtype) can be read against what the kernels themselves
// reach: weight rows of k elements through the calls FfnRunner makes (one
// panel of nr rows a call, the next panel given for the prefetch), m
// activation rows a call, one thread each, over
//   cache   a few panels that stay in L2 (the arithmetic alone);
//   stream  a buffer far larger than the caches (the arithmetic while the
//           blocks come from memory), next to
//   read    a plain read of the same buffer by the same threads, in the
//           same moments: stream / read is the share of the read rate the
//           kernel keeps;
//   tile    where the table has int8 tiles (Kernels::qtile), the in-cache
//           calls that way: each panel unpacked, then the tile over the
//           rows as quantized (FfnRunner's path at and above
//           Kernels::qtile_rows rows).
// The variants alternate in short blocks (this VM's bandwidth moves within
// seconds); each figure is the best block. Every table's results are
// checked against the portable kernels' before anything is timed.
// Uses the library's internals, not its C API.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "common/quant.hpp"
#include "cpu/aligned.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "machine_peaks.hpp"
#include "presets.hpp"

using namespace ep_moe;
using Clock = std::chrono::steady_clock;

namespace {

struct Weights {
  int k = 0, nr = 0;
  size_t row_bytes = 0, panel_bytes = 0, panels = 0;
  AlignedBuffer bytes;  // 64-byte aligned, as the layer's weights (and sum_words) want
  const uint8_t* panel(size_t p) const { return bytes.data<uint8_t>() + (p % panels) * panel_bytes; }
};

// `panels` panels of nr rows: 64 rows quantized from normal floats by
// ep_moe's quantizers, repeated (the kernels' time does not depend on the
// values).
Weights make_weights(ep_moe_dtype_t dt, int k, int nr, size_t panels, std::mt19937& rng) {
  Weights w;
  w.k = k;
  w.nr = nr;
  w.row_bytes = quant_row_bytes(dt, k);
  w.panel_bytes = w.row_bytes * static_cast<size_t>(nr);
  w.panels = panels;
  w.bytes.resize(w.panel_bytes * panels);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(k));
  constexpr size_t kDistinct = 64;
  for (size_t r = 0; r < std::min(kDistinct, panels * static_cast<size_t>(nr)); ++r) {
    for (float& v : x) v = nd(rng);
    quantize_row(dt, x.data(), w.bytes.data<uint8_t>() + r * w.row_bytes, k);
  }
  for (size_t off = kDistinct * w.row_bytes; off < w.bytes.size(); off += kDistinct * w.row_bytes)
    std::memcpy(w.bytes.data<uint8_t>() + off, w.bytes.data<uint8_t>(),
                std::min(kDistinct * w.row_bytes, w.bytes.size() - off));
  return w;
}

// w's panels with their rows interleaved in groups of il (pack.hpp's
// PackedWeight::il): the layout a table's kernels read when its
// il_of the format is il.
Weights interleaved(ep_moe_dtype_t dt, const Weights& w, int il) {
  Weights o;
  o.k = w.k;
  o.nr = w.nr;
  o.row_bytes = w.row_bytes;
  o.panel_bytes = w.panel_bytes;
  o.panels = w.panels;
  o.bytes.resize(w.bytes.size());
  for (size_t p = 0; p < w.panels; ++p)
    for (int j = 0; j < w.nr; ++j)
      cpu::group_put(dt, il,
                     o.bytes.data<uint8_t>() + p * w.panel_bytes + static_cast<size_t>(j / il * il) * w.row_bytes,
                     j % il, w.panel(p) + static_cast<size_t>(j) * w.row_bytes, w.k);
  return o;
}

// m activation rows quantized as the weight's format wants them.
struct Acts {
  std::vector<std::vector<uint8_t>> rows;
  std::vector<const void*> ptrs;
};
Acts make_acts(ep_moe_dtype_t dt, int k, int m, std::mt19937& rng) {
  Acts a;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(k));
  for (int i = 0; i < m; ++i) {
    for (float& v : x) v = nd(rng);
    a.rows.emplace_back(act_row_bytes(k));
    quantize_act_row(x.data(), k, act_quant_of(dt), a.rows.back().data());
  }
  for (auto& r : a.rows) a.ptrs.push_back(r.data());
  return a;
}

// Panels [p0, p1) of w unpacked into `tiles`, each through the int8 tile
// with the rows of a; the outputs' sum.
float run_tiled(const cpu::Kernels& kern, ep_moe_dtype_t dt, const Weights& w, const Acts& a, size_t p0, size_t p1,
                float* c, void* tiles) {
  const int m = static_cast<int>(a.ptrs.size());
  float s = 0;
  for (size_t p = p0; p < p1; ++p) {
    kern.qunpack[quant_index(dt)](w.panel(p), w.k, tiles);
    kern.qtile[quant_index(dt)](m, a.ptrs.data(), w.k, tiles, c, w.nr, p + 1 < p1 ? w.panel(p + 1) : nullptr);
    s += c[0];
  }
  return s;
}

// Panels [p0, p1) of w through fn, m rows a call; the outputs' sum (kept
// so the calls are not dropped).
float run_panels(cpu::QGemmFn fn, const Weights& w, const Acts& a, size_t p0, size_t p1, float* c) {
  const int m = static_cast<int>(a.ptrs.size());
  float s = 0;
  for (size_t p = p0; p < p1; ++p) {
    fn(m, a.ptrs.data(), w.k, w.panel(p), w.nr, c, w.nr, p + 1 < p1 ? w.panel(p + 1) : nullptr);
    s += c[0];
  }
  return s;
}

// Seconds of fn(t) on `threads` threads at once (the slowest thread's).
template <class F>
double timed(int threads, F&& fn) {
  std::vector<double> sec(static_cast<size_t>(threads));
  std::vector<std::thread> ts;
  std::atomic<int> ready{0};
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      const auto t0 = Clock::now();
      fn(t);
      sec[static_cast<size_t>(t)] = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  for (auto& th : ts) th.join();
  return *std::max_element(sec.begin(), sec.end());
}

// The largest difference between two tables' results over the first
// panels, relative to the largest result (w and wref: the same panels in
// each table's layout).
double check(cpu::QGemmFn fn, cpu::QGemmFn ref, const Weights& w, const Weights& wref, const Acts& a) {
  const int m = static_cast<int>(a.ptrs.size());
  std::vector<float> c1(static_cast<size_t>(m * w.nr)), c2(c1.size());
  double diff = 0, top = 0;
  for (size_t p = 0; p < std::min<size_t>(w.panels, 8); ++p) {
    fn(m, a.ptrs.data(), w.k, w.panel(p), w.nr, c1.data(), w.nr, nullptr);
    ref(m, a.ptrs.data(), w.k, wref.panel(p), w.nr, c2.data(), w.nr, nullptr);
    for (size_t i = 0; i < c1.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(c1[i] - c2[i])));
      top = std::max(top, static_cast<double>(std::fabs(c2[i])));
    }
  }
  return top > 0 ? diff / top : diff;
}

struct Figures {
  double cache = 0, stream = 0, read = 0, tile = 0;  // weights a second; read: bytes a second
  double tile_err = 0;                               // the tiles against the block kernel (relative)
};

// The int8 tiles' results (panels unpacked into `buf`) against the block
// kernel's, over the first panels (the largest difference over the
// largest result).
double check_tiles(const cpu::Kernels& kern, ep_moe_dtype_t dt, const Weights& w, const Acts& a, void* buf) {
  const int m = static_cast<int>(a.ptrs.size());
  std::vector<float> c1(static_cast<size_t>(m * w.nr)), c2(c1.size());
  double diff = 0, top = 0;
  for (size_t p = 0; p < std::min<size_t>(w.panels, 4); ++p) {
    run_tiled(kern, dt, w, a, p, p + 1, c1.data(), buf);
    kern.qgemm[quant_index(dt)](m, a.ptrs.data(), w.k, w.panel(p), w.nr, c2.data(), w.nr, nullptr);
    for (size_t i = 0; i < c1.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(c1[i] - c2[i])));
      top = std::max(top, static_cast<double>(std::fabs(c2[i])));
    }
  }
  return top > 0 ? diff / top : diff;
}

// The best of `blocks` alternated blocks of each pass (header comment).
Figures measure(const cpu::Kernels& kern, ep_moe_dtype_t dt, const Weights& wc, const Weights& ws, const Acts& a,
                int threads, int blocks, double block_s) {
  const cpu::QGemmFn fn = kern.qgemm[quant_index(dt)];
  const int nr = kern.nr, k = wc.k;
  const bool tiles = kern.qtile[quant_index(dt)] != nullptr;
  std::vector<std::vector<float>> c(static_cast<size_t>(threads), std::vector<float>(static_cast<size_t>(64 * nr)));
  std::vector<AlignedBuffer> unpacked(static_cast<size_t>(threads));
  for (auto& b : unpacked) b.resize(tiles ? cpu::qtile_panel_bytes(dt, k, nr) : 0);
  Figures f;
  if (tiles) f.tile_err = check_tiles(kern, dt, wc, a, unpacked[0].data<char>());
  std::vector<double> done(static_cast<size_t>(threads));
  std::atomic<float> sink{0};
  const size_t share = ws.panels / static_cast<size_t>(threads);
  // In cache: each thread its own passes over the small set, through the
  // block kernel (path 0) or the tiles (1).
  const auto in_cache = [&](int path) {
    const double dc = timed(threads, [&](int t) {
      float s = 0;
      const auto t0 = Clock::now();
      double n = 0;
      float* ct = c[static_cast<size_t>(t)].data();
      while (std::chrono::duration<double>(Clock::now() - t0).count() < block_s) {
        s += path == 1 ? run_tiled(kern, dt, wc, a, 0, wc.panels, ct, unpacked[static_cast<size_t>(t)].data<char>())
                       : run_panels(fn, wc, a, 0, wc.panels, ct);
        n += static_cast<double>(wc.panels);
      }
      sink.store(s);
      done[static_cast<size_t>(t)] = n;
    });
    double panels_done = 0;
    for (double n : done) panels_done += n;
    return panels_done * nr * k / dc;
  };
  for (int b = 0; b < blocks; ++b) {
    f.cache = std::max(f.cache, in_cache(0));
    if (tiles) f.tile = std::max(f.tile, in_cache(1));
    // Streamed, then a plain read of the same share.
    const double dstream = timed(threads, [&](int t) {
      const size_t p0 = share * static_cast<size_t>(t);
      sink.store(run_panels(fn, ws, a, p0, p0 + share, c[static_cast<size_t>(t)].data()));
    });
    f.stream = std::max(f.stream, static_cast<double>(share * static_cast<size_t>(threads)) * nr * k / dstream);
    const double dread = timed(threads, [&](int t) {
      const size_t p0 = share * static_cast<size_t>(t);
      // sum_words wants 32-byte aligned words: the share from the line it starts in.
      const size_t off = p0 * ws.panel_bytes / 64 * 64;
      sink.store(static_cast<float>(
          bench::sum_words(reinterpret_cast<const uint64_t*>(ws.panel(0) + off), share * ws.panel_bytes / 64 * 8)));
    });
    f.read = std::max(f.read, static_cast<double>(share * static_cast<size_t>(threads) * ws.panel_bytes) / dread);
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<ep_moe_dtype_t> dtypes = {EP_MOE_DTYPE_Q4_K, EP_MOE_DTYPE_Q8_0};
  std::vector<int> rows = {1, 8, 32};
  int k = 2048, threads = 1, blocks = 6, cache_kib = 256, stream_mb = 256;
  double block_s = 0.1;
  cli::Parser args("ep_moe_qkernel_bench [options]",
                   "The block-format kernels alone, per ISA table: in cache, streamed from memory, and a plain read "
                   "of the same bytes in the same moments.");
  args.custom("--dtype", "D,D", "block formats (default q4_k,q8_0; any of ep_moe_dtype_name's block formats)",
              [&dtypes](const std::string& v, std::string* err) {
                dtypes.clear();
                for (const auto& d : cli::split(v)) {
                  ep_moe_dtype_t t;
                  if (!presets::parse_dtype(d, &t, true) || !dtype_is_quant(t)) {
                    *err = "not a block format: " + d;
                    return false;
                  }
                  dtypes.push_back(t);
                }
                return !dtypes.empty();
              })
      .list("--rows", &rows, "activation rows per call (default 1,8,32)", 1, 64)
      .option("--k", &k, "elements per weight row, a multiple of 256 (default 2048)", 256, 1 << 20)
      .option("--threads", &threads, "threads, each on its own share (default 1)", 1, 1024)
      .option("--blocks", &blocks, "alternated blocks per figure (default 6)", 1, 1 << 20)
      .option("--block-seconds", &block_s, "seconds per block (default 0.1)", 1e-6, 3600)
      .option("--cache-kib", &cache_kib, "weights of the in-cache pass per thread, KiB (default 256)", 1, 1 << 20)
      .option("--stream-mb", &stream_mb, "weights of the streamed pass, MiB (default 256)", 1, 1 << 20);
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (k % 256 != 0) {
    std::fprintf(stderr, "--k must be a multiple of 256\n");
    return 2;
  }
  const cpu::Isa top = cpu::detect_isa();
  const cpu::Kernels& generic = cpu::kernels_for(cpu::Isa::Generic);
  std::printf("threads %d, k %d, this CPU's best table: %s, its block kernels: %s\n", threads, k, cpu::isa_name(top),
              cpu::kernels_for(top).qname);
  // The multiply's own rate, per thread, in the GMAC/s columns' unit.
  const double vnni = bench::int8_dot_peak_gops(threads, 1.0), mdb = bench::int8_maddubs_peak_gops(threads, 1.0);
  if (vnni > 0) std::printf("peak (avx512vnni vpdpbusd): %.1f GMAC/s a thread\n", vnni / 2 / threads);
  if (mdb > 0) std::printf("peak (avx2 vpmaddubsw): %.1f GMAC/s a thread\n", mdb / 2 / threads);
  std::printf("%-8s %-8s %5s %11s %11s %9s %11s %9s %7s %11s %6s\n", "isa", "dtype", "rows", "cache Gw/s", "GMAC/s",
              "strm GB/s", "stream Gw/s", "read GB/s", "strm/rd", "tile GMAC/s", "t/c");
  // Every table this CPU runs, and beside the AVX2 table its 8-row
  // kernels through the other multiply-add this CPU has: maddubs where the
  // table takes AVX-VNNI ("avx2-mdb"), and on an AVX512_VNNI CPU the
  // AVX-VNNI kernels' arithmetic through the 256-bit EVEX vpdpbusd
  // ("vnni256e", an estimate of what AVX-VNNI would give).
  struct Table {
    std::string name;
    cpu::Kernels kern;
  };
  std::vector<Table> tables;
  for (int i = 0; i <= static_cast<int>(top); ++i) {
    const auto isa = static_cast<cpu::Isa>(i);
    const cpu::Kernels& kern = cpu::kernels_for(isa);
    tables.push_back({isa == cpu::Isa::Avx2 && cpu::has_avx_vnni() ? "avx2vnni" : cpu::isa_name(isa), kern});
    if (isa != cpu::Isa::Avx2) continue;
    if (cpu::has_avx_vnni()) {
      tables.push_back({"avx2-mdb", kern});
      cpu::qgroups_avx2(tables.back().kern.qgemm);
    }
    if (cpu::has_avx512_vnni()) {
      tables.push_back({"vnni256e", kern});
      cpu::qgroups8_vnni_evex(tables.back().kern.qgemm);
    }
  }
  std::mt19937 rng(20261204);
  int failures = 0;
  for (ep_moe_dtype_t dt : dtypes) {
    for (const Table& table : tables) {
      const cpu::Kernels& kern = table.kern;
      const char* name = table.name.c_str();
      const cpu::QGemmFn fn = kern.qgemm[quant_index(dt)];
      if (!fn) continue;
      const int nr = kern.nr;
      const size_t row_bytes = quant_row_bytes(dt, k);
      const size_t cache_panels =
          std::max<size_t>(2, static_cast<size_t>(cache_kib) * 1024 / (row_bytes * static_cast<size_t>(nr)));
      const size_t stream_panels =
          std::max<size_t>(2, (static_cast<size_t>(stream_mb) << 20) / (row_bytes * static_cast<size_t>(nr)));
      // Rows one after another (the portable kernel's layout), and as this table's kernels read them.
      const Weights wplain = make_weights(dt, k, nr, cache_panels, rng);
      const Weights splain = make_weights(dt, k, nr, stream_panels, rng);
      const int il = kern.il_of(dt);
      const Weights wil = il ? interleaved(dt, wplain, il) : Weights{},
                    sil = il ? interleaved(dt, splain, il) : Weights{};
      const Weights& wc = il ? wil : wplain;
      const Weights& ws = il ? sil : splain;
      for (int m : rows) {
        const Acts a = make_acts(dt, k, m, rng);
        const double err = check(fn, generic.qgemm[quant_index(dt)], wc, wplain, a);
        if (err > 1e-5) {
          std::printf("%-8s %-8s %5d FAILED: differs from the portable kernel by %.3g of the largest result\n", name,
                      presets::dtype_name(dt), m, err);
          ++failures;
          continue;
        }
        const Figures f = measure(kern, dt, wc, ws, a, threads, blocks, block_s);
        if (f.tile_err > 1e-5) {
          std::printf("%-8s %-8s %5d FAILED: the int8 tile differs from the block kernel by %.3g\n", name,
                      presets::dtype_name(dt), m, f.tile_err);
          ++failures;
          continue;
        }
        const double bytes_per_w = static_cast<double>(row_bytes) / k;
        std::printf("%-8s %-8s %5d %11.2f %11.1f %9.2f %11.2f %9.2f %6.0f%% ", name, presets::dtype_name(dt), m,
                    f.cache / 1e9, f.cache * m / 1e9, f.stream * bytes_per_w / 1e9, f.stream / 1e9, f.read / 1e9,
                    100.0 * f.stream * bytes_per_w / f.read);
        if (f.tile > 0) std::printf("%11.1f %5.2fx\n", f.tile * m / 1e9, f.tile / f.cache);
        else std::printf("%11s %6s\n", "-", "-");
      }
    }
  }
  std::printf(
      "(Gw/s: G weight elements a second, each against every row of the call; GMAC/s = Gw/s x rows;\n"
      " strm/rd: the streamed pass's bytes a second over the plain read's, in the same blocks;\n"
      " tile: in cache through unpacked panels and the int8 tiles; t/c: its rate over the block kernel's)\n");
  return failures ? 1 : 0;
}

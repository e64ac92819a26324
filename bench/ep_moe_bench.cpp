// ep_moe_bench: the CPU expert path of one EP rank, for model presets, a
// token sweep and both strategies for non-local pairs (skip vs the seed's
// weight-0), reported against this machine's own measured peaks.
//
// One rank of an EP group is simulated exactly: its expert map says which
// experts it holds, the layer runs without a communicator (partial-sum
// mode), so the time is this rank's routing + expert work + combine.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "machine_peaks.hpp"
#include "presets.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::string> presets = {"qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"};
  std::vector<int> tokens = {1, 8, 64, 512};
  std::vector<int> strategies = {EP_MOE_SKIP_TOKENS, EP_MOE_SKIP_WEIGHT_ZERO};
  int threads = 0;  // 0: all hardware threads
  int ep = 0;       // 0: the preset's default
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_BF16;
  double min_time = 0.5, peak_time = 1.0;
  int bw_mb = 1024;
  std::string json;
};

void usage() {
  std::printf(
      "usage: ep_moe_bench [options]\n"
      "  --preset a,b,...    models (qwen3-30b-a3b, qwen2-57b-a14b, deepseek-v3, mixtral-8x7b)\n"
      "  --tokens 1,8,...    token counts per forward (default 1,8,64,512)\n"
      "  --strategy s,...    skip and/or weight0 (default both)\n"
      "  --ep N              EP size to simulate (default: the preset's)\n"
      "  --threads N         threads of the rank (default: all hardware threads)\n"
      "  --dtype D           f32, bf16 (default) or f16 weights and activations\n"
      "  --min-time S        seconds per measurement (default 0.5)\n"
      "  --peak-time S       seconds per peak measurement (default 1.0)\n"
      "  --bw-mb M           buffer for the bandwidth peak (default 1024)\n"
      "  --json PATH         also write the results as JSON\n");
}

const char* dtype_name(ep_moe_dtype_t d) { return d == EP_MOE_DTYPE_F32 ? "f32" : d == EP_MOE_DTYPE_BF16 ? "bf16" : "f16"; }

struct Row {
  std::string preset, strategy;
  int ep = 0, tokens = 0, threads = 0, iters = 0;
  double ms = 0, tokens_per_s = 0, gflops = 0, gflops_frac = 0, weight_gbs = 0, weight_frac = 0;
  std::string peak_kind;
  int64_t local_pairs = 0, active_experts = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--preset") o.presets = presets::split(next());
    else if (a == "--tokens") {
      o.tokens.clear();
      for (const auto& t : presets::split(next())) o.tokens.push_back(std::atoi(t.c_str()));
    } else if (a == "--strategy") {
      o.strategies.clear();
      for (const auto& s : presets::split(next())) {
        if (s == "skip") o.strategies.push_back(EP_MOE_SKIP_TOKENS);
        else if (s == "weight0") o.strategies.push_back(EP_MOE_SKIP_WEIGHT_ZERO);
        else {
          std::fprintf(stderr, "unknown strategy %s\n", s.c_str());
          return 2;
        }
      }
    } else if (a == "--ep") o.ep = std::atoi(next().c_str());
    else if (a == "--threads") o.threads = std::atoi(next().c_str());
    else if (a == "--dtype") {
      if (!presets::parse_dtype(next(), &o.dtype)) return 2;
    } else if (a == "--min-time") o.min_time = std::atof(next().c_str());
    else if (a == "--peak-time") o.peak_time = std::atof(next().c_str());
    else if (a == "--bw-mb") o.bw_mb = std::atoi(next().c_str());
    else if (a == "--json") o.json = next();
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int t : o.tokens)
    if (t < 1) {
      std::fprintf(stderr, "token counts must be >= 1\n");
      return 2;
    }

  const char* fma_isa = "";
  std::printf("measuring this machine's peaks with %d thread(s)...\n", threads);
  const double peak = bench::fma_peak_gflops(threads, o.peak_time, &fma_isa);
  const double dot_peak = bench::bf16_dot_peak_gflops(threads, o.peak_time);
  const double bw = bench::read_bandwidth_gbs(threads, o.peak_time, o.bw_mb);
  if (dot_peak > 0) std::printf("bf16 dot-product peak (avx512bf16): %.1f GFLOP/s\n", dot_peak);
  std::printf("f32 FMA peak (%s): %.1f GFLOP/s   read bandwidth (%d MiB buffer): %.1f GB/s\n", fma_isa, peak,
              o.bw_mb, bw);
  std::printf("%%peak is against the bf16 dot-product peak for bf16 weights and activations on the bf16 kernels, "
              "else the f32 FMA peak\n\n");
  std::printf("%-14s %4s %6s %-7s %9s %11s %9s %6s %9s %6s %7s %6s\n", "preset", "ep", "tokens", "strat", "ms",
              "tokens/s", "GFLOP/s", "%peak", "wGB/s", "%bw", "pairs", "active");

  std::vector<Row> rows;
  int max_tokens = *std::max_element(o.tokens.begin(), o.tokens.end());
  for (const auto& name : o.presets) {
    const presets::Model* m = presets::find(name);
    if (!m) {
      std::fprintf(stderr, "unknown preset %s\n", name.c_str());
      return 2;
    }
    const int ep = o.ep > 0 ? o.ep : m->default_ep;
    const int shared = m->shared_intermediate;
    for (int strategy : o.strategies) {
      if (strategy == EP_MOE_SKIP_WEIGHT_ZERO && ep == 1) continue;  // nothing is non-local
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      mc.ep_size = ep;
      mc.ep_rank = 0;
      mc.global_num_experts = m->experts;
      ep_moe_expert_map_t* map = nullptr;
      if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) {
        std::fprintf(stderr, "map: %s\n", ep_moe_last_error());
        return 1;
      }
      ep_moe_layer_config_t lc = presets::layer_config(*m, shared, o.dtype, o.dtype, max_tokens, threads);
      lc.skip_mode = strategy;
      ep_moe_layer_t* layer = nullptr;
      if (ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) != EP_MOE_OK) {
        std::fprintf(stderr, "layer: %s\n", ep_moe_last_error());
        return 1;
      }
      const std::string err = presets::load_random_weights(layer, map, *m, shared, 1);
      ep_moe_expert_map_destroy(map);
      if (!err.empty()) {
        std::fprintf(stderr, "weights: %s\n", err.c_str());
        return 1;
      }
      int64_t weight_bytes = 0, n_local = 0, shard = 0, isa = 0;
      ep_moe_layer_get_attr(&isa, layer, EP_MOE_LAYER_ATTR_CPU_ISA);
      // The bf16 kernels run bf16 weights with bf16 activations on pair dot
      // products: their peak is the dot-product peak.
      const bool dot = isa == 3 && o.dtype == EP_MOE_DTYPE_BF16 && dot_peak > 0;
      const double row_peak = dot ? dot_peak : peak;
      ep_moe_layer_get_attr(&weight_bytes, layer, EP_MOE_LAYER_ATTR_WEIGHT_BYTES);
      ep_moe_layer_get_attr(&n_local, layer, EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS);
      ep_moe_layer_get_attr(&shard, layer, EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE);
      const double expert_bytes =
          3.0 * m->hidden * m->intermediate * (o.dtype == EP_MOE_DTYPE_F32 ? 4.0 : 2.0);
      const double shared_bytes = 3.0 * m->hidden * static_cast<double>(shard) * (o.dtype == EP_MOE_DTYPE_F32 ? 4.0 : 2.0);

      for (int T : o.tokens) {
        // Several different batches, cycled, so decode rows touch different
        // experts each call and the cache cannot keep the same weights hot.
        const int sets = 16;
        std::vector<std::vector<uint8_t>> hiddens;
        std::vector<std::vector<float>> logits_sets;
        for (int k = 0; k < sets; ++k) {
          std::vector<float> hid(static_cast<size_t>(T) * m->hidden), lg(static_cast<size_t>(T) * m->experts);
          presets::fill(hid, hid.size(), 11 + static_cast<uint64_t>(k), static_cast<uint64_t>(T), 1.0f);
          presets::fill(lg, lg.size(), 1000 + static_cast<uint64_t>(k), static_cast<uint64_t>(T), 3.0f);
          hiddens.push_back(presets::encode(hid, o.dtype));
          logits_sets.push_back(std::move(lg));
        }
        std::vector<uint8_t> out(hiddens[0].size());
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = T;
        a.out = out.data();
        int64_t pairs_sum = 0, active_sum = 0;
        std::vector<double> times;
        const auto start = Clock::now();
        for (int it = 0;; ++it) {
          a.hidden = hiddens[static_cast<size_t>(it % sets)].data();
          a.router_logits = logits_sets[static_cast<size_t>(it % sets)].data();
          const auto t0 = Clock::now();
          if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
            std::fprintf(stderr, "forward: %s\n", ep_moe_layer_last_error(layer));
            return 1;
          }
          const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
          if (it > 0 || o.min_time <= 0) {  // the first call warms up
            times.push_back(dt);
            int64_t v = 0;
            ep_moe_layer_get_attr(&v, layer, EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS);
            pairs_sum += v;
            ep_moe_layer_get_attr(&v, layer, EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS);
            active_sum += v;
          }
          const double total = std::chrono::duration<double>(Clock::now() - start).count();
          if (times.size() >= 3 && total >= o.min_time) break;
          if (!times.empty() && total >= 10 * o.min_time) break;  // very slow rows: a few samples
        }
        // Work varies a little between batches: use mean work over mean time.
        double t = 0;
        for (double x : times) t += x;
        t /= static_cast<double>(times.size());
        Row r;
        r.preset = name;
        r.strategy = strategy == EP_MOE_SKIP_TOKENS ? "skip" : "weight0";
        r.ep = ep;
        r.tokens = T;
        r.threads = threads;
        r.iters = static_cast<int>(times.size());
        const double n_samples = static_cast<double>(times.size());
        r.local_pairs = static_cast<int64_t>(std::llround(static_cast<double>(pairs_sum) / n_samples));
        r.active_experts = static_cast<int64_t>(std::llround(static_cast<double>(active_sum) / n_samples));
        const double mean_pairs = static_cast<double>(pairs_sum) / n_samples;
        const double mean_active = static_cast<double>(active_sum) / n_samples;
        const double flops = 6.0 * m->hidden * (mean_pairs * m->intermediate +
                                                static_cast<double>(T) * static_cast<double>(shard));
        r.ms = t * 1e3;
        r.tokens_per_s = T / t;
        r.gflops = flops / t / 1e9;
        r.gflops_frac = r.gflops / row_peak;
        r.peak_kind = dot ? "bf16dot" : "f32fma";
        r.weight_gbs = (mean_active * expert_bytes + shared_bytes) / t / 1e9;
        r.weight_frac = r.weight_gbs / bw;
        std::printf("%-14s %4d %6d %-7s %9.3f %11.1f %9.1f %5.1f%% %9.1f %5.1f%% %7lld %6lld\n", name.c_str(), ep, T,
                    r.strategy.c_str(), r.ms, r.tokens_per_s, r.gflops, 100 * r.gflops_frac, r.weight_gbs,
                    100 * r.weight_frac, static_cast<long long>(r.local_pairs),
                    static_cast<long long>(r.active_experts));
        std::fflush(stdout);
        rows.push_back(r);
      }
      ep_moe_layer_destroy(layer);
      (void)weight_bytes;
      (void)n_local;
    }
  }
  // The same-run ratio the issue asks for: skip vs weight-0 expert time.
  std::printf("\n");
  for (const auto& r : rows) {
    if (r.strategy != "skip") continue;
    for (const auto& w : rows)
      if (w.strategy == "weight0" && w.preset == r.preset && w.tokens == r.tokens && w.ep == r.ep)
        std::printf("%-14s T=%-5d weight-0 / skip time: %.2fx\n", r.preset.c_str(), r.tokens, w.ms / r.ms);
  }

  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::fprintf(f, "{\n  \"ep_moe_version\": \"%s\",\n  \"dtype\": \"%s\",\n", ep_moe_version_string(),
                 dtype_name(o.dtype));
    std::fprintf(f, "  \"machine\": {\"threads\": %d, \"fma_isa\": \"%s\", \"fma_peak_gflops\": %.3f, "
                    "\"bf16_dot_peak_gflops\": %.3f, \"read_bandwidth_gbs\": %.3f},\n  \"results\": [\n",
                 threads, fma_isa, peak, dot_peak, bw);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "    {\"preset\": \"%s\", \"ep\": %d, \"tokens\": %d, \"strategy\": \"%s\", \"threads\": %d, "
                   "\"iters\": %d, \"ms\": %.6f, \"tokens_per_s\": %.3f, \"gflops\": %.3f, \"gflops_frac_peak\": "
                   "%.5f, \"peak\": \"%s\", \"weight_gbs\": %.3f, \"weight_frac_bw\": %.5f, \"local_pairs\": %lld, "
                   "\"active_experts\": %lld}%s\n",
                   r.preset.c_str(), r.ep, r.tokens, r.strategy.c_str(), r.threads, r.iters, r.ms, r.tokens_per_s,
                   r.gflops, r.gflops_frac, r.peak_kind.c_str(), r.weight_gbs, r.weight_frac, static_cast<long long>(r.local_pairs),
                   static_cast<long long>(r.active_experts), i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
    std::printf("\nwrote %s\n", o.json.c_str());
  }
  return 0;
}

// ep_moe_demo: runs one MoE layer of a real model's shape on random weights
// across in-process expert-parallel ranks, checks the result against the
// same layer on a single rank, and reports tokens/s. Public API only.
//
//   ep_moe_demo [--model NAME] [--ep N] [--tokens T] [--dtype f32|bf16|f16]
//               [--shared I] [--iters N] [--placement linear|round_robin]
//               [--plan] [--list]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "presets.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "qwen3-30b-a3b";
  int ep = 4, tokens = 64, iters = 3, shared = -1, redundant = 0;
  int hidden = 0, inter = 0, experts = 0, top_k = 0;  // overrides of the model's sizes
  int placement = EP_MOE_PLACEMENT_LINEAR;
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_BF16;
  bool plan = false;
};

void usage() {
  std::printf(
      "usage: ep_moe_demo [options]\n"
      "  --model NAME        model shape (--list shows them; default qwen3-30b-a3b)\n"
      "  --ep N              in-process expert-parallel ranks (default 4)\n"
      "  --tokens T          tokens per forward (default 64)\n"
      "  --dtype D           weights and activations: f32, bf16 (default) or f16\n"
      "  --shared I          shared-expert intermediate size (0 = none; default: the model's)\n"
      "  --hidden H, --inter I, --experts E, --topk K   override the model's sizes\n"
      "  --iters N           timed forward calls (default 3)\n"
      "  --placement P       linear (default) or round_robin\n"
      "  --plan              only print which experts each rank owns\n"
      "  --list              list the model shapes\n");
}

bool ok(ep_moe_status_t s, const char* what, const char* detail = nullptr) {
  if (s == EP_MOE_OK) return true;
  std::fprintf(stderr, "%s failed: %s: %s\n", what, ep_moe_status_string(s), detail ? detail : ep_moe_last_error());
  return false;
}

void log_to_stderr(ep_moe_log_level_t level, const char* msg, void*) {
  static const char* names[] = {"error", "warn", "info", "debug"};
  std::fprintf(stderr, "[ep_moe %s] %s\n", names[level], msg);
}

ep_moe_expert_map_t* make_map(const presets::Model& m, const Options& o, int ep, int rank) {
  ep_moe_expert_map_config_t c;
  ep_moe_expert_map_config_init(&c);
  c.ep_size = ep;
  c.ep_rank = rank;
  c.global_num_experts = m.experts;
  c.placement = o.placement;
  c.num_expert_group = m.groups;
  c.num_redundant_experts = o.redundant;
  ep_moe_expert_map_t* map = nullptr;
  return ok(ep_moe_expert_map_create(&map, &c), "ep_moe_expert_map_create") ? map : nullptr;
}

int print_plan(const presets::Model& m, const Options& o) {
  std::printf("%-5s %-8s %s\n", "rank", "experts", "local->global");
  for (int r = 0; r < o.ep; ++r) {
    ep_moe_expert_map_t* map = make_map(m, o, o.ep, r);
    if (!map) return 1;
    int32_t n = 0;
    ep_moe_expert_map_get_attr(&n, map, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED);
    size_t need = 0;
    ep_moe_expert_map_describe(nullptr, 0, &need, map);
    std::string text(need + 1, '\0');
    ep_moe_expert_map_describe(&text[0], text.size(), nullptr, map);
    text.resize(need);
    if (text.size() > 90) text = text.substr(0, 87) + "...";
    std::printf("%-5d %-8d %s\n", r, n, text.c_str());
    ep_moe_expert_map_destroy(map);
  }
  return 0;
}

struct Run {
  std::vector<std::vector<uint8_t>> outs;  // per rank
  double seconds = 0;                       // median forward time
  double load_seconds = 0;
  std::string error;
};

// Runs the layer on `ep` in-process ranks: each rank loads its experts, then
// `iters` timed forward calls on the same tokens.
Run run(const presets::Model& m, const Options& o, int ep, int shared, const std::vector<uint8_t>& hidden,
        const std::vector<float>& logits) {
  Run res;
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ep));
  if (!ok(ep_moe_comm_create_local(comms.data(), ep, nullptr), "ep_moe_comm_create_local")) {
    res.error = "comm";
    return res;
  }
  res.outs.resize(static_cast<size_t>(ep));
  std::vector<std::string> errors(static_cast<size_t>(ep));
  std::vector<double> times;
  const auto t_load = Clock::now();
  std::vector<double> load_done(static_cast<size_t>(ep), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      std::string& err = errors[static_cast<size_t>(r)];
      ep_moe_expert_map_t* map = make_map(m, o, ep, r);
      if (!map) {
        err = "map";
        ep_moe_comm_abort(comms[static_cast<size_t>(r)]);
        return;
      }
      const ep_moe_layer_config_t lc = presets::layer_config(m, shared, o.dtype, o.dtype, o.tokens, 0);
      ep_moe_layer_t* layer = nullptr;
      if (ep_moe_layer_create(&layer, &lc, map, comms[static_cast<size_t>(r)], nullptr) != EP_MOE_OK) {
        err = ep_moe_last_error();
      } else {
        err = presets::load_random_weights(layer, map, m, shared, 2026);
      }
      ep_moe_expert_map_destroy(map);
      if (!err.empty()) {
        ep_moe_comm_abort(comms[static_cast<size_t>(r)]);  // the others must not wait for us
        ep_moe_layer_destroy(layer);
        return;
      }
      load_done[static_cast<size_t>(r)] = std::chrono::duration<double>(Clock::now() - t_load).count();
      auto& out = res.outs[static_cast<size_t>(r)];
      out.assign(hidden.size(), 0);
      ep_moe_forward_args_t a;
      ep_moe_forward_args_init(&a);
      a.num_tokens = o.tokens;
      a.hidden = hidden.data();
      a.router_logits = logits.data();
      a.out = out.data();
      for (int it = 0; it <= o.iters; ++it) {  // the first call warms up
        if (ep_moe_comm_barrier(comms[static_cast<size_t>(r)]) != EP_MOE_OK) {
          err = ep_moe_comm_last_error(comms[static_cast<size_t>(r)]);
          break;
        }
        const auto t0 = Clock::now();
        if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
          err = ep_moe_layer_last_error(layer);
          break;
        }
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        if (r == 0 && it > 0) times.push_back(dt);
      }
      ep_moe_layer_destroy(layer);
    });
  }
  for (auto& t : threads) t.join();
  for (auto* c : comms) ep_moe_comm_destroy(c);
  for (int r = 0; r < ep; ++r)
    if (!errors[static_cast<size_t>(r)].empty()) {
      res.error = "rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)];
      return res;
    }
  std::sort(times.begin(), times.end());
  res.seconds = times.empty() ? 0 : times[times.size() / 2];
  res.load_seconds = *std::max_element(load_done.begin(), load_done.end());
  return res;
}

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
    if (a == "--model") o.model = next();
    else if (a == "--ep") o.ep = std::atoi(next().c_str());
    else if (a == "--tokens") o.tokens = std::atoi(next().c_str());
    else if (a == "--iters") o.iters = std::atoi(next().c_str());
    else if (a == "--shared") o.shared = std::atoi(next().c_str());
    else if (a == "--redundant") o.redundant = std::atoi(next().c_str());
    else if (a == "--hidden") o.hidden = std::atoi(next().c_str());
    else if (a == "--inter") o.inter = std::atoi(next().c_str());
    else if (a == "--experts") o.experts = std::atoi(next().c_str());
    else if (a == "--topk") o.top_k = std::atoi(next().c_str());
    else if (a == "--dtype") {
      if (!presets::parse_dtype(next(), &o.dtype)) {
        std::fprintf(stderr, "--dtype takes f32, bf16 or f16\n");
        return 2;
      }
    } else if (a == "--placement") {
      const std::string p = next();
      if (p == "linear") o.placement = EP_MOE_PLACEMENT_LINEAR;
      else if (p == "round_robin") o.placement = EP_MOE_PLACEMENT_ROUND_ROBIN;
      else {
        std::fprintf(stderr, "unknown placement %s\n", p.c_str());
        return 2;
      }
    } else if (a == "--plan") o.plan = true;
    else if (a == "--list") {
      for (const auto& m : presets::models()) std::printf("%-16s %s\n", m.name, m.note);
      return 0;
    } else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  const presets::Model* base = presets::find(o.model);
  if (!base) {
    std::fprintf(stderr, "unknown model %s (try --list)\n", o.model.c_str());
    return 2;
  }
  presets::Model custom = *base;
  if (o.hidden > 0) custom.hidden = o.hidden;
  if (o.inter > 0) custom.intermediate = o.inter;
  if (o.experts > 0) custom.experts = o.experts;
  if (o.top_k > 0) custom.top_k = o.top_k;
  if (custom.groups > 0 && custom.experts % custom.groups != 0) custom.groups = custom.topk_group = 0;
  const presets::Model* m = &custom;
  if (o.ep < 1 || o.tokens < 1 || o.iters < 1) {
    std::fprintf(stderr, "--ep, --tokens and --iters must be >= 1\n");
    return 2;
  }
  ep_moe_set_log_callback(log_to_stderr, EP_MOE_LOG_WARN, nullptr);
  const int shared = o.shared >= 0 ? o.shared : m->shared_intermediate;

  std::printf("ep_moe %s demo: %s\n", ep_moe_version_string(), m->note);
  std::printf("layer: H=%d I=%d E=%d top-%d, shared expert %d, %s weights and activations, EP=%d, %d tokens\n\n",
              m->hidden, m->intermediate, m->experts, m->top_k, shared,
              o.dtype == EP_MOE_DTYPE_F32 ? "f32" : o.dtype == EP_MOE_DTYPE_BF16 ? "bf16" : "f16", o.ep, o.tokens);
  if (o.plan) return print_plan(*m, o);
  print_plan(*m, o);

  // Random tokens and router logits.
  std::vector<float> hid(static_cast<size_t>(o.tokens) * m->hidden), logits(static_cast<size_t>(o.tokens) * m->experts);
  presets::fill(hid, hid.size(), 7, 1, 1.0f);
  presets::fill(logits, logits.size(), 7, 2, 3.0f);
  const std::vector<uint8_t> hidden = presets::encode(hid, o.dtype);

  std::printf("\nrunning on %d in-process ranks...\n", o.ep);
  const Run ep_run = run(*m, o, o.ep, shared, hidden, logits);
  if (!ep_run.error.empty()) {
    std::fprintf(stderr, "EP run failed: %s\n", ep_run.error.c_str());
    return 1;
  }
  std::printf("running the same layer on a single rank for reference...\n");
  const Run one = run(*m, o, 1, shared, hidden, logits);
  if (!one.error.empty()) {
    std::fprintf(stderr, "single-rank run failed: %s\n", one.error.c_str());
    return 1;
  }

  // Every EP rank must hold the same output, equal to the single-rank one.
  const std::vector<float> expect = presets::decode(one.outs[0], o.dtype);
  double scale = 1e-30, worst = 0;
  for (float v : expect) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (const auto& out : ep_run.outs) {
    const std::vector<float> got = presets::decode(out, o.dtype);
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(got[i] - expect[i])) / scale);
  }
  const double tol = o.dtype == EP_MOE_DTYPE_F32 ? 1e-4 : o.dtype == EP_MOE_DTYPE_F16 ? 5e-3 : 1e-2;
  const bool pass = worst <= tol;

  std::printf("\n%-22s %12s %12s %14s\n", "", "forward ms", "tokens/s", "weights load s");
  std::printf("%-22s %12.2f %12.1f %14.2f\n", ("EP=" + std::to_string(o.ep) + " in-process").c_str(),
              ep_run.seconds * 1e3, o.tokens / ep_run.seconds, ep_run.load_seconds);
  std::printf("%-22s %12.2f %12.1f %14.2f\n", "single rank", one.seconds * 1e3, o.tokens / one.seconds,
              one.load_seconds);
  std::printf("\nmax |EP - single rank| / max |single rank| = %.3g (tolerance %.0e): %s\n", worst, tol,
              pass ? "PASS" : "FAIL");
  std::printf("(this machine has %u hardware threads; in-process ranks share them)\n",
              std::thread::hardware_concurrency());
  return pass ? 0 : 1;
}

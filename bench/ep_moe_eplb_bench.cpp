// ep_moe_eplb_bench: expert load balancing on Zipf-skewed routing, through
// the public C API only.
//
// Part 1, per preset and EP size (in-process ranks; the experts' math is
// shrunk to H=32, I=16 since the load does not depend on it):
//   window 1: tokens whose top-k experts follow a Zipf law over the experts
//   (random popularity order) run through layers with the linear placement;
//   the per-rank pair counts give the imbalance before (max rank / mean).
//   ep_moe_layer_expert_load() sums the load, ep_moe_rebalance() computes a
//   placement with E/8 redundant slots (rounded up to whole slots per rank),
//   ep_moe_layer_replace() applies it; window 2 (fresh tokens, same law)
//   gives the imbalance after, measured, not predicted.
// Part 2, per preset whose expert weights fit --replace-gb: the time of the
//   same re-placement at the model's real sizes (bf16), the bytes moved, and
//   that rate as a fraction of this machine's memcpy bandwidth measured in
//   the same run; the output is checked unchanged by the move.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "cli.hpp"
#include "presets.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Options {
  std::vector<std::string> presets = {"qwen3-30b-a3b", "qwen2-57b-a14b", "deepseek-v3", "mixtral-8x7b"};
  std::vector<int> eps;  // empty: the preset's default and 8
  double zipf = 1.0;
  int tokens = 16384;
  int redundant_div = 8;  // E / this redundant slots
  std::vector<int> dispatch = {EP_MOE_DISPATCH_ALLGATHER, EP_MOE_DISPATCH_ALLTOALL};
  double replace_gb = 5.0;
  std::string json;
  unsigned seed = 1234;
};

void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back(fn, r);
  for (auto& t : ts) t.join();
}

// Top-k distinct experts per token, drawn without replacement with
// probability proportional to popularity (Gumbel top-k).
struct Router {
  std::vector<double> log_pop;
  int k;
  Router(int E, int K, double s, std::mt19937& g) : log_pop(static_cast<size_t>(E)), k(K) {
    std::vector<int> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), g);
    for (int i = 0; i < E; ++i) log_pop[static_cast<size_t>(order[static_cast<size_t>(i)])] = -s * std::log(i + 1.0);
  }
  void draw(int T, std::mt19937& g, std::vector<int32_t>* ids, std::vector<float>* w) const {
    const int E = static_cast<int>(log_pop.size());
    std::uniform_real_distribution<double> u(1e-12, 1.0);
    std::vector<std::pair<double, int>> key(static_cast<size_t>(E));
    ids->resize(static_cast<size_t>(T) * k);
    w->assign(static_cast<size_t>(T) * k, 1.0f / static_cast<float>(k));
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e)
        key[static_cast<size_t>(e)] = {log_pop[static_cast<size_t>(e)] - std::log(-std::log(u(g))), e};
      std::partial_sort(key.begin(), key.begin() + k, key.end(), std::greater<std::pair<double, int>>());
      for (int j = 0; j < k; ++j) (*ids)[static_cast<size_t>(t) * k + j] = key[static_cast<size_t>(j)].second;
    }
  }
};

ep_moe_expert_map_t* make_map(int ep, int r, int E, const std::vector<int32_t>& table) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = ep;
  mc.ep_rank = r;
  mc.global_num_experts = E;
  if (!table.empty()) {
    mc.placement = EP_MOE_PLACEMENT_CUSTOM;
    mc.custom_slots = table.data();
    mc.num_custom_slots = static_cast<int32_t>(table.size());
  }
  ep_moe_expert_map_t* m = nullptr;
  if (ep_moe_expert_map_create(&m, &mc) != EP_MOE_OK) {
    std::fprintf(stderr, "map: %s\n", ep_moe_last_error());
    std::exit(1);
  }
  return m;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "error: %s\n", what.c_str());
  std::exit(1);
}

// A group of in-process ranks running one layer each.
struct Group {
  int ep = 0;
  std::vector<ep_moe_comm_t*> comms;
  std::vector<ep_moe_layer_t*> layers;
  bool dp = false;  // every rank its own tokens (all-to-all)
  ~Group() {
    for (auto* l : layers) ep_moe_layer_destroy(l);
    for (auto* c : comms) ep_moe_comm_destroy(c);
  }
};

void make_group(Group& g, int ep, const ep_moe_layer_config_t& lc, bool dp,
                const std::function<std::string(ep_moe_layer_t*, const ep_moe_expert_map_t*)>& weights) {
  g.ep = ep;
  g.dp = dp;
  g.comms.assign(static_cast<size_t>(ep), nullptr);
  g.layers.assign(static_cast<size_t>(ep), nullptr);
  if (ep_moe_comm_create_local(g.comms.data(), ep, nullptr) != EP_MOE_OK) die(ep_moe_last_error());
  std::vector<std::string> err(static_cast<size_t>(ep));
  run_ranks(ep, [&](int r) {
    ep_moe_expert_map_t* m = make_map(ep, r, lc.num_experts, {});
    ep_moe_comm_t* c = g.comms[static_cast<size_t>(r)];
    if (ep_moe_layer_create(&g.layers[static_cast<size_t>(r)], &lc, m, c, dp ? c : nullptr) != EP_MOE_OK)
      err[static_cast<size_t>(r)] = ep_moe_last_error();
    else err[static_cast<size_t>(r)] = weights(g.layers[static_cast<size_t>(r)], m);
    ep_moe_expert_map_destroy(m);
  });
  for (const auto& e : err)
    if (!e.empty()) die(e);
}

// Runs one window: all-gather ranks see every token, all-to-all ranks a
// share. Returns each rank's output if `outs`.
void run_window(Group& g, const std::vector<int32_t>& ids, const std::vector<float>& w, int K, int H,
                ep_moe_dtype_t adt, const std::vector<float>* hidden, std::vector<std::vector<uint8_t>>* outs) {
  const int T = static_cast<int>(ids.size()) / K;
  std::vector<int32_t> counts(static_cast<size_t>(g.ep));
  for (int r = 0; r < g.ep; ++r) counts[static_cast<size_t>(r)] = g.dp ? T / g.ep + (r < T % g.ep) : T;
  const size_t es = adt == EP_MOE_DTYPE_F32 ? 4 : 2;
  std::vector<uint8_t> enc;
  if (hidden) enc = presets::encode(*hidden, adt);
  if (outs) outs->assign(static_cast<size_t>(g.ep), {});
  std::vector<std::string> err(static_cast<size_t>(g.ep));
  run_ranks(g.ep, [&](int r) {
    int first = 0;
    if (g.dp)
      for (int q = 0; q < r; ++q) first += counts[static_cast<size_t>(q)];
    const int n = counts[static_cast<size_t>(r)];
    std::vector<uint8_t> x(static_cast<size_t>(n) * H * es), out(static_cast<size_t>(n) * H * es);
    if (hidden) std::memcpy(x.data(), enc.data() + static_cast<size_t>(first) * H * es, x.size());
    std::vector<int32_t> decode(static_cast<size_t>(g.ep), 1);
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = n;
    a.hidden = x.data();
    a.topk_ids = ids.data() + static_cast<size_t>(first) * K;
    a.topk_weights = w.data() + static_cast<size_t>(first) * K;
    a.out = out.data();
    if (g.dp) {
      a.dp_token_counts = counts.data();
      a.dp_is_decode = decode.data();
    }
    if (ep_moe_layer_forward(g.layers[static_cast<size_t>(r)], &a) != EP_MOE_OK)
      err[static_cast<size_t>(r)] = ep_moe_layer_last_error(g.layers[static_cast<size_t>(r)]);
    if (outs) (*outs)[static_cast<size_t>(r)] = std::move(out);
  });
  for (const auto& e : err)
    if (!e.empty()) die(e);
}

// Per-rank pair counts of the window, and the global per-expert load; resets.
double window_imbalance(Group& g, int E, std::vector<int64_t>* load) {
  std::vector<int64_t> rank_load(static_cast<size_t>(g.ep), 0);
  load->assign(static_cast<size_t>(E), 0);
  std::vector<std::vector<int64_t>> all(static_cast<size_t>(g.ep));
  run_ranks(g.ep, [&](int r) {
    std::vector<int64_t> mine(static_cast<size_t>(E));
    ep_moe_layer_t* l = g.layers[static_cast<size_t>(r)];
    if (ep_moe_layer_expert_load(mine.data(), mine.size(), l, 0, 0) != EP_MOE_OK) die(ep_moe_layer_last_error(l));
    rank_load[static_cast<size_t>(r)] = std::accumulate(mine.begin(), mine.end(), int64_t{0});
    all[static_cast<size_t>(r)].resize(static_cast<size_t>(E));
    if (ep_moe_layer_expert_load(all[static_cast<size_t>(r)].data(), static_cast<size_t>(E), l, 1, 1) != EP_MOE_OK)
      die(ep_moe_layer_last_error(l));
  });
  *load = all[0];
  const double mean = std::accumulate(rank_load.begin(), rank_load.end(), 0.0) / g.ep;
  return static_cast<double>(*std::max_element(rank_load.begin(), rank_load.end())) / mean;
}

// Applies the table on every rank; returns the slowest rank's seconds and
// the bytes received in all.
double replace_all(Group& g, int E, const std::vector<int32_t>& table, int64_t* bytes) {
  std::vector<double> secs(static_cast<size_t>(g.ep));
  std::vector<std::string> err(static_cast<size_t>(g.ep));
  *bytes = 0;
  std::vector<int64_t> got(static_cast<size_t>(g.ep));
  run_ranks(g.ep, [&](int r) {
    ep_moe_expert_map_t* m = make_map(g.ep, r, E, table);
    const auto t0 = Clock::now();
    ep_moe_layer_t* l = g.layers[static_cast<size_t>(r)];
    if (ep_moe_layer_replace(l, m, nullptr, nullptr, 0) != EP_MOE_OK)
      err[static_cast<size_t>(r)] = ep_moe_layer_last_error(l);
    secs[static_cast<size_t>(r)] = seconds_since(t0);
    ep_moe_layer_get_attr(&got[static_cast<size_t>(r)], l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED);
    ep_moe_expert_map_destroy(m);
  });
  for (const auto& e : err)
    if (!e.empty()) die(e);
  for (int64_t b : got) *bytes += b;
  return *std::max_element(secs.begin(), secs.end());
}

double memcpy_gbs(int megabytes) {
  std::vector<char> a(static_cast<size_t>(megabytes) << 20, 1), b(a.size());
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    best = std::max(best, static_cast<double>(a.size()) / seconds_since(t0) / 1e9);
    a[static_cast<size_t>(i)] = b[static_cast<size_t>(i + 1)];
  }
  return best;
}

int slots_for(int E, int ep, int div) {
  const int P = E + std::max(1, E / div);
  return (P + ep - 1) / ep * ep;
}

struct Balance {
  std::string preset, dispatch;
  bool hier = false;
  int ep = 0, experts = 0, slots = 0, rpn = 0, groups = 0;
  double before = 0, predicted = 0, replay = 0, after = 0, rebalance_us = 0, replace_ms = 0;
  int64_t replace_bytes = 0;
};

struct Move {
  std::string preset, step;
  int ep = 0, slots = 0;
  double gb_weights = 0, replace_s = 0, gb_moved = 0, gbs = 0, frac = 0, max_diff = 0;
};

int parse_options(int argc, char** argv, Options* o) {
  cli::Parser args("ep_moe_eplb_bench [options]",
                   "Expert load balancing: imbalance before and after a re-placement on Zipf routing, and the cost of "
                   "moving the weights.");
  args.list("--preset", &o->presets, "models (qwen3-30b-a3b, qwen2-57b-a14b, deepseek-v3, mixtral-8x7b)")
      .list("--ep", &o->eps, "EP sizes (default: the preset's and 8)", 1, 4096)
      .option("--zipf", &o->zipf, "Zipf exponent of expert popularity (default 1.0)", 0, 100)
      .option("--tokens", &o->tokens, "tokens per load window (default 16384)", 1, 1 << 30)
      .option("--redundant-div", &o->redundant_div, "E/D redundant slots (default 8)", 1, 1 << 20)
      .custom("--dispatch", "A,B", "allgather, alltoall (default both)",
              [o](const std::string& v, std::string* err) {
                o->dispatch.clear();
                for (const auto& s : cli::split(v)) {
                  if (s == "allgather") o->dispatch.push_back(EP_MOE_DISPATCH_ALLGATHER);
                  else if (s == "alltoall") o->dispatch.push_back(EP_MOE_DISPATCH_ALLTOALL);
                  else *err = "unknown dispatch " + s;
                }
                return err->empty() && !o->dispatch.empty();
              })
      .option("--replace-gb", &o->replace_gb,
              "part 2 only for presets whose expert weights fit G GB (default 5; 0: skip)", 0, 1e6)
      .option("--seed", &o->seed, "routing seed (default 1234)")
      .option("--json", &o->json, "also write the results as JSON", "FILE");
  return args.parse(argc, argv);
}

// One part-1 row: ep ranks (hier: 8 a node, the groups kept on a node) with
// `dispatch`; a window on the linear placement, the rebalancer's table
// applied, the same window again and a fresh one.
Balance balance_case(const Options& o, const std::string& name, const presets::Model& m, const Router& router, int ep,
                     bool hier, int dispatch, std::mt19937& g) {
  presets::Model small = m;
  small.hidden = 32;
  small.intermediate = 16;
  // All-to-all ranks each bring a share of the tokens (workspace is
  // sized for max_tokens per rank).
  const int max_tokens = dispatch == EP_MOE_DISPATCH_ALLTOALL ? (o.tokens + ep - 1) / ep : o.tokens;
  ep_moe_layer_config_t lc = presets::layer_config(small, 0, EP_MOE_DTYPE_F32, EP_MOE_DTYPE_F32, max_tokens, 1);
  lc.dispatch_mode = dispatch;
  Group grp;
  make_group(grp, ep, lc, dispatch == EP_MOE_DISPATCH_ALLTOALL, [&](ep_moe_layer_t* l, const ep_moe_expert_map_t* mp) {
    return presets::load_random_weights(l, mp, small, 0, 7);
  });
  Balance b;
  b.preset = name;
  b.dispatch = dispatch == EP_MOE_DISPATCH_ALLGATHER ? "allgather" : "alltoall";
  b.hier = hier;
  b.ep = ep;
  b.experts = m.experts;
  b.slots = slots_for(m.experts, ep, o.redundant_div);
  b.rpn = hier ? 8 : 0;
  b.groups = hier ? m.groups : 0;
  std::vector<int32_t> ids;
  std::vector<float> w;
  router.draw(o.tokens, g, &ids, &w);
  run_window(grp, ids, w, m.top_k, small.hidden, EP_MOE_DTYPE_F32, nullptr, nullptr);
  std::vector<int64_t> load;
  b.before = window_imbalance(grp, m.experts, &load);
  const std::vector<double> loadd(load.begin(), load.end());
  ep_moe_rebalance_config_t rc;
  ep_moe_rebalance_config_init(&rc);
  rc.num_experts = m.experts;
  rc.num_slots = b.slots;
  rc.num_ranks = ep;
  rc.ranks_per_node = b.rpn;
  rc.num_expert_groups = b.groups;
  std::vector<int32_t> linear(static_cast<size_t>(m.experts));
  std::iota(linear.begin(), linear.end(), 0);
  rc.num_current_slots = m.experts;
  rc.current_slots = linear.data();
  std::vector<int32_t> table(static_cast<size_t>(b.slots));
  const auto t0 = Clock::now();
  if (ep_moe_rebalance(table.data(), table.size(), &b.predicted, loadd.data(), loadd.size(), &rc) != EP_MOE_OK)
    die(ep_moe_last_error());
  b.rebalance_us = seconds_since(t0) * 1e6;
  b.replace_ms = replace_all(grp, m.experts, table, &b.replace_bytes) * 1e3;
  // The same window again (the placement and the replica rule alone),
  // then a fresh one (plus sampling noise).
  run_window(grp, ids, w, m.top_k, small.hidden, EP_MOE_DTYPE_F32, nullptr, nullptr);
  b.replay = window_imbalance(grp, m.experts, &load);
  router.draw(o.tokens, g, &ids, &w);
  run_window(grp, ids, w, m.top_k, small.hidden, EP_MOE_DTYPE_F32, nullptr, nullptr);
  b.after = window_imbalance(grp, m.experts, &load);
  return b;
}

// Part 1 over every preset and EP size; false (after saying why) on an
// unknown preset or an EP size out of range.
bool part1(const Options& o, std::mt19937& g, std::vector<Balance>* rows) {
  std::printf(
      "Part 1: Zipf(%.2f) routing, %d tokens per window, E/%d redundant slots (rounded up to whole slots per rank)\n",
      o.zipf, o.tokens, o.redundant_div);
  std::printf("%-15s %-9s %-6s %4s %5s %5s %8s %9s %8s %8s %12s %11s\n", "preset", "dispatch", "place", "ep", "E",
              "slots", "before", "predicted", "replay", "fresh", "rebalance_us", "replace_ms");
  for (const auto& name : o.presets) {
    const presets::Model* m = presets::find(name);
    if (!m) {
      std::fprintf(stderr, "unknown preset %s\n", name.c_str());
      return false;
    }
    std::vector<int> eps = o.eps;
    if (eps.empty()) {
      eps.push_back(m->default_ep);
      if (m->default_ep != 8) eps.push_back(8);
    }
    const Router router(m->experts, m->top_k, o.zipf, g);
    for (int ep : eps) {
      if (ep < 1 || ep > 256) {
        std::fprintf(stderr, "EP size %d is outside [1, 256]\n", ep);
        return false;
      }
      // DeepSeek's grouped experts on several nodes (8 ranks each): both the
      // hierarchical placement (groups stay on a node) and the global one.
      const bool multi_node = m->groups > 0 && ep > 8 && ep % 8 == 0;
      for (int hier = multi_node ? 1 : 0; hier >= 0; --hier)
        for (int dispatch : o.dispatch) {
          if (dispatch == EP_MOE_DISPATCH_ALLTOALL && ep == 1) continue;
          const Balance b = balance_case(o, name, *m, router, ep, hier != 0, dispatch, g);
          std::printf("%-15s %-9s %-6s %4d %5d %5d %8.3f %9.3f %8.3f %8.3f %12.1f %11.2f\n", name.c_str(),
                      b.dispatch.c_str(), b.hier ? "hier" : "global", b.ep, b.experts, b.slots, b.before, b.predicted,
                      b.replay, b.after, b.rebalance_us, b.replace_ms);
          std::fflush(stdout);
          rows->push_back(b);
        }
    }
  }
  int met = 0, met_fresh = 0;
  for (const auto& b : *rows) {
    met += b.replay <= 1.05;
    met_fresh += b.after <= 1.05;
  }
  std::printf(
      "goal imbalance <= 1.05 after rebalancing: met in %d of %zu cases on the window it was computed from, %d of %zu "
      "on a fresh window\n\n",
      met, rows->size(), met_fresh, rows->size());
  return true;
}

// Part 2 for one preset at its real sizes: the re-placement from the linear
// placement, then after the load drifts by +-10 % (each time passing the
// placement in use to the rebalancer), checked on a few tokens run before
// and after.
void replace_steps(const Options& o, const std::string& name, const presets::Model& m, int ep, int P, double total_gb,
                   double bw, std::mt19937& g, std::vector<Move>* moves) {
  ep_moe_layer_config_t lc = presets::layer_config(m, 0, EP_MOE_DTYPE_BF16, EP_MOE_DTYPE_BF16, 64, 1);
  Group grp;
  make_group(grp, ep, lc, false, [&](ep_moe_layer_t* l, const ep_moe_expert_map_t* mp) {
    return presets::load_random_weights(l, mp, m, 0, 11);
  });
  const Router router(m.experts, m.top_k, o.zipf, g);
  std::vector<int32_t> ids;
  std::vector<float> w;
  router.draw(4096, g, &ids, &w);
  std::vector<double> load(static_cast<size_t>(m.experts), 0.0);
  for (int32_t e : ids) load[static_cast<size_t>(e)] += 1;
  // A few tokens through the layer before and after: the move must not change them.
  const int T = 16;
  std::vector<int32_t> tids;
  std::vector<float> tw;
  router.draw(T, g, &tids, &tw);
  std::vector<float> hidden;
  presets::fill(hidden, static_cast<size_t>(T) * m.hidden, 5, 6, 1.0f);
  std::vector<std::vector<uint8_t>> before, after;
  run_window(grp, tids, tw, m.top_k, m.hidden, EP_MOE_DTYPE_BF16, &hidden, &before);
  std::vector<int32_t> current(static_cast<size_t>(m.experts));
  std::iota(current.begin(), current.end(), 0);
  std::uniform_real_distribution<double> drift(0.9, 1.1);
  for (int step = 0; step < 2; ++step) {
    if (step == 1)
      for (auto& x : load) x *= drift(g);
    ep_moe_rebalance_config_t rc;
    ep_moe_rebalance_config_init(&rc);
    rc.num_experts = m.experts;
    rc.num_slots = P;
    rc.num_ranks = ep;
    rc.num_current_slots = static_cast<int32_t>(current.size());
    rc.current_slots = current.data();
    std::vector<int32_t> table(static_cast<size_t>(P));
    if (ep_moe_rebalance(table.data(), table.size(), nullptr, load.data(), load.size(), &rc) != EP_MOE_OK)
      die(ep_moe_last_error());
    Move mv;
    mv.preset = name;
    mv.step = step == 0 ? "from-linear" : "after-drift";
    mv.ep = ep;
    mv.slots = P;
    mv.gb_weights = total_gb;
    int64_t bytes = 0;
    mv.replace_s = replace_all(grp, m.experts, table, &bytes);
    mv.gb_moved = static_cast<double>(bytes) / 1e9;
    mv.gbs = mv.gb_moved / mv.replace_s;
    mv.frac = mv.gbs / bw;
    run_window(grp, tids, tw, m.top_k, m.hidden, EP_MOE_DTYPE_BF16, &hidden, &after);
    for (int r = 0; r < ep; ++r) {
      const auto a = presets::decode(before[static_cast<size_t>(r)], EP_MOE_DTYPE_BF16);
      const auto b = presets::decode(after[static_cast<size_t>(r)], EP_MOE_DTYPE_BF16);
      for (size_t i = 0; i < a.size(); ++i)
        mv.max_diff = std::max(mv.max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
    }
    std::printf("%-15s %-12s %4d %5d %10.2f %10.2f %10.3f %9.2f %9.1f%% %12.2g\n", name.c_str(), mv.step.c_str(), ep, P,
                mv.gb_weights, mv.gb_moved, mv.replace_s, mv.gbs, 100 * mv.frac, mv.max_diff);
    std::fflush(stdout);
    moves->push_back(mv);
    current = table;
  }
}

// Part 2 over the presets whose expert weights fit --replace-gb.
std::vector<Move> part2(const Options& o, std::mt19937& g) {
  std::vector<Move> moves;
  const double bw = memcpy_gbs(256);
  std::printf("Part 2: re-placement at the models' sizes (bf16, in-process ranks); memcpy bandwidth %.1f GB/s\n", bw);
  std::printf("%-15s %-12s %4s %5s %10s %10s %10s %9s %10s %12s\n", "preset", "step", "ep", "slots", "weights_GB",
              "moved_GB", "replace_s", "GB/s", "of_memcpy", "out_changed");
  for (const auto& name : o.presets) {
    const presets::Model* m = presets::find(name);  // part 1 checked every name
    const int ep = o.eps.empty() ? m->default_ep : o.eps[0];
    const int P = slots_for(m->experts, ep, o.redundant_div);
    const double expert_gb = 3.0 * m->hidden * m->intermediate * 2 / 1e9;
    const double total_gb = expert_gb * P;
    if (total_gb > o.replace_gb) {
      std::printf("%-15s skipped: %.1f GB of expert weights after re-placement exceeds --replace-gb %.1f\n",
                  name.c_str(), total_gb, o.replace_gb);
      continue;
    }
    replace_steps(o, name, *m, ep, P, total_gb, bw, g, &moves);
  }
  return moves;
}

void write_json(const Options& o, const std::vector<Balance>& rows, const std::vector<Move>& moves) {
  FILE* f = std::fopen(o.json.c_str(), "w");
  if (!f) die("cannot write " + o.json);
  std::fprintf(f, "{\n  \"zipf\": %g, \"tokens\": %d, \"redundant_div\": %d,\n  \"balance\": [\n", o.zipf, o.tokens,
               o.redundant_div);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& b = rows[i];
    std::fprintf(
        f,
        "    {\"preset\": \"%s\", \"dispatch\": \"%s\", \"ep\": %d, \"experts\": %d, \"slots\": %d, "
        "\"ranks_per_node\": %d, \"groups\": %d, \"imbalance_before\": %.4f, \"imbalance_predicted\": %.4f, "
        "\"imbalance_replay\": %.4f, \"imbalance_after\": %.4f, \"rebalance_us\": %.1f, \"replace_ms\": %.3f}%s\n",
        b.preset.c_str(), b.dispatch.c_str(), b.ep, b.experts, b.slots, b.rpn, b.groups, b.before, b.predicted,
        b.replay, b.after, b.rebalance_us, b.replace_ms, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"replace\": [\n");
  for (size_t i = 0; i < moves.size(); ++i) {
    const auto& v = moves[i];
    std::fprintf(f,
                 "    {\"preset\": \"%s\", \"step\": \"%s\", \"ep\": %d, \"slots\": %d, \"weights_gb\": %.3f, "
                 "\"moved_gb\": %.3f, "
                 "\"replace_s\": %.4f, \"gbs\": %.3f, \"fraction_of_memcpy\": %.4f, \"max_output_change\": %g}%s\n",
                 v.preset.c_str(), v.step.c_str(), v.ep, v.slots, v.gb_weights, v.gb_moved, v.replace_s, v.gbs, v.frac,
                 v.max_diff, i + 1 < moves.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const int rc = parse_options(argc, argv, &o); rc != cli::Parser::kRun) return rc;
  std::mt19937 g(o.seed);
  std::vector<Balance> rows;
  if (!part1(o, g, &rows)) return 2;
  const std::vector<Move> moves = o.replace_gb > 0 ? part2(o, g) : std::vector<Move>{};
  if (!o.json.empty()) write_json(o, rows, moves);
  return 0;
}

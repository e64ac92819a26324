// Soak: many forward calls of a small layer across 4 in-process ranks with
// random token counts (zeros included), each rank's output checked against
// the double-precision reference on every step; at the end the resident
// memory may have grown by less than 1 MiB since the warm-up and no file
// descriptor may be left open. Exit 0 only when all of that holds.
//
// usage: soak_forward [--steps N] [--seed S]     (default 2000 steps)
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/reference_moe.hpp"
#include "ep_moe/ep_moe.h"

namespace {

constexpr int kRanks = 4;

long rss_kib() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  long pages = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? resident * (sysconf(_SC_PAGESIZE) / 1024) : -1;
}

int open_fds() {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) ++n;
  closedir(d);
  return n - 3;  // ".", ".." and the directory itself
}

// A reusable barrier for the main thread and the rank threads.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const long gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  long gen_ = 0;
};

struct Step {
  std::vector<int32_t> counts;
  std::vector<std::vector<float>> hidden;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<double>> expect;
};

// The layer of `spec` on each of kRanks ranks (3 redundant replicas, so
// the map places some experts twice), every weight given as f32. False,
// with the reason printed, on any failure.
bool make_layers(const ref::Spec& spec, const ref::Weights& w, std::vector<ep_moe_comm_t*>& comms,
                 std::vector<ep_moe_layer_t*>& layers) {
  comms.assign(kRanks, nullptr);
  layers.assign(kRanks, nullptr);
  if (ep_moe_comm_create_local(comms.data(), kRanks, nullptr) != EP_MOE_OK) {
    std::fprintf(stderr, "comm: %s\n", ep_moe_last_error());
    return false;
  }
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  lc.hidden_size = spec.H;
  lc.intermediate_size = spec.I;
  lc.num_experts = spec.E;
  lc.top_k = spec.K;
  lc.shared_intermediate_size = spec.Is;
  lc.max_tokens = 4;
  lc.num_threads = 1;
  lc.dispatch_mode = EP_MOE_DISPATCH_AUTO;
  for (int r = 0; r < kRanks; ++r) {
    ep_moe_expert_map_config_t mc;
    ep_moe_expert_map_config_init(&mc);
    mc.ep_size = kRanks;
    mc.ep_rank = r;
    mc.global_num_experts = spec.E;
    mc.num_redundant_experts = 3;
    ep_moe_expert_map_t* map = nullptr;
    if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK ||
        ep_moe_layer_create(&layers[static_cast<size_t>(r)], &lc, map, comms[static_cast<size_t>(r)],
                            comms[static_cast<size_t>(r)]) != EP_MOE_OK) {
      std::fprintf(stderr, "create: %s\n", ep_moe_last_error());
      return false;
    }
    ep_moe_expert_map_destroy(map);
    ep_moe_layer_t* l = layers[static_cast<size_t>(r)];
    auto set = [&](ep_moe_weight_t kind, int e, const std::vector<float>& v, int rows, int cols) {
      return ep_moe_layer_set_weight(nullptr, l, kind, e, v.data(), EP_MOE_DTYPE_F32, rows, cols) == EP_MOE_OK;
    };
    bool ok = true;
    for (int e = 0; e < spec.E; ++e) {
      const auto i = static_cast<size_t>(e);
      ok = ok && set(EP_MOE_WEIGHT_EXPERT_GATE, e, w.gate[i], spec.I, spec.H) &&
           set(EP_MOE_WEIGHT_EXPERT_UP, e, w.up[i], spec.I, spec.H) &&
           set(EP_MOE_WEIGHT_EXPERT_DOWN, e, w.down[i], spec.H, spec.I);
    }
    ok = ok && set(EP_MOE_WEIGHT_SHARED_GATE, -1, w.s_gate, spec.Is, spec.H) &&
         set(EP_MOE_WEIGHT_SHARED_UP, -1, w.s_up, spec.Is, spec.H) &&
         set(EP_MOE_WEIGHT_SHARED_DOWN, -1, w.s_down, spec.H, spec.Is);
    if (!ok) {
      std::fprintf(stderr, "weights: %s\n", ep_moe_layer_last_error(l));
      return false;
    }
  }
  return true;
}

// The next step's inputs: per rank 0..4 tokens (a quarter of the ranks
// with none, and now and then none on any rank), random rows and routes,
// and the double-precision reference of each token.
void draw_step(std::mt19937& rng, const ref::Spec& spec, const ref::Weights& w, Step& cur) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.05f, 1.0f);
  cur.counts.assign(kRanks, 0);
  cur.hidden.assign(kRanks, {});
  cur.ids.assign(kRanks, {});
  cur.weights.assign(kRanks, {});
  cur.expect.assign(kRanks, {});
  const bool all_zero = rng() % 50 == 0;
  for (int r = 0; r < kRanks; ++r) {
    const int T = all_zero || rng() % 4 == 0 ? 0 : static_cast<int>(1 + rng() % 4);
    cur.counts[static_cast<size_t>(r)] = T;
    auto& h = cur.hidden[static_cast<size_t>(r)];
    h.resize(static_cast<size_t>(T) * spec.H);
    for (auto& x : h) x = nd(rng);
    auto& e = cur.expect[static_cast<size_t>(r)];
    e.resize(static_cast<size_t>(T) * spec.H);
    for (int t = 0; t < T; ++t) {
      std::vector<int> perm(static_cast<size_t>(spec.E));
      for (int i = 0; i < spec.E; ++i) perm[static_cast<size_t>(i)] = i;
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int> ids(perm.begin(), perm.begin() + spec.K);
      std::vector<double> wts;
      for (int k = 0; k < spec.K; ++k) {
        const float v = ud(rng);
        cur.ids[static_cast<size_t>(r)].push_back(ids[static_cast<size_t>(k)]);
        cur.weights[static_cast<size_t>(r)].push_back(v);
        wts.push_back(v);
      }
      ref::moe_token(spec, w, h.data() + static_cast<size_t>(t) * spec.H, ids, wts,
                     e.data() + static_cast<size_t>(t) * spec.H);
    }
  }
}

// One persistent thread a rank: on each step (between the two barriers)
// it runs the current step's forward and keeps its first error and its
// largest relative error against the reference.
class Ranks {
 public:
  Ranks(const std::vector<ep_moe_layer_t*>& layers, int H) : layers_(layers), H_(H) {
    for (int r = 0; r < kRanks; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  // Runs `cur` on every rank and waits for all of them.
  void step(const Step& cur) {
    cur_ = &cur;
    start_.wait();
    done_.wait();
  }
  void stop() {
    stop_ = true;
    start_.wait();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  const std::string& error(int r) const { return errors_[static_cast<size_t>(r)]; }
  double worst(int r) const { return worst_[static_cast<size_t>(r)]; }

 private:
  void loop(int r) {
    std::vector<float> out;
    ep_moe_layer_t* layer = layers_[static_cast<size_t>(r)];
    auto& error = errors_[static_cast<size_t>(r)];
    for (;;) {
      start_.wait();
      if (stop_) return;
      const Step& cur = *cur_;
      const int T = cur.counts[static_cast<size_t>(r)];
      out.assign(static_cast<size_t>(T) * H_ + 1, -7.0f);
      ep_moe_forward_args_t a;
      ep_moe_forward_args_init(&a);
      a.num_tokens = T;
      a.hidden = cur.hidden[static_cast<size_t>(r)].data();
      a.topk_ids = cur.ids[static_cast<size_t>(r)].data();
      a.topk_weights = cur.weights[static_cast<size_t>(r)].data();
      a.out = out.data();
      a.dp_token_counts = cur.counts.data();
      if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
        if (error.empty()) error = ep_moe_layer_last_error(layer);
      } else {
        const auto& exp = cur.expect[static_cast<size_t>(r)];
        double err = 0, scale = 1e-6;
        for (size_t i = 0; i < exp.size(); ++i) {
          err = std::max(err, std::fabs(out[i] - exp[i]));
          scale = std::max(scale, std::fabs(exp[i]));
        }
        if (out.back() != -7.0f) error = "wrote past the output";
        worst_[static_cast<size_t>(r)] = std::max(worst_[static_cast<size_t>(r)], err / scale);
      }
      done_.wait();
    }
  }

  const std::vector<ep_moe_layer_t*>& layers_;
  const int H_;
  const Step* cur_ = nullptr;
  bool stop_ = false;
  Barrier start_{kRanks + 1}, done_{kRanks + 1};
  std::vector<std::string> errors_ = std::vector<std::string>(kRanks);
  std::vector<double> worst_ = std::vector<double>(kRanks, 0.0);
  std::vector<std::thread> threads_;
};

}  // namespace

int main(int argc, char** argv) {
  long steps = 2000;
  unsigned seed = std::random_device{}();
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atol(argv[i + 1]);
    else if (std::strcmp(argv[i], "--seed") == 0) seed = static_cast<unsigned>(std::atol(argv[i + 1]));
  }
  std::printf("soak_forward: %ld steps on %d ranks, seed %u\n", steps, kRanks, seed);
  std::mt19937 rng(seed);
  ref::Spec spec;
  spec.H = 16;
  spec.I = 8;
  spec.E = 9;
  spec.K = 2;
  spec.Is = 8;
  const ref::Weights w = ref::random_weights(spec, ref::F32, rng);
  const int fds0 = open_fds();

  std::vector<ep_moe_comm_t*> comms;
  std::vector<ep_moe_layer_t*> layers;
  if (!make_layers(spec, w, comms, layers)) return 1;

  Ranks ranks(layers, spec.H);
  Step cur;
  long rss_warm = -1;
  const long warm = std::min<long>(steps / 2, 1000);
  const auto t0 = std::chrono::steady_clock::now();
  for (long s = 0; s < steps; ++s) {
    draw_step(rng, spec, w, cur);
    ranks.step(cur);
    if (s + 1 == warm) rss_warm = rss_kib();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const long rss_end = rss_kib();
  ranks.stop();
  for (auto* l : layers) ep_moe_layer_destroy(l);
  for (auto* c : comms) ep_moe_comm_destroy(c);
  const int fds1 = open_fds();

  int failures = 0;
  double worst_all = 0;
  for (int r = 0; r < kRanks; ++r) {
    worst_all = std::max(worst_all, ranks.worst(r));
    if (!ranks.error(r).empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, ranks.error(r).c_str());
      ++failures;
    }
  }
  if (worst_all > 1e-4) {
    std::fprintf(stderr, "max relative error %g > 1e-4\n", worst_all);
    ++failures;
  }
  const long growth = rss_warm >= 0 && rss_end >= 0 ? rss_end - rss_warm : 0;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' quarantine and shadow memory grow the RSS by design;
  // LeakSanitizer checks for leaks in that build instead.
  const bool check_rss = false;
#else
  const bool check_rss = true;
#endif
  if (check_rss && growth >= 1024) {
    std::fprintf(stderr, "RSS grew by %ld KiB after the warm-up (limit 1024)\n", growth);
    ++failures;
  }
  if (fds1 != fds0) {
    std::fprintf(stderr, "open file descriptors: %d before, %d after\n", fds0, fds1);
    ++failures;
  }
  std::printf(
      "soak_forward: %ld steps in %.1f s (%.0f steps/s), max rel error %.2g, RSS %ld -> %ld KiB (%+ld after "
      "step %ld), fds %d -> %d: %s\n",
      steps, secs, steps / secs, worst_all, rss_warm, rss_end, growth, warm, fds0, fds1, failures ? "FAIL" : "PASS");
  return failures ? 1 : 0;
}

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

  std::vector<ep_moe_comm_t*> comms(kRanks, nullptr);
  if (ep_moe_comm_create_local(comms.data(), kRanks, nullptr) != EP_MOE_OK) {
    std::fprintf(stderr, "comm: %s\n", ep_moe_last_error());
    return 1;
  }
  std::vector<ep_moe_layer_t*> layers(kRanks, nullptr);
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
      return 1;
    }
    ep_moe_expert_map_destroy(map);
    ep_moe_layer_t* l = layers[static_cast<size_t>(r)];
    bool ok = true;
    for (int e = 0; e < spec.E; ++e) {
      ok =
          ok && ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_EXPERT_GATE, e, w.gate[static_cast<size_t>(e)].data(),
                                        EP_MOE_DTYPE_F32, spec.I, spec.H) == EP_MOE_OK;
      ok = ok && ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_EXPERT_UP, e, w.up[static_cast<size_t>(e)].data(),
                                         EP_MOE_DTYPE_F32, spec.I, spec.H) == EP_MOE_OK;
      ok =
          ok && ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_EXPERT_DOWN, e, w.down[static_cast<size_t>(e)].data(),
                                        EP_MOE_DTYPE_F32, spec.H, spec.I) == EP_MOE_OK;
    }
    ok = ok && ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_SHARED_GATE, -1, w.s_gate.data(), EP_MOE_DTYPE_F32,
                                       spec.Is, spec.H) == EP_MOE_OK;
    ok = ok && ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_SHARED_UP, -1, w.s_up.data(), EP_MOE_DTYPE_F32,
                                       spec.Is, spec.H) == EP_MOE_OK;
    ok = ok && ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_SHARED_DOWN, -1, w.s_down.data(), EP_MOE_DTYPE_F32,
                                       spec.H, spec.Is) == EP_MOE_OK;
    if (!ok) {
      std::fprintf(stderr, "weights: %s\n", ep_moe_layer_last_error(l));
      return 1;
    }
  }

  // Persistent rank threads, one barrier before and one after each step.
  Step cur;
  Barrier start(kRanks + 1), done(kRanks + 1);
  bool stop = false;
  std::vector<std::string> errors(kRanks);
  std::vector<double> worst(kRanks, 0.0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> out;
      for (;;) {
        start.wait();
        if (stop) return;
        const int T = cur.counts[static_cast<size_t>(r)];
        out.assign(static_cast<size_t>(T) * spec.H + 1, -7.0f);
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = T;
        a.hidden = cur.hidden[static_cast<size_t>(r)].data();
        a.topk_ids = cur.ids[static_cast<size_t>(r)].data();
        a.topk_weights = cur.weights[static_cast<size_t>(r)].data();
        a.out = out.data();
        a.dp_token_counts = cur.counts.data();
        if (ep_moe_layer_forward(layers[static_cast<size_t>(r)], &a) != EP_MOE_OK) {
          if (errors[static_cast<size_t>(r)].empty())
            errors[static_cast<size_t>(r)] = ep_moe_layer_last_error(layers[static_cast<size_t>(r)]);
        } else {
          const auto& exp = cur.expect[static_cast<size_t>(r)];
          double err = 0, scale = 1e-6;
          for (size_t i = 0; i < exp.size(); ++i) {
            err = std::max(err, std::fabs(out[i] - exp[i]));
            scale = std::max(scale, std::fabs(exp[i]));
          }
          if (out.back() != -7.0f) errors[static_cast<size_t>(r)] = "wrote past the output";
          worst[static_cast<size_t>(r)] = std::max(worst[static_cast<size_t>(r)], err / scale);
        }
        done.wait();
      }
    });
  }

  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.05f, 1.0f);
  long rss_warm = -1;
  const long warm = std::min<long>(steps / 2, 1000);
  const auto t0 = std::chrono::steady_clock::now();
  for (long s = 0; s < steps; ++s) {
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
    start.wait();
    done.wait();
    if (s + 1 == warm) rss_warm = rss_kib();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const long rss_end = rss_kib();
  stop = true;
  start.wait();
  for (auto& t : threads) t.join();
  for (auto* l : layers) ep_moe_layer_destroy(l);
  for (auto* c : comms) ep_moe_comm_destroy(c);
  const int fds1 = open_fds();

  int failures = 0;
  double worst_all = 0;
  for (int r = 0; r < kRanks; ++r) {
    worst_all = std::max(worst_all, worst[static_cast<size_t>(r)]);
    if (!errors[static_cast<size_t>(r)].empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, errors[static_cast<size_t>(r)].c_str());
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

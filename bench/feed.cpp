#include "feed.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

namespace bench_feed {

using Clock = std::chrono::steady_clock;

Batches make_batches(const presets::Model& m, int T, ep_moe_dtype_t dt) {
  constexpr int kSets = 16;
  Batches b;
  for (int k = 0; k < kSets; ++k) {
    std::vector<float> hid(static_cast<size_t>(T) * m.hidden), lg(static_cast<size_t>(T) * m.experts);
    presets::fill(hid, hid.size(), 11 + static_cast<uint64_t>(k), static_cast<uint64_t>(T), 1.0f);
    presets::fill(lg, lg.size(), 1000 + static_cast<uint64_t>(k), static_cast<uint64_t>(T), 3.0f);
    b.hidden.push_back(presets::encode(hid, dt));
    b.logits.push_back(std::move(lg));
  }
  return b;
}

bool forward_batch(ep_moe_layer_t* layer, ep_moe_forward_args_t& a, const Batches& b, int it, double* wall_s,
                   int64_t* expert_ns, int64_t* local_pairs) {
  const size_t i = static_cast<size_t>(it) % b.hidden.size();
  a.hidden = b.hidden[i].data();
  a.router_logits = b.logits[i].data();
  const auto t0 = Clock::now();
  if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
    std::fprintf(stderr, "forward: %s\n", ep_moe_layer_last_error(layer));
    return false;
  }
  *wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  ep_moe_layer_get_attr(expert_ns, layer, EP_MOE_LAYER_ATTR_LAST_EXPERT_NS);
  if (local_pairs) ep_moe_layer_get_attr(local_pairs, layer, EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS);
  return true;
}

bool alternate(double block_s, int rounds, ep_moe_layer_t* const (&layers)[2], Feed* const (&feeds)[2], int num,
               bench_report::Alternated* q) {
  const int den = 1 - num;
  int it[2] = {0, 0};
  double wall = 0;
  int64_t ens = 0;
  for (int s = 0; s < 2; ++s)  // warm-up
    if (!forward_batch(layers[s], feeds[s]->a, feeds[s]->batches, it[s]++, &wall, &ens)) return false;
  std::vector<double> er, fr;
  for (int round = 0; round < rounds; ++round) {
    double mean_e[2] = {0, 0}, mean_f[2] = {0, 0};
    int64_t pairs[2] = {0, 0};
    for (int ph = 0; ph < 2; ++ph) {
      const int s = (ph + round) % 2;
      double e_sum = 0, f_sum = 0;
      int n = 0;
      const auto start = Clock::now();
      do {
        int64_t np = 0;
        if (!forward_batch(layers[s], feeds[s]->a, feeds[s]->batches, it[s]++, &wall, &ens, &np)) return false;
        e_sum += static_cast<double>(ens);
        f_sum += wall;
        pairs[s] += np;
        ++n;
      } while (std::chrono::duration<double>(Clock::now() - start).count() < block_s);
      mean_e[s] = e_sum / n;
      mean_f[s] = f_sum / n;
    }
    if (pairs[den] == 0 || mean_e[den] <= 0 || mean_f[den] <= 0) continue;
    er.push_back(mean_e[num] / mean_e[den]);
    fr.push_back(mean_f[num] / mean_f[den]);
  }
  q->rounds = static_cast<int>(er.size());
  if (!er.empty()) {
    q->expert = bench_report::median_of(er);
    q->expert_min = *std::min_element(er.begin(), er.end());
    q->expert_max = *std::max_element(er.begin(), er.end());
    q->forward = bench_report::median_of(fr);
  }
  return true;
}

}  // namespace bench_feed

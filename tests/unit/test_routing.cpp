// Top-k routing against a plain sort: ties (to the lower expert id),
// -inf logits, grouped selection with and without a correction bias.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "../common/seed.hpp"
#include "core/routing.hpp"

namespace {
// The k best indices of v: a full stable sort, larger first.
std::vector<int32_t> naive_top(const std::vector<float>& v, int32_t k) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int32_t a, int32_t b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}
}  // namespace

TEST_CASE("route picks the same experts as a full sort, ties to the lower id", "[unit][routing]") {
  std::mt19937 rng(test_seed() + 31);
  for (int trial = 0; trial < 400; ++trial) {
    ep_moe::RoutingParams p;
    const int32_t groups_opts[] = {0, 4, 8};
    p.num_group = groups_opts[trial % 3];
    p.num_experts =
        p.num_group ? p.num_group * (1 + static_cast<int32_t>(rng() % 8)) : 1 + static_cast<int32_t>(rng() % 160);
    p.top_k = 1 + static_cast<int32_t>(rng() % std::min<int32_t>(9, p.num_experts));
    if (p.num_group) {
      const int32_t per = p.num_experts / p.num_group;
      p.topk_group = 1 + static_cast<int32_t>(rng() % p.num_group);
      while (p.top_k > p.topk_group * per) p.topk_group++;
    }
    p.sigmoid = trial % 2 == 1;
    std::vector<float> bias(static_cast<size_t>(p.num_experts));
    if (trial % 5 == 0) {
      for (auto& b : bias) b = static_cast<float>(rng() % 4) * 0.25f;
      p.bias = bias.data();
    }
    const int64_t T = 3;
    // Few distinct values: many exact ties; some -inf (a softmax needs one finite).
    std::vector<float> logits(static_cast<size_t>(T * p.num_experts));
    for (auto& l : logits) l = static_cast<float>(static_cast<int>(rng() % 7) - 3);
    for (int64_t t = 0; t < T; ++t)
      for (int32_t e = 1; e < p.num_experts; ++e)
        if (rng() % 9 == 0)
          logits[static_cast<size_t>(t * p.num_experts + e)] = -std::numeric_limits<float>::infinity();
    std::vector<int32_t> ids(static_cast<size_t>(T * p.top_k));
    std::vector<float> w(ids.size());
    ep_moe::route(logits.data(), EP_MOE_DTYPE_F32, T, p, ids.data(), w.data());
    for (int64_t t = 0; t < T; ++t) {
      // The same scoring as route(), then plain sorts.
      const int32_t E = p.num_experts;
      std::vector<float> sc(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
      float mx = -std::numeric_limits<float>::infinity();
      for (int32_t e = 0; e < E; ++e) mx = std::max(mx, logits[static_cast<size_t>(t * E + e)]);
      float sum = 0;
      for (int32_t e = 0; e < E; ++e) {
        const float l = logits[static_cast<size_t>(t * E + e)];
        sc[static_cast<size_t>(e)] = p.sigmoid ? 1.0f / (1.0f + std::exp(-l)) : std::exp(l - mx);
        sum += sc[static_cast<size_t>(e)];
      }
      for (int32_t e = 0; e < E; ++e) {
        if (!p.sigmoid) sc[static_cast<size_t>(e)] /= sum;
        sel[static_cast<size_t>(e)] = sc[static_cast<size_t>(e)] + (p.bias ? p.bias[e] : 0.0f);
      }
      if (p.num_group) {
        const int32_t per = E / p.num_group;
        std::vector<float> gs(static_cast<size_t>(p.num_group));
        for (int32_t g = 0; g < p.num_group; ++g) {
          std::vector<float> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
          std::sort(v.begin(), v.end(), std::greater<float>());
          gs[static_cast<size_t>(g)] = p.bias && per >= 2 ? v[0] + v[1] : v[0];
        }
        const auto kept = naive_top(gs, p.topk_group);
        for (int32_t e = 0; e < E; ++e)
          if (std::find(kept.begin(), kept.end(), e / per) == kept.end())
            sel[static_cast<size_t>(e)] = -std::numeric_limits<float>::infinity();
      }
      const auto want = naive_top(sel, p.top_k);
      INFO("trial " << trial << " token " << t << " E " << E << " K " << p.top_k << " groups " << p.num_group);
      for (int32_t k = 0; k < p.top_k; ++k)
        CHECK(ids[static_cast<size_t>(t * p.top_k + k)] == want[static_cast<size_t>(k)]);
    }
  }
}

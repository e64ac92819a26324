#include "core/routing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/dtype.hpp"
#include "common/error.hpp"

namespace ep_moe {

namespace {
// Indices of the k largest values, largest first; ties go to the lower
// index. One pass keeping the best k in order: after the first few values
// most are below the k-th and cost one comparison (qwen3's 128 experts,
// k = 8: ~4x faster than a partial sort of all n indices).
void top_indices(const float* v, int32_t n, int32_t k, int32_t* out) {
  int32_t have = 0;
  for (int32_t i = 0; i < n; ++i) {
    const float x = v[i];
    // Later indices lose ties, so x must beat the k-th strictly.
    if (have == k && !(x > v[out[k - 1]])) continue;
    int32_t j = have < k ? have++ : k - 1;
    for (; j > 0 && x > v[out[j - 1]]; --j) out[j] = out[j - 1];
    out[j] = i;
  }
}
}  // namespace

void RouteScratch::fit(const RoutingParams& p) {
  const auto E = static_cast<size_t>(std::max(0, p.num_experts)), G = static_cast<size_t>(std::max(0, p.num_group));
  scores.resize(E);
  sel.resize(E);
  chosen.resize(static_cast<size_t>(std::max(0, p.top_k)));
  group_score.resize(G);
  kept_groups.resize(static_cast<size_t>(std::max(0, p.topk_group)));
  keep.resize(G);
}

void route(const void* logits, ep_moe_dtype_t dtype, int64_t T, const RoutingParams& p, int32_t* ids, float* weights,
           int64_t first_token, RouteScratch* scratch) {
  const int32_t E = p.num_experts, K = p.top_k;
  RouteScratch own;
  RouteScratch& rs = scratch ? *scratch : own;
  rs.fit(p);
  std::vector<float>& scores = rs.scores;
  std::vector<float>& sel = rs.sel;
  std::vector<int32_t>& chosen = rs.chosen;
  const int32_t G = p.num_group > 0 ? p.num_group : 0;
  std::vector<float>& group_score = rs.group_score;
  std::vector<int32_t>& kept_groups = rs.kept_groups;
  std::vector<char>& keep = rs.keep;

  for (int64_t t = 0; t < T; ++t) {
    const int64_t base = t * E;
    float mx = -std::numeric_limits<float>::infinity();
    for (int32_t e = 0; e < E; ++e) {
      const float l = load_elem(logits, dtype, base + e);
      if (std::isnan(l))
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "router_logits[token %lld, expert %d] is NaN",
             static_cast<long long>(first_token + t), e);
      scores[static_cast<size_t>(e)] = l;
      mx = std::max(mx, l);
    }
    if (p.sigmoid) {
      for (auto& s : scores) s = 1.0f / (1.0f + std::exp(-s));
    } else {
      if (std::isinf(mx))
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "router_logits of token %lld are %s: softmax is undefined",
             static_cast<long long>(first_token + t), mx > 0 ? "+inf" : "all -inf");
      float sum = 0.0f;
      for (auto& s : scores) {
        s = std::exp(s - mx);
        sum += s;
      }
      for (auto& s : scores) s /= sum;
    }
    for (int32_t e = 0; e < E; ++e)
      sel[static_cast<size_t>(e)] = scores[static_cast<size_t>(e)] + (p.bias ? p.bias[e] : 0.0f);

    if (G > 0) {
      const int32_t per = E / G;
      for (int32_t g = 0; g < G; ++g) {
        const float* v = sel.data() + g * per;
        if (p.bias) {  // sum of the two best (DeepSeek-V3 noaux_tc)
          float b1 = -std::numeric_limits<float>::infinity(), b2 = b1;
          for (int32_t i = 0; i < per; ++i) {
            if (v[i] > b1) {
              b2 = b1;
              b1 = v[i];
            } else if (v[i] > b2) {
              b2 = v[i];
            }
          }
          group_score[static_cast<size_t>(g)] = per >= 2 ? b1 + b2 : b1;
        } else {
          group_score[static_cast<size_t>(g)] = *std::max_element(v, v + per);
        }
      }
      top_indices(group_score.data(), G, p.topk_group, kept_groups.data());
      std::fill(keep.begin(), keep.end(), 0);
      for (int32_t g : kept_groups) keep[static_cast<size_t>(g)] = 1;
      for (int32_t e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per)]) sel[static_cast<size_t>(e)] = -std::numeric_limits<float>::infinity();
    }
    top_indices(sel.data(), E, K, chosen.data());

    float sum = 0.0f;
    for (int32_t k = 0; k < K; ++k) sum += scores[static_cast<size_t>(chosen[static_cast<size_t>(k)])];
    for (int32_t k = 0; k < K; ++k) {
      float w = scores[static_cast<size_t>(chosen[static_cast<size_t>(k)])];
      if (p.renormalize) w = sum > 0.0f ? w / sum : 0.0f;
      ids[t * K + k] = chosen[static_cast<size_t>(k)];
      weights[t * K + k] = w * p.scale;
    }
  }
}

void check_topk(const int32_t* ids, const float* weights, int64_t T, int32_t K, int32_t E) {
  for (int64_t i = 0; i < T * K; ++i) {
    if (ids[i] < 0 || ids[i] >= E)
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_ids[token %lld, slot %lld] = %d is outside [0, %d)",
           static_cast<long long>(i / K), static_cast<long long>(i % K), ids[i], E);
    if (!std::isfinite(weights[i]))
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_weights[token %lld, slot %lld] is not finite",
           static_cast<long long>(i / K), static_cast<long long>(i % K));
  }
}

}  // namespace ep_moe

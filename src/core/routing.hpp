// Top-k routing: router logits -> (expert id, weight) pairs per token, with
// the semantics of vLLM's fused_topk / grouped_topk.
#pragma once

#include <cstdint>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace ep_moe {

struct RoutingParams {
  int32_t num_experts = 0;
  int32_t top_k = 0;
  bool sigmoid = false;  // scoring: sigmoid instead of softmax
  bool renormalize = true;
  int32_t num_group = 0;  // grouped top-k when > 0
  int32_t topk_group = 0;
  const float* bias = nullptr;  // score-correction bias [E] or nullptr
  float scale = 1.0f;           // routed scaling factor
};

// route()'s per-token work lists. One kept by the caller (one per thread
// that routes) and fitted once makes route() allocate nothing.
struct RouteScratch {
  std::vector<float> scores, sel, group_score;
  std::vector<int32_t> chosen, kept_groups;
  std::vector<char> keep;
  // Sizes every list for p (allocates only where one is too small).
  void fit(const RoutingParams& p);
};

// Throws ep_moe::Error naming the token (first_token + its index here) for
// NaN logits (or an infinity that makes the scores undefined). Tokens are
// independent: ranges of them may be routed by separate calls.
void route(const void* logits, ep_moe_dtype_t dtype, int64_t num_tokens, const RoutingParams& p, int32_t* ids,
           float* weights, int64_t first_token = 0, RouteScratch* scratch = nullptr);

// Checks caller-given top-k ids/weights: ids in [0, E), weights finite.
void check_topk(const int32_t* ids, const float* weights, int64_t num_tokens, int32_t top_k, int32_t num_experts);

}  // namespace ep_moe

// Random layer configurations through the public API: sizes, routing
// (softmax or sigmoid, groups, score bias, scaling, renormalisation), the
// shared expert and its gate, activations, weight types (a different block
// format for down now and then, as Q4_K_M files mix them), activation
// types, thread counts, skip and dispatch modes, and token counts from 0 to
// past max_tokens, on one rank or two. Each configuration must be created or
// refused with a documented status and a message; a created layer takes its
// weights and runs, with finite outputs. The other tests check the numbers
// of chosen configurations against the reference; this one looks for the
// combinations nobody chose (the sanitizer builds run it too).
// EP_MOE_RANDOM_LAYERS=N draws N configurations (default 60);
// EP_MOE_SHOW_REFUSALS=1 prints each refusal's message.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/reference_quant.hpp"
#include "ep_moe/ep_moe.h"

namespace {

using Rng = std::mt19937;

int pick(Rng& g, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); }
template <class T, size_t N>
T pick(Rng& g, const T (&v)[N]) {
  return v[static_cast<size_t>(pick(g, 0, static_cast<int>(N) - 1))];
}

// The test-side dtype code (ref::F32, BF16, F16) of a float dtype.
int ref_dt(int32_t t) { return t == EP_MOE_DTYPE_F32 ? ref::F32 : t == EP_MOE_DTYPE_BF16 ? ref::BF16 : ref::F16; }

bool is_block_format(ep_moe_dtype_t t) { return t >= EP_MOE_DTYPE_Q8_0 && t <= EP_MOE_DTYPE_IQ1_M; }

// A [rows, cols] weight in dtype t with values of about 1/sqrt(cols)
// (block formats: random valid blocks of that magnitude).
std::vector<uint8_t> weight(ep_moe_dtype_t t, int64_t rows, int64_t cols, Rng& g) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(cols));
  if (is_block_format(t)) {
    std::vector<float> values;
    return refq::random_blocks(t, static_cast<int>(rows), static_cast<int>(cols), scale, g, &values);
  }
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (auto& x : v) x = ref::round_to(nd(g), ref_dt(t));
  return ref::encode(v, ref_dt(t));
}

bool documented_error(ep_moe_status_t s) { return s == EP_MOE_ERR_INVALID_ARGUMENT || s == EP_MOE_ERR_UNSUPPORTED; }

struct Drawn {
  ep_moe_layer_config_t lc;
  ep_moe_dtype_t down_dtype;  // the routed experts' down: weight_dtype or another block format
  int ep;
};

Drawn draw(Rng& g) {
  Drawn d;
  ep_moe_layer_config_t& c = d.lc;
  ep_moe_layer_config_init(&c);
  const ep_moe_dtype_t wts[] = {EP_MOE_DTYPE_F32,     EP_MOE_DTYPE_BF16,   EP_MOE_DTYPE_F16,   EP_MOE_DTYPE_Q8_0,
                                EP_MOE_DTYPE_Q4_0,    EP_MOE_DTYPE_Q4_K,   EP_MOE_DTYPE_Q5_K,  EP_MOE_DTYPE_Q6_K,
                                EP_MOE_DTYPE_IQ4_XS,  EP_MOE_DTYPE_MXFP4,  EP_MOE_DTYPE_Q2_K,  EP_MOE_DTYPE_Q3_K,
                                EP_MOE_DTYPE_Q4_1,    EP_MOE_DTYPE_Q5_0,   EP_MOE_DTYPE_Q5_1,  EP_MOE_DTYPE_IQ4_NL,
                                EP_MOE_DTYPE_IQ2_XXS, EP_MOE_DTYPE_IQ2_XS, EP_MOE_DTYPE_IQ2_S, EP_MOE_DTYPE_IQ3_XXS,
                                EP_MOE_DTYPE_IQ3_S,   EP_MOE_DTYPE_IQ1_S,  EP_MOE_DTYPE_IQ1_M};
  const ep_moe_dtype_t w = pick(g, wts);
  int64_t elems = 1;
  REQUIRE(ep_moe_dtype_block(&elems, nullptr, w) == EP_MOE_OK);  // 1 for f32, bf16, f16
  // Sizes in whole blocks, now and then not (a refusal to check).
  const int unit = static_cast<int>(std::max<int64_t>(elems, 32));
  const bool odd = pick(g, 0, 19) == 0;
  c.hidden_size = unit * pick(g, 1, elems >= 256 ? 2 : 8) + (odd ? 16 : 0);
  c.intermediate_size = unit * pick(g, 1, elems >= 256 ? 2 : 4);
  c.num_experts = pick(g, 1, 24);
  c.top_k = pick(g, 0, 19) == 0 ? pick(g, -1, c.num_experts + 1) : pick(g, 1, std::min(8, c.num_experts));
  c.activation = pick(g, 0, 3);
  c.weight_dtype = w;
  c.act_dtype = pick(g, 0, 2);
  c.scoring = pick(g, 0, 1);
  c.renormalize = pick(g, 0, 1);
  c.use_score_bias = c.scoring == EP_MOE_SCORING_SIGMOID ? pick(g, 0, 1) : 0;
  if (pick(g, 0, 3) == 0) {  // grouped top-k: groups dividing E
    std::vector<int> divs;
    for (int k = 2; k <= c.num_experts; ++k)
      if (c.num_experts % k == 0) divs.push_back(k);
    if (!divs.empty()) {
      c.num_expert_group = divs[static_cast<size_t>(pick(g, 0, static_cast<int>(divs.size()) - 1))];
      c.topk_group = pick(g, 1, c.num_expert_group);
    }
  }
  c.routed_scaling_factor = pick(g, 0, 1) ? 1.0f : 2.5f;
  if (pick(g, 0, 2) == 0) {
    c.shared_intermediate_size = unit * pick(g, 1, 2);
    c.shared_expert_gate = pick(g, 0, 1);
  }
  // top_k within the experts of topk_group groups (else a refusal).
  if (c.num_expert_group > 0 && c.top_k > c.topk_group * (c.num_experts / c.num_expert_group))
    c.topk_group = c.num_expert_group;
  c.max_tokens = pick(g, 1, 48);
  c.num_threads = pick(g, 1, 2);
  d.ep = pick(g, 0, 2) == 0 ? 2 : 1;
  // All-to-all and auto dispatch need a communicator; the weight-0 skip is
  // the all-gather flow's.
  c.dispatch_mode = d.ep > 1 ? pick(g, 0, 2) : EP_MOE_DISPATCH_ALLGATHER;
  c.skip_mode = c.dispatch_mode == EP_MOE_DISPATCH_ALLGATHER ? pick(g, 0, 1) : EP_MOE_SKIP_TOKENS;
  d.down_dtype = w;
  if (elems > 1 && pick(g, 0, 2) == 0) {  // another block format for down, of the same block size
    const ep_moe_dtype_t k256[] = {EP_MOE_DTYPE_Q4_K,    EP_MOE_DTYPE_Q5_K, EP_MOE_DTYPE_Q6_K,    EP_MOE_DTYPE_IQ4_XS,
                                   EP_MOE_DTYPE_Q2_K,    EP_MOE_DTYPE_Q3_K, EP_MOE_DTYPE_IQ2_XXS, EP_MOE_DTYPE_IQ2_S,
                                   EP_MOE_DTYPE_IQ3_XXS, EP_MOE_DTYPE_IQ1_M};
    const ep_moe_dtype_t k32[] = {EP_MOE_DTYPE_Q8_0, EP_MOE_DTYPE_Q4_0, EP_MOE_DTYPE_MXFP4,
                                  EP_MOE_DTYPE_Q5_0, EP_MOE_DTYPE_Q5_1, EP_MOE_DTYPE_IQ4_NL};
    d.down_dtype = elems == 256 ? pick(g, k256) : pick(g, k32);
  }
  return d;
}

std::string describe(const Drawn& d) {
  const ep_moe_layer_config_t& c = d.lc;
  return "ep " + std::to_string(d.ep) + " H " + std::to_string(c.hidden_size) + " I " +
         std::to_string(c.intermediate_size) + " E " + std::to_string(c.num_experts) + " k " + std::to_string(c.top_k) +
         " groups " + std::to_string(c.num_expert_group) + "/" + std::to_string(c.topk_group) + " scoring " +
         std::to_string(c.scoring) + " bias " + std::to_string(c.use_score_bias) + " act " +
         std::to_string(c.activation) + " w " + std::to_string(c.weight_dtype) + " down " +
         std::to_string(d.down_dtype) + " a " + std::to_string(c.act_dtype) + " shared " +
         std::to_string(c.shared_intermediate_size) + "/" + std::to_string(c.shared_expert_gate) + " max " +
         std::to_string(c.max_tokens) + " threads " + std::to_string(c.num_threads) + " skip " +
         std::to_string(c.skip_mode) + " dispatch " + std::to_string(c.dispatch_mode);
}

// One rank of a drawn layer: create, weights, forwards. Returns "" or what
// went wrong (checked on the main thread).
std::string run_rank(const Drawn& d, int rank, ep_moe_comm_t* comm, uint32_t seed, bool* created) {
  Rng g(seed + 1000u * static_cast<uint32_t>(rank + 1));
  const ep_moe_layer_config_t& c = d.lc;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = d.ep;
  mc.ep_rank = rank;
  mc.global_num_experts = std::max(1, c.num_experts);
  ep_moe_expert_map_t* map = nullptr;
  if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) return std::string("map: ") + ep_moe_last_error();
  // All-to-all and auto dispatch across two ranks: DP attention, each rank
  // its own tokens; all-gather: every rank the same tokens.
  const bool dp = d.ep > 1 && c.dispatch_mode != EP_MOE_DISPATCH_ALLGATHER;
  ep_moe_layer_t* layer = nullptr;
  const ep_moe_status_t s = ep_moe_layer_create(&layer, &c, map, comm, dp ? comm : nullptr);
  const std::string create_msg = ep_moe_last_error();
  std::string err;
  *created = s == EP_MOE_OK;
  if (s != EP_MOE_OK) {
    if (!documented_error(s) || create_msg.empty())
      err = "create: status " + std::to_string(s) + " '" + create_msg + "'";
    if (std::getenv("EP_MOE_SHOW_REFUSALS")) std::fprintf(stderr, "refused: %s\n", create_msg.c_str());
    ep_moe_expert_map_destroy(map);
    if (comm) ep_moe_comm_abort(comm);  // the other rank may have created its layer
    return err;
  }
  const auto set = [&](ep_moe_weight_t which, int32_t e, ep_moe_dtype_t t, int64_t rows, int64_t cols) {
    if (!err.empty()) return;
    const std::vector<uint8_t> w = weight(t, rows, cols, g);
    if (ep_moe_layer_set_weight(nullptr, layer, which, e, w.data(), t, rows, cols) != EP_MOE_OK)
      err = "set_weight " + std::to_string(which) + ": " + ep_moe_layer_last_error(layer);
  };
  const int H = c.hidden_size, I = c.intermediate_size, E = c.num_experts;
  const ep_moe_dtype_t w = static_cast<ep_moe_dtype_t>(c.weight_dtype);
  for (int e = 0; e < E; ++e) {
    int32_t owned = 0;
    ep_moe_expert_map_is_local(&owned, map, e);
    if (!owned) continue;
    set(EP_MOE_WEIGHT_EXPERT_GATE, e, w, I, H);
    set(EP_MOE_WEIGHT_EXPERT_UP, e, w, I, H);
    set(EP_MOE_WEIGHT_EXPERT_DOWN, e, d.down_dtype, H, I);
  }
  // The weights every rank is given whole (each keeps its shard of the
  // shared expert): the same on every rank.
  g.seed(seed);
  const int Is = c.shared_intermediate_size;
  if (Is > 0) {
    set(EP_MOE_WEIGHT_SHARED_GATE, -1, w, Is, H);
    set(EP_MOE_WEIGHT_SHARED_UP, -1, w, Is, H);
    set(EP_MOE_WEIGHT_SHARED_DOWN, -1, w, H, Is);
    if (c.shared_expert_gate) set(EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, EP_MOE_DTYPE_F32, 1, H);
  }
  if (c.use_score_bias) set(EP_MOE_WEIGHT_SCORE_BIAS, -1, EP_MOE_DTYPE_F32, 1, E);
  // Token counts 1, 0, max_tokens and one past (refused by every rank
  // before any collective). Under DP attention the second rank has half as
  // many (a zero-token rank at 1); all-gather ranks have the same tokens.
  const int counts[] = {1, 0, c.max_tokens, c.max_tokens + 1};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int j = 0; j < 4; ++j) {
    if (!err.empty()) break;
    const int32_t tc[2] = {counts[j], j == 3 ? counts[j] : counts[j] / 2};
    const int T = dp ? tc[rank] : counts[j];
    g.seed(seed + 7919u * static_cast<uint32_t>(j + 1) + (dp ? static_cast<uint32_t>(rank) : 0u));
    std::vector<float> xf(static_cast<size_t>(T) * H);
    for (auto& v : xf) v = ref::round_to(nd(g), ref_dt(c.act_dtype));
    const std::vector<uint8_t> x = ref::encode(xf, ref_dt(c.act_dtype));
    std::vector<uint8_t> y(x.size());
    std::vector<float> logits(static_cast<size_t>(T) * E);
    for (auto& v : logits) v = nd(g);
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = T;
    a.hidden = x.data();
    a.router_logits = logits.data();
    a.out = y.data();
    if (dp) a.dp_token_counts = tc;
    const ep_moe_status_t f = ep_moe_layer_forward(layer, &a);
    if (T > c.max_tokens) {
      if (f != EP_MOE_ERR_INVALID_ARGUMENT) err = "forward of max_tokens + 1: status " + std::to_string(f);
      break;  // a refused forward on one rank leaves the collective of the other unmatched: stop here
    }
    if (f != EP_MOE_OK) {
      err = std::string("forward of ") + std::to_string(T) + ": " + ep_moe_layer_last_error(layer);
      break;
    }
    const std::vector<float> out = ref::decode(y.data(), xf.size(), ref_dt(c.act_dtype));
    for (size_t i = 0; i < out.size() && err.empty(); ++i)
      if (!std::isfinite(out[i]))
        err = "forward of " + std::to_string(T) + ": output " + std::to_string(i) + " not finite";
  }
  if (!err.empty() && comm) ep_moe_comm_abort(comm);
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  return err;
}

}  // namespace

TEST_CASE("random layer configurations: created or refused with a message, and a created layer runs",
          "[layer][random]") {
  const char* env = std::getenv("EP_MOE_RANDOM_LAYERS");
  const int cases = env && std::atoi(env) > 0 ? std::atoi(env) : 60;
  Rng g(20261207);
  int created = 0, refused = 0;
  for (int i = 0; i < cases; ++i) {
    const Drawn d = draw(g);
    const uint32_t seed = static_cast<uint32_t>(g());
    INFO("case " << i << ": " << describe(d));
    std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(d.ep), nullptr);
    if (d.ep > 1) REQUIRE(ep_moe_comm_create_local(comms.data(), d.ep, nullptr) == EP_MOE_OK);
    std::vector<std::string> errs(static_cast<size_t>(d.ep));
    std::vector<char> made(static_cast<size_t>(d.ep), 0);
    std::vector<std::thread> ts;
    for (int r = 0; r < d.ep; ++r)
      ts.emplace_back([&, r] {
        bool c = false;
        errs[static_cast<size_t>(r)] = run_rank(d, r, comms[static_cast<size_t>(r)], seed, &c);
        made[static_cast<size_t>(r)] = c;
      });
    for (auto& t : ts) t.join();
    for (auto* c : comms) ep_moe_comm_destroy(c);
    // Both ranks take the same decision on the same configuration.
    CHECK(made.front() == made.back());
    for (const auto& e : errs) CHECK(e == "");
    (made.front() ? created : refused) += 1;
  }
  WARN(created << " configurations created and run, " << refused << " refused");
  CHECK(created > cases / 2);
  CHECK(refused > 0);
}

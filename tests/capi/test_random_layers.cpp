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
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace {

using Rng = std::mt19937;

int pick(Rng& g, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); }
template <class T, size_t N>
T pick(Rng& g, const T (&v)[N]) {
  return v[static_cast<size_t>(pick(g, 0, static_cast<int>(N) - 1))];
}

// Elements per block and bytes per block of a block format (1, element size
// for the float types).
void block_of(ep_moe_dtype_t t, int* elems, int* bytes) {
  switch (t) {
    case EP_MOE_DTYPE_Q8_0: *elems = 32, *bytes = 34; return;
    case EP_MOE_DTYPE_Q4_0: *elems = 32, *bytes = 18; return;
    case EP_MOE_DTYPE_MXFP4: *elems = 32, *bytes = 17; return;
    case EP_MOE_DTYPE_Q4_K: *elems = 256, *bytes = 144; return;
    case EP_MOE_DTYPE_Q5_K: *elems = 256, *bytes = 176; return;
    case EP_MOE_DTYPE_Q6_K: *elems = 256, *bytes = 210; return;
    case EP_MOE_DTYPE_IQ4_XS: *elems = 256, *bytes = 136; return;
    case EP_MOE_DTYPE_F32: *elems = 1, *bytes = 4; return;
    default: *elems = 1, *bytes = 2; return;  // bf16, f16
  }
}

uint16_t f16_of(float f) {  // small normal values only
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  if (e <= 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
  return static_cast<uint16_t>(((u >> 16) & 0x8000) | (e << 10) | ((u >> 13) & 0x3ff));
}

// A [rows, cols] weight in dtype t with values of about 1/sqrt(cols): block
// formats as random bytes with small scales (any bytes are valid blocks).
std::vector<uint8_t> weight(ep_moe_dtype_t t, int64_t rows, int64_t cols, Rng& g) {
  int elems = 1, bytes = 4;
  block_of(t, &elems, &bytes);
  const size_t n = static_cast<size_t>(rows * (cols / elems) * bytes);
  std::vector<uint8_t> b(n);
  std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
  if (t == EP_MOE_DTYPE_F32 || t == EP_MOE_DTYPE_BF16 || t == EP_MOE_DTYPE_F16) {
    for (size_t i = 0; i < n / static_cast<size_t>(bytes); ++i) {
      const float v = nd(g);
      uint32_t u;
      std::memcpy(&u, &v, 4);
      if (t == EP_MOE_DTYPE_F32) std::memcpy(&b[4 * i], &v, 4);
      else {
        const uint16_t h = t == EP_MOE_DTYPE_BF16 ? static_cast<uint16_t>(u >> 16) : f16_of(v);
        std::memcpy(&b[2 * i], &h, 2);
      }
    }
    return b;
  }
  for (auto& x : b) x = static_cast<uint8_t>(pick(g, 0, 255));
  // Random quants under small scales, so that outputs stay well inside
  // f16's range: the block scale d about 1/(32 sqrt(cols)), the K formats'
  // and IQ4_XS's sub-block scales 1 (MXFP4: an e8m0 exponent of 2^-9).
  const uint16_t d = f16_of(1.0f / (32.0f * std::sqrt(static_cast<float>(cols))));
  for (size_t at = 0; at < n; at += static_cast<size_t>(bytes)) {
    uint8_t* blk = &b[at];
    switch (t) {
      case EP_MOE_DTYPE_MXFP4: blk[0] = 118; break;
      case EP_MOE_DTYPE_Q6_K:
        std::memset(blk + 192, 1, 16);  // int8 scales
        std::memcpy(blk + 208, &d, 2);
        break;
      case EP_MOE_DTYPE_Q4_K:
      case EP_MOE_DTYPE_Q5_K:
        std::memcpy(blk, &d, 2);
        std::memcpy(blk + 2, &d, 2);  // dmin
        std::memset(blk + 4, 1, 12);  // 6-bit scales and mins of 1 (and their high bits 0)
        break;
      case EP_MOE_DTYPE_IQ4_XS:
        std::memcpy(blk, &d, 2);
        blk[2] = blk[3] = 0xAA;         // scales_h: 2 for each sub-block ...
        std::memset(blk + 4, 0x11, 4);  // ... scales_l: 1, so 33 - 32 = 1
        break;
      default: std::memcpy(blk, &d, 2);  // Q8_0, Q4_0
    }
  }
  return b;
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
  const ep_moe_dtype_t wts[] = {EP_MOE_DTYPE_F32,    EP_MOE_DTYPE_BF16, EP_MOE_DTYPE_F16,  EP_MOE_DTYPE_Q8_0,
                                EP_MOE_DTYPE_Q4_0,   EP_MOE_DTYPE_Q4_K, EP_MOE_DTYPE_Q5_K, EP_MOE_DTYPE_Q6_K,
                                EP_MOE_DTYPE_IQ4_XS, EP_MOE_DTYPE_MXFP4};
  const ep_moe_dtype_t w = pick(g, wts);
  int elems = 1, bytes = 4;
  block_of(w, &elems, &bytes);
  // Sizes in whole blocks, now and then not (a refusal to check).
  const int unit = std::max(elems, 32);
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
    const ep_moe_dtype_t k256[] = {EP_MOE_DTYPE_Q4_K, EP_MOE_DTYPE_Q5_K, EP_MOE_DTYPE_Q6_K, EP_MOE_DTYPE_IQ4_XS};
    const ep_moe_dtype_t k32[] = {EP_MOE_DTYPE_Q8_0, EP_MOE_DTYPE_Q4_0, EP_MOE_DTYPE_MXFP4};
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
  const size_t es = c.act_dtype == EP_MOE_DTYPE_F32 ? 4 : 2;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int j = 0; j < 4; ++j) {
    if (!err.empty()) break;
    const int32_t tc[2] = {counts[j], j == 3 ? counts[j] : counts[j] / 2};
    const int T = dp ? tc[rank] : counts[j];
    g.seed(seed + 7919u * static_cast<uint32_t>(j + 1) + (dp ? static_cast<uint32_t>(rank) : 0u));
    std::vector<uint8_t> x(static_cast<size_t>(T) * H * es), y(x.size());
    for (size_t i = 0; i < x.size() / es; ++i) {
      const float v = nd(g);
      if (es == 4) std::memcpy(&x[4 * i], &v, 4);
      else {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        const uint16_t h = c.act_dtype == EP_MOE_DTYPE_BF16 ? static_cast<uint16_t>(u >> 16) : f16_of(v);
        std::memcpy(&x[2 * i], &h, 2);
      }
    }
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
    for (size_t i = 0; i < y.size() / es && err.empty(); ++i) {
      float v = 0;
      if (es == 4) std::memcpy(&v, &y[4 * i], 4);
      else {
        uint16_t h;
        std::memcpy(&h, &y[2 * i], 2);
        const uint32_t u = c.act_dtype == EP_MOE_DTYPE_BF16 ? static_cast<uint32_t>(h) << 16
                           : (h & 0x7c00u) == 0x7c00u       ? 0x7f800000u
                                                            : 0u;  // f16: only inf/NaN matter here
        std::memcpy(&v, &u, 4);
      }
      if (!std::isfinite(v)) err = "forward of " + std::to_string(T) + ": output " + std::to_string(i) + " not finite";
    }
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

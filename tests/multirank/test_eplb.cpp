// Expert load balancing through the C API: load statistics and live
// re-placement (same group and elastic), against the double-precision
// reference and against independently computed expectations. The
// rebalancer's own tests are in test_rebalance.cpp.
#include <algorithm>
#include <cmath>

#include "../common/seed.hpp"
#include "../io/writers.hpp"
#include "harness.hpp"
#include "rebalance_helpers.hpp"

namespace {

using rebalance_helpers::rebalance;
using rebalance_helpers::zipf;

std::mt19937& rng() {
  static std::mt19937 g(test_seed());
  return g;
}

// ---------------------------------------------------------------------------
// In-process ranks whose layers live across phases (create, forward,
// replace, forward...). Each phase runs one thread per rank.

struct World {
  harness::Case c;        // spec, dtypes, dispatch, max_tokens
  bool dp_is_ep = false;  // every rank its own DP replica (dp_comm = the EP handle)
  ref::Weights w;
  std::vector<ep_moe_comm_t*> comms;  // the current EP group's handles
  std::vector<ep_moe_layer_t*> layers;
  std::vector<std::vector<ep_moe_comm_t*>> old_groups;  // kept alive until the end
  ~World() {
    for (auto* l : layers) ep_moe_layer_destroy(l);
    for (auto* h : comms) ep_moe_comm_destroy(h);
    for (auto& g : old_groups)
      for (auto* h : g) ep_moe_comm_destroy(h);
  }
};

ep_moe_expert_map_t* make_map(int ep, int rank, int E, const std::vector<int32_t>& custom) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = ep;
  mc.ep_rank = rank;
  mc.global_num_experts = E;
  if (!custom.empty()) {
    mc.placement = EP_MOE_PLACEMENT_CUSTOM;
    mc.custom_slots = custom.data();
    mc.num_custom_slots = static_cast<int32_t>(custom.size());
  }
  ep_moe_expert_map_t* m = nullptr;
  REQUIRE(ep_moe_expert_map_create(&m, &mc) == EP_MOE_OK);
  return m;
}

// Creates the group and its layers with every weight set.
void create(World& W, int ep, const std::vector<int32_t>& custom = {}) {
  W.comms.assign(static_cast<size_t>(ep), nullptr);
  REQUIRE(ep_moe_comm_create_local(W.comms.data(), ep, nullptr) == EP_MOE_OK);
  W.layers.assign(static_cast<size_t>(ep), nullptr);
  std::vector<std::string> err(static_cast<size_t>(ep));
  const ep_moe_layer_config_t lc = harness::layer_config(W.c);
  for (int r = 0; r < ep; ++r) {
    ep_moe_expert_map_t* m = make_map(ep, r, W.c.spec.E, custom);
    ep_moe_comm_t* h = W.comms[static_cast<size_t>(r)];
    REQUIRE(ep_moe_layer_create(&W.layers[static_cast<size_t>(r)], &lc, m, h, W.dp_is_ep ? h : nullptr) == EP_MOE_OK);
    ep_moe_expert_map_destroy(m);
    int stored = 0;
    REQUIRE(harness::load_weights(W.layers[static_cast<size_t>(r)], W.c, W.w, &stored) == "");
  }
}

struct Step {
  harness::Inputs in;
  std::vector<int> tokens;  // per replica
};

Step draw(const World& W, int ranks) {
  harness::Case c = W.c;
  c.dp = W.dp_is_ep ? ranks : 1;
  c.tokens.clear();
  std::uniform_int_distribution<int> t(0, c.max_tokens);
  for (int d = 0; d < c.dp; ++d) c.tokens.push_back(t(rng()));
  if (c.dp > 1) c.tokens[0] = 0;  // a zero-token rank
  else c.tokens[0] = std::max(1, c.tokens[0]);
  Step s;
  s.in = harness::make_inputs(c, W.w, rng());
  s.tokens = c.tokens;
  return s;
}

// One forward on every rank; returns each rank's output (decoded). Checks
// them against the reference.
std::vector<std::vector<float>> forward(World& W, const Step& s) {
  const int n = static_cast<int>(W.layers.size());
  std::vector<std::vector<float>> outs(static_cast<size_t>(n));
  std::vector<std::string> errs(static_cast<size_t>(n));
  const size_t es = W.c.adt == ref::F32 ? 4 : 2;
  harness::run_ranks(n, [&](int r) {
    const int rep = W.dp_is_ep ? r : 0;
    const int T = s.tokens[static_cast<size_t>(rep)];
    const auto hid = ref::encode(s.in.hidden[static_cast<size_t>(rep)], W.c.adt);
    std::vector<uint8_t> out(static_cast<size_t>(T) * W.c.spec.H * es + 1, 0xAB);
    std::vector<int32_t> counts(s.tokens.begin(), s.tokens.end());
    std::vector<int32_t> decode(counts.size(), 0);
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = T;
    a.hidden = hid.data();
    a.topk_ids = s.in.topk_ids[static_cast<size_t>(rep)].data();
    a.topk_weights = s.in.topk_w[static_cast<size_t>(rep)].data();
    a.out = out.data();
    if (W.dp_is_ep) {
      a.dp_token_counts = counts.data();
      a.dp_is_decode = decode.data();
    }
    if (ep_moe_layer_forward(W.layers[static_cast<size_t>(r)], &a) != EP_MOE_OK) {
      errs[static_cast<size_t>(r)] = ep_moe_layer_last_error(W.layers[static_cast<size_t>(r)]);
      return;
    }
    if (out.back() != 0xAB) errs[static_cast<size_t>(r)] = "wrote past the output";
    outs[static_cast<size_t>(r)] = ref::decode(out.data(), static_cast<size_t>(T) * W.c.spec.H, W.c.adt);
  });
  const double tol = harness::tolerance(W.c.adt, W.c.wdt, W.c.quant());
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ": " << errs[static_cast<size_t>(r)]);
    REQUIRE(errs[static_cast<size_t>(r)].empty());
    const auto& exp = s.in.expect[static_cast<size_t>(W.dp_is_ep ? r : 0)];
    const auto& got = outs[static_cast<size_t>(r)];
    REQUIRE(got.size() == exp.size());
    const auto rep = static_cast<size_t>(W.dp_is_ep ? r : 0);  // steps made by hand may have no slack
    const harness::RelError re =
        harness::relative_error(got, exp, rep < s.in.slack.size() ? &s.in.slack[rep] : nullptr);
    CHECK(re.err <= tol);
  }
  return outs;
}

// Runs ep_moe_layer_replace on every rank of the (new) group.
std::vector<ep_moe_status_t> replace(World& W, const std::vector<int32_t>& custom, int new_ep,
                                     const std::vector<ep_moe_comm_t*>& new_comms, const ep_moe_checkpoint_t* ck,
                                     int layer_index, std::vector<std::string>* messages = nullptr,
                                     const std::function<ep_moe_expert_map_t*(int)>& map_for = nullptr) {
  std::vector<ep_moe_status_t> st(static_cast<size_t>(new_ep), EP_MOE_OK);
  std::vector<std::string> msg(static_cast<size_t>(new_ep));
  // The maps are made here, on the test's thread: make_map asserts, and
  // Catch's assertions are not thread-safe (TSan reports a race otherwise).
  std::vector<ep_moe_expert_map_t*> maps(static_cast<size_t>(new_ep), nullptr);
  for (int r = 0; r < new_ep; ++r)
    maps[static_cast<size_t>(r)] = map_for ? map_for(r) : make_map(new_ep, r, W.c.spec.E, custom);
  harness::run_ranks(new_ep, [&](int r) {
    ep_moe_expert_map_t* m = maps[static_cast<size_t>(r)];
    ep_moe_comm_t* c = new_comms.empty() ? nullptr : new_comms[static_cast<size_t>(r)];
    st[static_cast<size_t>(r)] = ep_moe_layer_replace(W.layers[static_cast<size_t>(r)], m, c, ck, layer_index);
    if (st[static_cast<size_t>(r)] != EP_MOE_OK)
      msg[static_cast<size_t>(r)] = ep_moe_layer_last_error(W.layers[static_cast<size_t>(r)]);
    ep_moe_expert_map_destroy(m);
  });
  if (messages) *messages = msg;
  return st;
}

// The last rank is lost: its layer goes, and the survivors get a new group
// (returned; the old one stays alive, owned by the world, until the end).
std::vector<ep_moe_comm_t*> lose_last_rank(World& W) {
  ep_moe_layer_destroy(W.layers.back());
  W.layers.pop_back();
  W.old_groups.push_back(W.comms);
  std::vector<ep_moe_comm_t*> group(W.layers.size(), nullptr);
  REQUIRE(ep_moe_comm_create_local(group.data(), static_cast<int32_t>(group.size()), nullptr) == EP_MOE_OK);
  W.comms = group;
  return group;
}

// A rank joins: a new group one larger (returned, and the world's now; the
// old one stays alive, owned by the world) and, last in W.layers, the joining rank's layer of
// the new linear placement, without weights.
std::vector<ep_moe_comm_t*> join_fresh_rank(World& W) {
  const int n = static_cast<int>(W.layers.size()) + 1;
  W.old_groups.push_back(W.comms);
  std::vector<ep_moe_comm_t*> group(static_cast<size_t>(n), nullptr);
  REQUIRE(ep_moe_comm_create_local(group.data(), n, nullptr) == EP_MOE_OK);
  const ep_moe_layer_config_t lc = harness::layer_config(W.c);
  ep_moe_expert_map_t* m = make_map(n, n - 1, W.c.spec.E, {});
  ep_moe_layer_t* fresh = nullptr;
  REQUIRE(ep_moe_layer_create(&fresh, &lc, m, group.back(), nullptr) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  W.layers.push_back(fresh);
  W.comms = group;
  return group;
}

int64_t attr(ep_moe_layer_t* l, ep_moe_layer_attr_t a) {
  int64_t v = -1;
  REQUIRE(ep_moe_layer_get_attr(&v, l, a) == EP_MOE_OK);
  return v;
}

void check_close(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, double tol) {
  REQUIRE(a.size() == b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    REQUIRE(a[r].size() == b[r].size());
    double scale = 1e-6, err = 0;
    for (size_t i = 0; i < a[r].size(); ++i) {
      scale = std::max(scale, static_cast<double>(std::fabs(a[r][i])));
      err = std::max(err, static_cast<double>(std::fabs(a[r][i] - b[r][i])));
    }
    INFO("rank " << r << " before/after max difference " << err / scale);
    CHECK(err / scale <= tol);
  }
}

World small_world(int dispatch, bool dp_is_ep, int Is, int wdt) {
  World W;
  W.c.spec.H = 32;
  W.c.spec.I = 16;
  W.c.spec.E = 12;
  W.c.spec.K = 3;
  W.c.spec.Is = Is;
  W.c.wdt = wdt;
  W.c.dispatch = dispatch;
  W.c.max_tokens = 12;
  W.c.given_topk = true;
  W.dp_is_ep = dp_is_ep;
  W.w = ref::random_weights(W.c.spec, wdt, rng());
  return W;
}

}  // namespace

// ---------------------------------------------------------------------------

TEST_CASE("expert load: every routed pair counted once over the group, in every dispatch mode", "[eplb][load]") {
  struct Mode {
    int dispatch;
    bool dp_is_ep;
    int skip;
  };
  for (const Mode m : {Mode{EP_MOE_DISPATCH_ALLGATHER, false, EP_MOE_SKIP_TOKENS},
                       Mode{EP_MOE_DISPATCH_ALLGATHER, false, EP_MOE_SKIP_WEIGHT_ZERO},
                       Mode{EP_MOE_DISPATCH_ALLGATHER, true, EP_MOE_SKIP_TOKENS},
                       Mode{EP_MOE_DISPATCH_ALLTOALL, true, EP_MOE_SKIP_TOKENS},
                       Mode{EP_MOE_DISPATCH_AUTO, true, EP_MOE_SKIP_TOKENS}}) {
    for (int ep : {1, 3, 4}) {
      World W = small_world(m.dispatch, m.dp_is_ep && ep > 1, 8, ref::F32);
      W.c.skip_mode = m.skip;
      INFO("dispatch " << m.dispatch << " dp=ep " << m.dp_is_ep << " skip " << m.skip << " ep " << ep);
      if (ep == 1 && m.dispatch != EP_MOE_DISPATCH_ALLGATHER) continue;
      create(W, ep,
             ep == 4 ? std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 5, 0, 9} : std::vector<int32_t>{});
      std::vector<int64_t> expect(static_cast<size_t>(W.c.spec.E), 0);
      const int steps = 3;
      for (int f = 0; f < steps; ++f) {
        const Step s = draw(W, ep);
        for (const auto& ids : s.in.topk_ids)
          for (int32_t e : ids) ++expect[static_cast<size_t>(e)];
        forward(W, s);
      }
      std::vector<std::vector<int64_t>> local(static_cast<size_t>(ep)), total(static_cast<size_t>(ep));
      harness::run_ranks(ep, [&](int r) {
        local[static_cast<size_t>(r)].assign(static_cast<size_t>(W.c.spec.E), -1);
        total[static_cast<size_t>(r)].assign(static_cast<size_t>(W.c.spec.E), -1);
        ep_moe_layer_t* l = W.layers[static_cast<size_t>(r)];
        ep_moe_layer_expert_load(local[static_cast<size_t>(r)].data(), static_cast<size_t>(W.c.spec.E), l, 0, 0);
        ep_moe_layer_expert_load(total[static_cast<size_t>(r)].data(), static_cast<size_t>(W.c.spec.E), l, 1, 1);
      });
      std::vector<int64_t> sum(static_cast<size_t>(W.c.spec.E), 0);
      for (int r = 0; r < ep; ++r) {
        CHECK(total[static_cast<size_t>(r)] == expect);
        for (int e = 0; e < W.c.spec.E; ++e)
          sum[static_cast<size_t>(e)] += local[static_cast<size_t>(r)][static_cast<size_t>(e)];
      }
      CHECK(sum == expect);
      // Reset: a new window.
      for (int r = 0; r < ep; ++r) {
        CHECK(attr(W.layers[static_cast<size_t>(r)], EP_MOE_LAYER_ATTR_LOAD_STEPS) == 0);
        std::vector<int64_t> z(static_cast<size_t>(W.c.spec.E), -1);
        REQUIRE(ep_moe_layer_expert_load(z.data(), z.size(), W.layers[static_cast<size_t>(r)], 0, 0) == EP_MOE_OK);
        CHECK(std::all_of(z.begin(), z.end(), [](int64_t v) { return v == 0; }));
      }
    }
  }
}

TEST_CASE("expert load: argument errors", "[eplb][load][errors]") {
  World W = small_world(EP_MOE_DISPATCH_ALLGATHER, false, 0, ref::F32);
  create(W, 1);
  std::vector<int64_t> out(12);
  CHECK(ep_moe_layer_expert_load(nullptr, 12, W.layers[0], 0, 0) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_layer_expert_load(out.data(), 11, W.layers[0], 0, 0) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_layer_last_error(W.layers[0])).find("12 experts") != std::string::npos);
  CHECK(ep_moe_layer_expert_load(out.data(), 12, nullptr, 0, 0) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(ep_moe_layer_expert_load(out.data(), 12, W.layers[0], 1, 0) == EP_MOE_OK);  // no group: local counts
}

TEST_CASE("replace: a rebalanced placement gives the same output, in every dispatch mode", "[eplb][replace]") {
  struct Mode {
    int dispatch;
    bool dp_is_ep;
    int wdt;
  };
  for (const Mode m :
       {Mode{EP_MOE_DISPATCH_ALLGATHER, false, ref::BF16}, Mode{EP_MOE_DISPATCH_ALLGATHER, true, ref::F32},
        Mode{EP_MOE_DISPATCH_ALLTOALL, true, ref::F16}, Mode{EP_MOE_DISPATCH_AUTO, true, ref::F32}}) {
    for (int ep : {2, 3, 4}) {
      INFO("dispatch " << m.dispatch << " dp=ep " << m.dp_is_ep << " ep " << ep);
      World W = small_world(m.dispatch, m.dp_is_ep, 8, m.wdt);
      create(W, ep);
      // A skewed load: hot experts get replicas.
      const Step warm = draw(W, ep);
      forward(W, warm);
      std::vector<double> load = zipf(W.c.spec.E, 1.2, rng());
      const int P = ((W.c.spec.E + 3 + ep - 1) / ep) * ep;
      const auto table = rebalance(load, P, ep);
      const Step s = draw(W, ep);
      const auto before = forward(W, s);
      const auto st = replace(W, table, ep, {}, nullptr, 0);
      for (int r = 0; r < ep; ++r) REQUIRE(st[static_cast<size_t>(r)] == EP_MOE_OK);
      const auto after = forward(W, s);
      check_close(before, after, harness::tolerance(W.c.adt, W.c.wdt));
      int64_t sent = 0, received = 0;
      for (auto* l : W.layers) {
        sent += attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_SENT);
        received += attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED);
        CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ) == 0);
        CHECK(attr(l, EP_MOE_LAYER_ATTR_READY) == 1);
        CHECK(attr(l, EP_MOE_LAYER_ATTR_LOAD_STEPS) == 1);  // the window restarted at the replace
      }
      CHECK(sent == received);
      CHECK(sent > 0);
      // And back to linear: weights move back, output unchanged.
      std::vector<std::string> why;
      const auto st2 = replace(W, {}, ep, {}, nullptr, 0, &why);
      for (int r = 0; r < ep; ++r) {
        INFO("rank " << r << ": " << why[static_cast<size_t>(r)]);
        REQUIRE(st2[static_cast<size_t>(r)] == EP_MOE_OK);
      }
      check_close(before, forward(W, s), harness::tolerance(W.c.adt, W.c.wdt));
      forward(W, draw(W, ep));
    }
  }
}

TEST_CASE("replace: expert biases travel with their experts (GPT-OSS)", "[eplb][replace][bias]") {
  for (int dispatch : {EP_MOE_DISPATCH_ALLGATHER, EP_MOE_DISPATCH_ALLTOALL}) {
    INFO("dispatch " << dispatch);
    World W;
    W.c.spec.H = 32;
    W.c.spec.I = 16;
    W.c.spec.E = 12;
    W.c.spec.K = 3;
    W.c.spec.act = ref::SWIGLU_OAI;
    W.c.spec.expert_bias = true;
    W.c.wdt = ref::BF16;
    W.c.dispatch = dispatch;
    W.c.max_tokens = 12;
    W.c.given_topk = true;
    W.dp_is_ep = dispatch == EP_MOE_DISPATCH_ALLTOALL;
    W.w = ref::random_weights(W.c.spec, W.c.wdt, rng());
    create(W, 3);
    const Step s = draw(W, 3);
    const auto before = forward(W, s);
    // Every expert on two ranks (rank r: experts 4r .. 4r+7 mod 12): most move, with their biases.
    std::vector<int32_t> twice;
    for (int r = 0; r < 3; ++r)
      for (int i = 0; i < 8; ++i) twice.push_back((r * 4 + i) % 12);
    const auto st = replace(W, twice, 3, {}, nullptr, 0);
    for (auto x : st) REQUIRE(x == EP_MOE_OK);
    check_close(before, forward(W, s), harness::tolerance(W.c.adt, W.c.wdt));
    // Rank 2 is lost; the survivors hold every expert and swap some.
    const auto group = lose_last_rank(W);
    const auto st2 = replace(W, {0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11}, 2, group, nullptr, 0);
    for (auto x : st2) REQUIRE(x == EP_MOE_OK);
    for (auto* l : W.layers) {
      CHECK(attr(l, EP_MOE_LAYER_ATTR_READY) == 1);
      CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) > 0);
    }
    forward(W, draw(W, 2));
  }
}

TEST_CASE("replace: experts in GGUF block formats travel as their blocks, in every dispatch mode",
          "[eplb][replace][quant]") {
  // Q4_K gate/up with Q6_K down (Q4_K_M-like), on a bf16 layer (the blocks
  // are kept as given), Q8_0 throughout on a Q8_0 layer with a Q8_0
  // shared expert beside, IQ2_XXS with Q3_K down (DeepSeek UD-IQ2_XXS-like)
  // on a bf16 layer, and Q2_K with Q3_K down on a Q2_K layer.
  const int gu[] = {refq::Q4_K, refq::Q8_0, refq::IQ2_XXS, refq::Q2_K};
  const int dn[] = {refq::Q6_K, refq::Q8_0, refq::Q3_K, refq::Q3_K};
  const int lw[] = {-1, refq::Q8_0, -1, refq::Q2_K};
  for (int variant = 0; variant < 4; ++variant)
    for (int dispatch : {EP_MOE_DISPATCH_ALLGATHER, EP_MOE_DISPATCH_ALLTOALL}) {
      INFO("variant " << variant << " dispatch " << dispatch);
      World W;
      W.c.spec.H = 256;
      W.c.spec.I = 256;
      W.c.spec.E = 12;
      W.c.spec.K = 3;
      W.c.wdt = variant % 2 == 0 ? ref::BF16 : ref::F32;
      W.c.qgu = gu[variant];
      W.c.qdown = dn[variant];
      W.c.layer_wdt = lw[variant];
      W.c.spec.Is = variant == 1 && dispatch == EP_MOE_DISPATCH_ALLTOALL ? 64 : 0;
      W.c.qsgu = W.c.qsdown = W.c.spec.Is > 0 ? refq::Q8_0 : 0;
      W.c.dispatch = dispatch;
      W.c.max_tokens = 12;
      W.c.given_topk = true;
      W.dp_is_ep = dispatch == EP_MOE_DISPATCH_ALLTOALL;
      W.w = harness::case_weights(W.c, &W.c.spec, rng());
      create(W, 3);
      const Step s = draw(W, 3);
      const auto before = forward(W, s);
      const auto row = [](int t) { return 256 / refq::block_elems(t) * refq::block_bytes(t); };
      const int64_t blocks = 2 * 256 * row(W.c.qgu) + 256 * row(W.c.qdown);  // one expert's, H = I = 256
      // Every expert moves one rank on (rank r: experts 4r + 4 .. 4r + 7 mod
      // 12). Each keeps its rows, so each takes the same kernel on the same
      // blocks: the same bits in the same order of sums.
      std::vector<int32_t> shifted;
      for (int r = 0; r < 3; ++r)
        for (int i = 0; i < 4; ++i) shifted.push_back((r * 4 + 4 + i) % 12);
      for (auto x : replace(W, shifted, 3, {}, nullptr, 0)) REQUIRE(x == EP_MOE_OK);
      check_close(before, forward(W, s), 1e-6);
      for (auto* l : W.layers) CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) == 4 * blocks);
      // Every expert on two ranks (rank r: experts 4r .. 4r+7 mod 12): most
      // move. Replicas split an expert's rows, and fewer rows may take
      // another kernel (int8 tiles or block kernels) whose f32
      // sums differ in the last bits, enough for an element of the down
      // projection's quantized activation to land one step apart; forward
      // holds the output to the reference, which allows for that.
      std::vector<int32_t> twice;
      for (int r = 0; r < 3; ++r)
        for (int i = 0; i < 8; ++i) twice.push_back((r * 4 + i) % 12);
      const auto st = replace(W, twice, 3, {}, nullptr, 0);
      for (auto x : st) REQUIRE(x == EP_MOE_OK);
      forward(W, s);
      for (auto* l : W.layers) {
        CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) % blocks == 0);
        CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) >= blocks);
      }
      // Rank 2 is lost; the survivors hold every expert and swap some.
      const auto group = lose_last_rank(W);
      const auto st2 = replace(W, {0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11}, 2, group, nullptr, 0);
      for (auto x : st2) REQUIRE(x == EP_MOE_OK);
      for (auto* l : W.layers) CHECK(attr(l, EP_MOE_LAYER_ATTR_READY) == 1);
      // The same placement again: every expert kept, no bytes received, yet
      // each rank still knows its formats (the next re-placement agrees on
      // them) and computes on its blocks.
      const Step s2 = draw(W, 2);
      const auto kept = forward(W, s2);
      for (auto x : replace(W, {0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11}, 2, {}, nullptr, 0)) REQUIRE(x == EP_MOE_OK);
      for (auto* l : W.layers) CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) == 0);
      check_close(kept, forward(W, s2), 1e-6);
      std::vector<std::string> why;
      const auto st3 = replace(W, {}, 2, {}, nullptr, 0, &why);
      for (int r = 0; r < 2; ++r) {
        INFO("rank " << r << ": " << why[static_cast<size_t>(r)]);
        REQUIRE(st3[static_cast<size_t>(r)] == EP_MOE_OK);
      }
      check_close(kept, forward(W, s2), 1e-6);
    }
}

TEST_CASE("replace: a shared expert in blocks stays so where its shard stays, and moves dequantized where it changes",
          "[eplb][replace][quant]") {
  World W;
  W.c.spec.H = 256;
  W.c.spec.I = 256;
  W.c.spec.E = 6;
  W.c.spec.K = 2;
  W.c.spec.Is = 768;  // shards of 256 on 3 ranks (whole Q4_K/Q6_K blocks), of 192 on 4 (not)
  W.c.qgu = W.c.qsgu = refq::Q4_K;
  W.c.qdown = W.c.qsdown = refq::Q6_K;
  W.c.dispatch = EP_MOE_DISPATCH_ALLGATHER;
  W.c.max_tokens = 12;
  W.c.given_topk = true;
  W.w = harness::case_weights(W.c, &W.c.spec, rng());
  REQUIRE(W.c.spec.shared_act_block_down == 256);  // the reference quantizes the shard's input
  create(W, 3);
  const Step s = draw(W, 3);
  const auto before = forward(W, s);
  std::vector<int64_t> bytes;
  for (auto* l : W.layers) bytes.push_back(attr(l, EP_MOE_LAYER_ATTR_WEIGHT_BYTES));
  // Experts rotate between the ranks; every shard of the shared expert stays.
  const auto st = replace(W, {2, 3, 4, 5, 0, 1}, 3, {}, nullptr, 0);
  for (auto x : st) REQUIRE(x == EP_MOE_OK);
  check_close(before, forward(W, s), 1e-6);  // the same blocks
  for (size_t r = 0; r < W.layers.size(); ++r)
    CHECK(attr(W.layers[r], EP_MOE_LAYER_ATTR_WEIGHT_BYTES) == bytes[r]);  // still blocks
  // A fourth rank joins: every shard changes, and moves as units of the
  // dequantized values (f32 here, exact); the shared expert then reads f32
  // inputs, as the reference now does.
  const auto group = join_fresh_rank(W);
  for (auto x : replace(W, {}, 4, group, nullptr, 0)) REQUIRE(x == EP_MOE_OK);
  W.c.spec.shared_act_block_gu = W.c.spec.shared_act_block_down = 0;
  for (auto* l : W.layers) CHECK(attr(l, EP_MOE_LAYER_ATTR_READY) == 1);
  for (int i = 0; i < 2; ++i) forward(W, draw(W, 4));
}

TEST_CASE("replace: a placement that keeps every expert in place moves no bytes", "[eplb][replace]") {
  World W = small_world(EP_MOE_DISPATCH_ALLGATHER, false, 8, ref::F32);
  create(W, 3);
  const Step s = draw(W, 3);
  const auto before = forward(W, s);
  // Linear for 12 experts on 3 ranks is 0-3, 4-7, 8-11; the same as a custom table.
  const auto st = replace(W, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 3, {}, nullptr, 0);
  for (auto x : st) REQUIRE(x == EP_MOE_OK);
  for (auto* l : W.layers) {
    CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_SENT) == 0);
    CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) == 0);
    CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT) == 4);
  }
  check_close(before, forward(W, s), 1e-6);
}

TEST_CASE("elastic: 4 -> 3 ranks after a rank is lost; replicas mean nothing is reloaded", "[eplb][replace][elastic]") {
  for (int dispatch : {EP_MOE_DISPATCH_ALLTOALL, EP_MOE_DISPATCH_ALLGATHER}) {
    INFO("dispatch " << dispatch);
    // All-gather keeps the shared expert TP-sharded, so rank 3's shard is
    // lost with it: that mode runs without a shared expert here (the
    // checkpoint case below covers it).
    World W = small_world(dispatch, dispatch == EP_MOE_DISPATCH_ALLTOALL, dispatch == EP_MOE_DISPATCH_ALLTOALL ? 8 : 0,
                          ref::BF16);
    // Every expert on two ranks: 24 slots, 6 per rank.
    std::vector<int32_t> table;
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 6; ++i) table.push_back((r * 3 + i) % 12);
    create(W, 4, table);
    forward(W, draw(W, 4));
    // Rank 3 is lost: the survivors make a group of 3 and re-place.
    const auto group = lose_last_rank(W);
    // A balanced placement for the survivors (15 slots): experts move
    // between them, none is read again.
    const auto st = replace(W, rebalance(zipf(12, 1.0, rng()), 15, 3), 3, group, nullptr, 0);
    for (auto x : st) REQUIRE(x == EP_MOE_OK);
    int64_t received = 0;
    for (auto* l : W.layers) {
      received += attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED);
      CHECK(attr(l, EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ) == 0);
      CHECK(attr(l, EP_MOE_LAYER_ATTR_READY) == 1);
    }
    CHECK(received > 0);
    for (int i = 0; i < 3; ++i) forward(W, draw(W, 3));
  }
}

TEST_CASE("elastic: a lost shard comes from the checkpoint, only what is missing is read", "[eplb][replace][elastic]") {
  // A checkpoint of the same weights.
  writers::Model m;
  m.spec.H = 32;
  m.spec.I = 16;
  m.spec.E = 8;
  m.spec.K = 2;
  m.spec.Is = 12;
  m.dtype = "F32";
  m.layer = 1;
  const std::string path = writers::small_checkpoint(m, rng());
  ep_moe_checkpoint_t* ck = nullptr;
  REQUIRE(ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) == EP_MOE_OK);

  World W;
  W.c.spec = m.spec;
  W.c.max_tokens = 10;
  W.c.given_topk = true;
  W.w = m.w;
  // Each expert on one rank only: 2 per rank.
  create(W, 4);
  forward(W, draw(W, 4));
  const auto group = lose_last_rank(W);

  // Without a checkpoint: experts 6, 7 and shared units [9, 12) are gone.
  std::vector<std::string> msg;
  auto st = replace(W, {}, 3, group, nullptr, 0, &msg);
  for (int r = 0; r < 3; ++r) {
    CHECK(st[static_cast<size_t>(r)] == EP_MOE_ERR_NOT_FOUND);
    CHECK(msg[static_cast<size_t>(r)].find("no checkpoint") != std::string::npos);
  }
  // A layer index the checkpoint does not have: only rank 2 reads, after the
  // transfers; its failure still fails every rank, and nothing changes.
  st = replace(W, {}, 3, group, ck, 42, &msg);
  for (int r = 0; r < 3; ++r) {
    INFO(msg[static_cast<size_t>(r)]);
    CHECK(st[static_cast<size_t>(r)] != EP_MOE_OK);
    CHECK(attr(W.layers[static_cast<size_t>(r)], EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS) == 2);  // still the old map
  }
  CHECK(msg[0].find("rank 2") != std::string::npos);
  // With it: those are read, the rest moves between the survivors.
  st = replace(W, {}, 3, group, ck, m.layer, &msg);
  for (int r = 0; r < 3; ++r) {
    INFO(msg[static_cast<size_t>(r)]);
    REQUIRE(st[static_cast<size_t>(r)] == EP_MOE_OK);
  }
  // New linear split of 8 experts on 3 ranks: 0-2, 3-5, 6-7; of the shared
  // intermediate (12): [0,4), [4,8), [8,12). Only rank 2 reads: experts 6, 7
  // and its shard (it had [6, 9) of the old one, but [9, 12) is lost).
  const double expert_bytes = 3.0 * m.spec.H * m.spec.I * 4;
  CHECK(attr(W.layers[0], EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ) == 0);
  CHECK(attr(W.layers[1], EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ) == 0);
  CHECK(attr(W.layers[2], EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ) ==
        static_cast<int64_t>(2 * expert_bytes + 3.0 * 4 * m.spec.H * 4));
  for (int i = 0; i < 2; ++i) forward(W, draw(W, 3));
  ep_moe_checkpoint_close(ck);
}

TEST_CASE("elastic: 3 -> 4 ranks; the new rank receives everything it holds", "[eplb][replace][elastic]") {
  World W = small_world(EP_MOE_DISPATCH_ALLGATHER, false, 8, ref::F32);
  create(W, 3);
  const Step s3 = draw(W, 3);
  forward(W, s3);
  const auto group = join_fresh_rank(W);
  ep_moe_layer_t* fresh = W.layers.back();
  CHECK(attr(fresh, EP_MOE_LAYER_ATTR_READY) == 0);
  const auto st = replace(W, {}, 4, group, nullptr, 0);
  for (auto x : st) REQUIRE(x == EP_MOE_OK);
  CHECK(attr(fresh, EP_MOE_LAYER_ATTR_READY) == 1);
  CHECK(attr(fresh, EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED) > 0);
  CHECK(attr(fresh, EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT) == 0);
  for (int i = 0; i < 2; ++i) forward(W, draw(W, 4));
}

TEST_CASE("replace: a failure on one rank fails every rank and changes nothing", "[eplb][replace][errors]") {
  World W = small_world(EP_MOE_DISPATCH_ALLGATHER, false, 8, ref::F32);
  create(W, 3);
  const Step s = draw(W, 3);
  const auto before = forward(W, s);
  const std::vector<int32_t> table = {0, 1, 2, 3, 11, 10, 9, 8, 4, 5, 6, 7, 0, 0, 1};
  std::vector<std::string> msg;

  // Rank 1 passes a map of another placement.
  auto st = replace(W, {}, 3, {}, nullptr, 0, &msg,
                    [&](int r) { return make_map(3, r, 12, r == 1 ? std::vector<int32_t>{} : table); });
  for (int r = 0; r < 3; ++r) {
    CHECK(st[static_cast<size_t>(r)] == EP_MOE_ERR_INVALID_ARGUMENT);
    CHECK(msg[static_cast<size_t>(r)].find("placement") != std::string::npos);
  }
  check_close(before, forward(W, s), 1e-6);

  // Rank 2 passes no map: it reports it, the others abandon.
  st = replace(W, table, 3, {}, nullptr, 0, &msg, [&](int r) -> ep_moe_expert_map_t* {
    if (r == 2) return nullptr;
    return make_map(3, r, 12, table);
  });
  CHECK(st[2] == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(st[0] == EP_MOE_ERR_INVALID_ARGUMENT);  // its own handles are fine
  INFO(msg[0]);
  CHECK(msg[0].find("rank 2") != std::string::npos);
  check_close(before, forward(W, s), 1e-6);

  // A map of the wrong size for the group.
  st = replace(W, {}, 3, {}, nullptr, 0, &msg, [&](int r) { return make_map(r == 0 ? 2 : 3, r == 0 ? 1 : r, 12, {}); });
  for (auto x : st) CHECK(x == EP_MOE_ERR_INVALID_ARGUMENT);
  check_close(before, forward(W, s), 1e-6);

  // A map with another number of experts.
  st = replace(W, {}, 3, {}, nullptr, 0, &msg, [&](int r) { return make_map(3, r, r == 1 ? 13 : 12, {}); });
  for (auto x : st) CHECK(x == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(msg[1].find("13") != std::string::npos);
  check_close(before, forward(W, s), 1e-6);

  // NULL layer.
  ep_moe_expert_map_t* mm = make_map(1, 0, 12, {});
  CHECK(ep_moe_layer_replace(nullptr, mm, nullptr, nullptr, 0) == EP_MOE_ERR_INVALID_HANDLE);
  ep_moe_expert_map_destroy(mm);
}

TEST_CASE("replace without a communicator: one rank, duplicate slots", "[eplb][replace]") {
  World W = small_world(EP_MOE_DISPATCH_ALLGATHER, false, 8, ref::BF16);
  W.layers.assign(1, nullptr);
  const ep_moe_layer_config_t lc = harness::layer_config(W.c);
  ep_moe_expert_map_t* m = make_map(1, 0, 12, {});
  REQUIRE(ep_moe_layer_create(&W.layers[0], &lc, m, nullptr, nullptr) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  int stored = 0;
  REQUIRE(harness::load_weights(W.layers[0], W.c, W.w, &stored) == "");
  const Step s = draw(W, 1);
  const auto before = forward(W, s);
  m = make_map(1, 0, 12, {5, 5, 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 11});
  REQUIRE(ep_moe_layer_replace(W.layers[0], m, nullptr, nullptr, 0) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  CHECK(attr(W.layers[0], EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS) == 14);
  CHECK(attr(W.layers[0], EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT) == 12);
  check_close(before, forward(W, s), 1e-6);
}

namespace {
// A step whose every token routes to expert 0 (k = 0) and one other expert.
Step all_to_expert0(const World& W, int ranks, int T) {
  Step s;
  const auto& sp = W.c.spec;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> other(1, sp.E - 1);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> hid(static_cast<size_t>(T) * sp.H), tw(static_cast<size_t>(T) * 2);
    std::vector<int32_t> ti(static_cast<size_t>(T) * 2);
    std::vector<double> exp(static_cast<size_t>(T) * sp.H);
    for (auto& x : hid) x = n(rng());
    for (int t = 0; t < T; ++t) {
      ti[static_cast<size_t>(t) * 2] = 0;
      ti[static_cast<size_t>(t) * 2 + 1] = other(rng());
      tw[static_cast<size_t>(t) * 2] = u(rng());
      tw[static_cast<size_t>(t) * 2 + 1] = u(rng());
      ref::moe_token(sp, W.w, hid.data() + static_cast<size_t>(t) * sp.H, {0, ti[static_cast<size_t>(t) * 2 + 1]},
                     {tw[static_cast<size_t>(t) * 2], tw[static_cast<size_t>(t) * 2 + 1]},
                     exp.data() + static_cast<size_t>(t) * sp.H);
    }
    s.in.hidden.push_back(hid);
    s.in.topk_ids.push_back(ti);
    s.in.topk_w.push_back(tw);
    s.in.logits.emplace_back();
    s.in.expect.push_back(exp);
    s.tokens.push_back(T);
  }
  return s;
}

std::vector<int64_t> expert0_pairs(World& W) {
  std::vector<int64_t> out;
  for (auto* l : W.layers) {
    std::vector<int64_t> v(static_cast<size_t>(W.c.spec.E));
    REQUIRE(ep_moe_layer_expert_load(v.data(), v.size(), l, 0, 1) == EP_MOE_OK);
    out.push_back(v[0]);
  }
  return out;
}
}  // namespace

TEST_CASE("all-to-all replicas: holders keep their pairs, the rest go where an even share is missing",
          "[eplb][replicas][alltoall]") {
  World W = small_world(EP_MOE_DISPATCH_ALLTOALL, true, 8, ref::F32);
  W.c.spec.K = 2;
  W.w = ref::random_weights(W.c.spec, ref::F32, rng());
  // Expert 0 on ranks 0, 1 and 2; rank 3 has none. 12 tokens per rank, each
  // with expert 0: holders keep 12 and take 4 of rank 3's each -> 16 16 16 0.
  create(W, 4, {0, 1, 2, 3, 0, 4, 5, 6, 0, 7, 8, 9, 10, 11, 1, 2});
  forward(W, all_to_expert0(W, 4, 12));
  CHECK(expert0_pairs(W) == std::vector<int64_t>{16, 16, 16, 0});

  // Rank 0 holds 2 of the 3 replicas, rank 1 one: rank 1 keeping all its
  // own pairs (1/2) would exceed its share (1/3), so no rank keeps pairs
  // and (t + k) mod 3 spreads them: rank 0 gets 2/3.
  World V = small_world(EP_MOE_DISPATCH_ALLTOALL, true, 0, ref::F32);
  V.c.spec.K = 2;
  V.w = ref::random_weights(V.c.spec, ref::F32, rng());
  create(V, 2, {0, 0, 1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 10, 11});
  forward(V, all_to_expert0(V, 2, 12));
  CHECK(expert0_pairs(V) == std::vector<int64_t>{16, 8});

  // All-gather over the same gathered batch: (t + k) mod 3 as well.
  World G = small_world(EP_MOE_DISPATCH_ALLGATHER, true, 0, ref::F32);
  G.c.spec.K = 2;
  G.w = ref::random_weights(G.c.spec, ref::F32, rng());
  create(G, 2, {0, 0, 1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 10, 11});
  forward(G, all_to_expert0(G, 2, 12));
  CHECK(expert0_pairs(G) == std::vector<int64_t>{16, 8});
}

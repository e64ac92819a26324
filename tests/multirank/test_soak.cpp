// Zero-token ranks, many times: 1000 steps of random routing with random
// token counts (zeros on some ranks, sometimes on all), 2/4/8 ranks, every
// dispatch mode and both DP gathers. No hang, and every output equals the
// reference.
#include <atomic>

#include "../common/seed.hpp"
#include "harness.hpp"

namespace {

struct Step {
  std::vector<int32_t> counts;
  bool decode;
  std::vector<std::vector<float>> hidden, logits;
  std::vector<std::vector<double>> expect;
};

}  // namespace

TEST_CASE("1000 steps with zero-token ranks: no hang, outputs equal the reference", "[soak][zero]") {
  std::mt19937 rng(test_seed() + 77);
  const int steps = 1000;
  for (int ep : {2, 4, 8}) {
    INFO("ep " << ep);
    harness::Case c;
    c.ep = ep;
    c.dp = ep;
    c.spec.H = 16;
    c.spec.I = 8;
    c.spec.E = 2 * ep + 1;
    c.spec.K = 2;
    c.spec.Is = 8;
    c.max_tokens = 4;
    c.threads = 1;
    const ref::Weights w = ref::random_weights(c.spec, ref::F32, rng);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<Step> plan(static_cast<size_t>(steps));
    for (auto& st : plan) {
      st.counts.resize(static_cast<size_t>(ep));
      const bool all_zero = rng() % 20 == 0;
      for (auto& n : st.counts) n = all_zero || rng() % 5 < 2 ? 0 : static_cast<int32_t>(1 + rng() % 4);
      st.decode = rng() % 2 == 0;
      for (int d = 0; d < ep; ++d) {
        const int T = st.counts[static_cast<size_t>(d)];
        std::vector<float> h(static_cast<size_t>(T * c.spec.H)), l(static_cast<size_t>(T * c.spec.E));
        std::vector<double> e(static_cast<size_t>(T * c.spec.H));
        for (auto& x : h) x = nd(rng);
        for (int t = 0; t < T; ++t) {
          std::vector<int> ids;
          std::vector<double> wts;
          float* lt = l.data() + t * c.spec.E;
          do {
            for (int k = 0; k < c.spec.E; ++k) lt[k] = 2.0f * nd(rng);
          } while (!ref::route(c.spec, lt, w, ids, wts));
          ref::moe_token(c.spec, w, h.data() + t * c.spec.H, ids, wts, e.data() + t * c.spec.H);
        }
        st.hidden.push_back(std::move(h));
        st.logits.push_back(std::move(l));
        st.expect.push_back(std::move(e));
      }
    }
    std::vector<ep_moe_comm_t*> world(static_cast<size_t>(ep));
    ep_moe_comm_config_t cc;
    ep_moe_comm_config_init(&cc);
    cc.timeout_ms = 20000;
    REQUIRE(ep_moe_comm_create_local(world.data(), ep, &cc) == EP_MOE_OK);
    std::vector<int> bad(static_cast<size_t>(ep), 0);
    std::vector<std::string> first_error(static_cast<size_t>(ep));
    std::vector<double> worst(static_cast<size_t>(ep), 0);
    harness::run_ranks(ep, [&](int r) {
      // One layer per dispatch mode on this rank; steps rotate through them.
      ep_moe_layer_t* layers[3] = {nullptr, nullptr, nullptr};
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      mc.ep_size = ep;
      mc.ep_rank = r;
      mc.global_num_experts = c.spec.E;
      ep_moe_expert_map_t* map = nullptr;
      ep_moe_expert_map_create(&map, &mc);
      for (int m = 0; m < 3; ++m) {
        harness::Case cm = c;
        cm.dispatch = m;
        const auto lc = harness::layer_config(cm);
        if (ep_moe_layer_create(&layers[m], &lc, map, world[static_cast<size_t>(r)], world[static_cast<size_t>(r)]) !=
            EP_MOE_OK) {
          first_error[static_cast<size_t>(r)] = ep_moe_last_error();
          ep_moe_comm_abort(world[static_cast<size_t>(r)]);
          return;
        }
        int stored = 0;
        harness::load_weights(layers[m], cm, w, &stored);
      }
      ep_moe_expert_map_destroy(map);
      std::vector<int32_t> decode(static_cast<size_t>(ep));
      for (int s = 0; s < steps; ++s) {
        const Step& st = plan[static_cast<size_t>(s)];
        const int T = st.counts[static_cast<size_t>(r)];
        std::fill(decode.begin(), decode.end(), st.decode ? 1 : 0);
        std::vector<float> out(static_cast<size_t>(T * c.spec.H));
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = T;
        a.hidden = st.hidden[static_cast<size_t>(r)].data();
        a.router_logits = st.logits[static_cast<size_t>(r)].data();
        a.out = out.data();
        a.dp_token_counts = st.counts.data();
        a.dp_is_decode = decode.data();
        ep_moe_layer_t* layer = layers[s % 3];
        if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
          if (!bad[static_cast<size_t>(r)]++) first_error[static_cast<size_t>(r)] = ep_moe_layer_last_error(layer);
          break;  // the group is broken now; the peers fail too
        }
        const auto& e = st.expect[static_cast<size_t>(r)];
        for (size_t i = 0; i < e.size(); ++i) {
          const double err = std::fabs(out[i] - e[i]) / (1.0 + std::fabs(e[i]));
          worst[static_cast<size_t>(r)] = std::max(worst[static_cast<size_t>(r)], err);
        }
      }
      for (auto* l : layers) ep_moe_layer_destroy(l);
    });
    for (auto* h : world) ep_moe_comm_destroy(h);
    for (int r = 0; r < ep; ++r) {
      INFO("rank " << r << ": " << first_error[static_cast<size_t>(r)]);
      CHECK(bad[static_cast<size_t>(r)] == 0);
      CHECK(worst[static_cast<size_t>(r)] <= 1e-4);
    }
  }
}

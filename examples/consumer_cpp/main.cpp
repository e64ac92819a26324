// A C++17 program using an installed ep_moe through find_package(ep_moe) and
// the header-only wrappers of ep_moe.hpp: two in-process EP ranks run one
// layer, and both get the output that one rank alone computes.
#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

#include <ep_moe/ep_moe.hpp>

namespace {

constexpr int H = 16, I = 8, E = 6, T = 5;

ep_moe_layer_config_t config() {
  ep_moe_layer_config_t c;
  ep_moe_layer_config_init(&c);
  c.hidden_size = H;
  c.intermediate_size = I;
  c.num_experts = E;
  c.top_k = 2;
  c.max_tokens = T;
  c.num_threads = 1;
  return c;
}

float value(int a, int b, int m) { return 0.02f * static_cast<float>((a * 7 + b * 3) % m - m / 2); }

// Runs the layer as rank `r` of `ep` on `comm` and returns its output.
std::vector<float> run(int ep, int r, ep_moe_comm_t* comm) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = ep;
  mc.ep_rank = r;
  mc.global_num_experts = E;
  const ep_moe::expert_map map(mc);
  ep_moe::layer layer(config(), map, comm);
  std::vector<float> g(I * H), u(I * H), d(H * I);
  for (int e = 0; e < E; ++e) {
    for (int i = 0; i < I * H; ++i) {
      g[static_cast<size_t>(i)] = value(e, i, 11);
      u[static_cast<size_t>(i)] = value(e + 1, i, 13);
      d[static_cast<size_t>(i)] = value(e + 2, i, 9);
    }
    layer.set_weight(EP_MOE_WEIGHT_EXPERT_GATE, e, g.data(), EP_MOE_DTYPE_F32, I, H);
    layer.set_weight(EP_MOE_WEIGHT_EXPERT_UP, e, u.data(), EP_MOE_DTYPE_F32, I, H);
    layer.set_weight(EP_MOE_WEIGHT_EXPERT_DOWN, e, d.data(), EP_MOE_DTYPE_F32, H, I);
  }
  std::vector<float> x(T * H), logits(T * E), out(T * H);
  for (int i = 0; i < T * H; ++i) x[static_cast<size_t>(i)] = value(i, 1, 17);
  for (int i = 0; i < T * E; ++i) logits[static_cast<size_t>(i)] = 10.0f * value(i, 5, 23);
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = T;
  a.hidden = x.data();
  a.router_logits = logits.data();
  a.out = out.data();
  layer.forward(a);
  return out;
}

}  // namespace

int main() {
  try {
    auto comms = ep_moe::local_comms(2);
    std::vector<std::vector<float>> outs(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.emplace_back([&, r] { outs[static_cast<size_t>(r)] = run(2, r, comms[static_cast<size_t>(r)].get()); });
    for (auto& t : ranks) t.join();
    const std::vector<float> one = run(1, 0, nullptr);
    double worst = 0;
    for (const auto& o : outs)
      for (size_t i = 0; i < o.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(o[i] - one[i])));
    std::printf("ep_moe %s: 2 in-process ranks vs one rank: max |difference| %.2g\n", ep_moe_version_string(), worst);
    // Errors come back as ep_moe::error with the status and message.
    try {
      ep_moe_expert_map_config_t bad;
      ep_moe_expert_map_config_init(&bad);
      ep_moe::expert_map m(bad);  // global_num_experts = 0
      return 1;
    } catch (const ep_moe::error& e) {
      std::printf("a bad config says: %s\n", e.what());
      if (e.status() != EP_MOE_ERR_INVALID_ARGUMENT) return 1;
    }
    return worst < 1e-5 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "failed: %s\n", e.what());
    return 1;
  }
}

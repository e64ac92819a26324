// Helpers of the rebalancer's tests and the re-placement tests that use
// its tables: skewed loads and one ep_moe_rebalance call.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace rebalance_helpers {

// Zipf(s) weights over n items, in a random order.
inline std::vector<double> zipf(int n, double s, std::mt19937& g) {
  std::vector<double> w(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) w[static_cast<size_t>(i)] = 1.0 / std::pow(i + 1.0, s);
  std::shuffle(w.begin(), w.end(), g);
  return w;
}

inline std::vector<int32_t> rebalance(const std::vector<double>& load, int slots, int ranks, int rpn = 0,
                                      int groups = 0, double* imb = nullptr, const std::vector<int32_t>& current = {}) {
  ep_moe_rebalance_config_t rc;
  REQUIRE(ep_moe_rebalance_config_init(&rc) == EP_MOE_OK);
  rc.num_experts = static_cast<int32_t>(load.size());
  rc.num_slots = slots;
  rc.num_ranks = ranks;
  rc.ranks_per_node = rpn;
  rc.num_expert_groups = groups;
  rc.num_current_slots = static_cast<int32_t>(current.size());
  rc.current_slots = current.empty() ? nullptr : current.data();
  std::vector<int32_t> out(static_cast<size_t>(slots), -1);
  INFO(ep_moe_last_error());
  REQUIRE(ep_moe_rebalance(out.data(), out.size(), imb, load.data(), load.size(), &rc) == EP_MOE_OK);
  return out;
}

}  // namespace rebalance_helpers

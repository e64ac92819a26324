// The rebalancer through the C API (ep_moe_rebalance): every expert placed,
// replicas to the hot experts, node-local groups, packs kept in place, bad
// parameters; checked against expectations computed independently.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "../common/seed.hpp"
#include "rebalance_helpers.hpp"

namespace {

using rebalance_helpers::rebalance;
using rebalance_helpers::zipf;

std::mt19937& rng() {
  static std::mt19937 g(test_seed());
  return g;
}

// Max rank load / mean under the even split among replicas; written from
// the definition, independent of the library.
double imbalance(const std::vector<double>& load, const std::vector<int32_t>& slots, int ranks) {
  std::vector<int> reps(load.size(), 0);
  for (int32_t e : slots) ++reps[static_cast<size_t>(e)];
  std::vector<double> rl(static_cast<size_t>(ranks), 0.0);
  const size_t per = slots.size() / static_cast<size_t>(ranks);
  for (size_t s = 0; s < slots.size(); ++s)
    rl[s / per] += load[static_cast<size_t>(slots[s])] / reps[static_cast<size_t>(slots[s])];
  const double mean = std::accumulate(rl.begin(), rl.end(), 0.0) / ranks;
  return *std::max_element(rl.begin(), rl.end()) / mean;
}

}  // namespace

TEST_CASE("rebalance: every expert placed, replicas to the hot ones, balanced and deterministic", "[eplb][rebalance]") {
  double excess = 0, linear_excess = 0;  // summed (imbalance - 1) over the trials
  for (int trial = 0; trial < 20; ++trial) {
    const int ranks = 1 << (trial % 4);  // 1, 2, 4, 8
    const int E = 16 * (1 + trial % 3);
    const int P = E + E / 8 + ((E + E / 8) % ranks ? ranks - (E + E / 8) % ranks : 0);
    auto load = zipf(E, 0.6 + 0.1 * (trial % 5), rng());
    for (auto& x : load) x = std::round(x * 10000);
    double imb = 0;
    const auto slots = rebalance(load, P, ranks, 0, 0, &imb);
    INFO("E=" << E << " P=" << P << " ranks=" << ranks);
    std::vector<int> reps(static_cast<size_t>(E), 0);
    for (int32_t e : slots) {
      REQUIRE(e >= 0);
      REQUIRE(e < E);
      ++reps[static_cast<size_t>(e)];
    }
    for (int e = 0; e < E; ++e) CHECK(reps[static_cast<size_t>(e)] >= 1);
    // The hottest expert got at least as many replicas as the coldest.
    const auto hot = std::max_element(load.begin(), load.end()) - load.begin();
    const auto cold = std::min_element(load.begin(), load.end()) - load.begin();
    CHECK(reps[static_cast<size_t>(hot)] >= reps[static_cast<size_t>(cold)]);
    // The reported imbalance is the true one, and within the greedy bound:
    // max <= mean + the heaviest replica.
    const double mine = imbalance(load, slots, ranks);
    CHECK(std::fabs(imb - mine) < 1e-12);
    double heaviest = 0, total = std::accumulate(load.begin(), load.end(), 0.0);
    for (int e = 0; e < E; ++e)
      heaviest = std::max(heaviest, load[static_cast<size_t>(e)] / reps[static_cast<size_t>(e)]);
    CHECK(mine <= 1.0 + heaviest / (total / ranks) + 1e-9);
    // No swap of two replicas between the heaviest rank and another makes
    // the heaviest lighter (the packing's swap refinement ran to its end).
    const size_t per = slots.size() / static_cast<size_t>(ranks);
    auto share = [&](size_t s) { return load[static_cast<size_t>(slots[s])] / reps[static_cast<size_t>(slots[s])]; };
    std::vector<double> rl(static_cast<size_t>(ranks), 0.0);
    for (size_t s = 0; s < slots.size(); ++s) rl[s / per] += share(s);
    const size_t h = static_cast<size_t>(std::max_element(rl.begin(), rl.end()) - rl.begin());
    int improving = 0;
    for (size_t a = h * per; a < (h + 1) * per; ++a)
      for (size_t b = 0; b < slots.size(); ++b) {
        const double d = share(a) - share(b);
        improving += b / per != h && d > 0 && std::max(rl[h] - d, rl[b / per] + d) < rl[h] * (1 - 1e-12);
      }
    CHECK(improving == 0);
    // Far better than the linear placement without replicas, over the
    // trials (not in every one: a lucky linear split can be within a
    // rounding of perfect while no swap improves the rebalanced one; over
    // 100k seeds the excess below was at most 0.7 % of linear's).
    std::vector<int32_t> linear(static_cast<size_t>(E));
    std::iota(linear.begin(), linear.end(), 0);
    excess += mine - 1.0;
    linear_excess += imbalance(load, linear, ranks) - 1.0;
    // Deterministic.
    CHECK(rebalance(load, P, ranks) == slots);
  }
  CHECK(excess <= 0.1 * linear_excess);
}

TEST_CASE("rebalance: hierarchical keeps each expert group on one node", "[eplb][rebalance]") {
  const int E = 32, groups = 8, ranks = 8, rpn = 4, P = 40;
  auto load = zipf(E, 1.0, rng());
  const auto slots = rebalance(load, P, ranks, rpn, groups);
  std::map<int, std::set<int>> nodes_of_group;
  for (int s = 0; s < P; ++s)
    nodes_of_group[slots[static_cast<size_t>(s)] / (E / groups)].insert(s / (P / ranks) / rpn);
  REQUIRE(nodes_of_group.size() == static_cast<size_t>(groups));
  for (const auto& g : nodes_of_group) CHECK(g.second.size() == 1);
  // Groups that do not split over the nodes: global placement, still valid.
  const auto global = rebalance(load, P, ranks, rpn, 3 * 0 + 1);
  std::set<int> seen(global.begin(), global.end());
  CHECK(seen.size() == static_cast<size_t>(E));
}

// Experts rank r must receive going from table `a` to table `b` (both split
// evenly over `ranks`), summed over the ranks.
int moved(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int ranks) {
  int n = 0;
  for (int r = 0; r < ranks; ++r) {
    const size_t pa = a.size() / static_cast<size_t>(ranks), pb = b.size() / static_cast<size_t>(ranks);
    std::set<int32_t> had(a.begin() + static_cast<long>(r * pa), a.begin() + static_cast<long>((r + 1) * pa));
    std::set<int32_t> need(b.begin() + static_cast<long>(r * pb), b.begin() + static_cast<long>((r + 1) * pb));
    for (int32_t e : need) n += had.count(e) == 0;
  }
  return n;
}

TEST_CASE("rebalance: with the current placement, packs stay where they are", "[eplb][rebalance]") {
  for (int hier = 0; hier < 2; ++hier) {
    const int E = 64, ranks = 8, P = 72, rpn = hier ? 4 : 0, groups = hier ? 8 : 0;
    INFO("hierarchical " << hier);
    auto load = zipf(E, 1.0, rng());
    const auto first = rebalance(load, P, ranks, rpn, groups);
    // The same load again: nothing moves (and the balance is the same).
    double imb0 = 0, imb1 = 0;
    rebalance(load, P, ranks, rpn, groups, &imb0);
    const auto again = rebalance(load, P, ranks, rpn, groups, &imb1, first);
    CHECK(moved(first, again, ranks) == 0);
    CHECK(std::fabs(imb0 - imb1) < 1e-12);
    // A rotated table of the same contents: the packs follow their old ranks.
    std::vector<int32_t> rotated(first.begin() + P / ranks, first.end());
    rotated.insert(rotated.end(), first.begin(), first.begin() + P / ranks);
    if (!hier) CHECK(moved(rotated, rebalance(load, P, ranks, rpn, groups, nullptr, rotated), ranks) == 0);
    // A drifted load: fewer moves than ignoring the current placement.
    std::uniform_real_distribution<double> drift(0.9, 1.1);
    for (auto& x : load) x *= drift(rng());
    const int aware = moved(first, rebalance(load, P, ranks, rpn, groups, nullptr, first), ranks);
    const int blind = moved(first, rebalance(load, P, ranks, rpn, groups), ranks);
    CHECK(aware <= blind);
  }
  // Bad current tables.
  ep_moe_rebalance_config_t rc;
  ep_moe_rebalance_config_init(&rc);
  rc.num_experts = 4;
  rc.num_slots = 4;
  rc.num_ranks = 2;
  std::vector<double> load(4, 1.0);
  std::vector<int32_t> out(4), cur = {0, 1, 2, 9};
  rc.num_current_slots = 4;
  CHECK(ep_moe_rebalance(out.data(), 4, nullptr, load.data(), 4, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);  // NULL table
  rc.current_slots = cur.data();
  CHECK(ep_moe_rebalance(out.data(), 4, nullptr, load.data(), 4, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);  // expert 9
  CHECK(std::string(ep_moe_last_error()).find("current[3]") != std::string::npos);
  cur[3] = 3;
  rc.num_current_slots = -1;
  CHECK(ep_moe_rebalance(out.data(), 4, nullptr, load.data(), 4, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  rc.num_current_slots = 4;
  CHECK(ep_moe_rebalance(out.data(), 4, nullptr, load.data(), 4, &rc) == EP_MOE_OK);
}

TEST_CASE("rebalance at its documented limits completes, and one past each is refused", "[eplb][rebalance][limits]") {
  // 8192 experts in 8192 slots on 1024 ranks, with a current placement (the
  // costly path): the O(slots x experts) replication and O(ranks^3) matching
  // this replaced ran for minutes to hours at the old limits.
  constexpr int32_t E = 8192, P = 8192, R = 1024;
  std::vector<double> load(E);
  std::mt19937 g(test_seed() + 61);
  std::uniform_real_distribution<double> u(1.0, 1000.0);
  for (auto& x : load) x = u(g);
  std::vector<int32_t> out(P), cur(P);
  for (int32_t i = 0; i < P; ++i) cur[static_cast<size_t>(i)] = (i * 7) % E;
  ep_moe_rebalance_config_t rc;
  ep_moe_rebalance_config_init(&rc);
  rc.num_experts = E;
  rc.num_slots = P;
  rc.num_ranks = R;
  rc.num_current_slots = P;
  rc.current_slots = cur.data();
  double imbalance = 0;
  REQUIRE(ep_moe_rebalance(out.data(), out.size(), &imbalance, load.data(), load.size(), &rc) == EP_MOE_OK);
  CHECK(imbalance < 1.05);
  std::vector<char> seen(E, 0);
  for (int32_t e : out) seen[static_cast<size_t>(e)] = 1;
  CHECK(std::count(seen.begin(), seen.end(), 1) == E);
  rc.num_ranks = R + 1;
  rc.num_slots = P;  // not a multiple either way: the rank limit is named first
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), load.size(), &rc) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("num_ranks must be in [1, 1024]") != std::string::npos);
  rc.num_ranks = R;
  rc.num_slots = P + R;
  std::vector<int32_t> big(static_cast<size_t>(P + R));
  CHECK(ep_moe_rebalance(big.data(), big.size(), nullptr, load.data(), load.size(), &rc) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("num_slots must be in [num_experts=8192, 8192]") != std::string::npos);
}

TEST_CASE("rebalance: bad parameters are rejected with a message", "[eplb][rebalance][errors]") {
  ep_moe_rebalance_config_t rc;
  ep_moe_rebalance_config_init(&rc);
  rc.num_experts = 8;
  rc.num_slots = 10;
  rc.num_ranks = 4;
  std::vector<double> load(8, 1.0);
  std::vector<int32_t> out(16);
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), load.size(), &rc) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("multiple") != std::string::npos);
  rc.num_slots = 12;
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), load.size(), &rc) == EP_MOE_OK);
  CHECK(ep_moe_rebalance(out.data(), 11, nullptr, load.data(), load.size(), &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 7, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, nullptr, 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_rebalance(nullptr, out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  load[3] = -1;
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  load[3] = std::nan("");
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  load[3] = 1;
  rc.ranks_per_node = 3;
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  rc.ranks_per_node = 2;
  rc.num_expert_groups = 3;
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  rc.num_expert_groups = 4;
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_OK);
  rc.num_slots = 4;  // fewer slots than experts
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_INVALID_ARGUMENT);
  rc.struct_size = 3;
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, &rc) == EP_MOE_ERR_STRUCT_SIZE);
  CHECK(ep_moe_rebalance(out.data(), out.size(), nullptr, load.data(), 8, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_rebalance_config_init(nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
}

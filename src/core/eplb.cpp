#include "core/eplb.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/error.hpp"

namespace ep_moe {

void balanced_packing(const std::vector<double>& w, int32_t packs, std::vector<int32_t>* pack,
                      std::vector<int32_t>* slot) {
  const size_t n = w.size();
  const size_t per = n / static_cast<size_t>(packs);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a] > w[b]; });
  std::vector<double> total(static_cast<size_t>(packs), 0.0);
  std::vector<size_t> count(static_cast<size_t>(packs), 0);
  pack->assign(n, 0);
  slot->assign(n, 0);
  for (size_t i : order) {
    size_t best = SIZE_MAX;
    for (size_t p = 0; p < static_cast<size_t>(packs); ++p)
      if (count[p] < per && (best == SIZE_MAX || total[p] < total[best])) best = p;
    (*pack)[i] = static_cast<int32_t>(best);
    (*slot)[i] = static_cast<int32_t>(count[best]++);
    total[best] += w[i];
  }
}

namespace {
// Replicates n experts into `slots` physical experts: each new replica goes
// to the expert whose load per replica is the highest.
void replicate(const std::vector<double>& w, int32_t slots, std::vector<int32_t>* phys_expert,
               std::vector<int32_t>* replicas) {
  const int32_t n = static_cast<int32_t>(w.size());
  replicas->assign(static_cast<size_t>(n), 1);
  phys_expert->resize(static_cast<size_t>(slots));
  for (int32_t i = 0; i < n; ++i) (*phys_expert)[static_cast<size_t>(i)] = i;
  for (int32_t s = n; s < slots; ++s) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i)
      if (w[static_cast<size_t>(i)] / (*replicas)[static_cast<size_t>(i)] >
          w[static_cast<size_t>(best)] / (*replicas)[static_cast<size_t>(best)])
        best = i;
    (*phys_expert)[static_cast<size_t>(s)] = best;
    ++(*replicas)[static_cast<size_t>(best)];
  }
}
}  // namespace

std::vector<int32_t> rebalance(const std::vector<double>& load, const RebalanceParams& p) {
  const int32_t E = p.num_experts, P = p.num_slots, R = p.num_ranks;
  EP_MOE_CHECK_ARG(E >= 1 && E <= (1 << 20), "num_experts must be in [1, %d], got %d", 1 << 20, E);
  EP_MOE_CHECK_ARG(static_cast<int64_t>(load.size()) == E, "load has %zu entries, num_experts is %d", load.size(), E);
  EP_MOE_CHECK_ARG(R >= 1 && R <= (1 << 16), "num_ranks must be in [1, %d], got %d", 1 << 16, R);
  EP_MOE_CHECK_ARG(P >= E && P <= (1 << 22), "num_slots must be in [num_experts=%d, %d], got %d", E, 1 << 22, P);
  EP_MOE_CHECK_ARG(P % R == 0, "num_slots %d is not a multiple of num_ranks %d", P, R);
  EP_MOE_CHECK_ARG(p.ranks_per_node >= 0, "ranks_per_node must be >= 0, got %d", p.ranks_per_node);
  EP_MOE_CHECK_ARG(p.num_groups >= 0, "num_groups must be >= 0, got %d", p.num_groups);
  for (int32_t e = 0; e < E; ++e)
    EP_MOE_CHECK_ARG(std::isfinite(load[static_cast<size_t>(e)]) && load[static_cast<size_t>(e)] >= 0,
                     "load[%d] = %g is not a finite non-negative number", e, load[static_cast<size_t>(e)]);
  const int32_t rpn = p.ranks_per_node > 0 ? p.ranks_per_node : R;
  EP_MOE_CHECK_ARG(R % rpn == 0, "num_ranks %d is not a multiple of ranks_per_node %d", R, rpn);
  int32_t nodes = R / rpn;
  int32_t groups = p.num_groups > 1 ? p.num_groups : 1;
  EP_MOE_CHECK_ARG(E % groups == 0, "num_groups %d does not divide num_experts %d", groups, E);
  // Hierarchical only when groups split evenly over the nodes and every node
  // gets whole slots; otherwise one global pool (nodes and groups ignored).
  if (nodes > 1 && (groups % nodes != 0 || P % nodes != 0 || E % nodes != 0)) {
    nodes = 1;
    groups = 1;
  }
  if (nodes == 1) groups = 1;
  const int32_t group_size = E / groups, slots_per_node = P / nodes, ranks_per_node = R / nodes,
                slots_per_rank = P / R;

  // 1. Groups to nodes.
  std::vector<double> group_load(static_cast<size_t>(groups), 0.0);
  for (int32_t e = 0; e < E; ++e) group_load[static_cast<size_t>(e / group_size)] += load[static_cast<size_t>(e)];
  std::vector<int32_t> node_of_group, pos_in_node;
  balanced_packing(group_load, nodes, &node_of_group, &pos_in_node);

  std::vector<int32_t> slots(static_cast<size_t>(P), -1);
  for (int32_t node = 0; node < nodes; ++node) {
    // The node's experts, in group order.
    std::vector<int32_t> experts;
    for (int32_t g = 0; g < groups; ++g) {
      if (node_of_group[static_cast<size_t>(g)] != node) continue;
      for (int32_t i = 0; i < group_size; ++i) experts.push_back(g * group_size + i);
    }
    std::sort(experts.begin(), experts.end());
    std::vector<double> w;
    for (int32_t e : experts) w.push_back(load[static_cast<size_t>(e)]);
    // 2. Replicas within the node.
    std::vector<int32_t> phys, replicas;
    replicate(w, slots_per_node, &phys, &replicas);
    std::vector<double> phys_load(phys.size());
    for (size_t s = 0; s < phys.size(); ++s)
      phys_load[s] = w[static_cast<size_t>(phys[s])] / replicas[static_cast<size_t>(phys[s])];
    // 3. Replicas to the node's ranks.
    std::vector<int32_t> rank_of, pos;
    balanced_packing(phys_load, ranks_per_node, &rank_of, &pos);
    for (size_t s = 0; s < phys.size(); ++s) {
      const int32_t r = node * ranks_per_node + rank_of[s];
      slots[static_cast<size_t>(r * slots_per_rank + pos[s])] = experts[static_cast<size_t>(phys[s])];
    }
  }
  return slots;
}

double placement_imbalance(const std::vector<double>& load, const std::vector<int32_t>& slots, int32_t num_ranks) {
  std::vector<int32_t> replicas(load.size(), 0);
  for (int32_t e : slots) ++replicas[static_cast<size_t>(e)];
  const size_t per = slots.size() / static_cast<size_t>(num_ranks);
  std::vector<double> rank_load(static_cast<size_t>(num_ranks), 0.0);
  for (size_t s = 0; s < slots.size(); ++s) {
    const auto e = static_cast<size_t>(slots[s]);
    rank_load[s / per] += load[e] / replicas[e];
  }
  const double total = std::accumulate(rank_load.begin(), rank_load.end(), 0.0);
  if (total <= 0) return 1.0;
  return *std::max_element(rank_load.begin(), rank_load.end()) / (total / num_ranks);
}

}  // namespace ep_moe

// Expert-parallel load balancing: from per-expert load to a placement of
// physical slots (with replicas of hot experts) that evens the ranks' load.
// The method follows DeepSeek's EPLB: groups of experts to nodes, replicas
// within a node, replicas to the node's ranks — each step a greedy balanced
// packing refined by swaps. Deterministic: ties go to the lower index.
#pragma once

#include <cstdint>
#include <vector>

namespace ep_moe {

// The largest rebalance ep_moe_rebalance() takes: the keep-in-place swaps
// with a current placement cost O(slots^2) a pass and the packing's match
// O(ranks^2), so these bound a call at about a second (measured at the
// limits with a current placement on one node: tests/multirank/test_rebalance).
constexpr int32_t kRebalanceMaxSlots = 8192;  // and experts
constexpr int32_t kRebalanceMaxRanks = 1024;

struct RebalanceParams {
  int32_t num_experts = 0;     // E
  int32_t num_slots = 0;       // P >= E, P % num_ranks == 0
  int32_t num_ranks = 1;       // R
  int32_t ranks_per_node = 0;  // 0: one node
  int32_t num_groups = 0;      // expert groups; hierarchical when it divides by the nodes
  // The placement now in use (slot -> expert, split over num_ranks like a
  // custom table without per-rank counts), or empty. Packs of replicas go
  // to the ranks (and groups to the nodes) that already hold most of them,
  // so a rebalance moves as little as it can without losing balance.
  std::vector<int32_t> current;
};

// Returns slot -> expert for P slots, rank r owning slots [r*P/R, (r+1)*P/R).
// Throws INVALID_ARGUMENT naming the bad parameter.
std::vector<int32_t> rebalance(const std::vector<double>& load, const RebalanceParams& p);

// Greedy balanced packing: each pack receives exactly n / packs items
// (n % packs == 0), heaviest first into the lightest pack with room.
// pack[i] and slot[i] give item i's pack and its position in the pack.
void balanced_packing(const std::vector<double>& weight, int32_t packs, std::vector<int32_t>* pack,
                      std::vector<int32_t>* slot);

// Then pairwise swaps out of the heaviest pack while one makes it lighter
// (equal counts kept; pack and slot updated together).
void refine_packing(const std::vector<double>& weight, int32_t packs, std::vector<int32_t>* pack,
                    std::vector<int32_t>* slot);

// Max over ranks of the load they hold, each replica carrying load/replicas,
// divided by the mean (1.0 = perfect balance).
double placement_imbalance(const std::vector<double>& load, const std::vector<int32_t>& slots, int32_t num_ranks);

}  // namespace ep_moe

#include "core/eplb.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>

#include "common/error.hpp"
#include "core/expert_map.hpp"

namespace ep_moe {

namespace {
// Item indices by weight, heaviest first (ties: lower index first).
std::vector<size_t> heaviest_first(const std::vector<double>& w) {
  std::vector<size_t> order(w.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a] > w[b]; });
  return order;
}
}  // namespace

void balanced_packing(const std::vector<double>& w, int32_t packs, std::vector<int32_t>* pack,
                      std::vector<int32_t>* slot) {
  const size_t n = w.size();
  const size_t per = n / static_cast<size_t>(packs);
  const std::vector<size_t> order = heaviest_first(w);
  std::vector<double> total(static_cast<size_t>(packs), 0.0);
  std::vector<size_t> count(static_cast<size_t>(packs), 0);
  pack->assign(n, 0);
  slot->assign(n, 0);
  // The open packs by (total, index), lightest first: each item goes to the
  // lightest pack with room (ties: the lower index), in O(n log packs).
  using Open = std::pair<double, size_t>;
  std::priority_queue<Open, std::vector<Open>, std::greater<Open>> open;
  if (per > 0)
    for (size_t p = 0; p < static_cast<size_t>(packs); ++p) open.emplace(0.0, p);
  for (size_t i : order) {
    const size_t best = open.top().second;
    open.pop();
    (*pack)[i] = static_cast<int32_t>(best);
    (*slot)[i] = static_cast<int32_t>(count[best]++);
    total[best] += w[i];
    if (count[best] < per) open.emplace(total[best], best);
  }
}

void refine_packing(const std::vector<double>& w, int32_t packs, std::vector<int32_t>* pack,
                    std::vector<int32_t>* slot) {
  // Greedy filling can leave the heaviest pack heavier than it needs to be
  // (with equal counts per pack it is not even always better than taking
  // the items in index order). Pairwise swaps between the heaviest pack and
  // another follow, each the one that leaves the pair's heavier side
  // lightest, while one lowers the heaviest pack below where it was. Each
  // swap makes the packs' sorted loads strictly smaller, so this ends; a
  // budget of 2^22 pair evaluations keeps it to milliseconds for huge
  // inputs (a larger one buys a fraction of a per cent of imbalance).
  if (packs < 2) return;
  const size_t n = w.size();
  std::vector<double> total(static_cast<size_t>(packs), 0.0);
  for (size_t i : heaviest_first(w)) total[static_cast<size_t>((*pack)[i])] += w[i];  // as balanced_packing sums
  std::vector<std::vector<size_t>> items(static_cast<size_t>(packs));
  for (size_t i = 0; i < n; ++i) items[static_cast<size_t>((*pack)[i])].push_back(i);
  int64_t budget = int64_t{1} << 22;
  for (size_t iter = 0; iter < 4 * n && budget > 0; ++iter) {
    const size_t h = static_cast<size_t>(std::max_element(total.begin(), total.end()) - total.begin());
    double best_max = total[h];
    size_t bx = SIZE_MAX, by = SIZE_MAX;
    for (size_t a = 0; a < items[h].size(); ++a) {
      const size_t x = items[h][a];
      for (size_t p = 0; p < static_cast<size_t>(packs); ++p) {
        if (p == h) continue;
        budget -= static_cast<int64_t>(items[p].size());
        for (size_t b = 0; b < items[p].size(); ++b) {
          const size_t y = items[p][b];
          const double d = w[x] - w[y];
          if (!(d > 0)) continue;
          const double m = std::max(total[h] - d, total[p] + d);
          if (m < best_max) {
            best_max = m;
            bx = a;
            by = y;
          }
        }
      }
    }
    if (bx == SIZE_MAX) break;
    const size_t x = items[h][bx], p = static_cast<size_t>((*pack)[by]);
    const double d = w[x] - w[by];
    total[h] -= d;
    total[p] += d;
    std::swap((*pack)[x], (*pack)[by]);
    std::swap((*slot)[x], (*slot)[by]);
    items[h][bx] = by;
    *std::find(items[p].begin(), items[p].end(), by) = x;
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
  // By load per replica, highest first (ties: the lower index), in
  // O(slots log n).
  const auto per_replica = [&](int32_t i) { return w[static_cast<size_t>(i)] / (*replicas)[static_cast<size_t>(i)]; };
  const auto lighter = [&](int32_t a, int32_t b) {
    const double la = per_replica(a), lb = per_replica(b);
    return la < lb || (la == lb && a > b);
  };
  std::priority_queue<int32_t, std::vector<int32_t>, decltype(lighter)> heaviest(lighter);
  if (slots > n)
    for (int32_t i = 0; i < n; ++i) heaviest.push(i);
  for (int32_t s = n; s < slots; ++s) {
    const int32_t best = heaviest.top();
    heaviest.pop();
    (*phys_expert)[static_cast<size_t>(s)] = best;
    ++(*replicas)[static_cast<size_t>(best)];
    heaviest.push(best);
  }
}
}  // namespace

namespace {
// Assigns packs to owners maximising the overlap greedily: the pair with
// the largest overlap first (ties: lower pack, then lower owner). Returns
// owner_of[pack].
std::vector<int32_t> match(const std::vector<std::vector<int32_t>>& overlap) {
  const size_t n = overlap.size();
  std::vector<int32_t> owner_of(n, -1);
  std::vector<char> taken(n, 0);
  // The pairs that overlap, in the order the greedy takes them; then the
  // packs left (every overlap among them 0) to the owners left, lower to
  // lower. O(pairs log pairs), not O(n^3).
  struct Pair {
    int32_t overlap;
    uint32_t p, o;
  };
  std::vector<Pair> pairs;
  for (size_t p = 0; p < n; ++p)
    for (size_t o = 0; o < n; ++o)
      if (overlap[p][o] > 0) pairs.push_back(Pair{overlap[p][o], static_cast<uint32_t>(p), static_cast<uint32_t>(o)});
  std::sort(pairs.begin(), pairs.end(), [](const Pair& a, const Pair& b) {
    return a.overlap != b.overlap ? a.overlap > b.overlap : a.p != b.p ? a.p < b.p : a.o < b.o;
  });
  for (const Pair& q : pairs)
    if (owner_of[q.p] < 0 && !taken[q.o]) {
      owner_of[q.p] = static_cast<int32_t>(q.o);
      taken[q.o] = 1;
    }
  size_t o = 0;
  for (size_t p = 0; p < n; ++p) {
    if (owner_of[p] >= 0) continue;
    while (taken[o]) ++o;
    owner_of[p] = static_cast<int32_t>(o);
    taken[o] = 1;
  }
  return owner_of;
}
}  // namespace

// How far above the node's mean a rank may go to keep replicas where their
// experts already are.
constexpr double kKeepTolerance = 0.01;

// Moves fewer weights without losing balance: starting from a balanced
// packing (`pack`, ranks rank0.. of one node), swaps a replica placed on a
// rank that does not hold its expert with a replica on a rank that does
// (and does not hold that one's), whenever both ranks stay within `bound`.
// Every swap keeps at least one more replica where its expert already is;
// passes repeat until none applies. Deterministic (index order).
void keep_in_place(const std::vector<double>& w, const std::vector<int32_t>& phys, const std::vector<int32_t>& experts,
                   const std::vector<std::vector<char>>& holds, int32_t rank0, int32_t ranks, double bound,
                   std::vector<int32_t>* pack) {
  const size_t n = w.size();
  std::vector<double> total(static_cast<size_t>(ranks), 0.0);
  for (size_t i = 0; i < n; ++i) total[static_cast<size_t>((*pack)[i])] += w[i];
  auto expert = [&](size_t i) { return static_cast<size_t>(experts[static_cast<size_t>(phys[i])]); };
  auto held = [&](size_t i, int32_t r) { return holds[static_cast<size_t>(rank0 + r)][expert(i)] != 0; };
  for (int pass = 0; pass < 64; ++pass) {
    bool changed = false;
    for (size_t x = 0; x < n; ++x) {
      const int32_t r = (*pack)[x];
      if (held(x, r)) continue;
      size_t best = SIZE_MAX;
      bool best_double = false;
      for (size_t y = 0; y < n && !best_double; ++y) {
        const int32_t h = (*pack)[y];
        if (h == r || !held(x, h) || held(y, h)) continue;
        if (total[static_cast<size_t>(r)] - w[x] + w[y] > bound || total[static_cast<size_t>(h)] - w[y] + w[x] > bound)
          continue;
        const bool dbl = held(y, r);  // y lands where its expert is, too
        if (best == SIZE_MAX || dbl) {
          best = y;
          best_double = dbl;
        }
      }
      if (best == SIZE_MAX) continue;
      const int32_t h = (*pack)[best];
      total[static_cast<size_t>(r)] += w[best] - w[x];
      total[static_cast<size_t>(h)] += w[x] - w[best];
      (*pack)[x] = h;
      (*pack)[best] = r;
      changed = true;
    }
    if (!changed) break;
  }
}

namespace {

void check_params(const std::vector<double>& load, const RebalanceParams& p) {
  const int32_t E = p.num_experts, P = p.num_slots, R = p.num_ranks;
  EP_MOE_CHECK_ARG(E >= 1 && E <= kRebalanceMaxSlots, "num_experts must be in [1, %d], got %d", kRebalanceMaxSlots, E);
  EP_MOE_CHECK_ARG(static_cast<int64_t>(load.size()) == E, "load has %zu entries, num_experts is %d", load.size(), E);
  EP_MOE_CHECK_ARG(R >= 1 && R <= kRebalanceMaxRanks, "num_ranks must be in [1, %d], got %d", kRebalanceMaxRanks, R);
  EP_MOE_CHECK_ARG(P >= E && P <= kRebalanceMaxSlots, "num_slots must be in [num_experts=%d, %d], got %d", E,
                   kRebalanceMaxSlots, P);
  EP_MOE_CHECK_ARG(P % R == 0, "num_slots %d is not a multiple of num_ranks %d", P, R);
  EP_MOE_CHECK_ARG(p.ranks_per_node >= 0, "ranks_per_node must be >= 0, got %d", p.ranks_per_node);
  EP_MOE_CHECK_ARG(p.num_groups >= 0, "num_groups must be >= 0, got %d", p.num_groups);
  for (int32_t e = 0; e < E; ++e)
    EP_MOE_CHECK_ARG(std::isfinite(load[static_cast<size_t>(e)]) && load[static_cast<size_t>(e)] >= 0,
                     "load[%d] = %g is not a finite non-negative number", e, load[static_cast<size_t>(e)]);
  for (size_t i = 0; i < p.current.size(); ++i)
    EP_MOE_CHECK_ARG(p.current[i] >= 0 && p.current[i] < E, "current[%zu] = %d is not an expert in [0, %d)", i,
                     p.current[i], E);
  EP_MOE_CHECK_ARG(p.current.empty() || p.current.size() >= static_cast<size_t>(R),
                   "the current placement has %zu slots, fewer than the %d ranks", p.current.size(), R);
}

// What each rank holds now ([R][E]; empty without a current placement).
std::vector<std::vector<char>> holdings(const RebalanceParams& p) {
  std::vector<std::vector<char>> holds;
  if (p.current.empty()) return holds;
  const int32_t E = p.num_experts, R = p.num_ranks;
  holds.assign(static_cast<size_t>(R), std::vector<char>(static_cast<size_t>(E), 0));
  const auto Pc = static_cast<int32_t>(p.current.size());
  for (int32_t r = 0; r < R; ++r)
    for (int32_t s = split_start(Pc, R, r); s < split_start(Pc, R, r) + split_count(Pc, R, r); ++s)
      holds[static_cast<size_t>(r)][static_cast<size_t>(p.current[static_cast<size_t>(s)])] = 1;
  return holds;
}

// The replicas of one node and what its ranks hold now.
struct NodeReplicas {
  const std::vector<int32_t>& experts;  // the node's experts
  const std::vector<int32_t>& phys;     // replica -> index into experts
  const std::vector<double>& phys_load;
  const std::vector<std::vector<char>>& holds;
  int32_t first_rank, ranks;
};

// From a packing `ro` (replica -> pack) of one node: each pack goes to the
// node's rank that holds most of its experts now, then swaps within the
// start's heaviest rank (or the mean plus a tolerance) keep more replicas
// where their experts are. Returns the replicas kept in place.
int64_t settle_in_place(const NodeReplicas& n, std::vector<int32_t>* ro) {
  const size_t count = n.phys.size();
  auto held = [&](int32_t rank, size_t s) {
    return n.holds[static_cast<size_t>(n.first_rank + rank)]
                  [static_cast<size_t>(n.experts[static_cast<size_t>(n.phys[s])])];
  };
  std::vector<std::vector<int32_t>> ov(static_cast<size_t>(n.ranks),
                                       std::vector<int32_t>(static_cast<size_t>(n.ranks), 0));
  for (size_t s = 0; s < count; ++s)
    for (int32_t i = 0; i < n.ranks; ++i) ov[static_cast<size_t>((*ro)[s])][static_cast<size_t>(i)] += held(i, s);
  const std::vector<int32_t> owner = match(ov);
  for (auto& r : *ro) r = owner[static_cast<size_t>(r)];
  std::vector<double> plain(static_cast<size_t>(n.ranks), 0.0);
  double sum = 0;
  for (size_t s = 0; s < count; ++s) {
    plain[static_cast<size_t>((*ro)[s])] += n.phys_load[s];
    sum += n.phys_load[s];
  }
  const double bound = std::max(*std::max_element(plain.begin(), plain.end()), sum / n.ranks * (1.0 + kKeepTolerance));
  keep_in_place(n.phys_load, n.phys, n.experts, n.holds, n.first_rank, n.ranks, bound, ro);
  int64_t kept = 0;
  for (size_t s = 0; s < count; ++s) kept += held((*ro)[s], s);
  return kept;
}

// Node `node`'s experts (sorted) into its slots: replicas within the node,
// replicas to its ranks, kept where they are when there is a placement.
void place_node(const std::vector<double>& load, const std::vector<int32_t>& experts, int32_t node,
                int32_t ranks_per_node, int32_t slots_per_node, int32_t slots_per_rank,
                const std::vector<std::vector<char>>& holds, std::vector<int32_t>* slots) {
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
  const std::vector<int32_t> greedy = holds.empty() ? std::vector<int32_t>{} : rank_of;
  refine_packing(phys_load, ranks_per_node, &rank_of, &pos);
  if (!holds.empty()) {
    // Both the refined packing and the plain greedy one are tried as the
    // start of settle_in_place; the one keeping more replicas in place wins
    // (ties: the refined one): from either start alone, more weights moved
    // on some placements (the refined one from the linear placement, the
    // greedy one after a drift).
    const NodeReplicas nr{experts, phys, phys_load, holds, node * ranks_per_node, ranks_per_node};
    std::vector<int32_t> from_greedy = greedy;
    if (settle_in_place(nr, &from_greedy) > settle_in_place(nr, &rank_of)) rank_of = from_greedy;
    // Positions within each rank follow.
    std::vector<int32_t> count(static_cast<size_t>(ranks_per_node), 0);
    for (size_t s = 0; s < phys.size(); ++s) pos[s] = count[static_cast<size_t>(rank_of[s])]++;
  }
  for (size_t s = 0; s < phys.size(); ++s) {
    const int32_t r = node * ranks_per_node + rank_of[s];
    (*slots)[static_cast<size_t>(r * slots_per_rank + pos[s])] = experts[static_cast<size_t>(phys[s])];
  }
}

}  // namespace

std::vector<int32_t> rebalance(const std::vector<double>& load, const RebalanceParams& p) {
  check_params(load, p);
  const int32_t E = p.num_experts, P = p.num_slots, R = p.num_ranks;
  const std::vector<std::vector<char>> holds = holdings(p);
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
  const int32_t group_size = E / groups, slots_per_node = P / nodes, ranks_per_node = R / nodes, slots_per_rank = P / R;

  // 1. Groups to nodes.
  std::vector<double> group_load(static_cast<size_t>(groups), 0.0);
  for (int32_t e = 0; e < E; ++e) group_load[static_cast<size_t>(e / group_size)] += load[static_cast<size_t>(e)];
  std::vector<int32_t> node_of_group, pos_in_node;
  balanced_packing(group_load, nodes, &node_of_group, &pos_in_node);
  refine_packing(group_load, nodes, &node_of_group, &pos_in_node);

  // With a current placement, each pack of groups goes to the node that
  // holds most of its experts now.
  std::vector<int32_t> node_of_pack(static_cast<size_t>(nodes));
  for (int32_t q = 0; q < nodes; ++q) node_of_pack[static_cast<size_t>(q)] = q;
  if (!holds.empty() && nodes > 1) {
    std::vector<std::vector<int32_t>> ov(static_cast<size_t>(nodes),
                                         std::vector<int32_t>(static_cast<size_t>(nodes), 0));
    for (int32_t e = 0; e < E; ++e) {
      const int32_t q = node_of_group[static_cast<size_t>(e / group_size)];
      for (int32_t node = 0; node < nodes; ++node) {
        bool held = false;
        for (int32_t i = 0; i < ranks_per_node && !held; ++i)
          held = holds[static_cast<size_t>(node * ranks_per_node + i)][static_cast<size_t>(e)] != 0;
        ov[static_cast<size_t>(q)][static_cast<size_t>(node)] += held;
      }
    }
    node_of_pack = match(ov);
  }

  std::vector<int32_t> slots(static_cast<size_t>(P), -1);
  for (int32_t q = 0; q < nodes; ++q) {
    // The node's experts, in group order.
    std::vector<int32_t> experts;
    for (int32_t g = 0; g < groups; ++g) {
      if (node_of_group[static_cast<size_t>(g)] != q) continue;
      for (int32_t i = 0; i < group_size; ++i) experts.push_back(g * group_size + i);
    }
    std::sort(experts.begin(), experts.end());
    place_node(load, experts, node_of_pack[static_cast<size_t>(q)], ranks_per_node, slots_per_node, slots_per_rank,
               holds, &slots);
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

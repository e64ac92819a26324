// The expert map manager through the C API: every rule of seed 002 checked
// against an independent model of it, for ep_size 1..9 and several E.
#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "../common/seed.hpp"
#include "map_helpers.hpp"

namespace {

// Independent model of the seed's determine_expert_map: the global experts
// of rank r, in local-id order.
std::vector<int> model_local_experts(int ep, int r, int E, bool round_robin) {
  std::vector<int> out;
  if (round_robin) {
    for (int g = r; g < E; g += ep) out.push_back(g);
    return out;
  }
  const int base = E / ep, rem = E % ep;
  const int count = base + (r < rem ? 1 : 0);
  const int start = r * base + std::min(r, rem);
  for (int i = 0; i < count; ++i) out.push_back(start + i);
  return out;
}

std::string model_describe(int ep, int E, const std::vector<int>& locals, int shared) {
  if (ep == 1) return "[0.." + std::to_string(E - 1) + "]";
  std::string s;
  for (size_t j = 0; j < locals.size() + static_cast<size_t>(shared); ++j) {
    if (j) s += ", ";
    const int g = j < locals.size() ? locals[j] : E + static_cast<int>(j - locals.size());
    s += std::to_string(j) + "->" + std::to_string(g);
  }
  return s;
}

void check_rank(int ep, int r, int E, bool rr, int S, std::vector<int>& owner_count) {
  INFO("ep=" << ep << " rank=" << r << " E=" << E << " rr=" << rr << " S=" << S);
  // Round robin needs expert groups (seed fallback rule), so ask with groups.
  const auto cfg = map_config(ep, r, E, rr ? EP_MOE_PLACEMENT_ROUND_ROBIN : EP_MOE_PLACEMENT_LINEAR, S, rr ? 8 : 0);
  const MapPtr m = make_map(cfg);
  const bool eff_rr = rr && ep > 1;
  const auto locals = model_local_experts(ep, r, E, eff_rr);
  const int nl = static_cast<int>(locals.size());

  CHECK(attr(m, EP_MOE_MAP_ATTR_EP_SIZE) == ep);
  CHECK(attr(m, EP_MOE_MAP_ATTR_EP_RANK) == r);
  CHECK(attr(m, EP_MOE_MAP_ATTR_GLOBAL_NUM_EXPERTS) == E);
  CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_FUSED_SHARED) == S);
  CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_PHYSICAL) == E);
  CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_REDUNDANT) == 0);
  CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED) == nl);
  CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL) == nl + S);
  CHECK(attr(m, EP_MOE_MAP_ATTR_MAX_SLOTS_PER_RANK) == (E + ep - 1) / ep);
  CHECK(attr(m, EP_MOE_MAP_ATTR_PLACEMENT) == (eff_rr ? EP_MOE_PLACEMENT_ROUND_ROBIN : EP_MOE_PLACEMENT_LINEAR));
  CHECK(attr(m, EP_MOE_MAP_ATTR_FELL_BACK) == (rr && ep == 1 ? 1 : 0));

  // expert_map: global -> local, -1 elsewhere, shared appended.
  const auto emap = table(m, EP_MOE_MAP_TABLE_EXPERT_MAP);
  REQUIRE(emap.size() == static_cast<size_t>(E + S));
  std::vector<int> expect(static_cast<size_t>(E + S), -1);
  for (int j = 0; j < nl; ++j) expect[static_cast<size_t>(locals[static_cast<size_t>(j)])] = j;
  for (int i = 0; i < S; ++i) expect[static_cast<size_t>(E + i)] = nl + i;
  CHECK(std::vector<int>(emap.begin(), emap.end()) == expect);

  // mask: local experts, S ones, trailing 0 sentinel.
  const auto mask = table(m, EP_MOE_MAP_TABLE_EXPERT_MASK);
  REQUIRE(mask.size() == static_cast<size_t>(E + S + 1));
  for (int g = 0; g < E + S; ++g) CHECK(mask[static_cast<size_t>(g)] == (expect[static_cast<size_t>(g)] >= 0 ? 1 : 0));
  CHECK(mask.back() == 0);

  // local -> global is the inverse of the map on local ids (a bijection).
  const auto l2g = table(m, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL);
  REQUIRE(l2g.size() == static_cast<size_t>(nl + S));
  for (int j = 0; j < nl + S; ++j) {
    CHECK(emap[static_cast<size_t>(l2g[static_cast<size_t>(j)])] == j);
    int32_t g = -1, back = -1, loc = -1;
    REQUIRE(ep_moe_expert_map_local_to_global(&g, m.get(), j) == EP_MOE_OK);
    CHECK(g == l2g[static_cast<size_t>(j)]);
    REQUIRE(ep_moe_expert_map_global_to_local(&back, m.get(), g) == EP_MOE_OK);
    CHECK(back == j);
    REQUIRE(ep_moe_expert_map_is_local(&loc, m.get(), g) == EP_MOE_OK);
    CHECK(loc == 1);
  }
  for (int g = 0; g < E; ++g) {
    int32_t loc = -1, l = -2;
    REQUIRE(ep_moe_expert_map_is_local(&loc, m.get(), g) == EP_MOE_OK);
    REQUIRE(ep_moe_expert_map_global_to_local(&l, m.get(), g) == EP_MOE_OK);
    CHECK(l == expect[static_cast<size_t>(g)]);
    CHECK(loc == (l >= 0 ? 1 : 0));
    if (l >= 0) ++owner_count[static_cast<size_t>(g)];
  }

  // Routing tables: physical slots are numbered rank by rank.
  const auto g2p = table(m, EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL);
  const auto p2g = table(m, EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL);
  const auto slot_rank = table(m, EP_MOE_MAP_TABLE_SLOT_RANK);
  const auto spr = table(m, EP_MOE_MAP_TABLE_SLOTS_PER_RANK);
  const auto reps = table(m, EP_MOE_MAP_TABLE_REPLICA_COUNT);
  REQUIRE(g2p.size() == static_cast<size_t>(E));
  REQUIRE(p2g.size() == static_cast<size_t>(E));
  REQUIRE(spr.size() == static_cast<size_t>(ep));
  CHECK(std::accumulate(spr.begin(), spr.end(), 0) == E);
  CHECK(std::all_of(reps.begin(), reps.end(), [](int32_t v) { return v == 1; }));
  const int base = E / ep, rem = E % ep;
  for (int g = 0; g < E; ++g) {
    CHECK(p2g[static_cast<size_t>(g2p[static_cast<size_t>(g)])] == g);  // bijection
    if (eff_rr) {
      const int owner = g % ep;  // the seed's formula
      CHECK(g2p[static_cast<size_t>(g)] == owner * base + std::min(owner, rem) + g / ep);
    } else {
      CHECK(g2p[static_cast<size_t>(g)] == g);  // linear: identity
    }
  }
  const int off = r * base + std::min(r, rem);
  for (int j = 0; j < nl; ++j) {
    CHECK(p2g[static_cast<size_t>(off + j)] == l2g[static_cast<size_t>(j)]);
    CHECK(slot_rank[static_cast<size_t>(off + j)] == r);
  }
  CHECK(spr[static_cast<size_t>(r)] == nl);

  CHECK(describe(m) == model_describe(ep, E, locals, S));
}

}  // namespace

TEST_CASE("linear and round-robin maps for ep_size 1..9 and many E", "[map]") {
  for (int E : {1, 7, 8, 60, 64, 128, 256}) {
    for (int ep = 1; ep <= 9; ++ep) {
      for (bool rr : {false, true}) {
        for (int S : {0, 2}) {
          std::vector<int> owners(static_cast<size_t>(E), 0);
          int total = 0;
          for (int r = 0; r < ep; ++r) {
            check_rank(ep, r, E, rr, S, owners);
            total += E / ep + (r < E % ep ? 1 : 0);
          }
          INFO("E=" << E << " ep=" << ep << " rr=" << rr);
          CHECK(total == E);
          // Every expert owned by exactly one rank.
          CHECK(std::all_of(owners.begin(), owners.end(), [](int c) { return c == 1; }));
        }
      }
    }
  }
}

TEST_CASE("hand-worked seed cases: E=10 over 4 ranks", "[map]") {
  // base 2, remainder 2: the first two ranks hold 3 experts.
  const std::vector<std::vector<int>> linear = {{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}};
  const std::vector<std::vector<int>> rr = {{0, 4, 8}, {1, 5, 9}, {2, 6}, {3, 7}};
  for (int r = 0; r < 4; ++r) {
    const MapPtr lm = make_map(map_config(4, r, 10));
    const auto l = table(lm, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL);
    CHECK(std::vector<int>(l.begin(), l.end()) == linear[static_cast<size_t>(r)]);
    const MapPtr rm = make_map(map_config(4, r, 10, EP_MOE_PLACEMENT_ROUND_ROBIN, 0, 2));
    const auto x = table(rm, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL);
    CHECK(std::vector<int>(x.begin(), x.end()) == rr[static_cast<size_t>(r)]);
    CHECK(table(rm, EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL) == std::vector<int32_t>({0, 3, 6, 8, 1, 4, 7, 9, 2, 5}));
    CHECK(table(rm, EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL) == std::vector<int32_t>({0, 4, 8, 1, 5, 9, 2, 6, 3, 7}));
  }
  CHECK(describe(make_map(map_config(4, 1, 10, EP_MOE_PLACEMENT_ROUND_ROBIN, 0, 2))) == "0->1, 1->5, 2->9");
  CHECK(describe(make_map(map_config(4, 2, 10))) == "0->6, 1->7");
  CHECK(describe(make_map(map_config(1, 0, 10))) == "[0..9]");
  // Mask of rank 2 (linear) with two fused shared experts.
  CHECK(table(make_map(map_config(4, 2, 10, EP_MOE_PLACEMENT_LINEAR, 2)), EP_MOE_MAP_TABLE_EXPERT_MASK) ==
        std::vector<int32_t>({0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0}));
  CHECK(table(make_map(map_config(4, 2, 10, EP_MOE_PLACEMENT_LINEAR, 2)), EP_MOE_MAP_TABLE_EXPERT_MAP) ==
        std::vector<int32_t>({-1, -1, -1, -1, -1, -1, 0, 1, -1, -1, 2, 3}));
}

TEST_CASE("ranks with zero experts are legal", "[map]") {
  for (int r = 0; r < 4; ++r) {
    const MapPtr m = make_map(map_config(4, r, 2, EP_MOE_PLACEMENT_LINEAR, 1));
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED) == (r < 2 ? 1 : 0));
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL) == (r < 2 ? 2 : 1));
    if (r >= 2) {
      CHECK(describe(m) == "0->2");  // only the fused shared expert
      CHECK(table(m, EP_MOE_MAP_TABLE_EXPERT_MAP) == std::vector<int32_t>({-1, -1, 0}));
    }
  }
  const MapPtr empty = make_map(map_config(5, 4, 3));
  CHECK(describe(empty).empty());
  CHECK(table(empty, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL).empty());
  int32_t dummy = 5;
  CHECK(ep_moe_expert_map_copy_table(nullptr, 0, empty.get(), EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL) == EP_MOE_OK);
  CHECK(ep_moe_expert_map_local_to_global(&dummy, empty.get(), 0) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(dummy == 5);
}

namespace {
struct LogLines {
  std::vector<std::pair<int, std::string>> v;
};
void collect(ep_moe_log_level_t l, const char* m, void* u) { static_cast<LogLines*>(u)->v.emplace_back(l, m); }
}  // namespace

TEST_CASE("round robin falls back to linear by the seed's rules, saying why", "[map]") {
  LogLines logs;
  REQUIRE(ep_moe_set_log_callback(collect, EP_MOE_LOG_DEBUG, &logs) == EP_MOE_OK);
  struct Case {
    const char* name;
    int groups, redundant, eplb, a2a, tables, ep;
    bool falls;
    const char* why;
  };
  const Case cases[] = {
      {"supported", 8, 0, 0, 0, 1, 4, false, ""},
      {"no groups", 0, 0, 0, 0, 1, 4, true, "expert groups"},
      {"one group", 1, 0, 0, 0, 1, 4, true, "expert groups"},
      {"redundant", 8, 2, 0, 0, 1, 4, true, "redundant"},
      {"eplb", 8, 0, 1, 0, 1, 4, true, "load balancing"},
      {"a2a without tables", 8, 0, 0, 1, 0, 4, true, "routing tables"},
      {"a2a with tables", 8, 0, 0, 1, 1, 4, false, ""},
      {"ep 1", 8, 0, 0, 0, 1, 1, true, "ep_size is 1"},
  };
  for (const auto& k : cases) {
    INFO(k.name);
    logs.v.clear();
    auto c = map_config(k.ep, 0, 16, EP_MOE_PLACEMENT_ROUND_ROBIN, 0, k.groups);
    c.num_redundant_experts = k.redundant;
    c.enable_eplb = k.eplb;
    c.use_all2all_kernels = k.a2a;
    c.all2all_supports_routing_tables = k.tables;
    const MapPtr m = make_map(c);
    CHECK(attr(m, EP_MOE_MAP_ATTR_REQUESTED_PLACEMENT) == EP_MOE_PLACEMENT_ROUND_ROBIN);
    CHECK(attr(m, EP_MOE_MAP_ATTR_PLACEMENT) == (k.falls ? EP_MOE_PLACEMENT_LINEAR : EP_MOE_PLACEMENT_ROUND_ROBIN));
    CHECK(attr(m, EP_MOE_MAP_ATTR_FELL_BACK) == (k.falls ? 1 : 0));
    if (k.falls) {
      REQUIRE(logs.v.size() == 1);
      CHECK(logs.v[0].first == (k.ep == 1 ? EP_MOE_LOG_DEBUG : EP_MOE_LOG_WARN));
      CHECK(logs.v[0].second.find(k.why) != std::string::npos);
    } else {
      CHECK(logs.v.empty());
    }
  }
  REQUIRE(ep_moe_set_log_callback(nullptr, EP_MOE_LOG_ERROR, nullptr) == EP_MOE_OK);
}

TEST_CASE("linear placement with redundant slots: slot p holds expert p % E", "[map]") {
  // E=8, R=4: 12 slots, 3 per rank.
  const std::vector<std::vector<int>> held = {{0, 1, 2}, {3, 4, 5}, {6, 7, 0}, {1, 2, 3}};
  for (int r = 0; r < 4; ++r) {
    auto c = map_config(4, r, 8);
    c.num_redundant_experts = 4;
    const MapPtr m = make_map(c);
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_PHYSICAL) == 12);
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_REDUNDANT) == 4);
    const auto l2g = table(m, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL);
    CHECK(std::vector<int>(l2g.begin(), l2g.end()) == held[static_cast<size_t>(r)]);
    CHECK(table(m, EP_MOE_MAP_TABLE_REPLICA_COUNT) == std::vector<int32_t>({2, 2, 2, 2, 1, 1, 1, 1}));
    CHECK(table(m, EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL) == std::vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 7}));
    CHECK(table(m, EP_MOE_MAP_TABLE_SLOT_RANK) == std::vector<int32_t>({0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3}));
  }
  // One rank with more slots than experts holds an expert twice: the lowest
  // local id answers global_to_local.
  auto c = map_config(1, 0, 2);
  c.num_redundant_experts = 1;
  const MapPtr m = make_map(c);
  CHECK(table(m, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL) == std::vector<int32_t>({0, 1, 0}));
  CHECK(table(m, EP_MOE_MAP_TABLE_EXPERT_MAP) == std::vector<int32_t>({0, 1}));
  CHECK(describe(m) == "0->0, 1->1, 2->0");
}

TEST_CASE("custom placement tables, replicas and uneven ranks", "[map]") {
  // 6 experts, 9 slots: expert 0 three times, expert 3 twice; ranks 4/0/5 slots.
  const int32_t slots[] = {0, 1, 2, 0, 3, 4, 5, 0, 3};
  const int32_t per_rank[] = {4, 0, 5};
  std::vector<int> owners(6, 0);
  for (int r = 0; r < 3; ++r) {
    auto c = map_config(3, r, 6, EP_MOE_PLACEMENT_CUSTOM, 1);
    c.num_custom_slots = 9;
    c.custom_slots = slots;
    c.custom_slots_per_rank = per_rank;
    const MapPtr m = make_map(c);
    CHECK(attr(m, EP_MOE_MAP_ATTR_PLACEMENT) == EP_MOE_PLACEMENT_CUSTOM);
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_PHYSICAL) == 9);
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_REDUNDANT) == 3);
    CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED) == per_rank[r]);
    CHECK(attr(m, EP_MOE_MAP_ATTR_MAX_SLOTS_PER_RANK) == 5);
    CHECK(table(m, EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL) == std::vector<int32_t>(slots, slots + 9));
    CHECK(table(m, EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL) == std::vector<int32_t>({0, 1, 2, 4, 5, 6}));
    CHECK(table(m, EP_MOE_MAP_TABLE_REPLICA_COUNT) == std::vector<int32_t>({3, 1, 1, 2, 1, 1}));
    CHECK(table(m, EP_MOE_MAP_TABLE_SLOTS_PER_RANK) == std::vector<int32_t>({4, 0, 5}));
    const auto emap = table(m, EP_MOE_MAP_TABLE_EXPERT_MAP);
    for (int g = 0; g < 6; ++g)
      if (emap[static_cast<size_t>(g)] >= 0) owners[static_cast<size_t>(g)]++;
    CHECK(emap.back() == per_rank[r]);  // the fused shared expert
  }
  CHECK(owners == std::vector<int>({2, 1, 1, 1, 1, 1}));  // expert 3: twice on rank 2
  // Rank 2's view: slots 4..8 = {3,4,5,0,3}: expert 3 twice, lowest local id 0.
  auto c = map_config(3, 2, 6, EP_MOE_PLACEMENT_CUSTOM);
  c.num_custom_slots = 9;
  c.custom_slots = slots;
  c.custom_slots_per_rank = per_rank;
  const MapPtr m2 = make_map(c);
  CHECK(table(m2, EP_MOE_MAP_TABLE_EXPERT_MAP) == std::vector<int32_t>({3, -1, -1, 0, 1, 2}));
  CHECK(describe(m2) == "0->3, 1->4, 2->5, 3->0, 4->3");
  // Without per-rank counts the slots split like linear: 3/3/3.
  c.custom_slots_per_rank = nullptr;
  const MapPtr m3 = make_map(c);
  CHECK(table(m3, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL) == std::vector<int32_t>({5, 0, 3}));
}

TEST_CASE("custom placement errors name the problem", "[map][errors]") {
  const int32_t missing[] = {0, 1, 1, 3};  // expert 2 has no slot
  const int32_t outside[] = {0, 1, 2, 4};
  const int32_t good[] = {0, 1, 2, 3};
  const int32_t bad_sum[] = {1, 1};
  const int32_t negative[] = {5, -1};
  struct Case {
    const int32_t* slots;
    int n;
    const int32_t* per_rank;
    const char* needle;
  };
  const Case cases[] = {
      {missing, 4, nullptr, "no slot for expert 2"},
      {outside, 4, nullptr, "custom_slots[3] = 4"},
      {good, 4, bad_sum, "sums to 2"},
      {good, 4, negative, "custom_slots_per_rank[1] = -1"},
      {nullptr, 4, nullptr, "custom_slots is NULL"},
      {good, 0, nullptr, "num_custom_slots"},
      {good, 3, nullptr, "num_custom_slots"},
  };
  for (const auto& k : cases) {
    INFO(k.needle);
    auto c = map_config(2, 0, 4, EP_MOE_PLACEMENT_CUSTOM);
    c.custom_slots = k.slots;
    c.num_custom_slots = k.n;
    c.custom_slots_per_rank = k.per_rank;
    ep_moe_expert_map_t* m = reinterpret_cast<ep_moe_expert_map_t*>(0x1);
    CHECK(ep_moe_expert_map_create(&m, &c) == EP_MOE_ERR_INVALID_ARGUMENT);
    CHECK(m == reinterpret_cast<ep_moe_expert_map_t*>(0x1));
    CHECK(std::string(ep_moe_last_error()).find(k.needle) != std::string::npos);
  }
}

TEST_CASE("update recomputes everything for a new layout, and keeps the old one on failure", "[map]") {
  auto c = map_config(4, 1, 64, EP_MOE_PLACEMENT_ROUND_ROBIN, 1, 8);
  const MapPtr m = make_map(c);
  // Elastic re-layout: a rank is lost, 4 -> 3 ranks, this rank becomes rank 2.
  auto c2 = map_config(3, 2, 64, EP_MOE_PLACEMENT_LINEAR, 1);
  REQUIRE(ep_moe_expert_map_update(m.get(), &c2) == EP_MOE_OK);
  const MapPtr fresh = make_map(c2);
  for (int t = EP_MOE_MAP_TABLE_EXPERT_MAP; t <= EP_MOE_MAP_TABLE_REPLICA_COUNT; ++t)
    CHECK(table(m, static_cast<ep_moe_map_table_t>(t)) == table(fresh, static_cast<ep_moe_map_table_t>(t)));
  CHECK(describe(m) == describe(fresh));
  CHECK(attr(m, EP_MOE_MAP_ATTR_EP_SIZE) == 3);
  // A bad update fails and leaves the map as it was, with the message on the handle.
  auto bad = map_config(3, 3, 64);
  CHECK(ep_moe_expert_map_update(m.get(), &bad) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_expert_map_last_error(m.get())).find("ep_rank") != std::string::npos);
  CHECK(attr(m, EP_MOE_MAP_ATTR_EP_SIZE) == 3);
  CHECK(describe(m) == describe(fresh));
  // The expert count can change too.
  auto c3 = map_config(2, 0, 7);
  REQUIRE(ep_moe_expert_map_update(m.get(), &c3) == EP_MOE_OK);
  CHECK(describe(m) == "0->0, 1->1, 2->2, 3->3");
}

namespace {
// The seed's ep_mask_and_remap for a contiguous (linear) range, in doubles.
void seed_mask_and_remap(const std::vector<int32_t>& ids, const std::vector<float>& w, int start, int n_local,
                         std::vector<int32_t>& out_ids, std::vector<float>& out_w, std::vector<uint8_t>& out_mask) {
  out_ids.resize(ids.size());
  out_w.resize(ids.size());
  out_mask.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const bool local = ids[i] >= start && ids[i] < start + n_local;
    out_mask[i] = local;
    out_w[i] = local ? w[i] : 0.0f;
    out_ids[i] = local ? ids[i] - start : ids[i] % n_local;
  }
}
}  // namespace

TEST_CASE("mask_and_remap matches the seed for linear placement", "[remap]") {
  std::mt19937 rng(test_seed() + 17);
  for (int ep : {1, 2, 3, 4, 8}) {
    for (int E : {8, 60, 64}) {
      const int T = 1 + static_cast<int>(rng() % 37), K = 1 + static_cast<int>(rng() % 8);
      std::vector<int32_t> ids(static_cast<size_t>(T * K));
      std::vector<float> w(ids.size());
      std::uniform_int_distribution<int> pick(0, E - 1);
      std::uniform_real_distribution<float> wd(0.01f, 1.0f);
      for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = pick(rng);
        w[i] = wd(rng);
      }
      for (int r = 0; r < ep; ++r) {
        INFO("ep=" << ep << " E=" << E << " r=" << r);
        const MapPtr m = make_map(map_config(ep, r, E));
        const int nl = attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED);
        const int start = table(m, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL)[0];
        std::vector<int32_t> sid;
        std::vector<float> sw;
        std::vector<uint8_t> smask;
        seed_mask_and_remap(ids, w, start, nl, sid, sw, smask);
        std::vector<int32_t> oid(ids.size(), -9);
        std::vector<float> ow(ids.size(), -9.0f);
        std::vector<uint8_t> omask(ids.size(), 9);
        REQUIRE(ep_moe_mask_and_remap(oid.data(), ow.data(), omask.data(), m.get(), ids.data(), w.data(),
                                      EP_MOE_DTYPE_F32, T, K, EP_MOE_REMAP_SPREAD) == EP_MOE_OK);
        CHECK(oid == sid);
        CHECK(ow == sw);
        CHECK(omask == smask);
        // -1 mode: only non-local ids differ.
        REQUIRE(ep_moe_mask_and_remap(oid.data(), ow.data(), nullptr, m.get(), ids.data(), w.data(), EP_MOE_DTYPE_F32,
                                      T, K, EP_MOE_REMAP_MINUS_ONE) == EP_MOE_OK);
        for (size_t i = 0; i < ids.size(); ++i) CHECK(oid[i] == (smask[i] ? sid[i] : -1));
        // In place.
        std::vector<int32_t> iid = ids;
        std::vector<float> iw = w;
        REQUIRE(ep_moe_mask_and_remap(iid.data(), iw.data(), nullptr, m.get(), iid.data(), iw.data(), EP_MOE_DTYPE_F32,
                                      T, K, EP_MOE_REMAP_SPREAD) == EP_MOE_OK);
        CHECK(iid == sid);
        CHECK(iw == sw);
      }
    }
  }
}

TEST_CASE("mask_and_remap: 16-bit weights, shared ids, empty ranks, round robin", "[remap]") {
  const MapPtr m = make_map(map_config(4, 1, 8, EP_MOE_PLACEMENT_ROUND_ROBIN, 1, 4));  // experts 1, 5 + shared
  const int32_t ids[] = {1, 2, 5, 8, 0, 3};
  const uint16_t w[] = {0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0};  // bf16 1..6 (also nonzero as f16)
  for (ep_moe_dtype_t dt : {EP_MOE_DTYPE_BF16, EP_MOE_DTYPE_F16}) {
    int32_t oid[6];
    uint16_t ow[6];
    uint8_t mask[6];
    REQUIRE(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, w, dt, 3, 2, EP_MOE_REMAP_SPREAD) == EP_MOE_OK);
    CHECK(std::vector<int32_t>(oid, oid + 6) == std::vector<int32_t>({0, 0, 1, 2, 0, 1}));
    CHECK(std::vector<uint16_t>(ow, ow + 6) == std::vector<uint16_t>({0x3f80, 0, 0x4040, 0x4080, 0, 0}));
    CHECK(std::vector<uint8_t>(mask, mask + 6) == std::vector<uint8_t>({1, 0, 1, 1, 0, 0}));
  }
  // A rank without routed experts has nothing to spread to: -1.
  const MapPtr empty = make_map(map_config(4, 3, 3));
  const int32_t ids2[] = {0, 2};
  const float w2[] = {1.0f, 2.0f};
  int32_t oid2[2];
  float ow2[2];
  REQUIRE(ep_moe_mask_and_remap(oid2, ow2, nullptr, empty.get(), ids2, w2, EP_MOE_DTYPE_F32, 1, 2,
                                EP_MOE_REMAP_SPREAD) == EP_MOE_OK);
  CHECK(oid2[0] == -1);
  CHECK(oid2[1] == -1);
  CHECK(ow2[0] == 0.0f);
  // Zero tokens: nothing read or written, NULL buffers accepted.
  CHECK(ep_moe_mask_and_remap(nullptr, nullptr, nullptr, m.get(), nullptr, nullptr, EP_MOE_DTYPE_F32, 0, 8,
                              EP_MOE_REMAP_SPREAD) == EP_MOE_OK);
}

TEST_CASE("mask_and_remap rejects bad ids and writes nothing", "[remap][errors]") {
  const MapPtr m = make_map(map_config(2, 0, 8));
  const int32_t ids[] = {1, 2, 3, 8};
  const float w[] = {1, 1, 1, 1};
  int32_t oid[4] = {7, 7, 7, 7};
  float ow[4] = {7, 7, 7, 7};
  uint8_t mask[4] = {7, 7, 7, 7};
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, w, EP_MOE_DTYPE_F32, 2, 2, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  const std::string msg = ep_moe_expert_map_last_error(m.get());
  CHECK(msg.find("token 1, slot 1") != std::string::npos);
  CHECK(msg.find("= 8") != std::string::npos);
  for (int i = 0; i < 4; ++i) {
    CHECK(oid[i] == 7);
    CHECK(ow[i] == 7.0f);
    CHECK(mask[i] == 7);
  }
  const int32_t neg[] = {-1};
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), neg, w, EP_MOE_DTYPE_F32, 1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, w, EP_MOE_DTYPE_F32, -1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, w, EP_MOE_DTYPE_F32, 1, 0, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, w, static_cast<ep_moe_dtype_t>(9), 1, 1,
                              EP_MOE_REMAP_SPREAD) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, w, EP_MOE_DTYPE_F32, 1, 1,
                              static_cast<ep_moe_remap_mode_t>(5)) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(nullptr, ow, mask, m.get(), ids, w, EP_MOE_DTYPE_F32, 1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("out_ids") != std::string::npos);
  CHECK(ep_moe_mask_and_remap(oid, nullptr, mask, m.get(), ids, w, EP_MOE_DTYPE_F32, 1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), nullptr, w, EP_MOE_DTYPE_F32, 1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, m.get(), ids, nullptr, EP_MOE_DTYPE_F32, 1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_mask_and_remap(oid, ow, mask, nullptr, ids, w, EP_MOE_DTYPE_F32, 1, 1, EP_MOE_REMAP_SPREAD) ==
        EP_MOE_ERR_INVALID_HANDLE);
  for (int i = 0; i < 4; ++i) CHECK(oid[i] == 7);
}

TEST_CASE("bad map configs return INVALID_ARGUMENT naming the field", "[map][errors]") {
  struct Case {
    int ep, rank, E, placement, shared, redundant;
    const char* field;
  };
  const Case cases[] = {
      {0, 0, 8, 0, 0, 0, "ep_size"},
      {-3, 0, 8, 0, 0, 0, "ep_size"},
      {4, 4, 8, 0, 0, 0, "ep_rank"},
      {4, -1, 8, 0, 0, 0, "ep_rank"},
      {4, 0, 0, 0, 0, 0, "global_num_experts"},
      {4, 0, -8, 0, 0, 0, "global_num_experts"},
      {4, 0, 8, 7, 0, 0, "placement"},
      {4, 0, 8, -1, 0, 0, "placement"},
      {4, 0, 8, 0, -1, 0, "num_fused_shared_experts"},
      {4, 0, 8, 0, 0, -2, "num_redundant_experts"},
      {4, 0, 1 << 30, 0, 0, 0, "global_num_experts"},
  };
  for (const auto& k : cases) {
    INFO(k.field << " ep=" << k.ep << " rank=" << k.rank << " E=" << k.E);
    auto c = map_config(1, 0, 1);
    c.ep_size = k.ep;
    c.ep_rank = k.rank;
    c.global_num_experts = k.E;
    c.placement = k.placement;
    c.num_fused_shared_experts = k.shared;
    c.num_redundant_experts = k.redundant;
    ep_moe_expert_map_t* m = nullptr;
    CHECK(ep_moe_expert_map_create(&m, &c) == EP_MOE_ERR_INVALID_ARGUMENT);
    CHECK(m == nullptr);
    CHECK(std::string(ep_moe_last_error()).find(k.field) != std::string::npos);
  }
  auto c = map_config(2, 0, 8);
  c.num_expert_group = -1;
  ep_moe_expert_map_t* m = nullptr;
  CHECK(ep_moe_expert_map_create(&m, &c) == EP_MOE_ERR_INVALID_ARGUMENT);
}

TEST_CASE("uninitialised and foreign-size configs are rejected", "[map][errors]") {
  ep_moe_expert_map_config_t c;
  std::memset(&c, 0, sizeof c);
  c.ep_size = 1;
  c.global_num_experts = 8;
  ep_moe_expert_map_t* m = nullptr;
  CHECK(ep_moe_expert_map_create(&m, &c) == EP_MOE_ERR_STRUCT_SIZE);
  CHECK(std::string(ep_moe_last_error()).find("struct_size") != std::string::npos);
  std::memset(&c, 0xA5, sizeof c);
  CHECK(ep_moe_expert_map_create(&m, &c) == EP_MOE_ERR_STRUCT_SIZE);
  REQUIRE(ep_moe_expert_map_config_init(&c) == EP_MOE_OK);
  c.struct_size += 8;  // a newer header's larger struct
  c.global_num_experts = 8;
  CHECK(ep_moe_expert_map_create(&m, &c) == EP_MOE_ERR_STRUCT_SIZE);
  CHECK(m == nullptr);
  CHECK(ep_moe_expert_map_config_init(nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_expert_map_create(nullptr, &c) == EP_MOE_ERR_INVALID_ARGUMENT);
}

TEST_CASE("queries reject NULL, destroyed and out-of-range arguments and leave outputs alone", "[map][errors]") {
  const MapPtr m = make_map(map_config(2, 1, 8, EP_MOE_PLACEMENT_LINEAR, 1));
  int32_t v = 42;
  size_t n = 42;
  CHECK(ep_moe_expert_map_get_attr(&v, nullptr, EP_MOE_MAP_ATTR_EP_SIZE) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(ep_moe_expert_map_get_attr(nullptr, m.get(), EP_MOE_MAP_ATTR_EP_SIZE) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_expert_map_get_attr(&v, m.get(), static_cast<ep_moe_map_attr_t>(99)) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_expert_map_last_error(m.get())).find("attr 99") != std::string::npos);
  CHECK(ep_moe_expert_map_global_to_local(&v, m.get(), 9) == EP_MOE_ERR_INVALID_ARGUMENT);  // E + S = 9
  CHECK(ep_moe_expert_map_global_to_local(&v, m.get(), -1) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("global_id -1") != std::string::npos);
  CHECK(ep_moe_expert_map_local_to_global(&v, m.get(), 5) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_expert_map_is_local(&v, m.get(), 100) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_expert_map_is_local(nullptr, m.get(), 1) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_expert_map_table_length(&n, m.get(), static_cast<ep_moe_map_table_t>(77)) ==
        EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(ep_moe_expert_map_table_length(nullptr, m.get(), EP_MOE_MAP_TABLE_EXPERT_MAP) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(v == 42);
  CHECK(n == 42);
  // Too small a buffer: nothing written.
  int32_t buf[9];
  std::fill(buf, buf + 9, 5);
  CHECK(ep_moe_expert_map_copy_table(buf, 8, m.get(), EP_MOE_MAP_TABLE_EXPERT_MAP) == EP_MOE_ERR_BUFFER_TOO_SMALL);
  CHECK(std::all_of(buf, buf + 9, [](int32_t x) { return x == 5; }));
  CHECK(std::string(ep_moe_last_error()).find("needs 9") != std::string::npos);
  CHECK(ep_moe_expert_map_copy_table(nullptr, 9, m.get(), EP_MOE_MAP_TABLE_EXPERT_MAP) == EP_MOE_ERR_INVALID_ARGUMENT);
  // describe: truncation is snprintf-like; NULL buffer with a size is an error.
  char small[4] = {'x', 'x', 'x', 'x'};
  size_t need = 0;
  CHECK(ep_moe_expert_map_describe(small, sizeof small, &need, m.get()) == EP_MOE_OK);
  CHECK(need == std::string("0->4, 1->5, 2->6, 3->7, 4->8").size());
  CHECK(std::string(small) == "0->");
  CHECK(ep_moe_expert_map_describe(nullptr, 5, &need, m.get()) == EP_MOE_ERR_INVALID_ARGUMENT);
  // The handle stays usable after all of these failures.
  CHECK(attr(m, EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL) == 5);
  // A destroyed handle is detected (the registry no longer knows it).
  ep_moe_expert_map_t* gone = nullptr;
  const auto cfg = map_config(1, 0, 4);
  REQUIRE(ep_moe_expert_map_create(&gone, &cfg) == EP_MOE_OK);
  ep_moe_expert_map_destroy(gone);
  CHECK(ep_moe_expert_map_get_attr(&v, gone, EP_MOE_MAP_ATTR_EP_SIZE) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(std::string(ep_moe_last_error()).find("not a live") != std::string::npos);
  ep_moe_expert_map_destroy(gone);  // destroying twice is ignored
  ep_moe_expert_map_destroy(nullptr);
  CHECK(std::string(ep_moe_expert_map_last_error(nullptr)) == "the handle is NULL");
  CHECK(ep_moe_expert_map_update(nullptr, &cfg) == EP_MOE_ERR_INVALID_HANDLE);
  CHECK(ep_moe_expert_map_update(m.get(), nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
}

TEST_CASE("const queries may run from several threads at once", "[map][threads]") {
  const MapPtr m = make_map(map_config(8, 3, 256, EP_MOE_PLACEMENT_ROUND_ROBIN, 0, 8));
  const auto expect = table(m, EP_MOE_MAP_TABLE_EXPERT_MAP);
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      int good = 1;
      for (int it = 0; it < 200; ++it) {
        for (int g = 0; g < 256; ++g) {
          int32_t l = -5;
          if (ep_moe_expert_map_global_to_local(&l, m.get(), g) != EP_MOE_OK || l != expect[static_cast<size_t>(g)])
            good = 0;
        }
        int32_t bad = 0;
        if (ep_moe_expert_map_global_to_local(&bad, m.get(), 999) != EP_MOE_ERR_INVALID_ARGUMENT) good = 0;
      }
      ok[static_cast<size_t>(t)] = good;
    });
  }
  for (auto& th : threads) th.join();
  CHECK(ok == std::vector<int>(4, 1));
}

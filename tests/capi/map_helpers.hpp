// Helpers for expert-map tests through the public C API.
#pragma once

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

struct MapDeleter {
  void operator()(ep_moe_expert_map_t* m) const { ep_moe_expert_map_destroy(m); }
};
using MapPtr = std::unique_ptr<ep_moe_expert_map_t, MapDeleter>;

inline ep_moe_expert_map_config_t map_config(int ep, int rank, int E, int placement = EP_MOE_PLACEMENT_LINEAR,
                                             int shared = 0, int groups = 0) {
  ep_moe_expert_map_config_t c;
  REQUIRE(ep_moe_expert_map_config_init(&c) == EP_MOE_OK);
  c.ep_size = ep;
  c.ep_rank = rank;
  c.global_num_experts = E;
  c.placement = placement;
  c.num_fused_shared_experts = shared;
  c.num_expert_group = groups;
  return c;
}

inline MapPtr make_map(const ep_moe_expert_map_config_t& c) {
  ep_moe_expert_map_t* m = nullptr;
  const ep_moe_status_t s = ep_moe_expert_map_create(&m, &c);
  INFO(ep_moe_last_error());
  REQUIRE(s == EP_MOE_OK);
  REQUIRE(m != nullptr);
  return MapPtr(m);
}

inline int32_t attr(const MapPtr& m, ep_moe_map_attr_t a) {
  int32_t v = -12345;
  REQUIRE(ep_moe_expert_map_get_attr(&v, m.get(), a) == EP_MOE_OK);
  return v;
}

inline std::vector<int32_t> table(const MapPtr& m, ep_moe_map_table_t t) {
  size_t n = 0;
  REQUIRE(ep_moe_expert_map_table_length(&n, m.get(), t) == EP_MOE_OK);
  std::vector<int32_t> v(n + 1, -777);  // one spare entry must stay untouched
  REQUIRE(ep_moe_expert_map_copy_table(v.data(), n, m.get(), t) == EP_MOE_OK);
  REQUIRE(v[n] == -777);
  v.pop_back();
  return v;
}

inline std::string describe(const MapPtr& m) {
  size_t need = 0;
  REQUIRE(ep_moe_expert_map_describe(nullptr, 0, &need, m.get()) == EP_MOE_OK);
  std::string s(need + 1, '#');
  size_t need2 = 0;
  REQUIRE(ep_moe_expert_map_describe(&s[0], s.size(), &need2, m.get()) == EP_MOE_OK);
  REQUIRE(need2 == need);
  REQUIRE(s[need] == '\0');
  s.resize(need);
  return s;
}

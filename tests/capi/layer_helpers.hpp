// A layer through the public C API for the capi tests: rank `rank` of an
// EP group of `ep` with no communicator (its experts' share of each token),
// every weight of `w` given.
#pragma once

#include <catch2/catch.hpp>

#include "../multirank/harness.hpp"
#include "ep_moe/ep_moe.h"
#include "map_helpers.hpp"

inline ep_moe_layer_t* loaded_rank_layer(const harness::Case& c, const ref::Weights& w, int ep, int rank) {
  const MapPtr m = make_map(map_config(ep, rank, c.spec.E));
  const auto lc = harness::layer_config(c);
  ep_moe_layer_t* l = nullptr;
  REQUIRE(ep_moe_layer_create(&l, &lc, m.get(), nullptr, nullptr) == EP_MOE_OK);
  int stored = 0;
  REQUIRE(harness::load_weights(l, c, w, &stored).empty());
  return l;
}

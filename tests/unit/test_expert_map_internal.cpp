// Internal helpers of the map: the linear split and its invariants.
#include <catch2/catch.hpp>

#include "common/error.hpp"
#include "core/expert_map.hpp"

using namespace ep_moe;

TEST_CASE("split_count and split_start tile 0..n for every n and parts", "[unit][map]") {
  for (int32_t parts = 1; parts <= 17; ++parts) {
    for (int32_t n = 0; n <= 300; ++n) {
      int32_t next = 0;
      for (int32_t i = 0; i < parts; ++i) {
        REQUIRE(split_start(n, parts, i) == next);
        const int32_t c = split_count(n, parts, i);
        REQUIRE((c == n / parts || c == n / parts + 1));
        // The first n % parts parts hold the extra item.
        REQUIRE(c == n / parts + (i < n % parts ? 1 : 0));
        next += c;
      }
      REQUIRE(next == n);
    }
  }
}

TEST_CASE("ExpertMap throws ep_moe::Error with INVALID_ARGUMENT", "[unit][map]") {
  ExpertMapParams p;
  p.ep_size = 0;
  p.num_experts = 4;
  try {
    ExpertMap m(p);
    FAIL("no exception");
  } catch (const Error& e) {
    CHECK(e.status() == EP_MOE_ERR_INVALID_ARGUMENT);
    CHECK(std::string(e.what()).find("ep_size") != std::string::npos);
  }
}

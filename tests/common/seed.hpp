// One seed per test process: --rng-seed N replays a run; without it every
// run draws fresh inputs. The seed is printed so a failure can be replayed.
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <random>

inline unsigned test_seed() {
  static const unsigned seed = [] {
    const unsigned s = Catch::rngSeed() ? Catch::rngSeed() : std::random_device{}();
    std::fprintf(stderr, "random inputs drawn with seed %u (replay: --rng-seed %u)\n", s, s);
    return s;
  }();
  return seed;
}

// Timing two ways of doing the same work against each other, at run time
// (the layer's choices that depend on the CPU: kernels.cpp, matrix_engine.cpp).
#pragma once

#include <algorithm>
#include <chrono>

namespace ep_moe {
namespace cpu {

// Ratio of the time of `a` to that of `b` on the same work: one warm-up
// call of each (code and data into the caches), then the best of 7
// alternated rounds each (a preempted vCPU spoils one round).
template <class A, class B>
double best_ratio(A a, B b) {
  using clock = std::chrono::steady_clock;
  const auto time = [](auto& f) {
    const auto t0 = clock::now();
    f();
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  a();
  b();
  double best_a = 1e30, best_b = 1e30;
  for (int round = 0; round < 7; ++round) {
    best_a = std::min(best_a, time(a));
    best_b = std::min(best_b, time(b));
  }
  return best_a / best_b;
}

}  // namespace cpu
}  // namespace ep_moe

// What the forward steps share (layer.cpp, alltoall.cpp, cuda_backend.cpp):
// the step's collectives and its clock.
#pragma once

#include <chrono>
#include <cstdint>

#include "comm/comm.hpp"

namespace ep_moe {

// Monotonic nanoseconds, for the per-phase times of a step.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The collectives of one forward step, in order. On failure those not yet
// entered are joined as failures, so no peer waits for this rank.
struct Stages {
  Comm* list[4] = {nullptr, nullptr, nullptr, nullptr};
  int n = 0, next = 0;
  void add(Comm* c) { list[n++] = c; }
  Comm* enter() { return list[next++]; }
  void fail_rest(ep_moe_status_t s, const char* msg) noexcept {
    for (int i = next; i < n; ++i) list[i]->fail_collective(s, msg);
  }
};

}  // namespace ep_moe

// The collectives of one forward step (layer.cpp, layer_device.cpp).
#pragma once

#include "comm/comm.hpp"

namespace ep_moe {

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

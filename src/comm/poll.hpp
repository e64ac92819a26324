// Waiting for an asynchronous operation with a deadline and an abort flag:
// spins briefly, then sleeps with growing pauses (at most 1 ms), so a
// blocked rank costs little CPU and still answers within a millisecond.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "common/error.hpp"

namespace ep_moe {

enum class PollResult { Done, Aborted, TimedOut };

// `done()` is called until it returns true; it may throw.
template <class Done>
PollResult poll_until(Done&& done, std::chrono::steady_clock::time_point deadline, const std::atomic<bool>& aborted) {
  int spins = 0;
  std::chrono::microseconds pause(1);
  for (;;) {
    if (done()) return PollResult::Done;
    if (aborted.load(std::memory_order_acquire)) return PollResult::Aborted;
    if (std::chrono::steady_clock::now() >= deadline) return PollResult::TimedOut;
    if (++spins < 64) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::microseconds(1000)) pause *= 2;
  }
}

}  // namespace ep_moe

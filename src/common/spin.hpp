// Spin-then-block waiting, shared by the thread pool and the in-process
// communicator: a waiter spins for up to kSpinMicros before it blocks, since
// a wake-up through the kernel costs tens of microseconds on a virtual
// machine and a forward waits many times a few microseconds apart.
#pragma once

#include <chrono>
#include <thread>

namespace ep_moe {

constexpr int kSpinMicros = 50;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until pred() holds or kSpinMicros pass; returns pred().
template <class Pred>
bool spin_until(Pred pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  for (unsigned i = 0;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return pred();
  }
}

}  // namespace ep_moe

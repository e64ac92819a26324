// A small fork-join pool: the calling thread plus (n - 1) workers share the
// items of one parallel loop at a time. Between loops the workers, and the
// caller waiting for the last item, spin for up to kSpinMicros
// (common/spin.hpp) before they block: a forward runs a few loops
// microseconds apart, and a wake-up through the kernel costs tens of
// microseconds on a virtual machine, a tenth of a decode step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

#include "common/fn_ref.hpp"

namespace ep_moe {
namespace cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(item, thread_index) for every item in [0, n); returns when all
  // are done. fn must not throw. thread_index is in [0, size()). The loops
  // take their callables by FnRef: nothing is allocated per loop.
  void parallel_for(size_t n, FnRef<void(size_t, int)> fn);
  // The same over blocks of `block` consecutive indices of [0, n): calls
  // fn(begin, end, thread_index) once per block.
  void parallel_ranges(size_t n, size_t block, FnRef<void(size_t, size_t, int)> fn);
  // Wakes the workers blocked between loops, so that they spin (up to
  // kSpinMicros) for the next loop instead of needing a kernel wake-up when
  // it starts: call it before serial work of a few tens of microseconds
  // that a loop follows (a layer's forward calls it before routing). Cheap
  // when no worker is blocked.
  void wake();
  // Items [0, n) in one contiguous share per thread (size() shares of
  // nearly equal length), for loops that stream memory in item order: a
  // thread runs its share front to back, `grain` items per claim (but at
  // most half of what is left of it, and at least `steal`), so it reads
  // one long run instead of every size()-th block. A thread done with
  // its share helps with the others, `steal` items at a time from their
  // back, so a thread the OS holds up delays the loop by at most what it
  // had claimed. Calls fn(begin, end, next, thread_index) once per claim;
  // `next` is the item the thread will most likely start next (the first
  // after `end` in its share), or n when there is no such guess.
  void parallel_shares(size_t n, size_t grain, size_t steal, FnRef<void(size_t, size_t, size_t, int)> fn);

 private:
  void worker(int index);
  void drain(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  const FnRef<void(size_t, int)>* job_ = nullptr;  // the running loop's, on parallel_for's stack
  size_t job_size_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<unsigned long long> generation_{0};  // written under mutex_
  std::atomic<int> busy_{0};
  std::atomic<bool> stop_{false};
  unsigned long long pokes_ = 0;  // wake() calls, under mutex_
  std::atomic<int> asleep_{0};    // workers blocked on start_cv_
  // parallel_shares: per share, (front, back) of what is left, packed as
  // front | back << 32, one cache line each.
  struct alignas(64) Share {
    std::atomic<unsigned long long> left{0};
  };
  std::vector<Share> shares_;
};

// Threads a rank should use: `requested` when > 0, else the machine's
// hardware threads divided by the ranks sharing this process (at least 1).
int default_threads(int requested, int ranks_in_process);

}  // namespace cpu
}  // namespace ep_moe

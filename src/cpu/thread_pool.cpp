#include "cpu/thread_pool.hpp"

#include <algorithm>
#include <system_error>

#include "common/error.hpp"
#include "common/spin.hpp"

namespace ep_moe {
namespace cpu {

ThreadPool::ThreadPool(int threads) : shares_(static_cast<size_t>(std::max(1, threads))) {
  const int extra = std::max(0, threads - 1);
  workers_.reserve(static_cast<size_t>(extra));
  const auto stop_started = [this] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true, std::memory_order_release);
    }
    start_cv_.notify_all();
    for (auto& t : workers_) t.join();
  };
  try {
    for (int i = 0; i < extra; ++i) workers_.emplace_back(&ThreadPool::worker, this, i + 1);
  } catch (const std::system_error& e) {
    // The system refused a thread (EAGAIN: the process's thread or memory
    // limit): a resource the caller can free, not an internal error.
    stop_started();
    fail(EP_MOE_ERR_OUT_OF_MEMORY,
         "cannot start thread %zu of %d for the layer's pool: %s (a thread or memory limit; "
         "ask for fewer num_threads)",
         workers_.size() + 1, threads, e.what());
  } catch (...) {
    stop_started();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true, std::memory_order_release);
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::drain(int index) {
  for (;;) {
    const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= job_size_) break;
    (*job_)(i, index);
  }
}

void ThreadPool::worker(int index) {
  unsigned long long seen = 0;
  for (;;) {
    auto ready = [&] {
      return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
    };
    if (!spin_until(ready)) {
      std::unique_lock<std::mutex> lock(mutex_);
      const unsigned long long poked = pokes_;
      asleep_.fetch_add(1, std::memory_order_relaxed);
      start_cv_.wait(lock, [&] { return ready() || pokes_ != poked; });
      asleep_.fetch_sub(1, std::memory_order_relaxed);
      if (!ready()) continue;  // woken ahead of a loop: spin for it
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    drain(index);
    if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);  // the caller may be in wait(): notify under the lock
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::wake() {
  if (asleep_.load(std::memory_order_relaxed) == 0) return;  // none blocked (a miss only costs time)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++pokes_;
  }
  start_cv_.notify_all();
}

void ThreadPool::parallel_for(size_t n, FnRef<void(size_t, int)> fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_size_ = n;
    next_.store(0, std::memory_order_relaxed);
    busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);  // publishes job_, job_size_, next_, busy_
  }
  start_cv_.notify_all();
  drain(0);
  auto done = [&] { return busy_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(done)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, done);
  }
  job_ = nullptr;
}

void ThreadPool::parallel_ranges(size_t n, size_t block, FnRef<void(size_t, size_t, int)> fn) {
  block = std::max<size_t>(block, 1);
  parallel_for((n + block - 1) / block, [&](size_t b, int t) { fn(b * block, std::min(n, b * block + block), t); });
}

void ThreadPool::parallel_shares(size_t n, size_t grain, size_t steal, FnRef<void(size_t, size_t, size_t, int)> fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  steal = std::max<size_t>(steal, 1);
  const size_t s = static_cast<size_t>(size());
  if (s == 1 || n == 1) {
    for (size_t b = 0; b < n; b += grain) fn(b, std::min(n, b + grain), b + grain < n ? b + grain : n, 0);
    return;
  }
  if (n >= (size_t{1} << 32)) {  // beyond the packed 32-bit bounds: plain blocks
    parallel_ranges(n, grain, [&](size_t b, size_t e, int t) { fn(b, e, n, t); });
    return;
  }
  using U = unsigned long long;
  auto pack = [](size_t front, size_t back) { return static_cast<U>(front) | static_cast<U>(back) << 32; };
  for (size_t i = 0; i < s; ++i) shares_[i].left.store(pack(n * i / s, n * (i + 1) / s), std::memory_order_relaxed);
  // Takes up to `most` items off the front (or back) of a share: false when
  // it is empty; else [*begin, *end), and *rest: whether items remain past
  // them at the front.
  auto claim = [&](Share& sh, bool front, size_t most, size_t* begin, size_t* end, bool* rest) {
    U v = sh.left.load(std::memory_order_relaxed);
    for (;;) {
      const auto f = static_cast<size_t>(v & 0xffffffffu), b = static_cast<size_t>(v >> 32);
      if (f >= b) return false;
      // From the front, at most half of what is left (at least `steal`):
      // the owner's last claims are small, so a thread done early still
      // finds items to take instead of waiting out a whole grain.
      const size_t cap = front ? std::min(most, std::max(steal, (b - f + 1) / 2)) : most;
      const size_t take = std::min(cap, b - f);
      *begin = front ? f : b - take;
      *end = *begin + take;
      *rest = front && *end < b;
      if (sh.left.compare_exchange_weak(v, front ? pack(f + take, b) : pack(f, b - take), std::memory_order_relaxed))
        return true;
    }
  };
  // Published to the workers by parallel_for's generation (release/acquire).
  parallel_for(s, [&](size_t own, int t) {
    size_t b = 0, e = 0;
    bool rest = false;
    while (claim(shares_[own], true, grain, &b, &e, &rest)) fn(b, e, rest ? e : n, t);  // own share, from the front
    for (size_t d = 1; d < s; ++d)  // then the others', from the back
      while (claim(shares_[(own + d) % s], false, steal, &b, &e, &rest)) fn(b, e, n, t);
  });
}

int default_threads(int requested, int ranks_in_process) {
  if (requested > 0) return requested;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1, static_cast<int>(hw) / std::max(1, ranks_in_process));
}

}  // namespace cpu
}  // namespace ep_moe

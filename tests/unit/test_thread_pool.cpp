// The CPU thread pool's loops: every item runs exactly once whatever the
// thread count, and parallel_shares keeps each thread on its own
// contiguous share, front to back, until it helps with another's.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu/thread_pool.hpp"

using ep_moe::cpu::ThreadPool;

namespace {
struct Claim {
  size_t begin, end, next;
  int thread;
};
}  // namespace

TEST_CASE("parallel_for and parallel_ranges run every item once", "[unit][pool]") {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{1000}}) {
      // Catch's assertions are not thread-safe: workers only count, the
      // checks run on this thread afterwards.
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> bad{0};
      pool.parallel_for(n, [&](size_t i, int t) {
        if (t < 0 || t >= pool.size()) bad.fetch_add(1);
        hits[i].fetch_add(1);
      });
      for (size_t i = 0; i < n; ++i) CHECK(hits[i].load() == 1);
      std::vector<std::atomic<int>> hits2(n);
      pool.parallel_ranges(n, 3, [&](size_t b, size_t e, int) {
        if (b >= e || e - b > 3) bad.fetch_add(1);
        for (size_t i = b; i < e; ++i) hits2[i].fetch_add(1);
      });
      for (size_t i = 0; i < n; ++i) CHECK(hits2[i].load() == 1);
      CHECK(bad.load() == 0);
    }
  }
}

TEST_CASE("parallel_shares runs every item once, each claim within one share", "[unit][pool]") {
  for (int threads : {1, 2, 3, 4}) {
    ThreadPool pool(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{10}, size_t{64}, size_t{1001}}) {
      for (size_t grain : {size_t{1}, size_t{4}, size_t{16}}) {
        const size_t steal = std::max<size_t>(1, grain / 4);
        std::vector<std::atomic<int>> hits(n);
        std::mutex mu;
        std::vector<Claim> claims;
        pool.parallel_shares(n, grain, steal, [&](size_t b, size_t e, size_t next, int t) {
          for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          claims.push_back(Claim{b, e, next, t});
        });
        INFO("threads " << threads << " n " << n << " grain " << grain);
        for (size_t i = 0; i < n; ++i) CHECK(hits[i].load() == 1);
        const size_t s = static_cast<size_t>(pool.size());
        for (const Claim& c : claims) {
          REQUIRE(c.begin < c.end);
          CHECK(c.end - c.begin <= std::max(grain, steal));
          CHECK(c.thread >= 0);
          CHECK(c.thread < pool.size());
          // A claim never crosses a share boundary.
          size_t share = 0;
          while (c.begin >= n * (share + 1) / s) ++share;
          CHECK(c.end <= n * (share + 1) / s);
          // The guess of the next item is the rest of the claim's share, or none.
          CHECK((c.next == n || (c.next == c.end && c.next < n * (share + 1) / s)));
          // Each share's last items go in a claim of at most `steal` (the
          // owner's claims shrink near its end), so no thread is left
          // waiting out a whole grain of its peer's.
          if (s > 1 && n > 1 && c.end == n * (share + 1) / s) CHECK(c.end - c.begin <= steal);
        }
      }
    }
  }
}

TEST_CASE("parallel_shares: a stalled thread's share is finished by the others", "[unit][pool]") {
  ThreadPool pool(3);
  const size_t n = 300, lo = n / 3, hi = 2 * n / 3;  // the middle share
  std::vector<std::atomic<int>> hits(n), by(n);
  std::atomic<bool> stalled{false};
  pool.parallel_shares(n, 5, 1, [&](size_t b, size_t e, size_t, int t) {
    if (e - b == 1) {
      // A steal (or an owner's last item: owners claim 5, shrinking near
      // their share's end): slow, so the middle share's owner has long made
      // its first claim before thieves could reach it.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } else if (b >= lo && b < hi && !stalled.exchange(true)) {
      // The middle share's first owner claim holds its thread up until
      // every other item is done (or 5 s pass: then the checks below fail).
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      auto others_done = [&] {
        for (size_t i = 0; i < n; ++i)
          if ((i < b || i >= e) && hits[i].load() == 0) return false;
        return true;
      };
      while (!others_done() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    for (size_t i = b; i < e; ++i) {
      hits[i].fetch_add(1);
      by[i].store(t);
    }
  });
  for (size_t i = 0; i < n; ++i) CHECK(hits[i].load() == 1);
  REQUIRE(stalled.load());
  // The stalled owner made its first claim only; the rest of its share was
  // taken from the back by the other threads.
  const int staller = by[lo].load();
  for (size_t i = lo + 5; i < hi; ++i) CHECK(by[i].load() != staller);
}

TEST_CASE("wake: blocked workers woken between loops still run every item once", "[unit][pool]") {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (int round = 0; round < 4; ++round) {
      // Long enough for the workers to stop spinning and block.
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      pool.wake();
      if (round % 2) pool.wake();  // twice, and with workers already spinning
      std::vector<std::atomic<int>> hits(100);
      pool.parallel_for(hits.size(), [&](size_t i, int) { hits[i].fetch_add(1); });
      for (auto& h : hits) CHECK(h.load() == 1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    pool.wake();  // then destroyed at once: the woken workers still stop
  }
}

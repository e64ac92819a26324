// ep_moe_pool_bench: the cost of one fork-join loop of the layer's thread
// pool (src/cpu/thread_pool.hpp), the overhead every parallel phase of a
// forward pays once. A few microseconds of caller work separate the loops,
// as in a forward. Uses the library's internals, not its C API.
//   ep_moe_pool_bench [--threads N] [--loops N] [--gap-us U]
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "cli.hpp"
#include "cpu/thread_pool.hpp"

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int loops = 20000;
  double gap_us = 5;
  cli::Parser args("ep_moe_pool_bench [options]", "The cost of one fork-join loop of the layer's thread pool.");
  args.option("--threads", &threads, "pool threads, >= 2 (default: all hardware threads)", 2, 1024)
      .option("--loops", &loops, "loops timed (default 20000)", 1, 1 << 30)
      .option("--gap-us", &gap_us, "microseconds of caller work between loops (default 5)", 0, 1e6);
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (threads < 2 || loops < 1) {
    std::fprintf(stderr, "need --threads >= 2 and --loops >= 1\n");
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  ep_moe::cpu::ThreadPool pool(threads);
  std::atomic<long> sink{0};
  std::printf("threads %d, %d loops of %d items, %.1f us of caller work between loops\n", threads, loops, 2 * threads,
              gap_us);
  for (int rep = 0; rep < 3; ++rep) {
    double busy = 0;
    const auto t0 = Clock::now();
    for (int i = 0; i < loops; ++i) {
      pool.parallel_for(static_cast<size_t>(2 * threads), [&](size_t k, int) { sink += static_cast<long>(k); });
      const auto g0 = Clock::now();
      while (std::chrono::duration<double, std::micro>(Clock::now() - g0).count() < gap_us) {
      }
      busy += std::chrono::duration<double, std::micro>(Clock::now() - g0).count();
    }
    const double total = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    std::printf("fork-join loop: %.2f us (caller work excluded)\n", (total - busy) / loops);
  }
  return sink.load() >= 0 ? 0 : 1;
}

#include "machine_peaks.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/cpuid.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace bench {

namespace {
using Clock = std::chrono::steady_clock;

#if defined(__x86_64__)
// 12 independent accumulator chains hide the FMA latency on every x86 core
// we know; each iteration is 12 FMAs of `lanes` floats. The inner loops
// must be unrolled so the chains live in registers: a loop over a[] in
// memory adds a store-to-load round trip to every FMA and measured a third
// of the real peak (the figures before 2026-11-30 in docs/benchmarks.md
// were against that understated peak).
__attribute__((target("avx512f"))) double fma_avx512(int64_t iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  float out[16], s = 0;
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_ps(out, a[i]);
    for (float v : out) s += v;
  }
  return static_cast<double>(s);
}
__attribute__((target("avx2,fma"))) double fma_avx2(int64_t iters) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  float out[8], s = 0;
  for (int i = 0; i < 12; ++i) {
    _mm256_storeu_ps(out, a[i]);
    for (float v : out) s += v;
  }
  return static_cast<double>(s);
}
// The same chains with vdpbf16ps: 32 bf16 multiply-adds into 16 f32 lanes.
__attribute__((target("avx512f,avx512bf16"))) double dot_bf16(int64_t iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1e-7f * static_cast<float>(i));
  const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));  // (1.0, 1.0)
  const __m512bh y = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x33d633d6));  // ~1e-7
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  float out[16], s = 0;
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_ps(out, a[i]);
    for (float v : out) s += v;
  }
  return static_cast<double>(s);
}
// The same chains with vpdpbusd: 64 u8 x s8 multiply-adds into 16 i32 lanes.
__attribute__((target("avx512f,avx512vnni"))) double dot_int8(int64_t iters) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x01ff01ff);  // (1, 1, 1, 1) x (-1, 1, -1, 1)
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
  int32_t out[16];
  int64_t s = 0;
  for (int i = 0; i < 12; ++i) {
    _mm512_storeu_si512(out, a[i]);
    for (int32_t v : out) s += v;
  }
  return static_cast<double>(s);
}
// The same chains with AVX2's vpmaddubsw: 32 u8 x s8 products, added in
// pairs into 16 i16 lanes, then an i16 add (the AVX2 int8 kernels' step).
// Each chain's sums are its next u8 operand, so that the products depend
// on the loop (a product of two constants would be hoisted out of it).
__attribute__((target("avx2"))) double dot_maddubs(int64_t iters) {
  __m256i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi16(static_cast<int16_t>(i));
  __m256i x = _mm256_set1_epi16(1), y = _mm256_set1_epi32(0x01ff01ff);  // y: (-1, 1, -1, 1)
  asm("" : "+x"(x), "+x"(y));                                           // not constants to the compiler
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi16(_mm256_maddubs_epi16(a[i], y), x);
  int16_t out[16];
  int64_t s = 0;
  for (int i = 0; i < 12; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a[i]);
    for (int16_t v : out) s += v;
  }
  return static_cast<double>(s);
}
#endif

double fma_scalar(int64_t iters) {
  float a[12];
  for (int i = 0; i < 12; ++i) a[i] = 1.0f + 1e-7f * static_cast<float>(i);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = a[i] * 0.999999f + 1e-7f;
  double s = 0;
  for (float v : a) s += v;
  return s;
}

std::atomic<double> g_sink{0};

// The best rate of the sum of the counters in `done` (units per second)
// over 8 windows of seconds / 8 each, after seconds / 16 for the threads
// to start: on a shared machine a whole-run mean is pulled down by the
// moments a neighbour takes a core or the memory bus.
double best_window_rate(const std::vector<std::atomic<uint64_t>>& done, double seconds) {
  auto total = [&] {
    uint64_t n = 0;
    for (auto& d : done) n += d.load(std::memory_order_relaxed);
    return static_cast<double>(n);
  };
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds / 16));
  double best = 0, n0 = total();
  auto t0 = Clock::now();
  for (int w = 0; w < 8; ++w) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds / 8));
    const double n1 = total();
    const auto t1 = Clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    if (dt > 0) best = std::max(best, (n1 - n0) / dt);
    n0 = n1;
    t0 = t1;
  }
  return best;
}

// Iterations of fn per second, summed over `threads` threads running it
// without pause: the best of 8 windows of seconds / 8 each, as the read
// bandwidth is measured. Timing one fixed run of every thread instead
// reported the slower thread's rate: a vCPU held back for a moment (or
// clocked lower than the one calibrating) pulled the peak down by up to
// 15 % between runs minutes apart, and prefill rows then read above 100 %.
double iters_per_second(double (*fn)(int64_t), int threads, double seconds) {
  // Chunks of about a millisecond, so that progress is published often.
  int64_t chunk = 1 << 10;
  for (;;) {
    const auto t0 = Clock::now();
    g_sink = g_sink + fn(chunk);
    if (std::chrono::duration<double>(Clock::now() - t0).count() > 1e-3) break;
    chunk *= 2;
  }
  std::atomic<bool> stop{false};
  std::vector<std::atomic<uint64_t>> done(static_cast<size_t>(threads));
  for (auto& d : done) d = 0;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      double s = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        s += fn(chunk);
        done[static_cast<size_t>(t)].fetch_add(static_cast<uint64_t>(chunk), std::memory_order_relaxed);
      }
      g_sink = g_sink + s;
    });
  }
  const double best = best_window_rate(done, seconds);
  stop.store(true, std::memory_order_relaxed);
  for (auto& t : ts) t.join();
  return best;
}
}  // namespace

double bf16_dot_peak_gflops(int threads, double seconds) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512bf16")) return 0;
  return iters_per_second(dot_bf16, threads, seconds) * 12.0 * 32.0 * 2.0 / 1e9;
#else
  (void)threads;
  (void)seconds;
  return 0;
#endif
}

double int8_dot_peak_gops(int threads, double seconds) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512vnni")) return 0;
  return iters_per_second(dot_int8, threads, seconds) * 12.0 * 64.0 * 2.0 / 1e9;
#else
  (void)threads;
  (void)seconds;
  return 0;
#endif
}

double int8_maddubs_peak_gops(int threads, double seconds) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2")) return 0;
  return iters_per_second(dot_maddubs, threads, seconds) * 12.0 * 32.0 * 2.0 / 1e9;
#else
  (void)threads;
  (void)seconds;
  return 0;
#endif
}

double fma_peak_gflops(int threads, double seconds, const char** isa) {
  double (*fn)(int64_t) = fma_scalar;
  int lanes = 1;
  *isa = "scalar";
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) {
    fn = fma_avx512;
    lanes = 16;
    *isa = "avx512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    fn = fma_avx2;
    lanes = 8;
    *isa = "avx2";
  }
#endif
  return iters_per_second(fn, threads, seconds) * 12.0 * lanes * 2.0 / 1e9;
}

namespace {
// Sums one slice of the buffer (the sum keeps the loads alive).
#if defined(__x86_64__)
__attribute__((target("avx2"))) uint64_t sum_avx2(const uint64_t* p, size_t n) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_epi64(s0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    s1 = _mm256_add_epi64(s1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    s2 = _mm256_add_epi64(s2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    s3 = _mm256_add_epi64(s3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t out[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out),
                     _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
  uint64_t s = out[0] + out[1] + out[2] + out[3];
  for (; i < n; ++i) s += p[i];
  return s;
}
#endif
uint64_t sum_scalar(const uint64_t* p, size_t n) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  for (; i < n; ++i) s0 += p[i];
  return s0 + s1 + s2 + s3;
}
}  // namespace

uint64_t sum_words(const uint64_t* p, size_t n) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return sum_avx2(p, n);
#endif
  return sum_scalar(p, n);
}

ReadBandwidth::ReadBandwidth(int threads, int megabytes) : threads_(threads) {
  const size_t n = (static_cast<size_t>(megabytes) << 20) / sizeof(uint64_t);
  // 2 MiB aligned with transparent huge pages asked for, as the library's
  // weight buffers are (src/cpu/aligned.hpp); every page touched before timing.
  const size_t huge = size_t{2} << 20, bytes = (n * sizeof(uint64_t) + huge - 1) / huge * huge;
  auto* buf = static_cast<uint64_t*>(std::aligned_alloc(huge, bytes));
  if (!buf) return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)madvise(buf, bytes, MADV_HUGEPAGE);
#endif
  for (size_t i = 0; i < n; ++i) buf[i] = i;
  buf_ = buf;
  n_ = n;
}

ReadBandwidth::~ReadBandwidth() { std::free(buf_); }

double ReadBandwidth::measure(double seconds) {
  if (!buf_) return 0;
  const size_t n = n_;
  const int threads = threads_;
  const uint64_t* buf = static_cast<const uint64_t*>(buf_);
  std::atomic<bool> stop{false};
  std::vector<std::atomic<uint64_t>> done(static_cast<size_t>(threads));
  for (auto& d : done) d = 0;
  std::vector<std::thread> ts;
  const size_t chunk = (1u << 20) / sizeof(uint64_t);  // progress published every MiB
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      const size_t lo = n * static_cast<size_t>(t) / static_cast<size_t>(threads) / 8 * 8;
      const size_t hi = n * static_cast<size_t>(t + 1) / static_cast<size_t>(threads) / 8 * 8;
      uint64_t s = 0;
      while (!stop.load(std::memory_order_relaxed))
        for (size_t i = lo; i < hi && !stop.load(std::memory_order_relaxed); i += chunk) {
          const size_t len = std::min(chunk, hi - i);
          s += sum_words(buf + i, len);
          done[static_cast<size_t>(t)].fetch_add(len * sizeof(uint64_t), std::memory_order_relaxed);
        }
      g_sink = g_sink + static_cast<double>(s);
    });
  }
  // (Its warm-up before the first window also lets the threads touch the pages.)
  const double best = best_window_rate(done, seconds) / 1e9;
  stop = true;
  for (auto& t : ts) t.join();
  return best;
}

double memcpy_gbs_per_thread(int threads, double seconds, size_t bytes) {
  bytes = std::max<size_t>(bytes, 64);
  // Where the destination sits against the source matters: with separate
  // vectors, glibc placed them 16 bytes apart modulo 4 KiB for some sizes
  // (24-400 KB in the bench's combine), and memcpy can then run ~20x
  // slower (each load 4K-aliasing a store just made). So both are 4 KiB-aligned in one allocation, and the copy
  // is timed at two placements, the destination 0 and 2 KiB after a
  // 4 KiB boundary; each thread keeps its faster one (the library's own
  // buffers are 64-byte aligned, where neither is pathological).
  const size_t page = 4096, span = (bytes + page - 1) / page * page;
  constexpr size_t kPlacements[] = {0, 2048};
  // The threads copy together: each touches its buffers first, and the
  // timed window opens when all have (with 128 MiB buffers the touching
  // takes longer than a short window: the copies once never started and
  // the rate read 0, the bench's %mem column some 1e12 %). Each thread
  // counts at least one copy.
  std::vector<double> rate(static_cast<size_t>(threads), 0);
  bool failed = false;
  for (const size_t off : kPlacements) {
    std::atomic<bool> stop{false}, go{false}, no_memory{false};
    std::atomic<int> ready{0};
    std::vector<double> r(static_cast<size_t>(threads), 0);
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        char* buf = static_cast<char*>(std::aligned_alloc(page, 2 * span + page));
        if (buf) {
          std::memset(buf, t + 1, bytes);  // both touched before timing
          std::memset(buf + span + off, 0, bytes);
          std::memcpy(buf + span + off, buf, bytes);
        } else {
          no_memory = true;
        }
        ready.fetch_add(1);
        while (!go.load()) std::this_thread::yield();
        if (!buf) return;
        char* src = buf;
        char* dst = buf + span + off;
        double done = 0;
        const auto t0 = Clock::now();
        do {
          std::memcpy(dst, src, bytes);
          src[0] ^= 1;  // keep the copies observable
          done += static_cast<double>(bytes);
        } while (!stop.load(std::memory_order_relaxed));
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        g_sink = g_sink + static_cast<double>(dst[bytes / 2]);
        r[static_cast<size_t>(t)] = done / dt / 1e9;
        std::free(buf);
      });
    }
    while (ready.load() < threads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    go = true;
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds / 2));
    stop = true;
    for (auto& t : ts) t.join();
    failed = failed || no_memory.load();
    for (size_t t = 0; t < rate.size(); ++t) rate[t] = std::max(rate[t], r[t]);
  }
  if (failed) return 0;
  double sum = 0;
  for (double x : rate) sum += x;
  return sum / threads;
}

std::string cpu_description() {
  const ep_moe::CpuSignature s = ep_moe::cpu_signature();
  if (!s.vendor[0]) return "unknown CPU";
  std::string brand;
#if defined(__x86_64__) || defined(__i386__)
  unsigned top = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0x80000000u, &top, &b, &c, &d);
  if (top >= 0x80000004u) {
    for (unsigned leaf = 0x80000002u; leaf <= 0x80000004u; ++leaf) {
      unsigned r[4] = {0, 0, 0, 0};
      __get_cpuid(leaf, &r[0], &r[1], &r[2], &r[3]);
      brand.append(reinterpret_cast<const char*>(r), sizeof r);
    }
  }
#endif
  // Printable, single spaces, nothing a JSON string would need escaped.
  const auto keep = [](char ch) { return ch > ' ' && ch < 127 && ch != '"' && ch != '\\'; };
  std::string clean;
  for (char ch : brand) {
    if (ch == '\0') break;
    if (keep(ch)) clean += ch;
    else if (ch == ' ' && !clean.empty() && clean.back() != ' ') clean += ' ';
  }
  while (!clean.empty() && clean.back() == ' ') clean.pop_back();
  std::string v;
  for (char ch : std::string(s.vendor))
    if (keep(ch)) v += ch;
  if (clean.empty()) clean = "unnamed CPU";
  return clean + " (" + v + " family " + std::to_string(s.family) + " model " + std::to_string(s.model) + ")";
}

}  // namespace bench

// Failure injection on the create and load paths: every allocation (this
// binary replaces the global operator new, which the library's containers
// and aligned buffers use) and every file read (io::inject_read_failure) is
// made to fail in turn. Each failure must come back as a status with a
// message; nothing may crash, and the ASan build of this test (LeakSanitizer
// on) checks that nothing leaks.
#include <catch2/catch.hpp>

// The replacements below pair malloc with free behind operator new/delete;
// GCC cannot see that and warns about the pairing at inlined call sites.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "../io/writers.hpp"
#include "ep_moe/ep_moe.h"
#include "io/source.hpp"

namespace {
std::atomic<long> g_fail_at{-1};  // allocations until the failing one; -1: never
std::atomic<long> g_count{0};     // allocations while armed

bool should_fail() {
  if (g_fail_at.load(std::memory_order_relaxed) < 0) return false;
  g_count.fetch_add(1, std::memory_order_relaxed);
  return g_fail_at.fetch_sub(1, std::memory_order_relaxed) == 0;
}
void* checked(void* p) {
  if (!p) throw std::bad_alloc();
  return p;
}
void* aligned(size_t n, size_t a) {
  void* p = nullptr;
  if (posix_memalign(&p, a < sizeof(void*) ? sizeof(void*) : a, n ? n : 1) != 0) return nullptr;
  return p;
}
}  // namespace

void* operator new(size_t n) {
  if (should_fail()) throw std::bad_alloc();
  return checked(std::malloc(n ? n : 1));
}
void* operator new[](size_t n) {
  if (should_fail()) throw std::bad_alloc();
  return checked(std::malloc(n ? n : 1));
}
void* operator new(size_t n, const std::nothrow_t&) noexcept { return should_fail() ? nullptr : std::malloc(n ? n : 1); }
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return should_fail() ? nullptr : std::malloc(n ? n : 1); }
void* operator new(size_t n, std::align_val_t a) {
  if (should_fail()) throw std::bad_alloc();
  return checked(aligned(n, static_cast<size_t>(a)));
}
void* operator new[](size_t n, std::align_val_t a) {
  if (should_fail()) throw std::bad_alloc();
  return checked(aligned(n, static_cast<size_t>(a)));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

const std::string& checkpoint_path() {
  static const std::string path = [] {
    writers::Model m;
    m.spec.H = 16;
    m.spec.I = 8;
    m.spec.E = 4;
    m.spec.K = 2;
    m.spec.Is = 8;
    m.dtype = "BF16";
    m.layer = 1;
    std::mt19937 rng(5);
    return writers::small_checkpoint(m, rng);
  }();
  return path;
}

// The create-and-load path of a runtime: map, communicator, checkpoint,
// layer configured from it, load, one forward. Returns the first failing
// status (its message must be set) and frees everything it made. The test's
// own buffers exist before the failures are armed, so only the library's
// allocations can fail.
struct Buffers {
  std::vector<float> x = std::vector<float>(16, 0.25f), out = std::vector<float>(16, 0.0f);
  std::vector<int32_t> ids = {0, 3};
  std::vector<float> w = {0.5f, 0.5f};
  char message[512] = {0};
};

ep_moe_status_t run_path(Buffers& b) {
  ep_moe_expert_map_t* map = nullptr;
  ep_moe_comm_t* comm = nullptr;
  ep_moe_checkpoint_t* ck = nullptr;
  ep_moe_layer_t* layer = nullptr;
  ep_moe_status_t s = EP_MOE_OK;
  b.message[0] = 0;
  auto step = [&](ep_moe_status_t r) {
    if (s == EP_MOE_OK && r != EP_MOE_OK) {
      s = r;
      std::strncpy(b.message, ep_moe_last_error(), sizeof b.message - 1);
    }
    return s == EP_MOE_OK;
  };
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 4;
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  if (step(ep_moe_expert_map_create(&map, &mc)) && step(ep_moe_comm_create_local(&comm, 1, nullptr)) &&
      step(ep_moe_checkpoint_open(&ck, checkpoint_path().c_str(), nullptr)) &&
      step(ep_moe_checkpoint_layer_config(&lc, ck, 1))) {
    lc.max_tokens = 4;
    lc.num_threads = 2;
    lc.weight_dtype = EP_MOE_DTYPE_BF16;
    if (step(ep_moe_layer_create(&layer, &lc, map, comm, nullptr)) && step(ep_moe_layer_load(layer, ck, 1))) {
      ep_moe_forward_args_t a;
      ep_moe_forward_args_init(&a);
      a.num_tokens = 1;
      a.hidden = b.x.data();
      a.topk_ids = b.ids.data();
      a.topk_weights = b.w.data();
      a.out = b.out.data();
      step(ep_moe_layer_forward(layer, &a));
    }
  }
  g_fail_at = -1;  // free without failures
  ep_moe_layer_destroy(layer);
  ep_moe_checkpoint_close(ck);
  ep_moe_comm_destroy(comm);
  ep_moe_expert_map_destroy(map);
  return s;
}

}  // namespace

TEST_CASE("every allocation on the create and load path can fail: a status, never a crash", "[faults][alloc]") {
  checkpoint_path();
  Buffers b;
  g_count = 0;
  g_fail_at = 1L << 40;  // count only
  REQUIRE(run_path(b) == EP_MOE_OK);
  const long total = g_count.load();
  INFO("allocations on the path: " << total);
  REQUIRE(total > 10);
  long failed = 0;
  for (long n = 0; n < total; ++n) {
    if (std::getenv("EP_MOE_FAULT_TRACE")) std::fprintf(stderr, "failing allocation %ld\n", n);
    g_fail_at = n;
    const ep_moe_status_t s = run_path(b);
    INFO("allocation " << n << " failed: " << ep_moe_status_string(s) << " '" << b.message << "'");
    if (s == EP_MOE_OK) continue;  // the failing allocation was one the path does not need (e.g. a cache)
    ++failed;
    CHECK(s == EP_MOE_ERR_OUT_OF_MEMORY);
    CHECK(std::strlen(b.message) > 0);
  }
  CHECK(failed > total / 2);
  // And afterwards everything works again.
  REQUIRE(run_path(b) == EP_MOE_OK);
}

TEST_CASE("every file read on the open and load path can fail: EP_MOE_ERR_IO, never a crash", "[faults][io]") {
  checkpoint_path();
  Buffers b;
  long n = 0;
  for (;; ++n) {
    ep_moe::io::inject_read_failure(n);
    const ep_moe_status_t s = run_path(b);
    ep_moe::io::inject_read_failure(-1);
    if (s == EP_MOE_OK) break;  // n is past the last read
    INFO("read " << n << ": " << b.message);
    CHECK(s == EP_MOE_ERR_IO);
    CHECK(std::strstr(b.message, "injected") != nullptr);
    REQUIRE(n < 10000);
  }
  INFO("reads on the path: " << n);
  CHECK(n > 3);
}

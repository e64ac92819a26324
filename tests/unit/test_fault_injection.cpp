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
#include <thread>
#include <vector>

#include "../io/writers.hpp"
#include "../multirank/harness.hpp"
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
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  return should_fail() ? nullptr : std::malloc(n ? n : 1);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  return should_fail() ? nullptr : std::malloc(n ? n : 1);
}
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

// --- a forward after the first allocates nothing -------------------------
// A runtime calls forward every step: each allocation there is latency that
// varies and a failure that can come midway. After one forward has sized
// what it needs, later forwards must not touch the heap, on any thread of
// the layer's, in every CPU flow. (Not run here: the MPI transport, whose
// MPI library allocates as it likes.)
namespace {

// Runs c on c.ep in-process ranks: `warm` forwards each, then `counted`
// forwards with every allocation of the process counted. All inputs and
// outputs exist before the count starts, and the ranks start the counted
// forwards together and are torn down after it stops, so only the
// library's allocations (its pool workers' too) are counted. The counted
// forwards' outputs are checked against the reference. Returns the count.
// With own_router the layer computes its logits from a router weight (and
// its outputs are not checked: the reference routes by the drawn logits).
long allocations_in_forwards(const harness::Case& c, int warm, int counted, bool own_router = false) {
  INFO(c.describe());
  std::mt19937 rng(2024);
  const ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  const harness::Inputs in = harness::make_inputs(c, w, rng);
  std::vector<ep_moe_comm_t*> world;
  const std::function<void()> cleanup = harness::make_world(c, &world);
  const int attn_tp = c.ep / c.dp;
  std::atomic<int> ready{0}, done{0}, go{0}, release{0};
  std::vector<std::string> errors(static_cast<size_t>(c.ep));
  std::vector<double> worst(static_cast<size_t>(c.ep), 0.0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < c.ep; ++r)
    ranks.emplace_back([&, r] {
      std::string& err = errors[static_cast<size_t>(r)];
      ep_moe_comm_t* ep = world[static_cast<size_t>(r)];
      ep_moe_comm_t* dp = c.dp > 1 ? ep : nullptr;  // dp == ep: the EP handle (reduce-scatter)
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      mc.ep_size = c.ep;
      mc.ep_rank = r;
      mc.global_num_experts = c.spec.E;
      mc.num_expert_group = c.spec.groups;
      ep_moe_expert_map_t* map = nullptr;
      ep_moe_layer_t* layer = nullptr;
      const ep_moe_layer_config_t lc = harness::layer_config(c);
      int stored = 0;
      if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK ||
          ep_moe_layer_create(&layer, &lc, map, ep, dp) != EP_MOE_OK)
        err = ep_moe_last_error();
      if (err.empty()) err = harness::load_weights(layer, c, w, &stored);
      std::vector<float> router(static_cast<size_t>(c.spec.E) * c.spec.H);
      for (size_t i = 0; i < router.size(); ++i) router[i] = 0.05f * static_cast<float>((i * 7919) % 23) - 0.5f;
      if (err.empty() && own_router &&
          ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_ROUTER, -1, router.data(), EP_MOE_DTYPE_F32, c.spec.E,
                                  c.spec.H) != EP_MOE_OK)
        err = ep_moe_layer_last_error(layer);
      ep_moe_expert_map_destroy(map);
      const int replica = c.dp > 1 ? r / attn_tp : 0;
      const int T = c.tokens[static_cast<size_t>(replica)];
      const auto hid = ref::encode(in.hidden[static_cast<size_t>(replica)], c.adt);
      std::vector<uint8_t> out(static_cast<size_t>(T) * c.spec.H * (c.adt == ref::F32 ? 4 : 2) + 1);
      std::vector<int32_t> counts(c.tokens.begin(), c.tokens.end());
      ep_moe_forward_args_t a = harness::forward_args(c, in, replica, hid.data(), out.data());
      if (own_router) a.router_logits = nullptr;
      if (c.dp > 1) a.dp_token_counts = counts.data();
      const auto forward = [&] {
        if (err.empty() && ep_moe_layer_forward(layer, &a) != EP_MOE_OK) err = ep_moe_layer_last_error(layer);
        if (!err.empty()) ep_moe_comm_abort(ep);  // peers fail instead of waiting
      };
      for (int f = 0; f < warm; ++f) forward();
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      for (int f = 0; f < counted; ++f) forward();
      done.fetch_add(1);
      while (!release.load()) std::this_thread::yield();
      if (err.empty() && !own_router)
        worst[static_cast<size_t>(r)] =
            harness::relative_error(ref::decode(out.data(), static_cast<size_t>(T) * c.spec.H, c.adt),
                                    in.expect[static_cast<size_t>(replica)])
                .err;
      ep_moe_layer_destroy(layer);
    });
  while (ready.load() < c.ep) std::this_thread::yield();
  g_count = 0;
  g_fail_at = 1L << 40;  // count only
  go = 1;
  while (done.load() < c.ep) std::this_thread::yield();
  g_fail_at = -1;
  const long n = g_count.load();
  release = 1;
  for (auto& t : ranks) t.join();
  cleanup();
  for (int r = 0; r < c.ep; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<size_t>(r)]);
    REQUIRE(errors[static_cast<size_t>(r)].empty());
    CHECK(worst[static_cast<size_t>(r)] <= harness::tolerance(c.adt, c.wdt));
  }
  return n;
}

// A host runtime whose collectives complete inside the callback (no
// request), on the in-process backend: the callbacks backend's own
// allocations are then all that is counted of the transport.
ep_moe_comm_t* sync_local(void* ud) { return static_cast<ep_moe_comm_t*>(ud); }
ep_moe_status_t sync_all_gather(void** req, void* out, const void* in, size_t bytes, void* ud) {
  *req = nullptr;
  return ep_moe_comm_all_gather(out, in, bytes, EP_MOE_DTYPE_U8, sync_local(ud), nullptr);
}
ep_moe_status_t sync_all_gather_v(void** req, void* out, const void* in, const size_t* bytes, void* ud) {
  *req = nullptr;
  return ep_moe_comm_all_gather_v(out, in, bytes, EP_MOE_DTYPE_U8, sync_local(ud), nullptr);
}
ep_moe_status_t sync_all_to_all_v(void** req, void* out, const size_t* ob, const void* in, const size_t* ib, void* ud) {
  *req = nullptr;
  return ep_moe_comm_all_to_all_v(out, ob, in, ib, EP_MOE_DTYPE_U8, sync_local(ud), nullptr);
}
ep_moe_status_t sync_test(int32_t* done, void*, void*) {
  *done = 1;
  return EP_MOE_OK;
}

// Case::make_comms for the callbacks backend over such a host.
void make_sync_callbacks(int n, std::vector<ep_moe_comm_t*>* out, std::function<void()>* cleanup) {
  auto* local = new std::vector<ep_moe_comm_t*>(static_cast<size_t>(n), nullptr);
  REQUIRE(ep_moe_comm_create_local(local->data(), n, nullptr) == EP_MOE_OK);
  for (int r = 0; r < n; ++r) {
    ep_moe_comm_callbacks_t t;
    REQUIRE(ep_moe_comm_callbacks_init(&t) == EP_MOE_OK);
    t.rank = r;
    t.size = n;
    t.ranks_in_process = n;
    t.user_data = (*local)[static_cast<size_t>(r)];
    t.all_gather = sync_all_gather;
    t.all_gather_v = sync_all_gather_v;
    t.all_to_all_v = sync_all_to_all_v;
    t.test = sync_test;
    REQUIRE(ep_moe_comm_create_callbacks(&(*out)[static_cast<size_t>(r)], &t, nullptr) == EP_MOE_OK);
  }
  *cleanup = [out, local] {
    for (auto* h : *out) ep_moe_comm_destroy(h);
    for (auto* h : *local) ep_moe_comm_destroy(h);
    delete local;
  };
}

}  // namespace

TEST_CASE("forwards after the first allocate nothing, in every CPU flow", "[faults][alloc][forward]") {
  harness::Case base;
  base.spec.H = 96;
  base.spec.I = 48;
  base.spec.E = 8;
  base.spec.K = 3;
  base.threads = 2;
  base.max_tokens = 24;
  struct Flow {
    const char* name;
    int ep, dp, dispatch, wdt, adt, Is;
    bool given, grouped;
    std::vector<int> tokens;
    bool callbacks = false;   // over the callbacks backend (its own reductions) instead of the in-process one
    bool own_router = false;  // the layer's own router computes the logits
  };
  const std::vector<Flow> flows = {
      {"one rank, f32", 1, 1, EP_MOE_DISPATCH_ALLGATHER, ref::F32, ref::F32, 32, false, false, {19}},
      {"one rank, bf16, grouped top-k", 1, 1, EP_MOE_DISPATCH_ALLGATHER, ref::BF16, ref::BF16, 0, false, true, {24}},
      {"all-gather, bf16, shared expert",
       2,
       1,
       EP_MOE_DISPATCH_ALLGATHER,
       ref::BF16,
       ref::BF16,
       32,
       false,
       false,
       {13}},
      {"all-to-all, f16 weights, given top-k", 2, 1, EP_MOE_DISPATCH_ALLTOALL, ref::F16, ref::F32, 0, true, false, {7}},
      {"all-to-all, bf16, shared expert", 3, 1, EP_MOE_DISPATCH_ALLTOALL, ref::BF16, ref::BF16, 32, false, true, {11}},
      {"auto dispatch, f32", 2, 1, EP_MOE_DISPATCH_AUTO, ref::F32, ref::F32, 0, false, false, {5}},
      {"DP attention, a zero-token replica",
       2,
       2,
       EP_MOE_DISPATCH_ALLGATHER,
       ref::F32,
       ref::F32,
       32,
       false,
       false,
       {9, 0}},
      {"DP attention, bf16", 2, 2, EP_MOE_DISPATCH_ALLGATHER, ref::BF16, ref::BF16, 0, false, false, {3, 12}},
      {"callbacks, all-gather", 3, 1, EP_MOE_DISPATCH_ALLGATHER, ref::BF16, ref::BF16, 32, false, false, {10}, true},
      {"callbacks, all-to-all", 2, 1, EP_MOE_DISPATCH_ALLTOALL, ref::F32, ref::F32, 32, false, false, {6}, true},
      {"callbacks, DP attention", 2, 2, EP_MOE_DISPATCH_ALLGATHER, ref::F32, ref::F32, 0, false, false, {4, 7}, true},
      {"the layer's own router, bf16",
       2,
       1,
       EP_MOE_DISPATCH_ALLTOALL,
       ref::BF16,
       ref::BF16,
       32,
       false,
       false,
       {21},
       false,
       true},
  };
  for (const Flow& f : flows) {
    harness::Case c = base;
    c.ep = f.ep;
    c.dp = f.dp;
    c.dispatch = f.dispatch;
    c.wdt = f.wdt;
    c.adt = f.adt;
    c.spec.Is = f.Is;
    c.given_topk = f.given;
    if (f.grouped) {
      c.spec.groups = 4;
      c.spec.topk_group = 2;
      c.spec.sigmoid = true;
      c.spec.use_bias = true;
    }
    c.tokens = f.tokens;
    if (f.callbacks) c.make_comms = make_sync_callbacks;
    INFO(f.name);
    // The layer sizes everything at creation, so on the in-process backend
    // even the first forward allocates nothing; the message backends'
    // reductions size their slices in the first.
    CHECK(allocations_in_forwards(c, f.callbacks ? 1 : 0, 4, f.own_router) == 0);
  }
}

TEST_CASE(
    "the matrix engine: oneDNN's execute allocates; a failed allocation there is a status, then the next "
    "forward is right",
    "[faults][alloc][forward][engine]") {
  // ep_moe's side of a forward allocates nothing (the test above), but
  // oneDNN 2.6's execute builds its argument map on the heap, a few small
  // blocks a call, through the C and the C++ interfaces alike. So each of
  // those allocations is made to fail in turn: the forward returns
  // OUT_OF_MEMORY, and the next one is right.
  setenv("EP_MOE_BACKEND_DIR", EP_MOE_MODULE_DIR, 0);  // the module beside libep_moe.so
  if (!ep_moe_has_feature(EP_MOE_FEATURE_ONEDNN)) {
    WARN("skipped: libep_moe_onednn.so is not available");
    return;
  }
  setenv("EP_MOE_MATRIX_ENGINE", "onednn", 1);
  setenv("EP_MOE_MATRIX_MIN_ROWS", "1", 1);
  harness::Case c;  // depths the engine serves, with whole tiles (tests/multirank/test_engine.cpp)
  c.spec.H = 320;
  c.spec.I = 160;
  c.spec.E = 4;
  c.spec.K = 2;
  c.spec.Is = 96;
  c.wdt = c.adt = ref::BF16;
  c.threads = 2;
  c.max_tokens = 40;
  c.tokens = {37};
  std::mt19937 rng(99);
  const ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  const harness::Inputs in = harness::make_inputs(c, w, rng);
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = 1;
  mc.ep_rank = 0;
  mc.global_num_experts = c.spec.E;
  ep_moe_expert_map_t* map = nullptr;
  REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
  const ep_moe_layer_config_t lc = harness::layer_config(c);
  ep_moe_layer_t* layer = nullptr;
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  int stored = 0;
  REQUIRE(harness::load_weights(layer, c, w, &stored).empty());
  int64_t engine = 0;
  REQUIRE(ep_moe_layer_get_attr(&engine, layer, EP_MOE_LAYER_ATTR_MATRIX_ENGINE) == EP_MOE_OK);
  if (engine == 0) {
    WARN("skipped: oneDNN has no bf16 brgemm on this CPU");
  } else {
    const int T = c.tokens[0];
    const auto hid = ref::encode(in.hidden[0], c.adt);
    std::vector<uint8_t> out(static_cast<size_t>(T) * c.spec.H * 2);
    const ep_moe_forward_args_t a = harness::forward_args(c, in, 0, hid.data(), out.data());
    REQUIRE(ep_moe_layer_forward(layer, &a) == EP_MOE_OK);  // warm
    g_count = 0;
    g_fail_at = 1L << 40;  // count only
    REQUIRE(ep_moe_layer_forward(layer, &a) == EP_MOE_OK);
    g_fail_at = -1;
    const long n = g_count.load();
    int64_t pairs = 0;
    ep_moe_layer_get_attr(&pairs, layer, EP_MOE_LAYER_ATTR_LAST_ENGINE_PAIRS);
    CHECK(pairs > 0);
    CHECK(n > 0);  // if oneDNN stops allocating, this test (and docs/threading.md) can say so
    for (long k = 0; k < n; ++k) {
      INFO("allocation " << k << " of " << n << " fails");
      g_fail_at = k;
      const ep_moe_status_t st = ep_moe_layer_forward(layer, &a);
      g_fail_at = -1;
      CHECK(st == EP_MOE_ERR_OUT_OF_MEMORY);
      REQUIRE(ep_moe_layer_forward(layer, &a) == EP_MOE_OK);
      CHECK(harness::relative_error(ref::decode(out.data(), static_cast<size_t>(T) * c.spec.H, c.adt), in.expect[0])
                .err <= harness::tolerance(c.adt, c.wdt));
    }
  }
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  unsetenv("EP_MOE_MATRIX_ENGINE");
  unsetenv("EP_MOE_MATRIX_MIN_ROWS");
}

// The `callbacks` backend: a host runtime whose collectives are the
// in-process backend, run asynchronously (start returns a request, test
// polls it) or synchronously; the layer on top; and the failure paths.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "../multirank/harness.hpp"
#include "ep_moe/ep_moe.h"

namespace {

using Clock = std::chrono::steady_clock;

// One rank of the host runtime.
struct Host {
  ep_moe_comm_t* local = nullptr;  // the host's own transport
  bool async = true;
  bool fail_test = false;  // test() reports an error
  std::atomic<int> started{0}, cancelled{0};
};

struct Request {
  std::future<ep_moe_status_t> done;
};

template <class F>
ep_moe_status_t start(void** req, Host* h, F f) {
  h->started++;
  if (!h->async) {
    *req = nullptr;
    return f();
  }
  *req = new Request{std::async(std::launch::async, f)};
  return EP_MOE_OK;
}

ep_moe_status_t cb_all_gather(void** req, void* out, const void* in, size_t bytes, void* ud) {
  auto* h = static_cast<Host*>(ud);
  return start(req, h, [=] { return ep_moe_comm_all_gather(out, in, bytes, EP_MOE_DTYPE_U8, h->local, nullptr); });
}
ep_moe_status_t cb_all_gather_v(void** req, void* out, const void* in, const size_t* bytes, void* ud) {
  auto* h = static_cast<Host*>(ud);
  int32_t n = 0;
  ep_moe_comm_get_size(&n, h->local);
  std::vector<size_t> b(bytes, bytes + n);  // copy: the caller's array lives only during the call
  return start(req, h, [=] { return ep_moe_comm_all_gather_v(out, in, b.data(), EP_MOE_DTYPE_U8, h->local, nullptr); });
}
ep_moe_status_t cb_all_to_all_v(void** req, void* out, const size_t* ob, const void* in, const size_t* ib, void* ud) {
  auto* h = static_cast<Host*>(ud);
  int32_t n = 0;
  ep_moe_comm_get_size(&n, h->local);
  std::vector<size_t> o(ob, ob + n), i(ib, ib + n);
  return start(req, h, [=] {
    return ep_moe_comm_all_to_all_v(out, o.data(), in, i.data(), EP_MOE_DTYPE_U8, h->local, nullptr);
  });
}
ep_moe_status_t cb_all_reduce(void** req, void* out, const void* in, size_t count, ep_moe_dtype_t dt, void* stream,
                              void* ud) {
  auto* h = static_cast<Host*>(ud);
  return start(req, h, [=] { return ep_moe_comm_all_reduce(out, in, count, dt, h->local, stream); });
}
ep_moe_status_t cb_test(int32_t* out_done, void* request, void* ud) {
  auto* h = static_cast<Host*>(ud);
  auto* r = static_cast<Request*>(request);
  if (r->done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    *out_done = 0;
    return EP_MOE_OK;
  }
  const ep_moe_status_t s = r->done.get();
  delete r;
  *out_done = 1;
  return h->fail_test ? EP_MOE_ERR_IO : s;
}
void cb_cancel(void* request, void* ud) {
  auto* h = static_cast<Host*>(ud);
  h->cancelled++;
  ep_moe_comm_abort(h->local);  // the host gives up its own collective too
  delete static_cast<Request*>(request);
}

struct Group {
  std::vector<ep_moe_comm_t*> local, cb;
  std::vector<std::unique_ptr<Host>> hosts;
  Group(int n, bool async, bool native_reduce, int timeout_ms = 20000) {
    local.resize(static_cast<size_t>(n));
    REQUIRE(ep_moe_comm_create_local(local.data(), n, nullptr) == EP_MOE_OK);
    ep_moe_comm_config_t cc;
    ep_moe_comm_config_init(&cc);
    cc.timeout_ms = timeout_ms;
    for (int r = 0; r < n; ++r) {
      hosts.emplace_back(new Host());
      hosts.back()->local = local[static_cast<size_t>(r)];
      hosts.back()->async = async;
      ep_moe_comm_callbacks_t t;
      REQUIRE(ep_moe_comm_callbacks_init(&t) == EP_MOE_OK);
      t.rank = r;
      t.size = n;
      t.ranks_in_process = n;
      t.user_data = hosts.back().get();
      t.all_gather = cb_all_gather;
      t.all_gather_v = cb_all_gather_v;
      t.all_to_all_v = cb_all_to_all_v;
      if (native_reduce) t.all_reduce = cb_all_reduce;
      t.test = cb_test;
      t.cancel = cb_cancel;
      ep_moe_comm_t* c = nullptr;
      const ep_moe_status_t s = ep_moe_comm_create_callbacks(&c, &t, &cc);
      INFO(ep_moe_last_error());
      REQUIRE(s == EP_MOE_OK);
      cb.push_back(c);
    }
  }
  ~Group() {
    for (auto* c : cb) ep_moe_comm_destroy(c);
    for (auto* c : local) ep_moe_comm_destroy(c);
  }
};

}  // namespace

TEST_CASE("callbacks: collectives through the host's asynchronous and synchronous callbacks", "[callbacks]") {
  for (bool async : {true, false}) {
    for (bool native : {true, false}) {
      INFO("async " << async << " native all_reduce " << native);
      Group g(3, async, native);
      CHECK(std::string(ep_moe_comm_backend(g.cb[0])) == "callbacks");
      std::vector<std::vector<uint16_t>> out(3);
      std::vector<ep_moe_status_t> st(3);
      harness::run_ranks(3, [&](int r) {
        std::vector<uint16_t> in(1001);
        for (size_t i = 0; i < in.size(); ++i)
          in[i] = ref::to_bf16(static_cast<float>(r + 1) * 0.5f + static_cast<float>(i % 7));
        out[static_cast<size_t>(r)].assign(in.size(), 0);
        st[static_cast<size_t>(r)] = ep_moe_comm_all_reduce(out[static_cast<size_t>(r)].data(), in.data(), in.size(),
                                                            EP_MOE_DTYPE_BF16, g.cb[static_cast<size_t>(r)], nullptr);
      });
      for (int r = 0; r < 3; ++r) {
        REQUIRE(st[static_cast<size_t>(r)] == EP_MOE_OK);
        CHECK(out[static_cast<size_t>(r)] == out[0]);
      }
      for (size_t i = 0; i < out[0].size(); ++i) {
        float acc = 0;
        for (int r = 0; r < 3; ++r)
          acc += ref::from_bf16(ref::to_bf16(static_cast<float>(r + 1) * 0.5f + static_cast<float>(i % 7)));
        REQUIRE(out[0][i] == ref::to_bf16(acc));
      }
      // A split is not something callbacks can do.
      ep_moe_comm_t* sub = nullptr;
      harness::run_ranks(
          3, [&](int r) { st[static_cast<size_t>(r)] = ep_moe_comm_split(&sub, g.cb[static_cast<size_t>(r)], 0, 0); });
      for (auto s : st) CHECK(s == EP_MOE_ERR_UNSUPPORTED);
    }
  }
}

TEST_CASE("callbacks: the layer runs over the host's collectives in every dispatch mode", "[callbacks][forward]") {
  std::mt19937 rng(Catch::rngSeed() + 31);
  for (int dispatch : {EP_MOE_DISPATCH_ALLGATHER, EP_MOE_DISPATCH_ALLTOALL, EP_MOE_DISPATCH_AUTO}) {
    for (int dp : {1, 4}) {
      INFO("dispatch " << dispatch << " dp " << dp);
      harness::Case c;
      c.ep = 4;
      c.dp = dp;
      c.dispatch = dispatch;
      c.spec.H = 48;
      c.spec.I = 20;
      c.spec.E = 10;
      c.spec.K = 3;
      c.spec.Is = 12;
      c.wdt = ref::BF16;
      c.adt = ref::BF16;
      c.tokens = dp == 1 ? std::vector<int>{5} : std::vector<int>{3, 0, 7, 1};
      c.forwards = 2;
      const bool async = dispatch != EP_MOE_DISPATCH_AUTO, native = dispatch != EP_MOE_DISPATCH_ALLTOALL;
      c.make_comms = [async, native](int n, std::vector<ep_moe_comm_t*>* out, std::function<void()>* cleanup) {
        auto* g = new Group(n, async, native);
        *out = g->cb;
        *cleanup = [g] { delete g; };
      };
      harness::run_case(c, rng);
    }
  }
}

TEST_CASE("callbacks: a peer that stops responding makes the others time out, with cancel", "[callbacks][timeout]") {
  Group g(3, true, false, 300);
  std::vector<ep_moe_status_t> st(3, EP_MOE_OK);
  const auto t0 = Clock::now();
  harness::run_ranks(3, [&](int r) {
    if (r == 2) return;  // never joins
    st[static_cast<size_t>(r)] = ep_moe_comm_barrier(g.cb[static_cast<size_t>(r)]);
  });
  CHECK(Clock::now() - t0 < std::chrono::milliseconds(300 + 1000));
  // The first to time out cancels (and the host aborts its own group, so the
  // other may see that as a host failure instead of its own timeout).
  CHECK((st[0] == EP_MOE_ERR_TIMEOUT || st[0] == EP_MOE_ERR_REMOTE));
  CHECK((st[1] == EP_MOE_ERR_TIMEOUT || st[1] == EP_MOE_ERR_REMOTE));
  CHECK((st[0] == EP_MOE_ERR_TIMEOUT || st[1] == EP_MOE_ERR_TIMEOUT));
  CHECK(g.hosts[0]->cancelled.load() + g.hosts[1]->cancelled.load() >= 1);
  ep_moe_status_t ae = EP_MOE_OK;
  int32_t peer = 7;
  REQUIRE(ep_moe_comm_get_async_error(&ae, &peer, g.cb[0]) == EP_MOE_OK);
  CHECK(ae == st[0]);
  CHECK(peer == -1);                                         // the host cannot say who
  CHECK(ep_moe_comm_barrier(g.cb[0]) == EP_MOE_ERR_REMOTE);  // broken for good
}

TEST_CASE("callbacks: abort during a blocked call, a failing host, and bad tables", "[callbacks][errors]") {
  {
    Group g(2, true, false);
    ep_moe_status_t st = EP_MOE_OK;
    std::thread t([&] { st = ep_moe_comm_barrier(g.cb[0]); });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    REQUIRE(ep_moe_comm_abort(g.cb[0]) == EP_MOE_OK);
    REQUIRE(ep_moe_comm_abort(g.cb[0]) == EP_MOE_OK);
    t.join();
    CHECK(st == EP_MOE_ERR_ABORTED);
    CHECK(ep_moe_comm_barrier(g.cb[0]) != EP_MOE_OK);
  }
  {
    Group g(2, true, false);
    g.hosts[0]->fail_test = true;
    std::vector<ep_moe_status_t> st(2);
    harness::run_ranks(2,
                       [&](int r) { st[static_cast<size_t>(r)] = ep_moe_comm_barrier(g.cb[static_cast<size_t>(r)]); });
    CHECK(st[0] == EP_MOE_ERR_REMOTE);
    CHECK(std::string(ep_moe_comm_last_error(g.cb[0])).find("the host's all_gather failed") != std::string::npos);
  }
  ep_moe_comm_callbacks_t t;
  ep_moe_comm_callbacks_init(&t);
  t.size = 2;
  t.rank = 0;
  ep_moe_comm_t* c = nullptr;
  CHECK(ep_moe_comm_create_callbacks(&c, &t, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("all_gather is NULL") != std::string::npos);
  t.all_gather = cb_all_gather;
  t.all_gather_v = cb_all_gather_v;
  t.all_to_all_v = cb_all_to_all_v;
  CHECK(ep_moe_comm_create_callbacks(&c, &t, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("test is NULL") != std::string::npos);
  t.test = cb_test;
  t.rank = 2;
  CHECK(ep_moe_comm_create_callbacks(&c, &t, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  t.rank = 0;
  t.struct_size = 8;
  CHECK(ep_moe_comm_create_callbacks(&c, &t, nullptr) == EP_MOE_ERR_STRUCT_SIZE);
  CHECK(c == nullptr);
}

TEST_CASE("backends that are not built say so; MPI and NCCL argument checks", "[comm][backends]") {
  ep_moe_comm_t* c = nullptr;
  int dummy = 0;
  const ep_moe_status_t mpi = ep_moe_comm_create_mpi(&c, &dummy, 3, nullptr);
  if (ep_moe_has_feature(EP_MOE_FEATURE_MPI)) {
    CHECK(mpi == EP_MOE_ERR_INVALID_ARGUMENT);  // wrong sizeof(MPI_Comm)
  } else {
    CHECK(mpi == EP_MOE_ERR_UNSUPPORTED);
  }
  uint8_t id[128];
  const ep_moe_status_t nccl = ep_moe_nccl_get_unique_id(id, sizeof id);
  if (!ep_moe_has_feature(EP_MOE_FEATURE_NCCL)) CHECK(nccl == EP_MOE_ERR_UNSUPPORTED);
  CHECK(ep_moe_nccl_get_unique_id(id, 4) != EP_MOE_OK);
  CHECK(ep_moe_comm_create_nccl(&c, nullptr, nullptr) != EP_MOE_OK);
  const ep_moe_status_t from_id = ep_moe_comm_create_nccl_from_id(&c, id, sizeof id, 0, 1, nullptr);
  CHECK((from_id == EP_MOE_ERR_UNSUPPORTED || from_id == EP_MOE_OK || from_id == EP_MOE_ERR_REMOTE));
  if (from_id == EP_MOE_OK) ep_moe_comm_destroy(c);
  CHECK(std::string(ep_moe_comm_backend(nullptr)) == "invalid handle");
  ep_moe_status_t s;
  CHECK(ep_moe_comm_get_async_error(&s, nullptr, nullptr) == EP_MOE_ERR_INVALID_HANDLE);
}

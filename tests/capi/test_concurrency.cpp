// Calls that overlap on one handle, which the API says they must not: each
// gets a clear status, never a crash, a wrong answer or a deadlock.
// Meant for TSan too (label capi).
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "../common/seed.hpp"
#include "../io/writers.hpp"
#include "../multirank/harness.hpp"
#include "ep_moe/ep_moe.h"
#include "layer_helpers.hpp"

namespace {

harness::Case busy_case() {
  harness::Case c;
  c.spec.H = 256;
  c.spec.I = 512;
  c.spec.E = 8;
  c.spec.K = 2;
  c.max_tokens = 32;
  c.tokens = {32};
  c.threads = 1;
  return c;
}

// Rank r of an EP group of 2 over E experts, created without Catch's
// assertions (these run on the ranks' threads; Catch is not thread-safe).
ep_moe_expert_map_t* plain_map(int r, int E) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = 2;
  mc.ep_rank = r;
  mc.global_num_experts = E;
  ep_moe_expert_map_t* m = nullptr;
  return ep_moe_expert_map_create(&m, &mc) == EP_MOE_OK ? m : nullptr;
}

}  // namespace

TEST_CASE("two threads forwarding one layer: each call runs alone or fails with STATE, outputs right",
          "[layer][concurrency]") {
  std::mt19937 rng(test_seed() + 401);
  const harness::Case c = busy_case();
  const ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  const harness::Inputs in = harness::make_inputs(c, w, rng);
  ep_moe_layer_t* l = loaded_rank_layer(c, w, 1, 0);
  const size_t n = in.hidden[0].size();
  std::vector<float> want(n);
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = 32;
  a.hidden = in.hidden[0].data();
  a.router_logits = in.logits[0].data();
  a.out = want.data();
  REQUIRE(ep_moe_layer_forward(l, &a) == EP_MOE_OK);
  std::atomic<int> ok{0}, busy{0}, wrong{0}, other{0};
  auto run = [&] {
    std::vector<float> out(n);
    ep_moe_forward_args_t b = a;
    b.out = out.data();
    for (int i = 0; i < 200; ++i) {
      const ep_moe_status_t s = ep_moe_layer_forward(l, &b);
      if (s == EP_MOE_OK) {
        ++ok;
        if (std::memcmp(out.data(), want.data(), n * sizeof(float)) != 0) ++wrong;
      } else if (s == EP_MOE_ERR_STATE &&
                 std::string(ep_moe_last_error()).find("ep_moe_layer_forward is running on this ep_moe_layer_t") !=
                     std::string::npos) {
        ++busy;
      } else {
        ++other;
      }
    }
  };
  std::thread t1(run), t2(run);
  t1.join();
  t2.join();
  INFO(ok << " ran, " << busy << " refused as overlapping");
  CHECK(ok + busy == 400);
  CHECK(ok > 0);
  CHECK(wrong == 0);
  CHECK(other == 0);
  ep_moe_layer_destroy(l);
}

TEST_CASE("destroying a layer while another thread forwards it waits for that call, then refuses the next",
          "[layer][concurrency]") {
  std::mt19937 rng(test_seed() + 402);
  const harness::Case c = busy_case();
  const ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  const harness::Inputs in = harness::make_inputs(c, w, rng);
  ep_moe_layer_t* l = loaded_rank_layer(c, w, 1, 0);
  std::atomic<int> calls{0};
  std::atomic<ep_moe_status_t> last{EP_MOE_OK};
  std::thread t([&] {
    std::vector<float> out(in.hidden[0].size());
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = 32;
    a.hidden = in.hidden[0].data();
    a.router_logits = in.logits[0].data();
    a.out = out.data();
    for (;;) {
      const ep_moe_status_t s = ep_moe_layer_forward(l, &a);
      ++calls;
      if (s != EP_MOE_OK) {
        last = s;
        return;
      }
    }
  });
  while (calls < 3) std::this_thread::yield();
  ep_moe_layer_destroy(l);  // waits for the forward in flight
  t.join();
  CHECK(last == EP_MOE_ERR_INVALID_HANDLE);
  ep_moe_layer_destroy(l);  // a second destroy: nothing
}

TEST_CASE("closing a checkpoint while another thread loads from it waits for the load, then refuses the next",
          "[layer][concurrency]") {
  std::mt19937 rng(test_seed() + 403);
  harness::Case c = busy_case();
  writers::Model m;
  m.spec = c.spec;
  m.dtype = "F32";
  m.layer = 1;
  const std::string path = writers::small_checkpoint(m, rng);
  ep_moe_checkpoint_t* ck = nullptr;
  REQUIRE(ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) == EP_MOE_OK);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  REQUIRE(ep_moe_checkpoint_layer_config(&lc, ck, 1) == EP_MOE_OK);
  lc.max_tokens = 8;
  const MapPtr map = make_map(map_config(1, 0, c.spec.E));
  ep_moe_layer_t* l = nullptr;
  REQUIRE(ep_moe_layer_create(&l, &lc, map.get(), nullptr, nullptr) == EP_MOE_OK);
  std::atomic<int> loads{0};
  std::atomic<ep_moe_status_t> last{EP_MOE_OK};
  std::thread t([&] {
    for (;;) {
      const ep_moe_status_t s = ep_moe_layer_load(l, ck, 1);
      ++loads;
      if (s != EP_MOE_OK) {
        last = s;
        return;
      }
    }
  });
  while (loads < 2) std::this_thread::yield();
  ep_moe_checkpoint_close(ck);  // waits for the load in flight
  t.join();
  CHECK(last == EP_MOE_ERR_INVALID_HANDLE);
  ep_moe_layer_destroy(l);
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST_CASE("a thread the system refuses is OUT_OF_MEMORY naming the resource, not INTERNAL", "[layer][limits]") {
  // In a child process whose address space is capped a little above what
  // it uses: the pool's thread stacks (8 MiB each) cannot all be mapped.
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    long vm_kib = 0;
    {
      std::ifstream f("/proc/self/status");
      std::string line;
      while (std::getline(f, line))
        if (line.rfind("VmSize:", 0) == 0) vm_kib = std::stol(line.substr(7));
    }
    struct rlimit lim;
    lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(vm_kib + 48 * 1024) * 1024;
    if (vm_kib == 0 || setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    ep_moe_expert_map_config_t mc;
    ep_moe_expert_map_config_init(&mc);
    mc.ep_size = 1;
    mc.global_num_experts = 4;
    ep_moe_expert_map_t* m = nullptr;
    if (ep_moe_expert_map_create(&m, &mc) != EP_MOE_OK) _exit(4);
    ep_moe_layer_config_t lc;
    ep_moe_layer_config_init(&lc);
    lc.hidden_size = 16;
    lc.intermediate_size = 8;
    lc.num_experts = 4;
    lc.top_k = 2;
    lc.max_tokens = 4;
    lc.num_threads = 64;
    ep_moe_layer_t* l = nullptr;
    const ep_moe_status_t s = ep_moe_layer_create(&l, &lc, m, nullptr, nullptr);
    if (s == EP_MOE_OK) _exit(2);
    const std::string msg = ep_moe_last_error();
    _exit(s == EP_MOE_ERR_OUT_OF_MEMORY && msg.find("cannot start thread") != std::string::npos ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 2) {
    WARN("skipped: 64 threads started under the cap");
    return;
  }
  CHECK(WEXITSTATUS(status) == 0);
}
#endif

TEST_CASE("EP ranks that disagree on the layer all fail at the first forward, naming the difference",
          "[layer][agreement]") {
  struct Diff {
    const char* what;
    std::function<void(ep_moe_layer_config_t&)> cfg;  // applied to rank 1's config
    bool other_rows;                                  // rank 1 passes other hidden rows (no DP)
    const char* needle;
  };
  const Diff diffs[] = {
      {"top_k", [](ep_moe_layer_config_t& c) { c.top_k = 3; }, false, "rank 0 has top_k 2, rank 1 has 3"},
      {"scoring", [](ep_moe_layer_config_t& c) { c.scoring = EP_MOE_SCORING_SIGMOID; }, false, "scoring"},
      {"hidden rows", [](ep_moe_layer_config_t&) {}, true, "fingerprint of the hidden rows"},
      {"nothing", [](ep_moe_layer_config_t&) {}, false, nullptr},
  };
  constexpr int H = 16, I = 8, E = 4, T = 3;
  for (const Diff& d : diffs) {
    INFO(d.what);
    ep_moe_comm_t* comms[2] = {nullptr, nullptr};
    REQUIRE(ep_moe_comm_create_local(comms, 2, nullptr) == EP_MOE_OK);
    ep_moe_status_t status[2] = {EP_MOE_OK, EP_MOE_OK}, second[2] = {EP_MOE_OK, EP_MOE_OK};
    std::string msg[2];
    auto rank = [&](int r) {
      const MapPtr m(plain_map(r, E));
      ep_moe_layer_config_t lc;
      ep_moe_layer_config_init(&lc);
      lc.hidden_size = H;
      lc.intermediate_size = I;
      lc.num_experts = E;
      lc.top_k = 2;
      lc.max_tokens = T;
      lc.num_threads = 1;
      if (r == 1) d.cfg(lc);
      ep_moe_layer_t* l = nullptr;
      if (ep_moe_layer_create(&l, &lc, m.get(), comms[r], nullptr) != EP_MOE_OK) {
        status[r] = EP_MOE_ERR_INTERNAL;
        msg[r] = ep_moe_last_error();
        return;
      }
      std::vector<float> w(static_cast<size_t>(H * I), 0.01f * static_cast<float>(r + 1));
      int32_t st = 0;
      for (int e = 0; e < E; ++e) {
        ep_moe_layer_set_weight(&st, l, EP_MOE_WEIGHT_EXPERT_GATE, e, w.data(), EP_MOE_DTYPE_F32, I, H);
        ep_moe_layer_set_weight(&st, l, EP_MOE_WEIGHT_EXPERT_UP, e, w.data(), EP_MOE_DTYPE_F32, I, H);
        ep_moe_layer_set_weight(&st, l, EP_MOE_WEIGHT_EXPERT_DOWN, e, w.data(), EP_MOE_DTYPE_F32, H, I);
      }
      std::vector<float> hidden(static_cast<size_t>(T * H), d.other_rows && r == 1 ? 0.5f : 0.25f);
      std::vector<float> logits(static_cast<size_t>(T * E), 0.0f), out(hidden.size());
      for (int t = 0; t < T; ++t) logits[static_cast<size_t>(t * E + t % E)] = 1.0f;
      ep_moe_forward_args_t a;
      ep_moe_forward_args_init(&a);
      a.num_tokens = T;
      a.hidden = hidden.data();
      a.router_logits = logits.data();
      a.out = out.data();
      status[r] = ep_moe_layer_forward(l, &a);
      msg[r] = status[r] == EP_MOE_OK ? "" : ep_moe_layer_last_error(l);
      // The next forward (no check any more) still runs, or fails alike.
      second[r] = ep_moe_layer_forward(l, &a);
      ep_moe_layer_destroy(l);
    };
    std::thread t0(rank, 0), t1(rank, 1);
    t0.join();
    t1.join();
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << ": " << msg[r]);
      if (d.needle) {
        CHECK(status[r] == EP_MOE_ERR_INVALID_ARGUMENT);
        CHECK(msg[r].find("the EP ranks disagree on the layer") != std::string::npos);
        CHECK(msg[r].find(d.needle) != std::string::npos);
      } else {
        CHECK(status[r] == EP_MOE_OK);
        CHECK(second[r] == EP_MOE_OK);
      }
    }
    ep_moe_comm_destroy(comms[0]);
    ep_moe_comm_destroy(comms[1]);
  }
}

TEST_CASE("all-to-all without DP: a step where EP ranks pass different token counts fails on every rank",
          "[layer][agreement]") {
  constexpr int H = 16, I = 8, E = 4, T = 3;
  ep_moe_comm_t* comms[2] = {nullptr, nullptr};
  REQUIRE(ep_moe_comm_create_local(comms, 2, nullptr) == EP_MOE_OK);
  ep_moe_status_t first[2], second[2], third[2];
  std::string msg[2];
  auto rank = [&](int r) {
    const MapPtr m(plain_map(r, E));
    ep_moe_layer_config_t lc;
    ep_moe_layer_config_init(&lc);
    lc.hidden_size = H;
    lc.intermediate_size = I;
    lc.num_experts = E;
    lc.top_k = 2;
    lc.max_tokens = T;
    lc.num_threads = 1;
    lc.dispatch_mode = EP_MOE_DISPATCH_ALLTOALL;
    ep_moe_layer_t* l = nullptr;
    if (ep_moe_layer_create(&l, &lc, m.get(), comms[r], nullptr) != EP_MOE_OK) {
      first[r] = second[r] = third[r] = EP_MOE_ERR_INTERNAL;
      return;
    }
    std::vector<float> w(static_cast<size_t>(H * I), 0.01f);
    int32_t st = 0;
    for (int e = 0; e < E; ++e) {
      ep_moe_layer_set_weight(&st, l, EP_MOE_WEIGHT_EXPERT_GATE, e, w.data(), EP_MOE_DTYPE_F32, I, H);
      ep_moe_layer_set_weight(&st, l, EP_MOE_WEIGHT_EXPERT_UP, e, w.data(), EP_MOE_DTYPE_F32, I, H);
      ep_moe_layer_set_weight(&st, l, EP_MOE_WEIGHT_EXPERT_DOWN, e, w.data(), EP_MOE_DTYPE_F32, H, I);
    }
    std::vector<float> hidden(static_cast<size_t>(T * H), 0.25f), logits(static_cast<size_t>(T * E), 0.0f),
        out(hidden.size());
    for (int t = 0; t < T; ++t) logits[static_cast<size_t>(t * E + t % E)] = 1.0f;
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = T;
    a.hidden = hidden.data();
    a.router_logits = logits.data();
    a.out = out.data();
    first[r] = ep_moe_layer_forward(l, &a);
    if (r == 1) a.num_tokens = T - 1;  // the second step: rank 1 passes fewer tokens
    second[r] = ep_moe_layer_forward(l, &a);
    msg[r] = second[r] == EP_MOE_OK ? "" : ep_moe_layer_last_error(l);
    a.num_tokens = T;
    third[r] = ep_moe_layer_forward(l, &a);  // and the group goes on
    ep_moe_layer_destroy(l);
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << msg[r]);
    CHECK(first[r] == EP_MOE_OK);
    CHECK(second[r] == EP_MOE_ERR_INVALID_ARGUMENT);
    CHECK(msg[r].find("rank 0 passes 3 tokens, rank 1 2") != std::string::npos);
    CHECK(third[r] == EP_MOE_OK);
  }
  ep_moe_comm_destroy(comms[0]);
  ep_moe_comm_destroy(comms[1]);
}

// Calls that overlap on one handle, which the API says they must not: each
// gets a clear status, never a crash, a wrong answer or a deadlock.
// Meant for TSan too (label capi).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../common/seed.hpp"
#include "../io/writers.hpp"
#include "../multirank/harness.hpp"
#include "ep_moe/ep_moe.h"
#include "map_helpers.hpp"

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

ep_moe_layer_t* make_layer(const harness::Case& c, const ref::Weights& w) {
  const MapPtr m = make_map(map_config(1, 0, c.spec.E));
  const auto lc = harness::layer_config(c);
  ep_moe_layer_t* l = nullptr;
  REQUIRE(ep_moe_layer_create(&l, &lc, m.get(), nullptr, nullptr) == EP_MOE_OK);
  int stored = 0;
  REQUIRE(harness::load_weights(l, c, w, &stored).empty());
  return l;
}

}  // namespace

TEST_CASE("two threads forwarding one layer: each call runs alone or fails with STATE, outputs right",
          "[layer][concurrency]") {
  std::mt19937 rng(test_seed() + 401);
  const harness::Case c = busy_case();
  const ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  const harness::Inputs in = harness::make_inputs(c, w, rng);
  ep_moe_layer_t* l = make_layer(c, w);
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
  ep_moe_layer_t* l = make_layer(c, w);
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

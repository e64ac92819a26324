// Base C API: versions, statuses, features, logging, last-error slots.
#include <catch2/catch.hpp>
#include <chrono>
#include <future>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"

TEST_CASE("version macros and run-time version agree", "[base]") {
  CHECK(ep_moe_version() == EP_MOE_VERSION_NUMBER);
  const std::string expect = std::to_string(EP_MOE_VERSION_MAJOR) + "." + std::to_string(EP_MOE_VERSION_MINOR) + "." +
                             std::to_string(EP_MOE_VERSION_PATCH);
  CHECK(expect == ep_moe_version_string());
}

TEST_CASE("every status has its own text", "[base]") {
  std::vector<std::string> seen;
  for (int s = 0; s <= EP_MOE_ERR_DEVICE; ++s) {
    const char* t = ep_moe_status_string(static_cast<ep_moe_status_t>(s));
    REQUIRE(t != nullptr);
    CHECK(std::string(t) != "unknown status");
    for (const auto& o : seen) CHECK(o != t);
    seen.emplace_back(t);
  }
  CHECK(std::string(ep_moe_status_string(static_cast<ep_moe_status_t>(999))) == "unknown status");
  CHECK(std::string(ep_moe_status_string(static_cast<ep_moe_status_t>(-1))) == "unknown status");
}

TEST_CASE("has_feature reports the CPU and rejects unknown bits", "[base]") {
  CHECK(ep_moe_has_feature(EP_MOE_FEATURE_CPU) == 1);
  CHECK(ep_moe_has_feature(0) == 0);
  CHECK(ep_moe_has_feature(1u << 30) == 0);
  CHECK(ep_moe_has_feature(EP_MOE_FEATURE_CPU | (1u << 30)) == 0);
  // Each optional feature answers 0 or 1, and a combination answers the AND.
  const uint32_t all[] = {EP_MOE_FEATURE_CUDA, EP_MOE_FEATURE_NCCL, EP_MOE_FEATURE_CUBLASLT, EP_MOE_FEATURE_MPI};
  for (uint32_t f : all) {
    const int a = ep_moe_has_feature(f);
    CHECK((a == 0 || a == 1));
    CHECK(ep_moe_has_feature(f | EP_MOE_FEATURE_CPU) == a);
  }
}

namespace {
struct Captured {
  std::vector<std::pair<int, std::string>> lines;
};
void capture(ep_moe_log_level_t level, const char* msg, void* user) {
  static_cast<Captured*>(user)->lines.emplace_back(static_cast<int>(level), msg);
}
}  // namespace

TEST_CASE("log callback: installed, level-filtered, removed", "[base]") {
  Captured cap;
  REQUIRE(ep_moe_set_log_callback(capture, EP_MOE_LOG_WARN, &cap) == EP_MOE_OK);
  // A round-robin request without expert groups falls back with a warning.
  ep_moe_expert_map_config_t c;
  REQUIRE(ep_moe_expert_map_config_init(&c) == EP_MOE_OK);
  c.ep_size = 2;
  c.global_num_experts = 8;
  c.placement = EP_MOE_PLACEMENT_ROUND_ROBIN;
  ep_moe_expert_map_t* m = nullptr;
  REQUIRE(ep_moe_expert_map_create(&m, &c) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  REQUIRE(cap.lines.size() == 1);
  CHECK(cap.lines[0].first == EP_MOE_LOG_WARN);
  CHECK(cap.lines[0].second.find("falling back to linear") != std::string::npos);
  CHECK(cap.lines[0].second.find("expert groups") != std::string::npos);

  // Failures are logged at ERROR: a runtime listening at WARN sees them,
  // with the function's name and the message.
  CHECK(ep_moe_expert_map_create(&m, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  REQUIRE(cap.lines.size() == 2);
  CHECK(cap.lines[1].first == EP_MOE_LOG_ERROR);
  CHECK(cap.lines[1].second == ep_moe_last_error());
  CHECK(cap.lines[1].second.find("ep_moe_expert_map_create: config is NULL") != std::string::npos);
  // At ERROR only, the warning is filtered out and the failure is not.
  REQUIRE(ep_moe_set_log_callback(capture, EP_MOE_LOG_ERROR, &cap) == EP_MOE_OK);
  REQUIRE(ep_moe_expert_map_create(&m, &c) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  CHECK(ep_moe_expert_map_create(&m, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(cap.lines.size() == 3);

  REQUIRE(ep_moe_set_log_callback(nullptr, EP_MOE_LOG_DEBUG, nullptr) == EP_MOE_OK);
  REQUIRE(ep_moe_expert_map_create(&m, &c) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  CHECK(ep_moe_expert_map_create(&m, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(cap.lines.size() == 3);

  CHECK(ep_moe_set_log_callback(capture, static_cast<ep_moe_log_level_t>(9), &cap) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_last_error()).find("max_level") != std::string::npos);
  CHECK(ep_moe_set_log_callback(capture, static_cast<ep_moe_log_level_t>(-1), &cap) == EP_MOE_ERR_INVALID_ARGUMENT);
}

namespace {
// A callback that calls back into the library: reads the error, makes a
// call that fails (and would log), and on its third message removes itself.
struct Reentrant {
  int calls = 0;
  std::string last;
};
void reenter(ep_moe_log_level_t, const char* msg, void* user) {
  auto* r = static_cast<Reentrant*>(user);
  ++r->calls;
  r->last = msg;
  ep_moe_expert_map_t* m = nullptr;
  (void)ep_moe_expert_map_create(&m, nullptr);  // fails: its log is not passed back in
  (void)ep_moe_last_error();
  if (r->calls == 3) (void)ep_moe_set_log_callback(nullptr, EP_MOE_LOG_ERROR, nullptr);
}
}  // namespace

TEST_CASE("a log callback may call back into the library without deadlock or recursion", "[base]") {
  Reentrant r;
  REQUIRE(ep_moe_set_log_callback(reenter, EP_MOE_LOG_ERROR, &r) == EP_MOE_OK);
  // On a thread of its own, waited for: a deadlock fails the test instead of
  // stalling the run.
  std::promise<void> done;
  std::future<void> f = done.get_future();
  std::thread([&done] {
    ep_moe_expert_map_t* m = nullptr;
    for (int i = 0; i < 5; ++i) (void)ep_moe_expert_map_create(&m, nullptr);
    done.set_value();
  }).detach();
  REQUIRE(f.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
  CHECK(r.calls == 3);  // one per failure until it removed itself; none nested
  CHECK(r.last.find("ep_moe_expert_map_create: config is NULL") != std::string::npos);
  ep_moe_expert_map_t* m = nullptr;
  CHECK(ep_moe_expert_map_create(&m, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(r.calls == 3);
}

TEST_CASE("last error is per thread and names the function", "[base]") {
  ep_moe_expert_map_t* m = nullptr;
  CHECK(ep_moe_expert_map_create(&m, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  const std::string here = ep_moe_last_error();
  CHECK(here.find("ep_moe_expert_map_create") != std::string::npos);
  CHECK(here.find("config") != std::string::npos);
  std::string there = "unset";
  std::thread t([&] { there = ep_moe_last_error(); });
  t.join();
  CHECK(there.empty());
  CHECK(m == nullptr);
}

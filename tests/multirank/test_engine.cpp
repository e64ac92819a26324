// The matrix engine (libep_moe_onednn.so) in the layer: forced on with
// EP_MOE_MATRIX_ENGINE=onednn (on a CPU without AMX oneDNN runs its
// AVX-512 brgemm; with AMX, its tiles), against the double-precision
// reference, with the engine's whole tiles and the tiles' remaining panels
// in the same expert, and bit for bit on 1 and 3 threads.
#include <cstdlib>
#include <cstring>
#include <string>

#include "../common/seed.hpp"
#include "harness.hpp"

using harness::Case;

namespace {

std::mt19937& rng() {
  static std::mt19937 g(test_seed() + 37);
  return g;
}

// Sets an environment variable for a scope, then puts it back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// A bf16 layer whose depths the engine serves: H = 320 is one tile of 256
// columns and 2 panels of 32 more (the down's remaining panels stay on
// the tiles), I = 160 likewise for gate/up (2 I = 320 columns); the shared
// expert's I = 96 has no whole gate/up tile, but its down is on the engine.
Case engine_case(int ep, int threads, int tokens) {
  Case c;
  c.ep = ep;
  c.threads = threads;
  c.wdt = c.adt = ref::BF16;
  c.spec.H = 320;
  c.spec.I = 160;
  c.spec.E = 6;
  c.spec.K = 2;
  c.spec.Is = 96;
  c.max_tokens = tokens;
  c.tokens = {tokens};
  return c;
}

bool engine_here() {
  if (ep_moe_has_feature(EP_MOE_FEATURE_ONEDNN)) return true;
  WARN("skipped: libep_moe_onednn.so is not available (built without libdnnl-dev, or it does not load)");
  return false;
}

}  // namespace

TEST_CASE("the oneDNN matrix engine: prefill experts match the reference, the same bits on 1 and 3 threads",
          "[forward][engine]") {
  if (!engine_here()) return;
  const ScopedEnv isa("EP_MOE_CPU_ISA", nullptr);
  const ScopedEnv eng("EP_MOE_MATRIX_ENGINE", "onednn");
  for (const char* min_rows : {"1", "24"}) {
    const ScopedEnv mr("EP_MOE_MATRIX_MIN_ROWS", min_rows);
    for (int ep : {1, 2}) {
      INFO("min rows " << min_rows << ", ep " << ep);
      Case c = engine_case(ep, 1, 150);
      c.spec.shared_gate = ep == 2;
      std::mt19937 r1 = rng();
      std::mt19937 r3 = r1;
      rng().discard(1);
      const auto one = harness::run_case(c, r1);
      REQUIRE(!one.empty());
      if (one[0].engine == 0) {
        // Only a CPU on which oneDNN has no bf16 brgemm (no AVX512_BF16).
        WARN("skipped: oneDNN has no bf16 brgemm on this CPU (the layer's log says why)");
        return;
      }
      for (const auto& r : one) {
        CHECK(r.engine >= 1);
        // min rows 1: every routed pair, and on one rank the shared
        // expert's rows too (its down of depth 96; split over 2 ranks its
        // depth 48 is no engine shape); 24: the experts with enough rows.
        CHECK(r.engine_pairs > 0);
        const int64_t all = r.local_pairs + (ep == 1 ? r.tokens : 0);
        CHECK(r.engine_pairs <= all);
        if (std::strcmp(min_rows, "1") == 0) CHECK(r.engine_pairs == all);
      }
      c.threads = 3;
      const auto three = harness::run_case(c, r3);
      REQUIRE(one.size() == three.size());
      for (size_t r = 0; r < one.size(); ++r) {
        REQUIRE(one[r].out.size() == three[r].out.size());
        if (one[r].out.empty()) continue;
        CHECK(std::memcmp(one[r].out.data(), three[r].out.data(), one[r].out.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("the matrix engine is off by name, below amx, in decode, and for float activations", "[forward][engine]") {
  if (!engine_here()) return;
  const ScopedEnv mr("EP_MOE_MATRIX_MIN_ROWS", "8");
  {  // EP_MOE_MATRIX_ENGINE=off: never
    const ScopedEnv eng("EP_MOE_MATRIX_ENGINE", "off");
    const auto res = harness::run_case(engine_case(1, 2, 40), rng());
    CHECK(res[0].engine == 0);
    CHECK(res[0].engine_pairs == 0);
  }
  {  // auto: only where the CPU has AMX, and EP_MOE_CPU_ISA below amx forbids it
    const ScopedEnv eng("EP_MOE_MATRIX_ENGINE", nullptr);
    const ScopedEnv isa("EP_MOE_CPU_ISA", "avx512bf16");
    const auto res = harness::run_case(engine_case(1, 2, 40), rng());
    CHECK(res[0].engine == 0);
  }
  {  // forced, but decode: one token, below the row threshold
    const ScopedEnv eng("EP_MOE_MATRIX_ENGINE", "onednn");
    const ScopedEnv isa("EP_MOE_CPU_ISA", nullptr);
    Case c = engine_case(1, 2, 1);
    const auto res = harness::run_case(c, rng());
    if (res[0].engine > 0) CHECK(res[0].engine_pairs == 0);
    // f32 activations: the user asked for f32, the engine computes in bf16.
    c = engine_case(1, 2, 40);
    c.adt = ref::F32;
    const auto f = harness::run_case(c, rng());
    CHECK(f[0].engine == 0);
  }
}

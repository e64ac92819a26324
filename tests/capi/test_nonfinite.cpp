// Non-finite numbers in a forward: a token whose hidden row holds a NaN or
// an Inf gets an all-NaN output row on every dtype and ISA table, and no
// other token is touched; under the weight-0 skip strategy a NaN that an
// expert computes for a pair parked on it (weight 0) reaches no token.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../common/seed.hpp"
#include "../multirank/harness.hpp"
#include "ep_moe/ep_moe.h"
#include "layer_helpers.hpp"

namespace {

// Element j of row t set to a NaN or an Inf in dtype dt's encoding.
void set_nonfinite(std::vector<uint8_t>& rows, int dt, int64_t H, int64_t t, int64_t j, bool nan) {
  const size_t at = static_cast<size_t>(t * H + j);
  if (dt == ref::F32) {
    const float v = nan ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
    std::memcpy(rows.data() + 4 * at, &v, 4);
  } else {
    const uint16_t v = dt == ref::BF16 ? (nan ? 0x7fc0 : 0xff80) : (nan ? 0x7e00 : 0xfc00);
    std::memcpy(rows.data() + 2 * at, &v, 2);
  }
}

bool row_all_nan(const std::vector<uint8_t>& rows, int dt, int64_t H, int64_t t) {
  const size_t w = dt == ref::F32 ? 4 : 2;
  for (int64_t j = 0; j < H; ++j) {
    const uint8_t* p = rows.data() + static_cast<size_t>(t * H + j) * w;
    if (dt == ref::F32) {
      float v;
      std::memcpy(&v, p, 4);
      if (!std::isnan(v)) return false;
    } else {
      uint16_t v;
      std::memcpy(&v, p, 2);
      const uint16_t exp = dt == ref::BF16 ? 0x7f80 : 0x7c00, man = dt == ref::BF16 ? 0x007f : 0x03ff;
      if ((v & exp) != exp || (v & man) == 0) return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE("a NaN or Inf in a token's hidden row gives that token an all-NaN row, every dtype and ISA table",
          "[layer][nonfinite]") {
  std::mt19937 rng(test_seed() + 301);
  struct Variant {
    const char* name;
    int wdt, adt, q;  // q: the experts' block format (0: wdt itself)
  };
  const Variant variants[] = {
      {"f32", ref::F32, ref::F32, 0},
      {"bf16 weights and activations", ref::BF16, ref::BF16, 0},
      {"f16 activations", ref::F32, ref::F16, 0},
      {"q4_k", ref::F32, ref::F32, EP_MOE_DTYPE_Q4_K},
      {"q8_0 with bf16 activations", ref::F32, ref::BF16, EP_MOE_DTYPE_Q8_0},
      {"mxfp4", ref::F32, ref::F32, EP_MOE_DTYPE_MXFP4},
      {"q2_k", ref::F32, ref::F32, EP_MOE_DTYPE_Q2_K},
      {"iq2_xxs", ref::F32, ref::F32, EP_MOE_DTYPE_IQ2_XXS},
      {"iq3_xxs", ref::F32, ref::F32, EP_MOE_DTYPE_IQ3_XXS},
  };
  const char* before = std::getenv("EP_MOE_CPU_ISA");
  const std::string saved = before ? before : "";
  for (const char* isa : harness::kIsaNames) {
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (const Variant& v : variants) {
      harness::Case c;
      c.spec.H = 256;
      c.spec.I = 256;
      c.spec.E = 4;
      c.spec.K = 2;
      c.spec.Is = 256;  // a shared expert too
      c.wdt = v.wdt;
      c.adt = v.adt;
      c.qgu = c.qdown = v.q;
      c.max_tokens = 6;
      c.tokens = {6};
      INFO(isa << ", " << v.name);
      ref::Spec spec;
      const ref::Weights w = harness::case_weights(c, &spec, rng);
      const harness::Inputs in = harness::make_inputs(c, w, rng);
      ep_moe_layer_t* l = loaded_rank_layer(c, w, 1, 0);
      const int64_t H = c.spec.H;
      std::vector<uint8_t> hidden = ref::encode(in.hidden[0], c.adt);
      const size_t row = hidden.size() / 6;
      for (bool nan : {true, false}) {
        // Token 2's row as zeros, then with one NaN (or -Inf) in it.
        std::vector<uint8_t> zeroed = hidden;
        std::memset(zeroed.data() + 2 * row, 0, row);
        std::vector<uint8_t> bad = zeroed;
        set_nonfinite(bad, c.adt, H, 2, 77, nan);
        std::vector<uint8_t> out_zero(hidden.size()), out_bad(hidden.size());
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = 6;
        a.router_logits = in.logits[0].data();
        a.hidden = zeroed.data();
        a.out = out_zero.data();
        REQUIRE(ep_moe_layer_forward(l, &a) == EP_MOE_OK);
        a.hidden = bad.data();
        a.out = out_bad.data();
        REQUIRE(ep_moe_layer_forward(l, &a) == EP_MOE_OK);
        CHECK(row_all_nan(out_bad, c.adt, H, 2));
        for (int t = 0; t < 6; ++t)
          if (t != 2) CHECK(std::memcmp(out_bad.data() + t * row, out_zero.data() + t * row, row) == 0);
        // In place (out = hidden): the same.
        std::vector<uint8_t> inplace = bad;
        a.hidden = inplace.data();
        a.out = inplace.data();
        REQUIRE(ep_moe_layer_forward(l, &a) == EP_MOE_OK);
        CHECK(std::memcmp(inplace.data(), out_bad.data(), 2 * row) == 0);
        CHECK(row_all_nan(inplace, c.adt, H, 2));
      }
      ep_moe_layer_destroy(l);
    }
  }
  if (before) setenv("EP_MOE_CPU_ISA", saved.c_str(), 1);
  else unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("weight-0 skip: a NaN an expert computes for a parked pair reaches no token", "[layer][nonfinite]") {
  // Rank 1 of EP 2 holds experts 2 and 3; pairs of experts 0 and 1 are
  // parked on them with weight 0. Expert 2's gate weights hold a NaN.
  std::mt19937 rng(test_seed() + 302);
  harness::Case c;
  c.spec.H = 32;
  c.spec.I = 16;
  c.spec.E = 4;
  c.spec.K = 2;
  c.max_tokens = 3;
  c.tokens = {3};
  c.skip_mode = EP_MOE_SKIP_WEIGHT_ZERO;
  const ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  ep_moe_layer_t* l = loaded_rank_layer(c, w, 2, 1);
  std::vector<float> gate(static_cast<size_t>(c.spec.I * c.spec.H), 0.25f);
  gate[5] = std::numeric_limits<float>::quiet_NaN();
  int32_t stored = 0;
  REQUIRE(ep_moe_layer_set_weight(&stored, l, EP_MOE_WEIGHT_EXPERT_GATE, 2, gate.data(), EP_MOE_DTYPE_F32, c.spec.I,
                                  c.spec.H) == EP_MOE_OK);
  REQUIRE(stored == 1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> hidden(static_cast<size_t>(3 * c.spec.H)), out(hidden.size(), 42.0f);
  for (auto& x : hidden) x = n(rng);
  // Token 0 chose experts 0 and 1 (both parked here), token 1 experts 2 and
  // 3, token 2 experts 0 and 3.
  const std::vector<int32_t> ids = {0, 1, 2, 3, 0, 3};
  const std::vector<float> wts = {0.6f, 0.4f, 0.5f, 0.5f, 0.7f, 0.3f};
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = 3;
  a.hidden = hidden.data();
  a.topk_ids = ids.data();
  a.topk_weights = wts.data();
  a.out = out.data();
  REQUIRE(ep_moe_layer_forward(l, &a) == EP_MOE_OK);
  const int64_t H = c.spec.H;
  for (int64_t j = 0; j < H; ++j) {
    CAPTURE(j);
    CHECK(out[static_cast<size_t>(j)] == 0.0f);                 // no pair of its own here
    CHECK(std::isnan(out[static_cast<size_t>(H + j)]));         // chose the NaN expert
    CHECK(std::isfinite(out[static_cast<size_t>(2 * H + j)]));  // expert 3's share only
  }
  ep_moe_layer_destroy(l);
}

// The MoE layer forward pass across in-process EP/DP ranks, through the C
// API, against the double-precision dense reference.
#include <cstring>

#include "../common/seed.hpp"
#include "harness.hpp"

using harness::Case;

namespace {

std::mt19937& rng() {
  static std::mt19937 g(test_seed());
  return g;
}

// Uneven token counts per replica, including 0 and 1.
std::vector<int> uneven_tokens(int dp, int variant, int max_tokens) {
  static const int patterns[][4] = {{5, 0, 3, 1}, {1, 7, 0, 2}, {0, 0, 4, 9}, {9, 1, 1, 0}, {3, 5, 2, 7}};
  std::vector<int> t;
  for (int d = 0; d < dp; ++d) t.push_back(std::min(max_tokens, patterns[variant % 5][d % 4] + (d / 4)));
  if (dp == 1) t[0] = std::min(max_tokens, std::max(t[0], 1) + variant);  // non-DP: some tokens
  return t;
}

}  // namespace

TEST_CASE("forward matches the dense reference across EP, DP, placement and dtypes", "[forward][matrix]") {
  int variant = 0;
  double worst = 0;
  for (int ep : {1, 2, 3, 4, 8}) {
    for (int dp : {1, 2, 4}) {
      if (dp > ep || ep % dp != 0) continue;
      for (int placement : {EP_MOE_PLACEMENT_LINEAR, EP_MOE_PLACEMENT_ROUND_ROBIN}) {
        if (placement == EP_MOE_PLACEMENT_ROUND_ROBIN && ep == 1) continue;
        Case c;
        c.ep = ep;
        c.dp = dp;
        c.placement = placement;
        // Sizes off the kernels' tile multiples; E not divisible by EP.
        c.spec.H = 40 + 8 * (variant % 3);
        c.spec.I = 24 + 5 * (variant % 4);
        const int experts_for_ep[] = {0, 10, 15, 20, 30, 0, 0, 0, 36};  // never a multiple of ep (> 1)
        c.spec.E = experts_for_ep[ep];
        const int ks[] = {1, 2, 8};
        c.spec.K = std::min(ks[variant % 3], c.spec.E);
        c.spec.act = variant % 3;
        if (placement == EP_MOE_PLACEMENT_ROUND_ROBIN) {  // round robin needs expert groups
          c.spec.groups = c.spec.E % 2 == 0 ? 2 : 3;
          c.spec.topk_group = std::max(1, c.spec.groups - 1);
        }
        c.spec.Is = variant % 2 ? 20 + variant : 0;
        c.spec.shared_gate = c.spec.Is > 0 && variant % 4 == 1;
        const int dts[][2] = {{ref::F32, ref::F32},  {ref::BF16, ref::BF16}, {ref::F16, ref::F16},
                              {ref::BF16, ref::F32}, {ref::F32, ref::BF16},  {ref::F16, ref::BF16}};
        c.wdt = dts[variant % 6][0];
        c.adt = dts[variant % 6][1];
        c.given_topk = variant % 5 == 2;
        c.fused_gate_up = variant % 3 == 1;
        c.dp_same_handle = variant % 2 == 0;
        c.all_decode = variant % 4 == 3;
        c.tokens = uneven_tokens(dp, variant, c.max_tokens);
        c.forwards = 2;
        ++variant;
        harness::run_case(c, rng(), &worst);
      }
    }
  }
  WARN("worst relative error over the matrix: " << worst);
}

TEST_CASE("routing variants: sigmoid, bias, grouped top-k, no renormalisation, scaling", "[forward][routing]") {
  struct R {
    bool sigmoid, bias, renorm;
    int groups, topk_group;
    double scale;
  };
  const R rs[] = {{true, true, true, 4, 2, 2.5},     // DeepSeek-V3 style
                  {false, false, false, 0, 0, 1.0},  // no renormalisation
                  {false, false, true, 4, 1, 1.0},   // DeepSeek-V2 style group max
                  {true, false, true, 0, 0, 0.5},
                  {false, true, true, 0, 0, 1.0}};
  for (const R& r : rs) {
    for (int ep : {1, 4}) {
      Case c;
      c.ep = ep;
      c.spec.H = 48;
      c.spec.I = 20;
      c.spec.E = 16;
      c.spec.K = 4;
      c.spec.sigmoid = r.sigmoid;
      c.spec.use_bias = r.bias;
      c.spec.renormalize = r.renorm;
      c.spec.groups = r.groups;
      c.spec.topk_group = r.topk_group;
      c.spec.scale = r.scale;
      c.spec.Is = 16;
      c.tokens = {7};
      harness::run_case(c, rng());
    }
  }
}

TEST_CASE("DP gather modes follow seed 001: padded for prefill/graph/mixed, compact when all decode", "[forward][dp]") {
  struct M {
    bool decode, prefill, graph;
    int expect_gather;  // 1 padded, 2 compact
  };
  const M ms[] = {{true, false, false, 2}, {false, false, false, 1}, {true, true, false, 1}, {true, false, true, 1}};
  for (const M& m : ms) {
    for (bool same : {true, false}) {
      Case c;
      c.ep = 4;
      c.dp = 4;
      c.dp_same_handle = same;
      c.spec.H = 32;
      c.spec.I = 16;
      c.spec.E = 12;
      c.spec.K = 2;
      c.spec.Is = 8;
      c.all_decode = m.decode;
      c.is_prefill = m.prefill;
      c.is_graph = m.graph;
      c.tokens = {3, 0, 1, 6};
      const auto res = harness::run_case(c, rng());
      for (const auto& r : res) CHECK(r.gather == m.expect_gather);
    }
  }
  // DP 2 inside EP 4 (attention TP 2 per replica): gathered over a split group.
  Case c;
  c.ep = 4;
  c.dp = 2;
  c.spec.H = 32;
  c.spec.I = 16;
  c.spec.E = 12;
  c.spec.K = 3;
  c.tokens = {0, 5};
  c.all_decode = true;
  harness::run_case(c, rng());
}

TEST_CASE("bf16 rows read in place: DP gathers, shared expert with its gate, odd row strides", "[forward][dp][bf16]") {
  // bf16 weights and activations: on AVX512_BF16 the experts and the
  // shared gate read the gathered rows where they arrived (row stride
  // H*2 + K*8 bytes, here not a multiple of 4 elements); elsewhere the
  // widening path runs. Both must match the reference.
  for (int dp : {2, 4}) {
    for (bool decode : {false, true}) {
      Case c;
      c.ep = 4;
      c.dp = dp;
      c.wdt = ref::BF16;
      c.adt = ref::BF16;
      c.spec.H = 41;
      c.spec.I = 19;
      c.spec.E = 10;
      c.spec.K = 3;
      c.spec.Is = 14;
      c.spec.shared_gate = true;
      c.all_decode = decode;
      c.tokens = dp == 2 ? std::vector<int>{0, 7} : std::vector<int>{5, 0, 2, 9};
      harness::run_case(c, rng());
    }
  }
}

TEST_CASE("zero tokens on every rank, and at max_tokens", "[forward][edge]") {
  for (int ep : {1, 3, 4}) {
    Case c;
    c.ep = ep;
    c.dp = ep == 4 ? 4 : 1;
    c.spec.H = 32;
    c.spec.I = 16;
    c.spec.E = 9;
    c.spec.K = 2;
    c.spec.Is = 12;
    c.tokens.assign(static_cast<size_t>(c.dp), 0);
    harness::run_case(c, rng());
    c.tokens.assign(static_cast<size_t>(c.dp), c.max_tokens);
    harness::run_case(c, rng());
  }
}

TEST_CASE("token skip computes each pair exactly once; weight-0 computes every pair on every rank", "[forward][skip]") {
  for (int mode : {EP_MOE_SKIP_TOKENS, EP_MOE_SKIP_WEIGHT_ZERO}) {
    Case c;
    c.ep = 4;
    c.skip_mode = mode;
    c.spec.H = 32;
    c.spec.I = 16;
    c.spec.E = 16;
    c.spec.K = 4;
    c.tokens = {11};
    const auto res = harness::run_case(c, rng());
    int64_t pairs = 0, skipped = 0;
    for (const auto& r : res) {
      pairs += r.local_pairs;
      skipped += r.skipped;
      CHECK(r.tokens == 11);
      if (mode == EP_MOE_SKIP_WEIGHT_ZERO) {
        CHECK(r.local_pairs == 11 * 4);
        CHECK(r.skipped == 0);
      }
    }
    if (mode == EP_MOE_SKIP_TOKENS) {
      CHECK(pairs == 11 * 4);
      CHECK(skipped == 11 * 4 * 3);
    }
  }
}

TEST_CASE("the result does not depend on the EP size", "[forward][invariance]") {
  // Same weights and inputs (same seed) at EP 1, 2, 4 and 8: outputs agree.
  std::vector<std::vector<float>> outs;
  const uint32_t seed = rng()();
  for (int ep : {1, 2, 4, 8}) {
    Case c;
    c.ep = ep;
    c.spec.H = 40;
    c.spec.I = 24;
    c.spec.E = 24;
    c.spec.K = 3;
    c.spec.Is = 16;
    c.tokens = {9};
    std::mt19937 g(seed);
    outs.push_back(harness::run_case(c, g).back().out);
  }
  for (size_t i = 1; i < outs.size(); ++i) {
    REQUIRE(outs[i].size() == outs[0].size());
    double err = 0, scale = 1e-6;
    for (size_t j = 0; j < outs[0].size(); ++j) {
      err = std::max(err, static_cast<double>(std::fabs(outs[i][j] - outs[0][j])));
      scale = std::max(scale, static_cast<double>(std::fabs(outs[0][j])));
    }
    CHECK(err / scale <= 1e-5);
  }
}

TEST_CASE("kernels: every CPU ISA path and several threads agree with the reference", "[forward][isa]") {
  // EP_MOE_CPU_ISA lowers the kernels the layer picks at create time.
  // bf16 weights with bf16 activations take the pair-dot tiles where the CPU
  // has AVX512_BF16; odd H and I exercise their odd-k tails.
  for (int isa_i = 0; isa_i < 4; ++isa_i) {
    const char* isa = harness::kIsaNames[isa_i];
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (int variant = 0; variant < 5; ++variant) {
      const int wdt = variant == 0 ? ref::F32 : variant == 2 ? ref::F16 : ref::BF16;
      Case c;
      c.ep = 2;
      c.threads = 3;
      c.wdt = wdt;
      c.adt = variant >= 3 ? ref::BF16 : ref::F32;
      c.spec.H = variant == 4 ? 71 : 70;
      c.spec.I = 37;
      c.spec.E = 6;
      c.spec.K = 2;
      c.spec.Is = 29;
      c.max_tokens = 40;
      c.tokens = {37};
      if (harness::isa_skipped(harness::run_case(c, rng()), isa_i)) break;
    }
  }
  unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE(
    "experts with more rows than one kernel call (a prefill batch) match the reference, the same bits on 1 and 3 "
    "threads",
    "[forward][prefill]") {
  // ~100 rows a routed expert and 200 for the shared one: the expert path
  // cuts them into calls of 64 rows (the last one 8), and the down
  // projection of such a segment over a claim of small panels goes row
  // block by row block, a scatter of several panels at a time; H = 200 is
  // 12.5 panels of 16 (8 of 32), so runs and the last panel end in a tail.
  for (int isa_i = 0; isa_i < 4; ++isa_i) {
    const char* isa = harness::kIsaNames[isa_i];
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (int variant = 0; variant < 4; ++variant) {
      Case c;
      c.ep = variant % 2 ? 2 : 1;
      c.wdt = variant == 0 ? ref::F32 : variant == 2 ? ref::F16 : ref::BF16;
      c.adt = variant == 3 ? ref::BF16 : ref::F32;
      c.spec.H = 200;
      c.spec.I = 24;
      c.spec.E = 4;
      c.spec.K = 2;
      c.spec.Is = 20;
      c.spec.shared_gate = variant == 1;
      c.max_tokens = 200;
      c.tokens = {200};
      std::mt19937 r1 = rng();
      std::mt19937 r3 = r1;  // the same weights and inputs for both thread counts
      rng().discard(1);
      c.threads = 1;
      const auto one = harness::run_case(c, r1);
      if (harness::isa_skipped(one, isa_i)) break;
      c.threads = 3;
      const auto three = harness::run_case(c, r3);
      REQUIRE(one.size() == three.size());
      size_t compared = 0;
      for (size_t r = 0; r < one.size(); ++r) {
        INFO("isa " << isa << " variant " << variant << " rank " << r);
        REQUIRE(one[r].out.size() == three[r].out.size());
        if (one[r].out.empty()) continue;  // (memcmp of no bytes may not be given null pointers)
        CHECK(std::memcmp(one[r].out.data(), three[r].out.data(), one[r].out.size() * sizeof(float)) == 0);
        compared += one[r].out.size();
      }
      CHECK(compared >= static_cast<size_t>(200 * c.spec.H));
    }
  }
  unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("redundant replicas: each pair goes to one replica and the output is unchanged", "[forward][replicas]") {
  for (int ep : {2, 3, 4}) {
    for (int redundant : {1, 5}) {
      Case c;
      c.ep = ep;
      c.redundant = redundant;
      c.spec.H = 32;
      c.spec.I = 16;
      c.spec.E = 10;
      c.spec.K = 3;
      c.spec.Is = 8;
      c.tokens = {13};
      const auto res = harness::run_case(c, rng());
      int64_t pairs = 0;
      for (const auto& r : res) pairs += r.local_pairs;
      CHECK(pairs == 13 * 3);  // computed once, not once per replica
    }
  }
  // A custom table whose last rank holds only replicas (of experts 0 and 5);
  // ranks hold 3, 3 and 2 slots.
  Case c;
  c.ep = 3;
  c.placement = EP_MOE_PLACEMENT_CUSTOM;
  c.custom_slots = {0, 1, 2, 3, 4, 5, 0, 5};
  c.spec.H = 32;
  c.spec.I = 16;
  c.spec.E = 6;
  c.spec.K = 2;
  // 64 tokens, not 15: with ~10 pairs on experts 0 and 5, all of them fell
  // on the other replicas for about one seed in a thousand (seed 3277313883
  // did), and the check below failed by chance; with ~40 pairs it cannot
  // in practice (~1e-12).
  c.max_tokens = 64;
  c.tokens = {64};
  const auto res = harness::run_case(c, rng());
  int64_t pairs = 0;
  for (const auto& r : res) pairs += r.local_pairs;
  CHECK(pairs == 64 * 2);
  // Replicas share the load: the rank holding only replicas computed pairs too.
  for (const auto& r : res) CHECK(r.local_pairs > 0);
}

TEST_CASE("all-to-all and auto dispatch match the reference (and so the all-gather flow)", "[forward][alltoall]") {
  int variant = 0;
  for (int ep : {2, 3, 4, 8}) {
    for (int dp : {1, ep}) {
      for (int dispatch : {EP_MOE_DISPATCH_ALLTOALL, EP_MOE_DISPATCH_AUTO}) {
        Case c;
        c.ep = ep;
        c.dp = dp;
        c.dispatch = dispatch;
        // Some rows wider than the combine's 64-column vector blocks, with a tail.
        c.spec.H = variant % 4 == 3 ? 136 : 40 + 8 * (variant % 2);
        c.spec.I = 24;
        c.spec.E = 3 * ep + 1;
        c.spec.K = variant % 3 == 0 ? 1 : variant % 3 == 1 ? 2 : std::min(8, c.spec.E);
        c.spec.Is = variant % 2 ? 20 : 0;
        c.spec.shared_gate = c.spec.Is > 0 && variant % 4 == 1;
        const int dts[][2] = {{ref::F32, ref::F32}, {ref::BF16, ref::BF16}, {ref::F16, ref::F32}};
        c.wdt = dts[variant % 3][0];
        c.adt = dts[variant % 3][1];
        c.redundant = variant % 4 == 2 ? ep : 0;  // replicas: local ones are preferred
        c.given_topk = variant % 5 == 3;
        c.all_decode = variant % 2 == 0;
        c.tokens = uneven_tokens(dp, variant, c.max_tokens);
        c.forwards = 2;
        ++variant;
        const auto res = harness::run_case(c, rng());
        for (const auto& r : res) {
          if (dispatch == EP_MOE_DISPATCH_ALLTOALL) CHECK(r.dispatch == EP_MOE_DISPATCH_ALLTOALL);
          else CHECK((r.dispatch == EP_MOE_DISPATCH_ALLTOALL || r.dispatch == EP_MOE_DISPATCH_ALLGATHER));
          CHECK(r.dispatch == res[0].dispatch);  // every rank made the same choice
        }
      }
    }
  }
}

TEST_CASE("all-to-all: each token row crosses once per owning rank; auto prefers it for sparse DP decode",
          "[forward][alltoall]") {
  // DP == EP == 4, 8 experts (2 per rank), top-1: a token goes to one rank.
  Case c;
  c.ep = 4;
  c.dp = 4;
  c.spec.H = 64;
  c.spec.I = 16;
  c.spec.E = 8;
  c.spec.K = 1;
  c.all_decode = true;
  c.tokens = {2, 0, 1, 3};
  c.dispatch = EP_MOE_DISPATCH_AUTO;
  const auto res = harness::run_case(c, rng());
  int64_t rows = 0;
  for (const auto& r : res) rows += r.tokens;  // rows received by each rank
  CHECK(rows == 6);                            // every token exactly once (top-1)
  for (const auto& r : res) CHECK(r.dispatch == EP_MOE_DISPATCH_ALLTOALL);
  // Every rank holds a replica of every expert: the local one is preferred,
  // so no row leaves its rank.
  Case rep = c;
  rep.spec.E = 4;
  rep.redundant = 12;
  rep.dispatch = EP_MOE_DISPATCH_ALLTOALL;
  rep.tokens = {3, 1, 0, 2};
  const auto res_rep = harness::run_case(rep, rng());
  for (int r = 0; r < 4; ++r) CHECK(res_rep[static_cast<size_t>(r)].tokens == rep.tokens[static_cast<size_t>(r)]);
  // Non-DP (the same tokens everywhere): the all-gather flow moves less.
  c.dp = 1;
  c.tokens = {6};
  const auto res2 = harness::run_case(c, rng());
  for (const auto& r : res2) CHECK(r.dispatch == EP_MOE_DISPATCH_ALLGATHER);
}

TEST_CASE("GPT-OSS experts: gate/up/down biases and the clamped SwiGLU, every ISA path, EP, DP, dispatch, replicas",
          "[forward][bias]") {
  // Gate/up weights are drawn 4x larger for EP_MOE_ACT_SWIGLU_OAI, so that
  // the clamp at 7 is reached. The variants cover the expert path's phases:
  // decode rows (gemv), a few rows (gemm runs), prefill rows beyond one
  // kernel call in row-block and panel order (H 512, I 640 on one thread:
  // claims of 16 down panels above the row-block bytes).
  for (int isa_i = 0; isa_i < 4; ++isa_i) {
    const char* isa = harness::kIsaNames[isa_i];
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (int variant = 0; variant < 8; ++variant) {
      INFO("isa " << isa << " variant " << variant);
      Case c;
      c.spec.act = variant == 7 ? ref::SILU : ref::SWIGLU_OAI;  // biases with another activation too
      c.spec.expert_bias = true;
      c.spec.H = 40 + 3 * variant;
      c.spec.I = 20 + variant;
      c.spec.E = 12;
      c.spec.K = 3;
      c.ep = 1 + variant % 4;
      c.wdt = variant % 3 == 1 ? ref::BF16 : variant % 3 == 2 ? ref::F16 : ref::F32;
      c.adt = variant == 4 ? ref::BF16 : ref::F32;
      c.fused_gate_up = variant % 2 == 1;
      c.spec.Is = variant == 2 ? 16 : 0;  // a shared expert without biases beside biased routed ones
      c.max_tokens = 16;
      c.tokens = {variant == 0 ? 1 : 9};
      if (variant == 3) {  // DP attention, uneven, a zero-token rank
        c.dp = 4;
        c.tokens = {0, 5, 16, 3};
      }
      if (variant == 5) {  // all-to-all, every rank its own replica
        c.dp = c.ep;
        c.dispatch = EP_MOE_DISPATCH_ALLTOALL;
        c.tokens = {4, 0};
      }
      if (variant == 6) {  // redundant replicas; weight-0 skip computes foreign pairs with weight 0
        c.redundant = 3;
        c.skip_mode = EP_MOE_SKIP_WEIGHT_ZERO;
      }
      if (variant == 1) {  // prefill rows: one thread, wide layer
        c.spec.H = 512;
        c.spec.I = 640;
        c.spec.E = 2;
        c.spec.K = 2;
        c.threads = 1;
        c.max_tokens = 100;
        c.tokens = {100};
      }
      if (harness::isa_skipped(harness::run_case(c, rng()), isa_i)) break;
    }
  }
  unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("GGUF block-format experts: every type and mix, every ISA path, EP, DP, dispatch, replicas, prefill rows",
          "[forward][quant]") {
  // Routed experts given as random valid blocks (tests/common/reference_quant.hpp
  // decodes them independently); the reference quantizes the activations of
  // those experts as the kernels state. The variants cover each type for
  // gate/up and for down (mixes as Q4_K_M files have them), weight_dtype a
  // float type (blocks kept as given) or a block format, decode rows,
  // prefill rows beyond one kernel call, DP with a zero-token rank,
  // all-to-all, replicas with weight-0 skip, a float shared expert beside
  // them, and bf16 activations.
  const int types[] = {refq::Q8_0, refq::Q4_0, refq::Q4_K, refq::Q5_K, refq::Q6_K, refq::IQ4_XS, refq::MXFP4};
  for (int isa_i = 0; isa_i < 4; ++isa_i) {
    const char* isa = harness::kIsaNames[isa_i];
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (int variant = 0; variant < 9; ++variant) {
      INFO("isa " << isa << " variant " << variant);
      Case c;
      c.qgu = types[variant % 7];
      c.qdown = variant == 7 ? refq::Q6_K : variant == 8 ? refq::Q8_0 : c.qgu;  // Q4_K_M-like mixes
      if (variant == 8) c.qgu = refq::Q4_K;
      c.spec.H = 256 + 256 * (variant % 2);
      c.spec.I = 256;
      c.spec.E = 10;
      c.spec.K = 3;
      c.ep = 1 + variant % 4;
      c.wdt = variant % 3 == 1 ? ref::BF16 : ref::F32;
      c.layer_wdt = variant == 5 ? refq::Q4_K : -1;  // a block-format weight_dtype: blocks of other types still kept
      c.adt = variant == 4 ? ref::BF16 : ref::F32;
      c.fused_gate_up = variant % 2 == 1;
      c.spec.Is = variant == 2 ? 64 : 0;  // a float shared expert beside block-format routed ones
      c.spec.shared_gate = variant == 2;
      c.max_tokens = 16;
      c.tokens = {variant == 0 ? 1 : 9};
      if (variant == 3) {  // DP attention, uneven, a zero-token rank
        c.dp = 4;
        c.tokens = {0, 5, 16, 3};
      }
      if (variant == 5) {  // all-to-all, every rank its own replica
        c.dp = c.ep;
        c.dispatch = EP_MOE_DISPATCH_ALLTOALL;
        c.tokens = std::vector<int>(static_cast<size_t>(c.ep), 3);
        c.tokens[0] = 0;
      }
      if (variant == 6) {  // redundant replicas; weight-0 skip computes foreign pairs with weight 0
        c.redundant = 3;
        c.skip_mode = EP_MOE_SKIP_WEIGHT_ZERO;
      }
      if (variant == 1) {  // prefill rows: one thread, more rows than one kernel call
        c.spec.E = 2;
        c.spec.K = 2;
        c.threads = 1;
        c.max_tokens = 100;
        c.tokens = {100};
      }
      double worst = 0;
      if (harness::isa_skipped(harness::run_case(c, rng(), &worst), isa_i)) break;
      WARN("block formats " << c.qgu << "/" << c.qdown << " " << isa << " variant " << variant << ": max error "
                            << worst);
    }
  }
  unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("GGUF block-format experts in prefill: interleaved-row kernels or int8 tiles, each format and mix",
          "[forward][quant]") {
  // Experts with many rows in a chunk (prefill): the interleaved-row
  // kernels over several calls of rows (AVX2, and the AVX-512 tables
  // without AVX512_VNNI) and with AVX512_VNNI the int8 tiles
  // (Kernels::qtile_rows: every format; on AVX2 Q5_K and Q6_K), against the reference with the
  // activations quantized as stated, on every ISA path: gate/up and down
  // in different formats (mixes), an expert's rows past one kernel call, a
  // block-format shared expert over every token (rows past one kernel call
  // in down's panel-by-panel order), DP with uneven tokens, bf16
  // activations, two threads, fresh inputs a second forward.
  const int types[] = {refq::Q8_0, refq::Q4_0, refq::MXFP4, refq::IQ4_XS};
  for (int isa_i = 0; isa_i < 4; ++isa_i) {
    const char* isa = harness::kIsaNames[isa_i];
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (int variant = 0; variant < 9; ++variant) {
      INFO("isa " << isa << " variant " << variant);
      Case c;
      c.qgu = c.qdown = types[variant % 4];
      if (variant == 4) c.qgu = refq::Q4_K;    // Q4_K gate/up, Q8_0 down
      if (variant == 5) c.qdown = refq::Q6_K;  // Q4_0 gate/up, Q6_K down
      if (variant == 8) {                      // Q5_K gate/up, Q6_K down (both on AVX2's tiles)
        c.qgu = refq::Q5_K;
        c.qdown = refq::Q6_K;
      }
      c.spec.H = variant == 3 ? 512 : 256;
      c.spec.I = 256;
      c.spec.E = 4;
      c.spec.K = 2;
      c.ep = 1 + variant % 2;
      c.threads = 2;
      // 160 tokens, top-2 of 4 experts: ~80 rows an expert, past every
      // format's qtile_rows (64 at most).
      c.max_tokens = 160;
      c.tokens = {160};
      c.forwards = 2;
      c.fused_gate_up = variant == 2;
      if (variant == 6) {  // a Q8_0 shared expert over every token beside them
        c.spec.Is = 256;
        c.qsgu = c.qsdown = refq::Q8_0;
      }
      if (variant == 7) {  // DP attention, uneven, bf16 activations
        c.dp = 2;
        c.tokens = {110, 50};
        c.adt = ref::BF16;
      }
      double worst = 0;
      if (harness::isa_skipped(harness::run_case(c, rng(), &worst), isa_i)) break;
      WARN("prefill " << c.qgu << "/" << c.qdown << " " << isa << " variant " << variant << ": max error " << worst);
    }
  }
  unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("GGUF block-format shared expert: kept as blocks where its shard is whole blocks, else dequantized",
          "[forward][quant]") {
  // The shared expert given as blocks (a Q4_K_M-like mix of formats,
  // Q8_0, gate and up in two formats), beside block-format routed experts:
  // its gate/up blocks are kept (when in one format), its down blocks where this rank's column shard
  // is whole blocks (the reference then quantizes its input as the kernels
  // state), else dequantized. Kept, the layer holds a fraction of the f32
  // bytes of the shared expert.
  for (int variant = 0; variant < 7; ++variant) {
    INFO("variant " << variant);
    Case c;
    c.qgu = refq::Q4_K;
    c.qdown = refq::Q6_K;
    c.qsgu = variant == 3 ? refq::Q8_0 : refq::Q4_K;
    c.qsdown = variant == 3 ? refq::Q8_0 : refq::Q6_K;
    c.spec.H = 256;
    c.spec.I = 256;
    c.spec.E = 6;
    c.spec.K = 2;
    c.spec.Is = 1024;
    c.spec.shared_gate = variant % 2 == 0;
    c.ep = 1 + variant % 3;  // shards 1024, 512, 342/341/341 (all-gather)
    c.fused_gate_up = variant == 1;
    c.tokens = {variant == 4 ? 1 : 11};
    if (variant == 4) c.qsdown = 0;  // floats beside blocks
    // variant 2: shards of 342/341/341 columns, not whole blocks: dequantized
    if (variant == 6) c.qsup = refq::Q8_0;  // gate and up in two formats: both held dequantized (f32 here)
    if (variant == 5) {                     // all-to-all: every rank the whole shared expert
      c.dp = c.ep;
      c.dispatch = EP_MOE_DISPATCH_ALLTOALL;
      c.tokens = {4, 0, 7};
    }
    double worst = 0;
    const auto res = harness::run_case(c, rng(), &worst);
    WARN("shared expert " << c.qsgu << "/" << c.qsdown << " ep " << c.ep << ": max error " << worst);
    // Every routed expert in its blocks, the router and the small vectors:
    // above what any rank holds beside its shared shard.
    const int64_t H = c.spec.H, I = c.spec.I, Is = c.spec.Is;
    const int64_t others = c.spec.E * (2 * I * H / 256 * 144 + H * I / 256 * 210) + c.spec.E * H * 4 + 65536;
    const bool split = c.dispatch == EP_MOE_DISPATCH_ALLGATHER;
    const int64_t shard_f32 = 3 * (split ? Is / c.ep : Is) * H * 4;  // this rank's shard in f32
    for (const auto& r : res) {
      INFO("weight bytes " << r.weight_bytes << ", the shard in f32 " << shard_f32 << ", the rest below " << others);
      if (c.qsdown && !c.qsup && (c.ep != 3 || !split)) CHECK(r.weight_bytes < others + shard_f32 / 2);
      if (c.qsup) CHECK(r.weight_bytes > 2 * shard_f32 / 3);  // gate and up in f32
    }
  }
}

TEST_CASE("GGUF block-format experts: the error is the int8 activations' as stated, not a bug", "[forward][quant]") {
  // The same layer and inputs against two references: one that quantizes
  // the block-format experts' activations as the kernels state (the
  // tolerance), one that keeps them in float. The second is far off (the
  // 8-bit activations' own error, about a hundredth), the first within f32
  // rounding (an h element on a rounding boundary allowed its one step):
  // without the stated activation quantization, or with another one, the
  // first would be off by as much as the second.
  const int types[] = {refq::Q8_0,   refq::Q4_0,  refq::Q4_K,    refq::Q5_K,  refq::Q6_K,  refq::IQ4_XS, refq::MXFP4,
                       refq::Q2_K,   refq::Q3_K,  refq::Q4_1,    refq::Q5_0,  refq::Q5_1,  refq::IQ4_NL, refq::IQ2_XXS,
                       refq::IQ2_XS, refq::IQ2_S, refq::IQ3_XXS, refq::IQ3_S, refq::IQ1_S, refq::IQ1_M};
  for (int t : types) {
    double err_q = 0, err_f = 0;
    for (bool float_acts : {false, true}) {
      std::mt19937 g(test_seed() + static_cast<unsigned>(t));  // the same weights and inputs for both
      Case c;
      c.qgu = c.qdown = t;
      c.spec.H = 512;
      c.spec.I = 256;
      c.spec.E = 8;
      c.spec.K = 2;
      c.ep = 2;
      c.tokens = {12};
      c.ref_float_acts = float_acts;
      c.tol = float_acts ? 1.0 : -1;
      harness::run_case(c, g, float_acts ? &err_f : &err_q);
    }
    INFO("type " << t << ": error against the stated int8 activations " << err_q << ", against float activations "
                 << err_f);
    CHECK(err_f > 100 * harness::tolerance(ref::F32, ref::F32, true));
    // The 8-bit activations' error is a hundredth or two here, not a
    // mismatch (a wrong expert or block is of the order of the output).
    // The K formats' activation blocks of 256 take their step from the
    // largest of 256 values, so their error has about twice the tail of
    // Q8_0's blocks of 32 (docs/quantization.md, Tolerances).
    CHECK(err_f < (refq::act_block(t) == 256 ? 0.1 : 0.05));
  }
}

TEST_CASE("GGUF block formats against the unquantized layer: each format's own error, in its order",
          "[forward][quant]") {
  // Float weights given to a layer whose weight_dtype is a block format
  // (routed and shared experts quantized by ep_moe's quantizers), against
  // the float reference of the same weights: the whole quantization error
  // of weights and activations.
  // Each format within its bound (docs/quantization.md: 1.5x the largest
  // of 101 seeds; the largest element error is heavy-tailed, about 1.4x its
  // median at the 99th percentile), and more bits never worse than fewer by
  // much: Q8_0 < Q6_K < Q5_K < Q4_K.
  const int types[] = {refq::Q8_0, refq::Q6_K, refq::Q5_K, refq::Q4_K, refq::IQ4_XS, refq::Q4_0, refq::MXFP4};
  const double bound[] = {0.03, 0.1, 0.16, 0.28, 0.28, 0.32, 0.42};
  double err[7] = {};
  for (int i = 0; i < 7; ++i) {
    std::mt19937 g(test_seed() + 77);  // the same weights and inputs for every format
    Case c;
    c.layer_wdt = types[i];
    c.spec.H = 512;
    c.spec.I = 256;
    c.spec.E = 8;
    c.spec.K = 2;
    c.spec.Is = 512;  // a shard of 256 on each rank: whole blocks, quantized too
    c.ep = 2;
    c.tokens = {12};
    c.tol = bound[i];
    const auto res = harness::run_case(c, g, &err[i]);
    WARN("format " << types[i] << " against the unquantized layer: max error " << err[i]);
    // Held as blocks, the shared shard too: below the routed blocks, the
    // router and half the shard in f32.
    const double bpw = static_cast<double>(refq::block_bytes(types[i])) / refq::block_elems(types[i]);
    const double H = c.spec.H, I = c.spec.I;
    const double shard_f32 = 3 * 256 * H * 4, others = 4 * 3 * I * H * bpw + c.spec.E * H * 4 + 65536;
    for (const auto& r : res) CHECK(static_cast<double>(r.weight_bytes) < others + shard_f32 / 2);
  }
  CHECK(err[0] < err[1]);
  CHECK(err[1] < err[2]);
  CHECK(err[2] < err[3]);
}

TEST_CASE("GGUF low-bit experts (Q2_K ... IQ1_M): every type, every ISA path, mixes as dynamic quants lay them out",
          "[forward][quant]") {
  // The formats computed through their decoded form (random valid blocks;
  // tests/common/reference_quant.hpp), each as gate/up with a down of
  // another type the way "dynamic" GGUF quants mix them (DeepSeek-R1
  // UD-Q2_K_XL: Q2_K/Q3_K; UD-IQ2_XXS: IQ2_XXS/Q3_K; Qwen3-235B UD-IQ1_S:
  // IQ1_S/IQ1_M/IQ2_XS), against the reference with the activations
  // quantized as stated: decode and prefill rows, EP 1-4, DP with a
  // zero-token rank, all-to-all, replicas with weight-0 skip, a
  // block-format weight_dtype, bf16 activations.
  const int gate_up[] = {refq::Q2_K,   refq::Q3_K,    refq::Q4_1,   refq::Q5_0,  refq::Q5_1,
                         refq::IQ4_NL, refq::IQ2_XXS, refq::IQ2_XS, refq::IQ2_S, refq::IQ3_XXS,
                         refq::IQ3_S,  refq::IQ1_S,   refq::IQ1_M};
  const int down[] = {refq::Q3_K,  refq::Q2_K,   refq::Q5_0,  refq::Q4_1,    refq::IQ4_NL, refq::Q5_1, refq::Q3_K,
                      refq::IQ2_S, refq::IQ2_XS, refq::IQ3_S, refq::IQ3_XXS, refq::IQ1_M,  refq::IQ1_S};
  for (int isa_i = 0; isa_i < 4; ++isa_i) {
    const char* isa = harness::kIsaNames[isa_i];
    setenv("EP_MOE_CPU_ISA", isa, 1);
    for (int v = 0; v < 13; ++v) {
      INFO("isa " << isa << " gate/up " << gate_up[v] << " down " << down[v]);
      Case c;
      c.qgu = gate_up[v];
      c.qdown = down[v];
      c.spec.H = 256 + 256 * (v % 2);
      c.spec.I = 256;
      c.spec.E = 10;
      c.spec.K = 3;
      c.ep = 1 + v % 4;
      c.wdt = v % 3 == 1 ? ref::BF16 : ref::F32;
      c.layer_wdt = v == 5 ? refq::IQ2_XXS : -1;  // a block-format weight_dtype: blocks of other types still kept
      c.adt = v == 4 ? ref::BF16 : ref::F32;
      c.fused_gate_up = v % 2 == 1;
      c.max_tokens = 16;
      c.tokens = {v % 5 == 0 ? 1 : 9};
      if (v % 5 == 3) {  // DP attention over 4 EP ranks, uneven, a zero-token rank
        c.ep = 4;
        c.dp = 4;
        c.tokens = {0, 5, 16, 3};
      }
      if (v == 6) {  // all-to-all, every rank its own replica
        c.dp = c.ep;
        c.dispatch = EP_MOE_DISPATCH_ALLTOALL;
        c.tokens = std::vector<int>(static_cast<size_t>(c.ep), 3);
        c.tokens[0] = 0;
      }
      if (v == 7) {  // redundant replicas; weight-0 skip computes foreign pairs with weight 0
        c.redundant = 3;
        c.skip_mode = EP_MOE_SKIP_WEIGHT_ZERO;
      }
      if (v % 4 == 1) {  // prefill rows: one thread, more rows than one kernel call
        c.spec.E = 2;
        c.spec.K = 2;
        c.threads = 1;
        c.max_tokens = 100;
        c.tokens = {100};
      }
      double worst = 0;
      if (harness::isa_skipped(harness::run_case(c, rng(), &worst), isa_i)) break;
    }
  }
  unsetenv("EP_MOE_CPU_ISA");
}

TEST_CASE("GGUF low-bit formats against the unquantized layer: each format's own error", "[forward][quant]") {
  // As above for the formats computed through their decoded form: float
  // weights quantized by ep_moe's quantizers (one scale per sub-block,
  // nearest level or grid point: no search for the best scales, so the
  // grid formats' error is above llama.cpp's), each within its bound
  // (docs/quantization.md: 1.5x the largest of 101 seeds), and the formats
  // of more bits per weight no worse than those of fewer in each family.
  const int types[] = {refq::Q5_1,    refq::Q5_0,  refq::Q4_1,   refq::IQ4_NL,  refq::Q3_K,  refq::Q2_K, refq::IQ3_S,
                       refq::IQ3_XXS, refq::IQ2_S, refq::IQ2_XS, refq::IQ2_XXS, refq::IQ1_M, refq::IQ1_S};
  const double bound[] = {0.135, 0.15, 0.27, 0.31, 0.54, 1.51, 0.65, 0.86, 1.26, 1.46, 1.3, 2.0, 2.66};
  double err[13] = {};
  for (int i = 0; i < 13; ++i) {
    std::mt19937 g(test_seed() + 78);  // the same weights and inputs for every format
    Case c;
    c.layer_wdt = types[i];
    c.spec.H = 512;
    c.spec.I = 256;
    c.spec.E = 8;
    c.spec.K = 2;
    c.ep = 2;
    c.tokens = {12};
    c.tol = bound[i];
    harness::run_case(c, g, &err[i]);
    WARN("format " << types[i] << " against the unquantized layer: max error " << err[i]);
  }
  // Orders that held in all of 101 seeds: 5 bits below 4 (Q5_1, Q5_0 <
  // Q4_1), Q3_K below Q2_K, the 3-bit grids' best below the 2-bit grids'
  // worst (IQ3_S, IQ3_XXS < IQ2_XXS), IQ2_XXS below IQ1_S.
  CHECK(err[0] < err[2]);
  CHECK(err[1] < err[2]);
  CHECK(err[4] < err[5]);
  CHECK(err[6] < err[10]);
  CHECK(err[7] < err[10]);
  CHECK(err[10] < err[12]);
}

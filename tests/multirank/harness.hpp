// Runs one MoE layer across in-process ranks through the public C API and
// compares every rank's output with the double-precision reference.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/reference_moe.hpp"
#include "../common/reference_quant.hpp"
#include "ep_moe/ep_moe.h"

namespace harness {

// Runs fn(rank) on `n` threads and joins them.
inline void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back(fn, r);
  for (auto& t : ts) t.join();
}

struct Case {
  ref::Spec spec;
  int ep = 1, dp = 1;
  bool dp_same_handle = true;  // dp == ep: pass the EP handle (reduce-scatter) or a split copy
  int placement = EP_MOE_PLACEMENT_LINEAR;
  int redundant = 0;                  // linear placement: redundant slots
  std::vector<int32_t> custom_slots;  // custom placement table (placement CUSTOM)
  int wdt = ref::F32, adt = ref::F32;
  // Routed experts' gate/up and down given in GGUF block formats
  // (ep_moe_dtype_t values; 0: in wdt), and the config's weight_dtype
  // (-1: wdt).
  int qgu = 0, qdown = 0, layer_wdt = -1;
  // The shared expert's gate/up and down likewise (0: in wdt), and its up
  // in another format than its gate (0: the same; not with fused_gate_up).
  int qsgu = 0, qsdown = 0, qsup = 0;
  bool quant() const { return qgu || qdown || qsgu || qsdown; }
  // The reference leaves the activations of block-format experts in float
  // (how far the kernels' int8 activations move the result), and a bound
  // that replaces the dtypes' tolerance (< 0: the tolerance).
  bool ref_float_acts = false;
  double tol = -1;
  bool given_topk = false;
  bool fused_gate_up = false;
  int skip_mode = EP_MOE_SKIP_TOKENS;
  int dispatch = EP_MOE_DISPATCH_ALLGATHER;
  int threads = 0;
  int max_tokens = 16;
  std::vector<int> tokens;  // per DP replica
  bool all_decode = false;  // dp_is_decode all set (compact gather unless graph/prefill)
  bool is_prefill = false, is_graph = false;
  int forwards = 1;  // forward calls on the same layers (fresh inputs each)
  // Makes the EP world's handles (default: in-process ranks) and a cleanup.
  std::function<void(int, std::vector<ep_moe_comm_t*>*, std::function<void()>*)> make_comms;

  std::string describe() const {
    std::ostringstream o;
    o << "ep=" << ep << " dp=" << dp << (dp > 1 && dp == ep ? (dp_same_handle ? "(same)" : "(split)") : "")
      << " place=" << placement << " redundant=" << redundant << " custom=" << custom_slots.size() << " H=" << spec.H
      << " I=" << spec.I << " E=" << spec.E << " K=" << spec.K << " act=" << spec.act << " wdt=" << wdt
      << " qgu=" << qgu << " qdown=" << qdown << " qsgu=" << qsgu << " qsdown=" << qsdown << " layer_wdt=" << layer_wdt
      << " adt=" << adt << " sigmoid=" << spec.sigmoid << " groups=" << spec.groups << "/" << spec.topk_group
      << " bias=" << spec.use_bias << " Is=" << spec.Is << " sgate=" << spec.shared_gate
      << " ebias=" << spec.expert_bias << " topk_given=" << given_topk << " fused=" << fused_gate_up
      << " skip=" << skip_mode << " dispatch=" << dispatch << " decode=" << all_decode << " prefill=" << is_prefill
      << " graph=" << is_graph << " tokens=[";
    for (size_t i = 0; i < tokens.size(); ++i) o << (i ? "," : "") << tokens[i];
    o << "]";
    return o.str();
  }
};

inline double tolerance(int adt, int wdt, bool quant = false) {
  if (adt == ref::BF16 || wdt == ref::BF16) return 1e-2;
  if (adt == ref::F16 || wdt == ref::F16) return 5e-3;
  // Block formats: the reference quantizes the activations as the kernels
  // do, so f32 accumulation is what is left; an h element on a rounding
  // boundary (f32 in the kernels, float64 here) may land one step apart,
  // which the reference's slack allows for that element's outputs alone.
  if (quant) return 1e-5;
  return 1e-4;
}

// Whether every rank's shard of the shared expert's down columns is whole
// blocks of the case's shared down format (the all-gather flow splits the
// intermediate over the EP ranks, the others keep it whole); the harness
// refuses cases where only some ranks' are.
inline bool shared_down_whole_blocks(const Case& c) {
  const int Is = c.spec.Is, qk = refq::block_elems(c.qsdown);
  if (c.dispatch != EP_MOE_DISPATCH_ALLGATHER) return Is % qk == 0;
  int whole = 0;
  for (int r = 0, start = 0; r < c.ep; ++r) {
    const int n = Is / c.ep + (r < Is % c.ep ? 1 : 0);
    whole += start % qk == 0 && n % qk == 0;
    start += n;
  }
  if (whole != 0 && whole != c.ep)
    throw std::runtime_error("a case where only some shared down shards are whole blocks");
  return whole == c.ep;
}

// The case's weights: random in wdt, the routed experts' parts in block
// formats where the case says (random valid blocks, their values in gate,
// up, down), and the spec with the activation blocks the kernels use.
inline ref::Weights case_weights(const Case& c, ref::Spec* spec, std::mt19937& rng) {
  ref::Weights w = ref::random_weights(c.spec, c.wdt, rng);
  *spec = c.spec;
  const auto& s = c.spec;
  const float sw = 1.0f / std::sqrt(static_cast<float>(s.H)), sd = 1.0f / std::sqrt(static_cast<float>(s.I));
  for (int e = 0; c.qgu && e < s.E; ++e) {
    const auto E = static_cast<size_t>(e);
    w.gate_q.push_back(refq::random_blocks(c.qgu, s.I, s.H, sw, rng, &w.gate[E]));
    w.up_q.push_back(refq::random_blocks(c.qgu, s.I, s.H, sw, rng, &w.up[E]));
  }
  for (int e = 0; c.qdown && e < s.E; ++e)
    w.down_q.push_back(refq::random_blocks(c.qdown, s.H, s.I, sd, rng, &w.down[static_cast<size_t>(e)]));
  spec->act_block_gu = c.qgu && !c.ref_float_acts ? refq::act_block(c.qgu) : 0;
  spec->act_block_down = c.qdown && !c.ref_float_acts ? refq::act_block(c.qdown) : 0;
  if (s.Is > 0 && c.qsgu) {
    w.s_gate_q = refq::random_blocks(c.qsgu, s.Is, s.H, sw, rng, &w.s_gate);
    w.s_up_q = refq::random_blocks(c.qsup ? c.qsup : c.qsgu, s.Is, s.H, sw, rng, &w.s_up);
    // Two formats: the layer holds both dequantized, and reads f32 inputs.
    spec->shared_act_block_gu = c.ref_float_acts || c.qsup ? 0 : refq::act_block(c.qsgu);
  }
  if (s.Is > 0 && c.qsdown) {
    w.s_down_q = refq::random_blocks(c.qsdown, s.H, s.Is, 1.0f / std::sqrt(static_cast<float>(s.Is)), rng, &w.s_down);
    // The down shard keeps its blocks (and quantizes its input) where it is
    // whole blocks: on every rank here, or on none (shared_blocks_everywhere).
    spec->shared_act_block_down = c.ref_float_acts || !shared_down_whole_blocks(c) ? 0 : refq::act_block(c.qsdown);
  }
  return w;
}

struct Inputs {
  std::vector<std::vector<float>> hidden, logits, topk_w;  // per replica (rounded to their dtypes)
  std::vector<std::vector<int32_t>> topk_ids;
  std::vector<std::vector<double>> expect;  // per replica [T, H]
  std::vector<std::vector<double>> slack;   // per replica [T, H]: ref::moe_token's
};

// Draws inputs with no near-ties in routing, and their reference outputs.
inline Inputs make_inputs(const Case& c, const ref::Weights& w, std::mt19937& rng) {
  const auto& s = c.spec;
  Inputs in;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int d = 0; d < c.dp; ++d) {
    const int T = c.tokens[static_cast<size_t>(d)];
    std::vector<float> hid(static_cast<size_t>(T) * s.H), lg(static_cast<size_t>(T) * s.E),
        tw(static_cast<size_t>(T) * s.K);
    std::vector<int32_t> ti(static_cast<size_t>(T) * s.K);
    std::vector<double> exp(static_cast<size_t>(T) * s.H), slack(exp.size());
    for (auto& x : hid) x = ref::round_to(n(rng), c.adt);
    for (int t = 0; t < T; ++t) {
      std::vector<int> ids;
      std::vector<double> wts;
      if (c.given_topk) {
        std::vector<int> perm(static_cast<size_t>(s.E));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int k = 0; k < s.K; ++k) {
          ti[static_cast<size_t>(t) * s.K + k] = perm[static_cast<size_t>(k)];
          tw[static_cast<size_t>(t) * s.K + k] = u(rng);
          ids.push_back(perm[static_cast<size_t>(k)]);
          wts.push_back(tw[static_cast<size_t>(t) * s.K + k]);
        }
      } else {
        float* l = lg.data() + static_cast<size_t>(t) * s.E;
        do {
          for (int e = 0; e < s.E; ++e) l[e] = 2.0f * n(rng);
        } while (!ref::route(s, l, w, ids, wts));
      }
      ref::moe_token(s, w, hid.data() + static_cast<size_t>(t) * s.H, ids, wts,
                     exp.data() + static_cast<size_t>(t) * s.H, slack.data() + static_cast<size_t>(t) * s.H);
    }
    in.hidden.push_back(std::move(hid));
    in.logits.push_back(std::move(lg));
    in.topk_ids.push_back(std::move(ti));
    in.topk_w.push_back(std::move(tw));
    in.expect.push_back(std::move(exp));
    in.slack.push_back(std::move(slack));
  }
  return in;
}

struct RankResult {
  ep_moe_status_t status = EP_MOE_OK;
  std::string error;
  std::vector<float> out;
  int64_t local_pairs = 0, skipped = 0, tokens = 0, gather = -1, dispatch = -1;
  int64_t own_tokens = 0;  // this rank's tokens in the last forward (its replica's)
  // EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS .. LAST_COMBINE_BYTES after the last forward
  int64_t permute_ns = -1, permute_bytes = -1, expert_ns = -1, combine_ns = -1, combine_bytes = -1;
  int64_t cpu_isa = -1;
  int64_t weight_bytes = -1;               // EP_MOE_LAYER_ATTR_WEIGHT_BYTES
  int64_t engine = -1, engine_pairs = -1;  // EP_MOE_LAYER_ATTR_MATRIX_ENGINE, _LAST_ENGINE_PAIRS
  int stored = 0;
};

// Gives every weight to the layer (all experts: non-local ones are skipped).
inline std::string load_weights(ep_moe_layer_t* layer, const Case& c, const ref::Weights& w, int* stored) {
  const auto& s = c.spec;
  auto put = [&](ep_moe_weight_t which, int expert, const std::vector<float>& v, int rows, int cols,
                 int32_t* st) -> bool {
    const auto bytes = ref::encode(v, c.wdt);
    return ep_moe_layer_set_weight(st, layer, which, expert, bytes.data(), static_cast<ep_moe_dtype_t>(c.wdt), rows,
                                   cols) == EP_MOE_OK;
  };
  // A routed part in its block format, when the case gives it so.
  auto put_q = [&](ep_moe_weight_t which, int expert, const std::vector<float>& v, const std::vector<uint8_t>* q,
                   int qt, int rows, int cols, int32_t* st) -> bool {
    if (!qt) return put(which, expert, v, rows, cols, st);
    return ep_moe_layer_set_weight(st, layer, which, expert, q->data(), static_cast<ep_moe_dtype_t>(qt), rows, cols) ==
           EP_MOE_OK;
  };
  for (int e = 0; e < s.E; ++e) {
    int32_t st = -1;
    bool ok;
    const auto E = static_cast<size_t>(e);
    if (c.fused_gate_up) {
      std::vector<float> gu = w.gate[E];
      gu.insert(gu.end(), w.up[E].begin(), w.up[E].end());
      std::vector<uint8_t> guq;
      if (c.qgu) {
        guq = w.gate_q[E];
        guq.insert(guq.end(), w.up_q[E].begin(), w.up_q[E].end());
      }
      ok = put_q(EP_MOE_WEIGHT_EXPERT_GATE_UP, e, gu, &guq, c.qgu, 2 * s.I, s.H, &st);
    } else {
      ok = put_q(EP_MOE_WEIGHT_EXPERT_GATE, e, w.gate[E], c.qgu ? &w.gate_q[E] : nullptr, c.qgu, s.I, s.H, &st) &&
           put_q(EP_MOE_WEIGHT_EXPERT_UP, e, w.up[E], c.qgu ? &w.up_q[E] : nullptr, c.qgu, s.I, s.H, &st);
    }
    ok = ok && put_q(EP_MOE_WEIGHT_EXPERT_DOWN, e, w.down[E], c.qdown ? &w.down_q[E] : nullptr, c.qdown, s.H, s.I, &st);
    if (ok && s.expert_bias) {  // f32, as given (the layer keeps them so)
      auto bias = [&](ep_moe_weight_t which, const std::vector<float>& v) {
        return ep_moe_layer_set_weight(nullptr, layer, which, e, v.data(), EP_MOE_DTYPE_F32, 1,
                                       static_cast<int64_t>(v.size())) == EP_MOE_OK;
      };
      if (c.fused_gate_up) {
        std::vector<float> gu = w.gate_b[E];
        gu.insert(gu.end(), w.up_b[E].begin(), w.up_b[E].end());
        ok = bias(EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, gu);
      } else {
        ok = bias(EP_MOE_WEIGHT_EXPERT_GATE_BIAS, w.gate_b[E]) && bias(EP_MOE_WEIGHT_EXPERT_UP_BIAS, w.up_b[E]);
      }
      ok = ok && bias(EP_MOE_WEIGHT_EXPERT_DOWN_BIAS, w.down_b[E]);
    }
    if (!ok) return ep_moe_layer_last_error(layer);
    *stored += st;
  }
  if (s.Is > 0) {
    bool ok;
    if (c.fused_gate_up) {
      std::vector<float> gu = w.s_gate;
      gu.insert(gu.end(), w.s_up.begin(), w.s_up.end());
      std::vector<uint8_t> guq = w.s_gate_q;
      guq.insert(guq.end(), w.s_up_q.begin(), w.s_up_q.end());
      ok = put_q(EP_MOE_WEIGHT_SHARED_GATE_UP, -1, gu, &guq, c.qsgu, 2 * s.Is, s.H, nullptr);
    } else {
      ok = put_q(EP_MOE_WEIGHT_SHARED_GATE, -1, w.s_gate, &w.s_gate_q, c.qsgu, s.Is, s.H, nullptr) &&
           put_q(EP_MOE_WEIGHT_SHARED_UP, -1, w.s_up, &w.s_up_q, c.qsup ? c.qsup : c.qsgu, s.Is, s.H, nullptr);
    }
    ok = ok && put_q(EP_MOE_WEIGHT_SHARED_DOWN, -1, w.s_down, &w.s_down_q, c.qsdown, s.H, s.Is, nullptr);
    if (ok && s.shared_gate)
      ok = ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, w.s_gate_w.data(),
                                   EP_MOE_DTYPE_F32, 1, s.H) == EP_MOE_OK;
    if (!ok) return ep_moe_layer_last_error(layer);
  }
  if (s.use_bias && ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_SCORE_BIAS, -1, w.bias.data(),
                                            EP_MOE_DTYPE_F32, 1, s.E) != EP_MOE_OK)
    return ep_moe_layer_last_error(layer);
  return "";
}

inline ep_moe_layer_config_t layer_config(const Case& c) {
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  const auto& s = c.spec;
  lc.hidden_size = s.H;
  lc.intermediate_size = s.I;
  lc.num_experts = s.E;
  lc.top_k = s.K;
  lc.activation = s.act;
  lc.weight_dtype = c.layer_wdt >= 0 ? c.layer_wdt : c.wdt;
  lc.act_dtype = c.adt;
  lc.scoring = s.sigmoid ? EP_MOE_SCORING_SIGMOID : EP_MOE_SCORING_SOFTMAX;
  lc.renormalize = s.renormalize;
  lc.num_expert_group = s.groups;
  lc.topk_group = s.topk_group;
  lc.use_score_bias = s.use_bias;
  lc.routed_scaling_factor = static_cast<float>(s.scale);
  lc.shared_intermediate_size = s.Is;
  lc.shared_expert_gate = s.shared_gate;
  lc.max_tokens = c.max_tokens;
  lc.num_threads = c.threads;
  lc.skip_mode = c.skip_mode;
  lc.dispatch_mode = c.dispatch;
  return lc;
}

// The largest |got - exp| over the largest |exp| (at least 1e-6), at index
// `worst`. NaN-safe: a NaN in got makes err NaN, which fails any bound.
struct RelError {
  double err = 0, scale = 1e-6;
  size_t worst = 0;
};
// slack (optional): per element, how far it may be off beyond the
// tolerance (ref::moe_token's: rounding boundaries of block-format h rows).
inline RelError relative_error(const std::vector<float>& got, const std::vector<double>& exp,
                               const std::vector<double>* slack = nullptr) {
  RelError r;
  for (size_t i = 0; i < exp.size(); ++i) r.scale = std::max(r.scale, std::fabs(exp[i]));
  for (size_t i = 0; i < exp.size(); ++i) {
    const double e = std::max(0.0, std::fabs(got[i] - exp[i]) - (slack ? (*slack)[i] : 0.0));
    if (!(e <= r.err)) {
      r.err = e;
      r.worst = i;
    }
  }
  r.err /= r.scale;
  return r;
}

// A forward of replica `replica`'s tokens of `in` (its top-k or its logits,
// as c says), hidden rows encoded by the caller; DP fields left unset.
inline ep_moe_forward_args_t forward_args(const Case& c, const Inputs& in, int replica, const void* hidden, void* out) {
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = c.tokens[static_cast<size_t>(replica)];
  a.hidden = hidden;
  if (c.given_topk) {
    a.topk_ids = in.topk_ids[static_cast<size_t>(replica)].data();
    a.topk_weights = in.topk_w[static_cast<size_t>(replica)].data();
  } else {
    a.router_logits = in.logits[static_cast<size_t>(replica)].data();
  }
  a.out = out;
  return a;
}

// The EP world's handles for c (c.make_comms, else in-process ranks) into
// *world (c.ep entries); returns what frees them.
inline std::function<void()> make_world(const Case& c, std::vector<ep_moe_comm_t*>* world) {
  world->assign(static_cast<size_t>(c.ep), nullptr);
  std::function<void()> cleanup;
  if (c.make_comms) {
    c.make_comms(c.ep, world, &cleanup);
  } else {
    REQUIRE(ep_moe_comm_create_local(world->data(), c.ep, nullptr) == EP_MOE_OK);
    cleanup = [world] {
      for (auto* h : *world) ep_moe_comm_destroy(h);
    };
  }
  return cleanup;
}

// Rank r's layer of the case on its EP (and DP) handles, with every
// weight given; null with *err set where a step failed. *err may also be
// set beside a layer (weights refused, or a count of stored experts other
// than the map's local ones).
inline ep_moe_layer_t* rank_layer(const Case& c, int r, ep_moe_comm_t* ep, ep_moe_comm_t* dp, const ref::Weights& w,
                                  RankResult* res, std::string* err) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = c.ep;
  mc.ep_rank = r;
  mc.global_num_experts = c.spec.E;
  mc.placement = c.placement;
  mc.num_expert_group = c.spec.groups;
  mc.num_redundant_experts = c.redundant;
  if (c.placement == EP_MOE_PLACEMENT_CUSTOM) {
    mc.custom_slots = c.custom_slots.data();
    mc.num_custom_slots = static_cast<int32_t>(c.custom_slots.size());
  }
  ep_moe_expert_map_t* map = nullptr;
  if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) {
    *err = std::string("map: ") + ep_moe_last_error();
    return nullptr;
  }
  const ep_moe_layer_config_t lc = layer_config(c);
  ep_moe_layer_t* layer = nullptr;
  if (ep_moe_layer_create(&layer, &lc, map, ep, dp) != EP_MOE_OK) {
    *err = std::string("layer: ") + ep_moe_last_error();
    ep_moe_expert_map_destroy(map);
    return nullptr;
  }
  int32_t n_local = 0;  // distinct experts with a slot here
  for (int e = 0; e < c.spec.E; ++e) {
    int32_t is_local = 0;
    ep_moe_expert_map_is_local(&is_local, map, e);
    n_local += is_local;
  }
  ep_moe_expert_map_destroy(map);  // the layer keeps its own copy
  const std::string werr = load_weights(layer, c, w, &res->stored);
  if (!werr.empty()) *err = "weights: " + werr;
  if (res->stored != n_local) *err += " stored != local experts";
  return layer;
}

// The layer's attributes after its last forward into *res.
inline void read_attrs(ep_moe_layer_t* layer, RankResult* res) {
  const std::pair<int64_t*, ep_moe_layer_attr_t> attrs[] = {
      {&res->local_pairs, EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS},
      {&res->skipped, EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS},
      {&res->tokens, EP_MOE_LAYER_ATTR_LAST_TOKENS},
      {&res->gather, EP_MOE_LAYER_ATTR_LAST_GATHER},
      {&res->dispatch, EP_MOE_LAYER_ATTR_LAST_DISPATCH},
      {&res->permute_ns, EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS},
      {&res->permute_bytes, EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES},
      {&res->cpu_isa, EP_MOE_LAYER_ATTR_CPU_ISA},
      {&res->weight_bytes, EP_MOE_LAYER_ATTR_WEIGHT_BYTES},
      {&res->engine, EP_MOE_LAYER_ATTR_MATRIX_ENGINE},
      {&res->engine_pairs, EP_MOE_LAYER_ATTR_LAST_ENGINE_PAIRS},
      {&res->expert_ns, EP_MOE_LAYER_ATTR_LAST_EXPERT_NS},
      {&res->combine_ns, EP_MOE_LAYER_ATTR_LAST_COMBINE_NS},
      {&res->combine_bytes, EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES},
  };
  for (const auto& [v, a] : attrs) ep_moe_layer_get_attr(v, layer, a);
}

// Rank r's part of the case: its layer, then each step's forward of its
// replica's tokens (outputs into outs[f][r]), then its attributes.
inline void run_rank(const Case& c, int r, ep_moe_comm_t* ep, const ref::Weights& w, const std::vector<Inputs>& steps,
                     RankResult* res, std::vector<std::vector<std::vector<float>>>* outs, std::string* setup_error) {
  const int attn_tp = c.ep / c.dp;
  ep_moe_comm_t* dp = nullptr;
  if (c.dp > 1) {
    if (attn_tp == 1 && c.dp_same_handle) {
      dp = ep;
    } else if (ep_moe_comm_split(&dp, ep, r % attn_tp, r) != EP_MOE_OK) {
      *setup_error = std::string("split: ") + ep_moe_last_error();
      return;
    }
  }
  ep_moe_layer_t* layer = rank_layer(c, r, ep, dp, w, res, setup_error);
  if (!layer) {
    if (dp && dp != ep) ep_moe_comm_destroy(dp);
    return;
  }
  const int replica = c.dp > 1 ? r / attn_tp : 0;
  const int T = c.tokens[static_cast<size_t>(replica)];
  const size_t es = c.adt == ref::F32 ? 4 : 2;
  for (int f = 0; f < c.forwards; ++f) {
    const Inputs& in = steps[static_cast<size_t>(f)];
    const auto hid = ref::encode(in.hidden[static_cast<size_t>(replica)], c.adt);
    std::vector<uint8_t> out(static_cast<size_t>(T) * c.spec.H * es + 1, 0xAB);
    std::vector<int32_t> counts(c.tokens.begin(), c.tokens.end());
    std::vector<int32_t> decode(static_cast<size_t>(c.dp), c.all_decode ? 1 : 0);
    ep_moe_forward_args_t a = forward_args(c, in, replica, hid.data(), out.data());
    if (c.dp > 1) {
      a.dp_token_counts = counts.data();
      a.dp_is_decode = decode.data();
      a.is_prefill = c.is_prefill;
      a.is_graph = c.is_graph;
    }
    res->status = ep_moe_layer_forward(layer, &a);
    if (res->status != EP_MOE_OK) {
      res->error = ep_moe_layer_last_error(layer);
      break;
    }
    (*outs)[static_cast<size_t>(f)][static_cast<size_t>(r)] =
        ref::decode(out.data(), static_cast<size_t>(T) * c.spec.H, c.adt);
    if (out.back() != 0xAB) res->error = "forward wrote past the output";
  }
  read_attrs(layer, res);
  res->own_tokens = T;
  ep_moe_layer_destroy(layer);
  if (dp && dp != ep) ep_moe_comm_destroy(dp);
}

// Phase attributes of the last forward: present and consistent on every
// rank; exact byte counts where the flow is simple (all-gather, no DP).
inline void check_phase_attrs(const Case& c, const std::vector<RankResult>& results) {
  for (int r = 0; r < c.ep && c.forwards > 0; ++r) {
    const RankResult& x = results[static_cast<size_t>(r)];
    if (x.status != EP_MOE_OK) continue;
    INFO("rank " << r << " phase attrs: permute " << x.permute_ns << " ns " << x.permute_bytes << " B, expert "
                 << x.expert_ns << " ns, combine " << x.combine_ns << " ns " << x.combine_bytes << " B");
    const int64_t es = c.adt == ref::F32 ? 4 : 2, H = c.spec.H, T = x.own_tokens;
    CHECK(x.permute_ns >= 0);
    CHECK(x.expert_ns >= 0);
    CHECK(x.combine_ns >= 0);
    // bf16 rows with bf16 weights on AVX512_BF16 go to the bf16 tiles where
    // they are: no row is widened, only the routing rows are unpacked. Not
    // where any part is held in blocks: its int8 rows are quantized from f32.
    const bool direct = c.adt == ref::BF16 && c.wdt == ref::BF16 && x.cpu_isa == 3 && !c.quant();
    // f32 rows in the all-gather flow without DP are read where they are
    // too (Layer::f32_rows): nothing to widen.
    const bool in_place = direct || (c.adt == ref::F32 && x.dispatch == EP_MOE_DISPATCH_ALLGATHER && c.dp == 1);
    if (in_place) {
      CHECK(x.permute_bytes >= 0);
    } else {
      CHECK(x.permute_bytes >= T * H * es);  // every own token row is moved at least once
    }
    CHECK(x.combine_bytes >= T * H * es);  // and every output row written from a result
    if (x.local_pairs > 0) CHECK(x.expert_ns > 0);
    if (x.dispatch == EP_MOE_DISPATCH_ALLGATHER && c.dp == 1) {
      CHECK(x.permute_bytes == (in_place ? 0 : T * H * 4));  // inputs widened to f32, or read in place
      CHECK(x.combine_bytes == T * H * es + (es == 4 ? 0 : T * H * 4));
    }
  }
}

// Every forward's outputs on every rank against the reference of its
// replica's tokens, within the case's tolerance (each element's slack
// beyond it); the largest error into *worst_err.
inline void check_outputs(const Case& c, const std::vector<Inputs>& steps,
                          const std::vector<std::vector<std::vector<float>>>& outs, double* worst_err) {
  const int attn_tp = c.ep / c.dp;
  const double tol = c.tol >= 0 ? c.tol : tolerance(c.adt, c.wdt, c.quant());
  for (int f = 0; f < c.forwards; ++f) {
    for (int r = 0; r < c.ep; ++r) {
      const int replica = c.dp > 1 ? r / attn_tp : 0;
      const auto& exp = steps[static_cast<size_t>(f)].expect[static_cast<size_t>(replica)];
      const auto& got = outs[static_cast<size_t>(f)][static_cast<size_t>(r)];
      REQUIRE(got.size() == exp.size());
      const auto& slack = steps[static_cast<size_t>(f)].slack[static_cast<size_t>(replica)];
      const RelError re = relative_error(got, exp, &slack);
      const double err = re.err, scale = re.scale;
      const size_t worst = re.worst;
      if (worst_err) *worst_err = std::max(*worst_err, err);
      INFO("forward " << f << " rank " << r << " max error " << err << " (relative to max |ref| " << scale << ") at "
                      << worst << ": got " << (got.empty() ? 0.0 : got[worst]) << " expected "
                      << (exp.empty() ? 0.0 : exp[worst]) << " slack " << (exp.empty() ? 0.0 : slack[worst]));
      CHECK(err <= tol);
    }
  }
}

// Runs the case on c.ep in-process ranks; returns per-rank results of the
// last forward and checks every forward against the reference.
inline std::vector<RankResult> run_case(const Case& c, std::mt19937& rng, double* worst_err = nullptr) {
  INFO(c.describe());
  ref::Spec spec;
  const ref::Weights w = case_weights(c, &spec, rng);
  Case cq = c;  // the spec with the activation blocks, for the reference
  cq.spec = spec;
  std::vector<Inputs> steps;
  for (int f = 0; f < c.forwards; ++f) steps.push_back(make_inputs(cq, w, rng));

  std::vector<ep_moe_comm_t*> world;
  const std::function<void()> cleanup = make_world(c, &world);
  std::vector<RankResult> results(static_cast<size_t>(c.ep));
  std::vector<std::vector<std::vector<float>>> outs(static_cast<size_t>(c.forwards),
                                                    std::vector<std::vector<float>>(static_cast<size_t>(c.ep)));
  std::vector<std::string> setup_error(static_cast<size_t>(c.ep));
  run_ranks(c.ep, [&](int r) {
    const auto i = static_cast<size_t>(r);
    run_rank(c, r, world[i], w, steps, &results[i], &outs, &setup_error[i]);
  });
  cleanup();

  for (int r = 0; r < c.ep; ++r) {
    INFO("rank " << r << ": " << setup_error[static_cast<size_t>(r)] << results[static_cast<size_t>(r)].error);
    REQUIRE(setup_error[static_cast<size_t>(r)].empty());
    CHECK(results[static_cast<size_t>(r)].error.empty());
    REQUIRE(results[static_cast<size_t>(r)].status == EP_MOE_OK);
  }
  check_phase_attrs(c, results);
  check_outputs(c, steps, outs, worst_err);
  results.back().out = outs.back().back();
  return results;
}

// The ISA loops run each of these through EP_MOE_CPU_ISA, which can only
// lower the kernels a layer picks: after a case under `isa`, true (with a
// "skipped" line, never a pass) when the layer ran a lower table because
// this CPU lacks it. The caller then leaves that ISA's remaining cases.
inline const char* const kIsaNames[] = {"generic", "avx2", "avx512", "avx512bf16"};
inline bool isa_skipped(const std::vector<RankResult>& res, int isa) {
  const int64_t ran = res.empty() ? -1 : res[0].cpu_isa;
  if (ran >= isa) return false;
  WARN("skipped: " << kIsaNames[isa] << " kernels (this CPU has none; the layer ran "
                   << (ran >= 0 && ran < 4 ? kIsaNames[ran] : "?") << ")");
  return true;
}

}  // namespace harness

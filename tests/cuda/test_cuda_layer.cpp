// The CUDA layer against the double-precision dense reference
// (tests/common/reference_moe.hpp), through the public C API only.
//
// EP ranks are several layers on the one device, each with ep_comm NULL
// (forward returns the rank's partial sum); the partials are summed on the
// host. One case runs through an NCCL communicator of one rank, one through
// a captured CUDA graph replayed on fresh inputs. Inputs are drawn fresh for
// every run (the seed is printed; EP_MOE_TEST_SEED=N replays it).
//
// Without a CUDA device it checks that a device layer is refused with
// EP_MOE_ERR_UNSUPPORTED, prints "skipped: no CUDA device" and exits 77
// (ctest's "skipped"), never "passed".
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "../common/cuda_check.hpp"
#include "../common/reference_moe.hpp"
#include "../io/writers.hpp"
#include "ep_moe/ep_moe.h"

namespace {

int failures = 0, checks = 0;
void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

struct Case {
  std::string name;
  ref::Spec s;
  int wdt = ref::F32, adt = ref::F32;
  int ep = 1;
  int redundant = 0;  // redundant expert slots (replicas)
  std::vector<int> tokens;
  int mode = 0;  // 0 router logits, 1 given top-k, 2 the layer's own router
  int skip_mode = EP_MOE_SKIP_TOKENS;
  int sync_free = 16;
  bool device_weights = false;  // weights given as device buffers of the weight dtype
  bool skew = false;            // given top-k: every token picks expert 0 (uneven expert counts)
};

// A case of these shapes; the rest at the defaults above.
Case make_case(const char* name, int H, int I, int E, int K, int ep = 1) {
  Case c;
  c.name = name;
  c.s.H = H;
  c.s.I = I;
  c.s.E = E;
  c.s.K = K;
  c.ep = ep;
  return c;
}

double tolerance(int adt, int wdt) {
  if (adt == ref::BF16 || wdt == ref::BF16) return 1e-2;
  if (adt == ref::F16 || wdt == ref::F16) return 5e-3;
  return 1e-4;
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t n) { CU(cudaMalloc(&p, n ? n : 1)); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

void* upload(const std::vector<uint8_t>& v, std::vector<std::unique_ptr<DevBuf>>& keep) {
  keep.push_back(std::make_unique<DevBuf>(v.size()));
  if (!v.empty()) CU(cudaMemcpy(keep.back()->p, v.data(), v.size(), cudaMemcpyHostToDevice));
  return keep.back()->p;
}

// Rank `rank` of `ep`: linear placement with `redundant` replica slots, or
// the custom slot table `slots`. NULL (and a failure) when it cannot be made.
ep_moe_expert_map_t* map_for(int ep, int rank, int E, int redundant = 0, const std::vector<int32_t>& slots = {}) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = ep;
  mc.ep_rank = rank;
  mc.global_num_experts = E;
  mc.num_redundant_experts = redundant;
  if (!slots.empty()) {
    mc.placement = EP_MOE_PLACEMENT_CUSTOM;
    mc.custom_slots = slots.data();
    mc.num_custom_slots = static_cast<int32_t>(slots.size());
  }
  ep_moe_expert_map_t* m = nullptr;
  if (ep_moe_expert_map_create(&m, &mc) != EP_MOE_OK) {
    expect(false, std::string("map: ") + ep_moe_last_error());
    return nullptr;
  }
  return m;
}

ep_moe_expert_map_t* make_map(const Case& c, int rank) { return map_for(c.ep, rank, c.s.E, c.redundant); }

ep_moe_layer_config_t layer_config(const Case& c, int max_tokens) {
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  lc.hidden_size = c.s.H;
  lc.intermediate_size = c.s.I;
  lc.num_experts = c.s.E;
  lc.top_k = c.s.K;
  lc.activation = c.s.act;
  lc.weight_dtype = c.wdt;
  lc.act_dtype = c.adt;
  lc.scoring = c.s.sigmoid ? EP_MOE_SCORING_SIGMOID : EP_MOE_SCORING_SOFTMAX;
  lc.renormalize = c.s.renormalize;
  lc.num_expert_group = c.s.groups;
  lc.topk_group = c.s.topk_group;
  lc.use_score_bias = c.s.use_bias;
  lc.routed_scaling_factor = static_cast<float>(c.s.scale);
  lc.shared_intermediate_size = c.s.Is;
  lc.shared_expert_gate = c.s.shared_gate;
  lc.max_tokens = max_tokens;
  lc.skip_mode = c.skip_mode;
  lc.device = 0;
  lc.sync_free_tokens = c.sync_free;
  return lc;
}

// Sets every weight; device buffers of the weight dtype when asked.
bool set_weights(ep_moe_layer_t* l, const Case& c, const ref::Weights& w, const std::vector<float>& router,
                 std::vector<std::unique_ptr<DevBuf>>& keep) {
  const auto& s = c.s;
  auto put = [&](ep_moe_weight_t which, int e, const std::vector<float>& v, int64_t rows, int64_t cols) {
    ep_moe_status_t st;
    if (c.device_weights) {
      const void* d = upload(ref::encode(v, c.wdt), keep);
      st = ep_moe_layer_set_weight(nullptr, l, which, e, d, static_cast<ep_moe_dtype_t>(c.wdt), rows, cols);
    } else {
      st = ep_moe_layer_set_weight(nullptr, l, which, e, v.data(), EP_MOE_DTYPE_F32, rows, cols);
    }
    if (st != EP_MOE_OK) expect(false, std::string("set_weight: ") + ep_moe_layer_last_error(l));
    return st == EP_MOE_OK;
  };
  bool ok = true;
  for (int e = 0; e < s.E && ok; ++e) {
    if (e % 2 == 0) {
      std::vector<float> gu = w.gate[static_cast<size_t>(e)];
      gu.insert(gu.end(), w.up[static_cast<size_t>(e)].begin(), w.up[static_cast<size_t>(e)].end());
      ok = put(EP_MOE_WEIGHT_EXPERT_GATE_UP, e, gu, 2 * s.I, s.H);
    } else {
      ok = put(EP_MOE_WEIGHT_EXPERT_GATE, e, w.gate[static_cast<size_t>(e)], s.I, s.H) &&
           put(EP_MOE_WEIGHT_EXPERT_UP, e, w.up[static_cast<size_t>(e)], s.I, s.H);
    }
    ok = ok && put(EP_MOE_WEIGHT_EXPERT_DOWN, e, w.down[static_cast<size_t>(e)], s.H, s.I);
  }
  if (ok && s.Is > 0)
    ok = put(EP_MOE_WEIGHT_SHARED_GATE, -1, w.s_gate, s.Is, s.H) &&
         put(EP_MOE_WEIGHT_SHARED_UP, -1, w.s_up, s.Is, s.H) && put(EP_MOE_WEIGHT_SHARED_DOWN, -1, w.s_down, s.H, s.Is);
  if (ok && s.shared_gate)
    ok = ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, w.s_gate_w.data(), EP_MOE_DTYPE_F32,
                                 1, s.H) == EP_MOE_OK;
  if (ok && s.use_bias)
    ok = ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_SCORE_BIAS, -1, w.bias.data(), EP_MOE_DTYPE_F32, 1, s.E) ==
         EP_MOE_OK;
  if (ok && c.mode == 2)
    ok = ep_moe_layer_set_weight(nullptr, l, EP_MOE_WEIGHT_ROUTER, -1, router.data(), EP_MOE_DTYPE_F32, s.E, s.H) ==
         EP_MOE_OK;
  int64_t ready = 0;
  ep_moe_layer_get_attr(&ready, l, EP_MOE_LAYER_ATTR_READY);
  expect(ok && ready == 1, c.name + ": weights set and layer ready");
  return ok && ready == 1;
}

struct Step {
  std::vector<float> hidden, logits, topk_w;
  std::vector<int32_t> topk_ids;
  std::vector<int> ref_ids;  // [T, K] the reference's choice
  std::vector<double> expect;
};

// Draws one step's inputs with no near-ties in routing, and the reference.
Step draw(const Case& c, int T, const ref::Weights& w, const std::vector<float>& router, std::mt19937& rng) {
  const auto& s = c.s;
  Step st;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  st.hidden.resize(static_cast<size_t>(T) * s.H);
  st.logits.resize(static_cast<size_t>(T) * s.E);
  st.topk_w.resize(static_cast<size_t>(T) * s.K);
  st.topk_ids.resize(static_cast<size_t>(T) * s.K);
  st.expect.resize(static_cast<size_t>(T) * s.H);
  for (int t = 0; t < T; ++t) {
    float* x = st.hidden.data() + static_cast<size_t>(t) * s.H;
    float* l = st.logits.data() + static_cast<size_t>(t) * s.E;
    std::vector<int> ids;
    std::vector<double> wts;
    for (;;) {
      for (int i = 0; i < s.H; ++i) x[i] = ref::round_to(n(rng), c.adt);
      if (c.mode == 1) {
        std::vector<int> perm(static_cast<size_t>(s.E));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        if (c.skew) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));
        ids.assign(perm.begin(), perm.begin() + s.K);
        wts.clear();
        for (int k = 0; k < s.K; ++k) {
          st.topk_ids[static_cast<size_t>(t) * s.K + k] = ids[static_cast<size_t>(k)];
          st.topk_w[static_cast<size_t>(t) * s.K + k] = u(rng);
          wts.push_back(st.topk_w[static_cast<size_t>(t) * s.K + k]);
        }
        break;
      }
      if (c.mode == 2) {  // logits = x . router (f32 inputs, so compute them in double)
        for (int e = 0; e < s.E; ++e) {
          double a = 0;
          for (int i = 0; i < s.H; ++i) a += static_cast<double>(router[static_cast<size_t>(e) * s.H + i]) * x[i];
          l[e] = static_cast<float>(a);
        }
        if (ref::route(s, l, w, ids, wts, 1e-3)) break;
      } else {
        for (int e = 0; e < s.E; ++e) l[e] = 2.0f * n(rng);
        if (ref::route(s, l, w, ids, wts)) break;
      }
    }
    ref::moe_token(s, w, x, ids, wts, st.expect.data() + static_cast<size_t>(t) * s.H);
    st.ref_ids.insert(st.ref_ids.end(), ids.begin(), ids.end());
  }
  return st;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - want[i];
    if (!std::isfinite(got[i])) return INFINITY;
    num += d * d;
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct RankLayer {
  ep_moe_layer_t* layer = nullptr;
  ep_moe_expert_map_t* map = nullptr;
  ~RankLayer() {
    ep_moe_layer_destroy(layer);
    ep_moe_expert_map_destroy(map);
  }
};

// Device copies of a step's inputs and the forward arguments for them.
struct DeviceStep {
  std::vector<std::unique_ptr<DevBuf>> keep;
  ep_moe_forward_args_t args;
};

void fill_step(DeviceStep& d, const Case& c, const Step& st, int T, void* out, cudaStream_t s) {
  ep_moe_forward_args_init(&d.args);
  d.args.num_tokens = T;
  d.args.hidden = upload(ref::encode(st.hidden, c.adt), d.keep);
  if (c.mode == 0) d.args.router_logits = upload(ref::encode(st.logits, ref::F32), d.keep);
  if (c.mode == 1) {
    std::vector<uint8_t> ids(st.topk_ids.size() * 4), ws(st.topk_w.size() * 4);
    if (!ids.empty()) std::memcpy(ids.data(), st.topk_ids.data(), ids.size());
    if (!ws.empty()) std::memcpy(ws.data(), st.topk_w.data(), ws.size());
    d.args.topk_ids = static_cast<const int32_t*>(upload(ids, d.keep));
    d.args.topk_weights = static_cast<const float*>(upload(ws, d.keep));
  }
  d.args.out = out;
  d.args.stream = s;
}

std::vector<double> read_out(const void* dev, const Case& c, size_t n) {
  const size_t es = c.adt == ref::F32 ? 4 : 2;
  std::vector<uint8_t> raw(n * es);
  if (n) CU(cudaMemcpy(raw.data(), dev, raw.size(), cudaMemcpyDeviceToHost));
  const std::vector<float> f = ref::decode(raw.data(), n, c.adt);
  return std::vector<double>(f.begin(), f.end());
}

void run_case(const Case& c, std::mt19937& rng) {
  const auto& s = c.s;
  const ref::Weights w = ref::random_weights(s, c.wdt, rng);
  std::vector<float> router;
  if (c.mode == 2) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    router.resize(static_cast<size_t>(s.E) * s.H);
    for (auto& x : router) x = n(rng) / std::sqrt(static_cast<float>(s.H));
  }
  int max_t = 1;
  for (int t : c.tokens) max_t = std::max(max_t, t);
  std::vector<RankLayer> ranks(static_cast<size_t>(c.ep));
  std::vector<std::unique_ptr<DevBuf>> keep;
  const ep_moe_layer_config_t lc = layer_config(c, max_t);
  for (int r = 0; r < c.ep; ++r) {
    RankLayer& rl = ranks[static_cast<size_t>(r)];
    rl.map = make_map(c, r);
    if (!rl.map) return;
    if (ep_moe_layer_create(&rl.layer, &lc, rl.map, nullptr, nullptr) != EP_MOE_OK) {
      expect(false, c.name + ": create: " + ep_moe_last_error());
      return;
    }
    if (!set_weights(rl.layer, c, w, router, keep)) return;
  }
  cudaStream_t stream;
  CU(cudaStreamCreate(&stream));
  const double tol = tolerance(c.adt, c.wdt);
  for (int T : c.tokens) {
    const Step st = draw(c, T, w, router, rng);
    const size_t n = static_cast<size_t>(T) * s.H, es = c.adt == ref::F32 ? 4 : 2;
    std::vector<double> sum(n, 0.0);
    DevBuf out(n * es);
    int64_t pairs = 0;
    for (int r = 0; r < c.ep; ++r) {
      DeviceStep d;
      fill_step(d, c, st, T, out.p, stream);
      CU(cudaMemset(out.p, 0xff, n * es));  // NaN poison: every element must be written
      const ep_moe_status_t rc = ep_moe_layer_forward(ranks[static_cast<size_t>(r)].layer, &d.args);
      if (rc != EP_MOE_OK) {
        expect(false, c.name + ": forward: " + ep_moe_layer_last_error(ranks[static_cast<size_t>(r)].layer));
        continue;
      }
      CU(cudaStreamSynchronize(stream));
      const std::vector<double> part = read_out(out.p, c, n);
      for (size_t i = 0; i < n; ++i) sum[i] += part[i];
      int64_t v = 0, sf = -2;
      ep_moe_layer_get_attr(&v, ranks[static_cast<size_t>(r)].layer, EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS);
      pairs += v;
      ep_moe_layer_get_attr(&sf, ranks[static_cast<size_t>(r)].layer, EP_MOE_LAYER_ATTR_LAST_SYNC_FREE);
      expect(sf == (T <= c.sync_free ? 1 : 0), c.name + ": sync-free path iff T <= sync_free_tokens");
    }
    const double err = rel_err(sum, st.expect);
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s T=%d: rel err %.3g (tol %.0e)", c.name.c_str(), T, err, tol);
    std::printf("  %s\n", buf);
    expect(err <= tol, buf);
    if (c.skip_mode == EP_MOE_SKIP_TOKENS)
      expect(pairs == static_cast<int64_t>(T) * s.K, c.name + ": every pair computed exactly once over the ranks");
  }
  CU(cudaStreamDestroy(stream));
}

// Captures one forward of `layer` (T tokens, router logits) in a CUDA graph
// and replays it `replays` times, each on fresh inputs copied into the
// captured buffers, every output (poisoned first) against the reference.
void capture_and_replay(const std::string& name, ep_moe_layer_t* layer, const Case& c, const ref::Weights& w, int T,
                        int replays, std::mt19937& rng) {
  cudaStream_t s;
  CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t n = static_cast<size_t>(T) * c.s.H, es = c.adt == ref::F32 ? 4 : 2;
  const double tol = tolerance(c.adt, c.wdt);
  DevBuf out(n * es);
  DeviceStep d;
  fill_step(d, c, draw(c, T, w, {}, rng), T, out.p, s);  // the buffers the graph captures
  cudaGraph_t graph;
  CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const ep_moe_status_t rc = ep_moe_layer_forward(layer, &d.args);
  CU(cudaStreamEndCapture(s, &graph));
  expect(rc == EP_MOE_OK, name + ": forward under capture: " + ep_moe_layer_last_error(layer));
  if (rc == EP_MOE_OK) {
    cudaGraphExec_t exec;
    CU(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < replays; ++rep) {
      const Step st = draw(c, T, w, {}, rng);
      const auto hid = ref::encode(st.hidden, c.adt);
      const auto lg = ref::encode(st.logits, ref::F32);
      CU(cudaMemcpyAsync(const_cast<void*>(d.args.hidden), hid.data(), hid.size(), cudaMemcpyHostToDevice, s));
      CU(cudaMemcpyAsync(const_cast<void*>(d.args.router_logits), lg.data(), lg.size(), cudaMemcpyHostToDevice, s));
      CU(cudaMemsetAsync(out.p, 0xff, n * es, s));
      CU(cudaGraphLaunch(exec, s));
      CU(cudaStreamSynchronize(s));
      const double err = rel_err(read_out(out.p, c, n), st.expect);
      char buf[200];
      std::snprintf(buf, sizeof buf, "%s replay %d: rel err %.3g (tol %.0e)", name.c_str(), rep, err, tol);
      std::printf("  %s\n", buf);
      expect(err <= tol, buf);
    }
    CU(cudaGraphExecDestroy(exec));
  }
  CU(cudaGraphDestroy(graph));
  CU(cudaStreamDestroy(s));
}

// The synchronisation-free path captured in a CUDA graph, replayed on new
// inputs copied into the captured buffers.
void graph_case(std::mt19937& rng) {
  Case c = make_case("graph", 128, 64, 16, 4);
  c.s.Is = 48;
  c.wdt = c.adt = ref::BF16;
  c.sync_free = 8;
  const int T = 6;
  const ref::Weights w = ref::random_weights(c.s, c.wdt, rng);
  RankLayer rl;
  rl.map = make_map(c, 0);
  const ep_moe_layer_config_t lc = layer_config(c, 64);
  std::vector<std::unique_ptr<DevBuf>> keep;
  if (!rl.map || ep_moe_layer_create(&rl.layer, &lc, rl.map, nullptr, nullptr) != EP_MOE_OK) {
    expect(false, std::string("graph: create: ") + ep_moe_last_error());
    return;
  }
  if (!set_weights(rl.layer, c, w, {}, keep)) return;
  capture_and_replay("graph", rl.layer, c, w, T, 3, rng);
}

// EP=1 through an NCCL communicator of one rank, in both dispatch modes
// (the all-to-all plans on the host and exchanges its counts through the
// device), and the all-gather flow captured in a CUDA graph with its NCCL
// all-reduce.
void nccl_case(std::mt19937& rng) {
  if (!ep_moe_has_feature(EP_MOE_FEATURE_NCCL)) {
    std::printf("  nccl: not built, skipped\n");
    return;
  }
  Case c = make_case("nccl", 96, 64, 8, 2);
  c.s.Is = 32;
  c.sync_free = 8;
  uint8_t id[128];
  ep_moe_comm_t* comm = nullptr;
  if (ep_moe_nccl_get_unique_id(id, sizeof id) != EP_MOE_OK ||
      ep_moe_comm_create_nccl_from_id(&comm, id, sizeof id, 0, 1, nullptr) != EP_MOE_OK) {
    expect(false, std::string("nccl: comm: ") + ep_moe_last_error());
    return;
  }
  const ref::Weights w = ref::random_weights(c.s, c.wdt, rng);
  for (int dispatch : {EP_MOE_DISPATCH_ALLGATHER, EP_MOE_DISPATCH_ALLTOALL}) {
    RankLayer rl;
    rl.map = make_map(c, 0);
    ep_moe_layer_config_t lc = layer_config(c, 64);
    lc.dispatch_mode = dispatch;
    std::vector<std::unique_ptr<DevBuf>> keep;
    if (!rl.map || ep_moe_layer_create(&rl.layer, &lc, rl.map, comm, nullptr) != EP_MOE_OK ||
        !set_weights(rl.layer, c, w, {}, keep)) {
      expect(false, std::string("nccl: layer: ") + ep_moe_last_error());
      break;
    }
    const char* mode = dispatch == EP_MOE_DISPATCH_ALLGATHER ? "all-gather" : "all-to-all";
    for (int T : {40, 3}) {
      const Step st = draw(c, T, w, {}, rng);
      DevBuf out(static_cast<size_t>(T) * c.s.H * 4);
      DeviceStep d;
      fill_step(d, c, st, T, out.p, nullptr);
      const ep_moe_status_t rc = ep_moe_layer_forward(rl.layer, &d.args);
      expect(rc == EP_MOE_OK, std::string("nccl: forward: ") + ep_moe_layer_last_error(rl.layer));
      CU(cudaDeviceSynchronize());
      const double err = rel_err(read_out(out.p, c, static_cast<size_t>(T) * c.s.H), st.expect);
      std::printf("  nccl EP=1 %s T=%d: rel err %.3g (tol 1e-4)\n", mode, T, err);
      expect(err <= 1e-4, std::string("nccl output, ") + mode);
      std::vector<int64_t> load(static_cast<size_t>(c.s.E), -1), want(static_cast<size_t>(c.s.E), 0);
      for (int e : st.ref_ids) ++want[static_cast<size_t>(e)];
      expect(ep_moe_layer_expert_load(load.data(), load.size(), rl.layer, 1, 1) == EP_MOE_OK && load == want,
             std::string("nccl: expert load, ") + mode + " " + ep_moe_layer_last_error(rl.layer));
    }
    if (dispatch == EP_MOE_DISPATCH_ALLGATHER) {  // captured with the NCCL all-reduce inside
      capture_and_replay("nccl EP=1 graph", rl.layer, c, w, 4, 1, rng);
    }
  }
  ep_moe_comm_destroy(comm);
}

// Ranks that talk: one thread per rank, in-process communicators (their
// collectives are staged through host memory), so the real forward runs
// with its collectives: the all-gather flow, DP attention (padded gather +
// reduce-scatter, compact gather + all-reduce), all-to-all and auto.
struct GroupCase {
  Case c;
  int dispatch = EP_MOE_DISPATCH_ALLGATHER;
  bool dp = false;          // every rank its own DP replica (dp_comm = ep_comm)
  bool decode = false;      // DP: every replica decodes (compact gather)
  std::vector<int> tokens;  // per rank (all-gather without DP: the same on every rank)
};

void group_case(const GroupCase& g, std::mt19937& rng) {
  const Case& c = g.c;
  const int n = c.ep;
  std::printf("%s\n", c.name.c_str());
  const ref::Weights w = ref::random_weights(c.s, c.wdt, rng);
  std::vector<ep_moe_comm_t*> world(static_cast<size_t>(n), nullptr);
  if (ep_moe_comm_create_local(world.data(), n, nullptr) != EP_MOE_OK) {
    expect(false, c.name + ": local comms: " + ep_moe_last_error());
    return;
  }
  int max_t = 1;
  for (int t : g.tokens) max_t = std::max(max_t, t);
  std::vector<RankLayer> ranks(static_cast<size_t>(n));
  std::vector<std::unique_ptr<DevBuf>> keep;
  ep_moe_layer_config_t lc = layer_config(c, max_t);
  lc.dispatch_mode = g.dispatch;
  bool ok = true;
  for (int r = 0; r < n && ok; ++r) {
    RankLayer& rl = ranks[static_cast<size_t>(r)];
    rl.map = make_map(c, r);
    ok = rl.map && ep_moe_layer_create(&rl.layer, &lc, rl.map, world[static_cast<size_t>(r)],
                                       g.dp ? world[static_cast<size_t>(r)] : nullptr) == EP_MOE_OK;
    if (!ok) expect(false, c.name + ": create: " + ep_moe_last_error());
    ok = ok && set_weights(rl.layer, c, w, {}, keep);
  }
  if (ok) {
    const bool same = !g.dp && g.dispatch == EP_MOE_DISPATCH_ALLGATHER;
    std::vector<Step> steps;
    for (int r = 0; r < n; ++r)
      steps.push_back(same && r > 0 ? steps[0] : draw(c, g.tokens[static_cast<size_t>(r)], w, {}, rng));
    std::vector<int32_t> counts(g.tokens.begin(), g.tokens.end()), decode(static_cast<size_t>(n), g.decode ? 1 : 0);
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<double> errs(static_cast<size_t>(n), 0.0);
    std::vector<std::vector<int64_t>> loads(static_cast<size_t>(n),
                                            std::vector<int64_t>(static_cast<size_t>(c.s.E), -1));
    std::vector<std::thread> th;
    for (int r = 0; r < n; ++r)
      th.emplace_back([&, r] {
        const int T = g.tokens[static_cast<size_t>(r)];
        const size_t es = c.adt == ref::F32 ? 4 : 2, cnt = static_cast<size_t>(T) * c.s.H;
        cudaStream_t s;
        CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        DevBuf out(cnt * es);
        CU(cudaMemset(out.p, 0xff, cnt * es));
        DeviceStep d;
        fill_step(d, c, steps[static_cast<size_t>(r)], T, out.p, s);
        if (g.dp) {
          d.args.dp_token_counts = counts.data();
          d.args.dp_is_decode = decode.data();
          d.args.is_prefill = g.decode ? 0 : 1;
        }
        ep_moe_layer_t* l = ranks[static_cast<size_t>(r)].layer;
        if (ep_moe_layer_forward(l, &d.args) != EP_MOE_OK) {
          errors[static_cast<size_t>(r)] = ep_moe_layer_last_error(l);
        } else {
          CU(cudaStreamSynchronize(s));
          errs[static_cast<size_t>(r)] = rel_err(read_out(out.p, c, cnt), steps[static_cast<size_t>(r)].expect);
          // The load window over the group (collective), then reset.
          if (ep_moe_layer_expert_load(loads[static_cast<size_t>(r)].data(), static_cast<size_t>(c.s.E), l, 1, 1) !=
              EP_MOE_OK)
            errors[static_cast<size_t>(r)] = std::string("expert_load: ") + ep_moe_layer_last_error(l);
        }
        CU(cudaStreamDestroy(s));
      });
    for (auto& t : th) t.join();
    const double tol = tolerance(c.adt, c.wdt);
    for (int r = 0; r < n; ++r) {
      char buf[320];
      std::snprintf(
          buf, sizeof buf, "%s rank %d T=%d: rel err %.3g (tol %.0e)%s%s", c.name.c_str(), r,
          g.tokens[static_cast<size_t>(r)], errs[static_cast<size_t>(r)], tol,
          errors[static_cast<size_t>(r)].empty() ? "" : " forward failed: ", errors[static_cast<size_t>(r)].c_str());
      std::printf("  %s\n", buf);
      expect(errors[static_cast<size_t>(r)].empty() && errs[static_cast<size_t>(r)] <= tol, buf);
    }
    // Every rank sees the group's per-expert pairs: the reference's choices
    // over the distinct tokens.
    std::vector<int64_t> want(static_cast<size_t>(c.s.E), 0);
    for (int r = 0; r < (same ? 1 : n); ++r)
      for (int e : steps[static_cast<size_t>(r)].ref_ids) ++want[static_cast<size_t>(e)];
    for (int r = 0; r < n; ++r)
      expect(loads[static_cast<size_t>(r)] == want, c.name + ": expert load of rank " + std::to_string(r));
    if (g.dispatch != EP_MOE_DISPATCH_AUTO) {
      int64_t mode = -1;
      ep_moe_layer_get_attr(&mode, ranks[0].layer, EP_MOE_LAYER_ATTR_LAST_DISPATCH);
      expect(mode == g.dispatch, c.name + ": the dispatch mode asked for");
    }
  }
  for (auto& rl : ranks) {
    ep_moe_layer_destroy(rl.layer);
    rl.layer = nullptr;
  }
  for (auto* w2 : world) ep_moe_comm_destroy(w2);
}

std::vector<GroupCase> group_cases() {
  std::vector<GroupCase> v;
  auto make = [](const char* name, int ep, int H, int I, int E, int K) {
    GroupCase g;
    g.c = make_case(name, H, I, E, K, ep);
    return g;
  };
  {
    GroupCase g = make("local EP3 all-gather, bf16, shared", 3, 128, 64, 12, 3);
    g.c.s.Is = 64;
    g.c.wdt = g.c.adt = ref::BF16;
    g.tokens = {40, 40, 40};
    v.push_back(g);
  }
  {
    GroupCase g = make("local EP2 DP2 padded gather + reduce-scatter (prefill)", 2, 96, 64, 8, 2);
    g.c.s.Is = 32;
    g.dp = true;
    g.tokens = {30, 0};
    v.push_back(g);
  }
  {
    GroupCase g = make("local EP2 DP2 compact gather (decode), f16", 2, 96, 64, 8, 2);
    g.c.wdt = g.c.adt = ref::F16;
    g.dp = true;
    g.decode = true;
    g.tokens = {5, 3};
    v.push_back(g);
  }
  {
    GroupCase g = make("local EP3 all-to-all, shared, given top-k", 3, 128, 64, 12, 4);
    g.c.s.Is = 48;
    g.c.mode = 1;
    g.dispatch = EP_MOE_DISPATCH_ALLTOALL;
    g.tokens = {20, 0, 37};
    v.push_back(g);
  }
  {
    GroupCase g = make("local EP4 all-to-all, replicas, bf16", 4, 128, 64, 16, 4);
    g.c.redundant = 4;
    g.c.wdt = g.c.adt = ref::BF16;
    g.dispatch = EP_MOE_DISPATCH_ALLTOALL;
    g.tokens = {33, 1, 0, 80};
    v.push_back(g);
  }
  // Odd H in bf16: the activations end 2 bytes off a 4-byte boundary, so a
  // packed row's ids sit after 2 bytes of padding (a misaligned int32 access
  // faults on a GPU).
  {
    GroupCase g = make("local EP2 DP2 padded gather, bf16, odd H", 2, 97, 45, 8, 2);
    g.c.wdt = g.c.adt = ref::BF16;
    g.dp = true;
    g.tokens = {7, 0};
    v.push_back(g);
  }
  {
    GroupCase g = make("local EP3 all-to-all, bf16, odd H", 3, 97, 45, 10, 3);
    g.c.wdt = g.c.adt = ref::BF16;
    g.dispatch = EP_MOE_DISPATCH_ALLTOALL;
    g.tokens = {5, 0, 9};
    v.push_back(g);
  }
  {
    GroupCase g = make("local EP2 auto with DP", 2, 64, 48, 8, 2);
    g.c.s.Is = 32;
    g.dispatch = EP_MOE_DISPATCH_AUTO;
    g.dp = true;
    g.tokens = {16, 9};
    v.push_back(g);
  }
  return v;
}

// Weights from the checkpoint loader (safetensors in two namings, GGUF
// Q8_0 widened to bf16), each of 2 ranks reading its own experts into device memory; the
// layer's own loaded router routes.
void loader_case(std::mt19937& rng) {
  using writers::Scheme;
  const std::pair<Scheme, const char*> files[] = {
      {Scheme::Qwen, "BF16"}, {Scheme::FusedTransposed, "F16"}, {Scheme::Gguf, "Q8_0"}};
  for (const auto& f : files) {
    writers::Model m;
    m.spec.H = 64;
    m.spec.I = 32;
    m.spec.E = 8;
    m.spec.K = 2;
    m.dtype = f.second;
    m.layer = 3;
    m.w = ref::random_weights(m.spec, ref::F32, rng);
    const auto ts = writers::moe_tensors(m, f.first, rng);
    const std::string dir = writers::temp_dir("cuda");
    std::string path;
    if (f.first == Scheme::Gguf) {
      path = dir + "/model.gguf";
      writers::write_file(path, writers::gguf_bytes(ts, writers::gguf_meta(m)));
    } else {
      const std::string config = writers::hf_config(m, f.first);
      writers::write_file(dir + "/config.json", std::vector<uint8_t>(config.begin(), config.end()));
      path = dir + "/model.safetensors";
      writers::write_file(path, writers::safetensors_bytes(ts, {{"format", "pt"}}));
    }
    const std::string name = std::string("loader ") + f.second + (f.first == Scheme::Gguf ? " gguf" : " safetensors");
    ep_moe_checkpoint_t* ck = nullptr;
    if (ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) != EP_MOE_OK) {
      expect(false, name + ": open: " + ep_moe_last_error());
      continue;
    }
    Case c;
    c.name = name;
    c.s = m.spec;
    c.mode = 2;
    const int T = 24, n = 2;
    const Step st = draw(c, T, m.w, m.router, rng);
    const size_t cnt = static_cast<size_t>(T) * c.s.H;
    std::vector<double> sum(cnt, 0.0);
    std::vector<std::unique_ptr<DevBuf>> keep;
    DevBuf out(cnt * 4);
    bool ok = true;
    for (int r = 0; r < n && ok; ++r) {
      Case cr = c;
      cr.ep = n;
      RankLayer rl;
      rl.map = make_map(cr, r);
      ep_moe_layer_config_t lc;
      ep_moe_layer_config_init(&lc);
      lc.device = 0;  // before: a CUDA layer's weight_dtype for block formats is bf16, which they are widened to
      ok = ep_moe_checkpoint_layer_config(&lc, ck, m.layer) == EP_MOE_OK;
      lc.max_tokens = 64;
      ok = ok && rl.map && ep_moe_layer_create(&rl.layer, &lc, rl.map, nullptr, nullptr) == EP_MOE_OK;
      ok = ok && ep_moe_layer_load(rl.layer, ck, m.layer) == EP_MOE_OK;
      if (!ok) {
        expect(false, name + ": " + (rl.layer ? ep_moe_layer_last_error(rl.layer) : ep_moe_last_error()));
        break;
      }
      DeviceStep d;
      fill_step(d, c, st, T, out.p, nullptr);  // mode 2: no logits, no top-k
      ok = ep_moe_layer_forward(rl.layer, &d.args) == EP_MOE_OK;
      expect(ok, name + ": forward: " + ep_moe_layer_last_error(rl.layer));
      CU(cudaDeviceSynchronize());
      const std::vector<double> part = read_out(out.p, c, cnt);
      for (size_t i = 0; i < cnt; ++i) sum[i] += part[i];
    }
    ep_moe_checkpoint_close(ck);
    if (!ok) continue;
    const double err = rel_err(sum, st.expect);
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s EP=2 T=%d: rel err %.3g (tol 1e-2)", name.c_str(), T, err);
    std::printf("  %s\n", buf);
    expect(err <= 1e-2, buf);
  }
}

// Live re-placement of CUDA layers: EP 2 -> 3 with a joining rank (experts
// and shared shards move between ranks through a host communicator), then a
// custom placement with replicas on the same 3 ranks; and over NCCL (one
// rank, replicas: records and units staged through device memory). Each
// placement is checked by a forward against the reference.
// One all-gather forward on every layer (threads), checked against `st`.
void check_group(const std::string& name, const Case& c, std::vector<ep_moe_layer_t*>& layers, const Step& st, int T) {
  const size_t n = layers.size(), cnt = static_cast<size_t>(T) * c.s.H, es = c.adt == ref::F32 ? 4 : 2;
  std::vector<std::string> errors(n);
  std::vector<double> errs(n, 0.0);
  std::vector<std::thread> th;
  for (size_t r = 0; r < n; ++r)
    th.emplace_back([&, r] {
      cudaStream_t s;
      CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      DevBuf out(cnt * es);
      DeviceStep d;
      fill_step(d, c, st, T, out.p, s);
      if (ep_moe_layer_forward(layers[r], &d.args) != EP_MOE_OK) {
        errors[r] = ep_moe_layer_last_error(layers[r]);
      } else {
        CU(cudaStreamSynchronize(s));
        errs[r] = rel_err(read_out(out.p, c, cnt), st.expect);
      }
      CU(cudaStreamDestroy(s));
    });
  for (auto& t : th) t.join();
  for (size_t r = 0; r < n; ++r) {
    char buf[300];
    std::snprintf(buf, sizeof buf, "%s rank %zu: rel err %.3g (tol 1e-2)%s%s", name.c_str(), r, errs[r],
                  errors[r].empty() ? "" : " forward failed: ", errors[r].c_str());
    std::printf("  %s\n", buf);
    expect(errors[r].empty() && errs[r] <= 1e-2, buf);
  }
}

void replace_case(std::mt19937& rng) {
  Case c = make_case("replace", 128, 64, 8, 2);
  c.s.Is = 48;
  c.wdt = c.adt = ref::BF16;
  c.sync_free = 4;
  const ref::Weights w = ref::random_weights(c.s, c.wdt, rng);
  const int T = 24;
  std::vector<std::unique_ptr<DevBuf>> keep;
  std::vector<ep_moe_comm_t*> two(2, nullptr), three(3, nullptr);
  ep_moe_comm_create_local(two.data(), 2, nullptr);
  ep_moe_comm_create_local(three.data(), 3, nullptr);
  std::vector<ep_moe_layer_t*> layers;
  ep_moe_layer_config_t lc = layer_config(c, 64);
  bool ok = true;
  for (int r = 0; r < 2 && ok; ++r) {
    ep_moe_expert_map_t* m = map_for(2, r, c.s.E);
    ep_moe_layer_t* l = nullptr;
    ok = m && ep_moe_layer_create(&l, &lc, m, two[static_cast<size_t>(r)], nullptr) == EP_MOE_OK;
    ep_moe_expert_map_destroy(m);
    if (ok) layers.push_back(l);
    Case cr = c;
    ok = ok && set_weights(l, cr, w, {}, keep);
  }
  if (ok) {
    check_group("replace: EP2 before", c, layers, draw(c, T, w, {}, rng), T);
    // The joining rank: a layer of the new placement, no weights.
    ep_moe_expert_map_t* m2 = map_for(3, 2, c.s.E);
    ep_moe_layer_t* fresh = nullptr;
    ok = m2 && ep_moe_layer_create(&fresh, &lc, m2, three[2], nullptr) == EP_MOE_OK;
    ep_moe_expert_map_destroy(m2);
    if (ok) layers.push_back(fresh);
  }
  auto replace_all = [&](const std::vector<int32_t>& slots, bool new_comm, const char* what) {
    std::vector<ep_moe_status_t> st(layers.size(), EP_MOE_OK);
    std::vector<std::string> msg(layers.size());
    std::vector<std::thread> th;
    for (size_t r = 0; r < layers.size(); ++r)
      th.emplace_back([&, r] {
        ep_moe_expert_map_t* m = map_for(3, static_cast<int>(r), c.s.E, 0, slots);
        st[r] = ep_moe_layer_replace(layers[r], m, new_comm ? three[r] : nullptr, nullptr, 0);
        if (st[r] != EP_MOE_OK) msg[r] = ep_moe_layer_last_error(layers[r]);
        ep_moe_expert_map_destroy(m);
      });
    for (auto& t : th) t.join();
    for (size_t r = 0; r < layers.size(); ++r)
      expect(st[r] == EP_MOE_OK, std::string(what) + ": rank " + std::to_string(r) + ": " + msg[r]);
    return std::all_of(st.begin(), st.end(), [](ep_moe_status_t x) { return x == EP_MOE_OK; });
  };
  if (ok && replace_all({}, true, "replace EP2 -> EP3 (a joining rank)")) {
    int64_t got = 0;
    ep_moe_layer_get_attr(&got, layers[2], EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED);
    expect(got > 0, "the joining rank received weights");
    check_group("replace: EP3 after growing", c, layers, draw(c, T, w, {}, rng), T);
    const std::vector<int32_t> slots = {7, 6, 5, 4, 3, 2, 1, 0, 0, 7, 3, 4};  // reversed, plus replicas
    if (replace_all(slots, false, "replace with a custom placement and replicas"))
      check_group("replace: EP3 custom placement with replicas", c, layers, draw(c, T, w, {}, rng), T);
  }
  for (auto* l : layers) ep_moe_layer_destroy(l);
  for (auto* x : two) ep_moe_comm_destroy(x);
  for (auto* x : three) ep_moe_comm_destroy(x);

  // NCCL, one rank: the same placement with replicas of two experts.
  if (!ep_moe_has_feature(EP_MOE_FEATURE_NCCL)) return;
  uint8_t id[128];
  ep_moe_comm_t* comm = nullptr;
  if (ep_moe_nccl_get_unique_id(id, sizeof id) != EP_MOE_OK ||
      ep_moe_comm_create_nccl_from_id(&comm, id, sizeof id, 0, 1, nullptr) != EP_MOE_OK) {
    expect(false, std::string("replace nccl: comm: ") + ep_moe_last_error());
    return;
  }
  ep_moe_expert_map_t* m = map_for(1, 0, c.s.E);
  ep_moe_layer_t* l = nullptr;
  if (m && ep_moe_layer_create(&l, &lc, m, comm, nullptr) == EP_MOE_OK && set_weights(l, c, w, {}, keep)) {
    ep_moe_expert_map_t* m1 = map_for(1, 0, c.s.E, 0, {0, 1, 2, 3, 4, 5, 6, 7, 5, 2});
    const ep_moe_status_t st = ep_moe_layer_replace(l, m1, nullptr, nullptr, 0);
    expect(st == EP_MOE_OK, std::string("replace over NCCL: ") + ep_moe_layer_last_error(l));
    ep_moe_expert_map_destroy(m1);
    int64_t slots = 0;
    ep_moe_layer_get_attr(&slots, l, EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS);
    expect(slots == 10, "replace over NCCL: 10 slots");
    std::vector<ep_moe_layer_t*> one = {l};
    if (st == EP_MOE_OK) check_group("replace over NCCL, replicas", c, one, draw(c, T, w, {}, rng), T);
  } else {
    expect(false, std::string("replace nccl: layer: ") + ep_moe_last_error());
  }
  ep_moe_layer_destroy(l);
  ep_moe_expert_map_destroy(m);
  ep_moe_comm_destroy(comm);
}

// Bad input: clear statuses, and the layer still works afterwards.
void error_cases(std::mt19937& rng) {
  Case c = make_case("errors", 64, 32, 8, 2);
  c.sync_free = 4;
  const ref::Weights w = ref::random_weights(c.s, c.wdt, rng);
  RankLayer rl;
  rl.map = make_map(c, 0);
  ep_moe_layer_config_t lc = layer_config(c, 64);
  std::vector<std::unique_ptr<DevBuf>> keep;
  ep_moe_layer_t* bad = nullptr;
  lc.device = 4096;
  expect(ep_moe_layer_create(&bad, &lc, rl.map, nullptr, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT,
         "a device that does not exist is an INVALID_ARGUMENT");
  lc.device = 0;
  if (ep_moe_layer_create(&rl.layer, &lc, rl.map, nullptr, nullptr) != EP_MOE_OK ||
      !set_weights(rl.layer, c, w, {}, keep)) {
    expect(false, "errors: layer");
    return;
  }
  const int T = 20;  // above sync_free_tokens: inputs are checked
  Step st = draw(c, T, w, {}, rng);
  DevBuf out(static_cast<size_t>(T) * c.s.H * 4);
  {
    DeviceStep d;
    fill_step(d, c, st, T, out.p, nullptr);
    d.args.hidden = st.hidden.data();  // host memory
    expect(ep_moe_layer_forward(rl.layer, &d.args) == EP_MOE_ERR_INVALID_ARGUMENT,
           "host hidden pointer is an INVALID_ARGUMENT");
    expect(std::string(ep_moe_layer_last_error(rl.layer)).find("memory of CUDA device") != std::string::npos,
           "the message says device memory");
  }
  {
    Step nan = st;
    nan.logits[static_cast<size_t>(7) * c.s.E + 3] = NAN;
    DeviceStep d;
    fill_step(d, c, nan, T, out.p, nullptr);
    expect(ep_moe_layer_forward(rl.layer, &d.args) == EP_MOE_ERR_INVALID_ARGUMENT,
           "NaN logits are an INVALID_ARGUMENT");
    expect(std::string(ep_moe_layer_last_error(rl.layer)).find("token 7") != std::string::npos,
           std::string("the message names the token: ") + ep_moe_layer_last_error(rl.layer));
  }
  {
    Case g = c;
    g.mode = 1;
    Step t = draw(g, T, w, {}, rng);
    t.topk_ids[5] = c.s.E + 3;
    DeviceStep d;
    fill_step(d, g, t, T, out.p, nullptr);
    expect(ep_moe_layer_forward(rl.layer, &d.args) == EP_MOE_ERR_INVALID_ARGUMENT,
           "an out-of-range expert id is an INVALID_ARGUMENT");
  }
  {
    // A graph cannot capture a collective staged through host memory.
    ep_moe_comm_t* local = nullptr;
    RankLayer one;
    one.map = make_map(c, 0);
    ep_moe_layer_config_t lc1 = layer_config(c, 64);
    if (ep_moe_comm_create_local(&local, 1, nullptr) == EP_MOE_OK &&
        ep_moe_layer_create(&one.layer, &lc1, one.map, local, nullptr) == EP_MOE_OK &&
        set_weights(one.layer, c, w, {}, keep)) {
      cudaStream_t s;
      CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      DeviceStep d;
      fill_step(d, c, st, 2, out.p, s);
      cudaGraph_t graph = nullptr;
      CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      const ep_moe_status_t rc = ep_moe_layer_forward(one.layer, &d.args);
      const cudaError_t ec = cudaStreamEndCapture(s, &graph);
      expect(rc == EP_MOE_ERR_UNSUPPORTED,
             std::string("capturing a host-staged collective is UNSUPPORTED: ") + ep_moe_layer_last_error(one.layer));
      if (ec == cudaSuccess && graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      expect(ep_moe_layer_forward(one.layer, &d.args) == EP_MOE_OK,
             std::string("and works uncaptured: ") + ep_moe_layer_last_error(one.layer));
      CU(cudaStreamSynchronize(s));
      CU(cudaStreamDestroy(s));
    } else {
      expect(false, std::string("errors: local layer: ") + ep_moe_last_error());
    }
    ep_moe_layer_destroy(one.layer);
    one.layer = nullptr;
    ep_moe_comm_destroy(local);
  }
  {
    DeviceStep d;
    fill_step(d, c, st, T, out.p, nullptr);
    expect(ep_moe_layer_forward(rl.layer, &d.args) == EP_MOE_OK, "the layer works after bad input");
    CU(cudaDeviceSynchronize());
    const double err = rel_err(read_out(out.p, c, static_cast<size_t>(T) * c.s.H), st.expect);
    expect(err <= 1e-4, "and computes the right output");
  }
  {
    // GGUF block formats: a CUDA layer holds weight_dtype (no block-format
    // weight_dtype); blocks from host memory are widened to it as they are
    // stored, blocks in device memory are refused.
    ep_moe_layer_config_t qc = lc;
    qc.weight_dtype = EP_MOE_DTYPE_Q8_0;
    ep_moe_layer_t* q = nullptr;
    expect(ep_moe_layer_create(&q, &qc, rl.map, nullptr, nullptr) == EP_MOE_ERR_UNSUPPORTED,
           "a block-format weight_dtype is UNSUPPORTED on a CUDA layer");
    if (q) ep_moe_layer_destroy(q);
    ref::Weights wq = w;
    const std::vector<uint8_t> blocks = writers::quantize_q8_0(wq.down[1]);  // wq.down[1]: the blocks' values
    expect(ep_moe_layer_set_weight(nullptr, rl.layer, EP_MOE_WEIGHT_EXPERT_DOWN, 1, upload(blocks, keep),
                                   EP_MOE_DTYPE_Q8_0, c.s.H, c.s.I) == EP_MOE_ERR_UNSUPPORTED,
           "Q8_0 blocks in device memory are UNSUPPORTED");
    const bool set = ep_moe_layer_set_weight(nullptr, rl.layer, EP_MOE_WEIGHT_EXPERT_DOWN, 1, blocks.data(),
                                             EP_MOE_DTYPE_Q8_0, c.s.H, c.s.I) == EP_MOE_OK;
    expect(set, std::string("Q8_0 blocks from host memory are widened: ") + ep_moe_layer_last_error(rl.layer));
    const Step sq = draw(c, T, wq, {}, rng);
    DeviceStep d;
    fill_step(d, c, sq, T, out.p, nullptr);
    expect(set && ep_moe_layer_forward(rl.layer, &d.args) == EP_MOE_OK, "a forward with the widened blocks");
    CU(cudaDeviceSynchronize());
    const double err = rel_err(read_out(out.p, c, static_cast<size_t>(T) * c.s.H), sq.expect);
    std::printf("  errors: Q8_0 host blocks widened to f32: rel err %.3g (tol 1e-4)\n", err);
    expect(err <= 1e-4, "which hold the blocks' values exactly");
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int ep : {1, 2, 3}) {
    Case c = make_case("f32 softmax", 128, 96, 16, 4);
    c.name += " ep" + std::to_string(ep);
    c.ep = ep;
    c.tokens = {37, 5, 1, 0};
    v.push_back(c);
  }
  {
    Case c = make_case("bf16 sigmoid grouped+bias shared (deepseek-like) ep3", 256, 128, 32, 6);
    c.s.sigmoid = true;
    c.s.groups = 8;
    c.s.topk_group = 3;
    c.s.use_bias = true;
    c.s.scale = 2.5;
    c.s.Is = 96;
    c.wdt = c.adt = ref::BF16;
    c.ep = 3;
    c.tokens = {300, 9, 0, 1};
    c.device_weights = true;
    v.push_back(c);
  }
  {
    Case c = make_case("bf16 weights f32 act, given top-k, weight-0 ep2", 128, 64, 16, 4);
    c.wdt = ref::BF16;
    c.ep = 2;
    c.mode = 1;
    c.skip_mode = EP_MOE_SKIP_WEIGHT_ZERO;
    c.tokens = {50, 3};
    v.push_back(c);
  }
  {
    Case c = make_case("f16 odd sizes, gated shared (qwen2-like) ep2", 97, 45, 12, 3);
    c.s.Is = 50;
    c.s.shared_gate = true;
    c.wdt = c.adt = ref::F16;
    c.ep = 2;
    c.tokens = {33, 7};
    c.device_weights = true;
    v.push_back(c);
  }
  {
    Case c = make_case("skewed top-k (one expert in every token), bf16 ep2", 128, 64, 32, 2);
    c.wdt = c.adt = ref::BF16;
    c.ep = 2;
    c.mode = 1;
    c.skew = true;
    c.tokens = {200, 40};
    v.push_back(c);
  }
  for (int E : {160, 1100}) {  // plan scans over several warps, and several slots per thread
    Case c = make_case("many experts", 32, 16, E, 4);
    c.name += " E=" + std::to_string(E);
    c.tokens = {300, 40, 2};
    c.sync_free = 48;
    v.push_back(c);
  }
  {
    Case c = make_case("own router f32 ep2", 64, 48, 8, 2);
    c.mode = 2;
    c.ep = 2;
    c.tokens = {20, 2};
    v.push_back(c);
  }
  {
    Case c = make_case("replicas ep4 gelu", 128, 64, 16, 4);
    c.s.act = ref::GELU;
    c.redundant = 4;
    c.ep = 4;
    c.tokens = {64, 3};
    v.push_back(c);
  }
  {
    Case c = make_case("bf16 large batch ep4 gelu-tanh", 512, 256, 32, 8);
    c.s.act = ref::GELU_TANH;
    c.s.Is = 128;
    c.wdt = c.adt = ref::BF16;
    c.ep = 4;
    c.tokens = {1000, 64};
    c.sync_free = 64;
    v.push_back(c);
  }
  return v;
}

int no_device() {
  // The refusal is part of the contract: check it before saying "skipped".
  ep_moe_expert_map_t* m = map_for(1, 0, 4);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  lc.hidden_size = 8;
  lc.intermediate_size = 8;
  lc.num_experts = 4;
  lc.top_k = 2;
  lc.device = 0;
  ep_moe_layer_t* l = nullptr;
  if (!m) return 1;
  const ep_moe_status_t st = ep_moe_layer_create(&l, &lc, m, nullptr, nullptr);
  ep_moe_expert_map_destroy(m);
  if (st != EP_MOE_ERR_UNSUPPORTED) {
    std::fprintf(stderr, "FAIL: a CUDA layer without a device returned %d, not UNSUPPORTED\n", static_cast<int>(st));
    ep_moe_layer_destroy(l);
    return 1;
  }
  std::printf("device layer refused as expected: %s\n", ep_moe_last_error());
  std::printf("skipped: no CUDA device\n");
  return 77;
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return no_device();
  unsigned seed = std::random_device{}();
  if (const char* e = std::getenv("EP_MOE_TEST_SEED")) seed = static_cast<unsigned>(std::strtoul(e, nullptr, 10));
  std::printf("random inputs drawn with seed %u (replay: EP_MOE_TEST_SEED=%u)\n", seed, seed);
  std::mt19937 rng(seed);
  const bool quick = std::getenv("EP_MOE_CUDA_QUICK") != nullptr;  // one small case (for compute-sanitizer)
  for (const Case& c : cases()) {
    std::printf("%s\n", c.name.c_str());
    run_case(c, rng);
    if (quick) break;
  }
  if (!quick) {
    for (const GroupCase& g : group_cases()) group_case(g, rng);
    graph_case(rng);
    loader_case(rng);
    replace_case(rng);
    nccl_case(rng);
    error_cases(rng);
  }
  std::printf("%d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}

// Run under mpirun (-np 2, -np 4): the MPI backend's collectives, failure
// propagation and timeout, and the layer's correctness suite — every rank's
// output against the double-precision reference — in every dispatch mode.
// Exit code 0 only when every rank passed.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/reference_moe.hpp"
#include "ep_moe/ep_moe.h"

namespace {

int g_rank = 0, g_size = 1, g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "[rank %d] FAIL: %s\n", g_rank, what.c_str());
  }
}

ep_moe_comm_t* make_comm(int timeout_ms) {
  MPI_Comm w = MPI_COMM_WORLD;
  ep_moe_comm_config_t cc;
  ep_moe_comm_config_init(&cc);
  cc.timeout_ms = timeout_ms;
  ep_moe_comm_t* c = nullptr;
  const ep_moe_status_t s = ep_moe_comm_create_mpi(&c, &w, sizeof w, &cc);
  expect(s == EP_MOE_OK, std::string("create_mpi: ") + ep_moe_last_error());
  return c;
}

void collectives(ep_moe_comm_t* c) {
  // bf16 all-reduce: ep_moe's own reduction, f32 in rank order, one rounding.
  const size_t n = 1003;
  std::vector<uint16_t> in(n), out(n);
  for (size_t i = 0; i < n; ++i)
    in[i] = ref::to_bf16(0.25f * static_cast<float>(g_rank + 1) + static_cast<float>(i % 5));
  expect(ep_moe_comm_all_reduce(out.data(), in.data(), n, EP_MOE_DTYPE_BF16, c, nullptr) == EP_MOE_OK, "all_reduce");
  for (size_t i = 0; i < n; ++i) {
    float acc = 0;
    for (int r = 0; r < g_size; ++r)
      acc += ref::from_bf16(ref::to_bf16(0.25f * static_cast<float>(r + 1) + static_cast<float>(i % 5)));
    if (out[i] != ref::to_bf16(acc)) {
      expect(false, "all_reduce value at " + std::to_string(i));
      break;
    }
  }
  // all_to_all_v: rank p sends p + q + 1 int64 values to rank q.
  std::vector<size_t> sc(static_cast<size_t>(g_size)), rc(static_cast<size_t>(g_size));
  std::vector<int64_t> send, recv, want;
  for (int q = 0; q < g_size; ++q) {
    sc[static_cast<size_t>(q)] = static_cast<size_t>(g_rank + q + 1);
    rc[static_cast<size_t>(q)] = static_cast<size_t>(q + g_rank + 1);
    for (size_t k = 0; k < sc[static_cast<size_t>(q)]; ++k)
      send.push_back(g_rank * 1000 + q * 10 + static_cast<int64_t>(k));
    for (size_t k = 0; k < rc[static_cast<size_t>(q)]; ++k)
      want.push_back(q * 1000 + g_rank * 10 + static_cast<int64_t>(k));
  }
  recv.assign(want.size(), -1);
  expect(ep_moe_comm_all_to_all_v(recv.data(), rc.data(), send.data(), sc.data(), EP_MOE_DTYPE_I64, c, nullptr) ==
             EP_MOE_OK,
         "all_to_all_v");
  expect(recv == want, "all_to_all_v values");
  // A split into even and odd ranks.
  ep_moe_comm_t* sub = nullptr;
  expect(ep_moe_comm_split(&sub, c, g_rank % 2, g_rank) == EP_MOE_OK, "split");
  if (sub) {
    int32_t v = g_rank, size = 0;
    ep_moe_comm_get_size(&size, sub);
    expect(ep_moe_comm_all_reduce(&v, &v, 1, EP_MOE_DTYPE_I32, sub, nullptr) == EP_MOE_OK, "sub all_reduce");
    int32_t want_v = 0;
    for (int r = g_rank % 2; r < g_size; r += 2) want_v += r;
    expect(v == want_v, "sub all_reduce value");
    ep_moe_comm_destroy(sub);
  }
  // One rank passes NULL: it gets INVALID_ARGUMENT, the others REMOTE; the
  // communicator stays usable.
  float x = 1.0f;
  const ep_moe_status_t s =
      ep_moe_comm_all_reduce(g_rank == g_size - 1 ? nullptr : &x, &x, 1, EP_MOE_DTYPE_F32, c, nullptr);
  expect(s == (g_rank == g_size - 1 ? EP_MOE_ERR_INVALID_ARGUMENT : EP_MOE_ERR_REMOTE), "failure propagation");
  expect(ep_moe_comm_barrier(c) == EP_MOE_OK, "barrier after a failure");
}

struct Case {
  ref::Spec spec;
  int dp = 1, dispatch = EP_MOE_DISPATCH_ALLGATHER, placement = EP_MOE_PLACEMENT_LINEAR, wdt = ref::F32, adt = ref::F32;
  bool given_topk = false, decode = false;
  bool replace = false;  // then rebalance on the step's load, re-place live, and check again
};

// Every replica's tokens (the same on every rank: drawn from the case's
// seed): the hidden rows, the router's logits or the given top-k, and the
// double-precision reference's outputs.
struct Inputs {
  std::vector<int32_t> counts;  // tokens per replica, zeros too
  std::vector<std::vector<float>> hid, lg, tw;
  std::vector<std::vector<int32_t>> ti;
  std::vector<std::vector<double>> expect_out;
};

Inputs draw_inputs(const Case& k, const ref::Weights& w, std::mt19937& rng, int idx) {
  const ref::Spec& s = k.spec;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.05f, 1.0f);
  const auto replicas = static_cast<size_t>(k.dp);
  Inputs in;
  in.counts.resize(replicas);
  for (size_t d = 0; d < replicas; ++d) in.counts[d] = static_cast<int32_t>((d * 5 + idx * 3) % 7);  // zeros too
  if (replicas == 1) in.counts[0] = 3 + idx % 4;
  in.hid.resize(replicas);
  in.lg.resize(replicas);
  in.tw.resize(replicas);
  in.ti.resize(replicas);
  in.expect_out.resize(replicas);
  for (size_t d = 0; d < replicas; ++d) {
    const int T = in.counts[d];
    auto& h = in.hid[d];
    h.resize(static_cast<size_t>(T * s.H));
    for (auto& v : h) v = ref::round_to(nd(rng), k.adt);
    in.lg[d].resize(static_cast<size_t>(T * s.E));
    in.ti[d].resize(static_cast<size_t>(T * s.K));
    in.tw[d].resize(static_cast<size_t>(T * s.K));
    in.expect_out[d].resize(static_cast<size_t>(T * s.H));
    for (int t = 0; t < T; ++t) {
      std::vector<int> ids;
      std::vector<double> wts;
      if (k.given_topk) {
        std::vector<int> perm(static_cast<size_t>(s.E));
        for (int e = 0; e < s.E; ++e) perm[static_cast<size_t>(e)] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int j = 0; j < s.K; ++j) {
          in.ti[d][static_cast<size_t>(t * s.K + j)] = perm[static_cast<size_t>(j)];
          const float wv = ud(rng);
          in.tw[d][static_cast<size_t>(t * s.K + j)] = wv;
          ids.push_back(perm[static_cast<size_t>(j)]);
          wts.push_back(wv);
        }
      } else {
        float* l = in.lg[d].data() + t * s.E;
        do {
          for (int e = 0; e < s.E; ++e) l[e] = 2.0f * nd(rng);
        } while (!ref::route(s, l, w, ids, wts));
      }
      ref::moe_token(s, w, h.data() + t * s.H, ids, wts, in.expect_out[d].data() + t * s.H);
    }
  }
  return in;
}

// This rank's layer of the case with every expert's weights given (the
// layer keeps its own); null, with the failure recorded, where it could
// not be created.
ep_moe_layer_t* make_layer(ep_moe_comm_t* c, const Case& k, const ref::Weights& w, const std::string& tag) {
  const ref::Spec& s = k.spec;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = g_size;
  mc.ep_rank = g_rank;
  mc.global_num_experts = s.E;
  mc.placement = k.placement;
  mc.num_expert_group = s.groups;
  ep_moe_expert_map_t* map = nullptr;
  ep_moe_expert_map_create(&map, &mc);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  lc.hidden_size = s.H;
  lc.intermediate_size = s.I;
  lc.num_experts = s.E;
  lc.top_k = s.K;
  lc.weight_dtype = k.wdt;
  lc.act_dtype = k.adt;
  lc.num_expert_group = s.groups;
  lc.topk_group = s.topk_group;
  lc.shared_intermediate_size = s.Is;
  lc.max_tokens = 8;
  lc.num_threads = 1;
  lc.dispatch_mode = k.dispatch;
  ep_moe_layer_t* layer = nullptr;
  const ep_moe_status_t st = ep_moe_layer_create(&layer, &lc, map, c, k.dp > 1 ? c : nullptr);
  ep_moe_expert_map_destroy(map);
  if (st != EP_MOE_OK) {
    expect(false, tag + ": create: " + ep_moe_last_error());
    return nullptr;
  }
  auto put = [&](ep_moe_weight_t which, int e, const std::vector<float>& v, int rows, int cols) {
    const auto b = ref::encode(v, k.wdt);
    expect(ep_moe_layer_set_weight(nullptr, layer, which, e, b.data(), static_cast<ep_moe_dtype_t>(k.wdt), rows,
                                   cols) == EP_MOE_OK,
           tag + ": set_weight");
  };
  for (int e = 0; e < s.E; ++e) {
    put(EP_MOE_WEIGHT_EXPERT_GATE, e, w.gate[static_cast<size_t>(e)], s.I, s.H);
    put(EP_MOE_WEIGHT_EXPERT_UP, e, w.up[static_cast<size_t>(e)], s.I, s.H);
    put(EP_MOE_WEIGHT_EXPERT_DOWN, e, w.down[static_cast<size_t>(e)], s.H, s.I);
  }
  if (s.Is > 0) {
    put(EP_MOE_WEIGHT_SHARED_GATE, -1, w.s_gate, s.Is, s.H);
    put(EP_MOE_WEIGHT_SHARED_UP, -1, w.s_up, s.Is, s.H);
    put(EP_MOE_WEIGHT_SHARED_DOWN, -1, w.s_down, s.H, s.Is);
  }
  return layer;
}

// The load over the group, a placement with g_size redundant slots, and
// the weights moved over MPI by a live re-placement. True when it was done.
bool replace_live(ep_moe_layer_t* layer, const Case& k, const std::string& tag) {
  const int E = k.spec.E;
  std::vector<int64_t> load(static_cast<size_t>(E));
  expect(ep_moe_layer_expert_load(load.data(), load.size(), layer, 1, 1) == EP_MOE_OK, tag + ": expert_load");
  std::vector<double> loadd(load.begin(), load.end());
  for (auto& v : loadd) v += 1;  // every expert some load
  ep_moe_rebalance_config_t rc;
  ep_moe_rebalance_config_init(&rc);
  rc.num_experts = E;
  rc.num_slots = (E + g_size + g_size - 1) / g_size * g_size;
  rc.num_ranks = g_size;
  std::vector<int32_t> table(static_cast<size_t>(rc.num_slots));
  expect(ep_moe_rebalance(table.data(), table.size(), nullptr, loadd.data(), loadd.size(), &rc) == EP_MOE_OK,
         tag + ": rebalance");
  ep_moe_expert_map_config_t nc;
  ep_moe_expert_map_config_init(&nc);
  nc.ep_size = g_size;
  nc.ep_rank = g_rank;
  nc.global_num_experts = E;
  nc.placement = EP_MOE_PLACEMENT_CUSTOM;
  nc.custom_slots = table.data();
  nc.num_custom_slots = rc.num_slots;
  ep_moe_expert_map_t* next = nullptr;
  expect(ep_moe_expert_map_create(&next, &nc) == EP_MOE_OK, tag + ": custom map");
  const ep_moe_status_t rs = ep_moe_layer_replace(layer, next, nullptr, nullptr, 0);
  expect(rs == EP_MOE_OK, tag + ": replace: " + ep_moe_layer_last_error(layer));
  ep_moe_expert_map_destroy(next);
  return rs == EP_MOE_OK;
}

void run_case(ep_moe_comm_t* c, const Case& k, uint32_t seed, int idx) {
  std::mt19937 rng(seed);  // the same on every rank: same weights and inputs
  const ref::Spec& s = k.spec;
  const ref::Weights w = ref::random_weights(s, k.wdt, rng);
  const Inputs in = draw_inputs(k, w, rng, idx);
  const std::string tag = "case " + std::to_string(idx);
  ep_moe_layer_t* layer = make_layer(c, k, w, tag);
  if (!layer) return;
  const auto replica = static_cast<size_t>(k.dp > 1 ? g_rank : 0);
  const int T = in.counts[replica];
  const auto hb = ref::encode(in.hid[replica], k.adt);
  std::vector<uint8_t> out(static_cast<size_t>(T * s.H) * (k.adt == ref::F32 ? 4 : 2) + 1, 0);
  std::vector<int32_t> decode(static_cast<size_t>(k.dp), k.decode ? 1 : 0);
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = T;
  a.hidden = hb.data();
  if (k.given_topk) {
    a.topk_ids = in.ti[replica].data();
    a.topk_weights = in.tw[replica].data();
  } else {
    a.router_logits = in.lg[replica].data();
  }
  a.out = out.data();
  if (k.dp > 1) {
    a.dp_token_counts = in.counts.data();
    a.dp_is_decode = decode.data();
  }
  auto run = [&](const std::string& when) {
    const ep_moe_status_t st = ep_moe_layer_forward(layer, &a);
    expect(st == EP_MOE_OK, tag + when + ": forward: " + ep_moe_layer_last_error(layer));
    if (st == EP_MOE_OK) {
      const auto got = ref::decode(out.data(), static_cast<size_t>(T * s.H), k.adt);
      const auto& want = in.expect_out[replica];
      double scale = 1e-6, err = 0;
      for (double v : want) scale = std::max(scale, std::fabs(v));
      for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(got[i] - want[i]));
      const double tol = (k.adt == ref::BF16 || k.wdt == ref::BF16) ? 1e-2
                         : (k.adt == ref::F16 || k.wdt == ref::F16) ? 5e-3
                                                                    : 1e-4;
      expect(err / scale <= tol, tag + when + ": error " + std::to_string(err / scale));
    }
  };
  run("");
  // The same step after a live re-placement must give the same answer.
  if (k.replace && replace_live(layer, k, tag)) run(" after replace");
  ep_moe_layer_destroy(layer);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const uint32_t seed = argc > 1 ? static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10)) : std::random_device{}();
  uint32_t shared_seed = seed;
  MPI_Bcast(&shared_seed, 1, MPI_UINT32_T, 0, MPI_COMM_WORLD);
  if (g_rank == 0) std::printf("mpi_forward: %d ranks, seed %u\n", g_size, shared_seed);

  ep_moe_comm_t* c = make_comm(30000);
  expect(std::string(ep_moe_comm_backend(c)) == "mpi", "backend name");
  collectives(c);

  int idx = 0;
  for (int dispatch : {EP_MOE_DISPATCH_ALLGATHER, EP_MOE_DISPATCH_ALLTOALL, EP_MOE_DISPATCH_AUTO})
    for (int dp : {1, g_size})
      for (int variant = 0; variant < 3; ++variant) {
        Case k;
        k.dispatch = dispatch;
        k.dp = dp;
        k.spec.H = 40;
        k.spec.I = 24;
        k.spec.E = 3 * g_size + 1;  // never a multiple of the EP size
        k.spec.K = variant == 0 ? 1 : variant == 1 ? 2 : std::min(8, k.spec.E);
        k.spec.Is = variant == 1 ? 16 : 0;
        k.wdt = variant == 2 ? ref::BF16 : ref::F32;
        k.adt = variant == 2 ? ref::BF16 : ref::F32;
        k.given_topk = variant == 1;
        k.decode = variant != 0;
        k.replace = variant == 1;
        if (variant == 2 && dispatch == EP_MOE_DISPATCH_ALLGATHER && g_size > 1) {  // round robin needs groups
          k.spec.E = 4 * g_size;
          k.spec.groups = 2;
          k.spec.topk_group = 2;
          k.placement = EP_MOE_PLACEMENT_ROUND_ROBIN;
        }
        run_case(c, k, shared_seed + static_cast<uint32_t>(idx), idx);
        ++idx;
      }

  // A rank that joins late: the others time out within timeout + 1 s.
  ep_moe_comm_t* t = make_comm(500);
  const auto t0 = std::chrono::steady_clock::now();
  if (g_rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const ep_moe_status_t bs = ep_moe_comm_barrier(t);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (g_rank != 0 && g_size > 1) {
    expect(bs == EP_MOE_ERR_TIMEOUT, "late peer: timeout");
    expect(took < 1.5, "late peer: returned within timeout + 1 s");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  ep_moe_comm_destroy(t);

  ep_moe_comm_destroy(c);
  int total = 0;
  MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) std::printf("mpi_forward: %d cases, %d failures over %d ranks\n", idx, total, g_size);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}

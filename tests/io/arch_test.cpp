// Loads the per-architecture checkpoints of arch_checkpoints.py through the
// C API alone (open -> layer config derived from the file -> expert map from
// it -> create -> load -> forward with the loaded router) and compares with
// the output of the architecture's own MoE block, computed there in float64:
// at EP 1-4, T = 1, 7 and 64, with every rank holding all tokens and with
// DP attention (uneven token counts, a zero-token rank). Then each case's
// mutations of the derived config (another scoring, renormalisation, scale,
// grouping or activation) must move the output far outside the tolerance: a
// case that passes with the wrong semantics fails (what the config cannot
// express, GPT-OSS's biases, interleaving and clamp, the writer checks: its
// reference without each differs by more than kMutated). Cases the library must refuse are
// checked for the status and the message. Exit 77 when the writers did not run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace {

constexpr double kTolerance = 1e-4;  // f32 weights and activations against float64
constexpr double kMutated = 1e-2;    // what a wrong semantic must at least cost

struct Case {
  std::string name, kind, path, arch, mutations, needle;
  int layer = 0, H = 0, T = 0;
};

int failures = 0;
void failf(const Case& c, const std::string& what) {
  std::fprintf(stderr, "FAIL %s: %s\n", c.name.c_str(), what.c_str());
  ++failures;
}

template <class T>
std::vector<T> read_all(const std::string& path, size_t n) {
  std::vector<T> v(n);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  if (!in) v.clear();
  return v;
}

// The bytes a rank must read of a layer without a shared expert, by the
// checkpoint's own account (ep_moe_checkpoint_tensor_info): each of its
// experts' weights and biases (fused gate_up where the file has it), the
// router and its bias, the score bias. -1 when a lookup fails.
int64_t expected_bytes(ep_moe_checkpoint_t* ck, int layer, const ep_moe_expert_map_t* map, int experts) {
  int64_t total = 0;
  const auto add = [&](ep_moe_weight_t w, int32_t e) {
    ep_moe_tensor_info_t t;
    ep_moe_tensor_info_init(&t);
    if (ep_moe_checkpoint_tensor_info(&t, ck, layer, w, e) != EP_MOE_OK) return false;
    total += t.bytes;
    return true;
  };
  for (int32_t e = 0; e < experts; ++e) {
    int32_t local = 0;
    if (ep_moe_expert_map_is_local(&local, map, e) != EP_MOE_OK) return -1;
    if (!local) continue;
    if (!add(EP_MOE_WEIGHT_EXPERT_GATE_UP, e) &&
        !(add(EP_MOE_WEIGHT_EXPERT_GATE, e) && add(EP_MOE_WEIGHT_EXPERT_UP, e)))
      return -1;
    if (!add(EP_MOE_WEIGHT_EXPERT_DOWN, e)) return -1;
    if (!add(EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, e) && add(EP_MOE_WEIGHT_EXPERT_GATE_BIAS, e))
      add(EP_MOE_WEIGHT_EXPERT_UP_BIAS, e);
    add(EP_MOE_WEIGHT_EXPERT_DOWN_BIAS, e);
  }
  for (ep_moe_weight_t w : {EP_MOE_WEIGHT_ROUTER, EP_MOE_WEIGHT_ROUTER_BIAS, EP_MOE_WEIGHT_SCORE_BIAS}) add(w, -1);
  return total;
}

// One forward of `T` tokens over `ep` ranks; `dp`: every rank its own DP
// replica (rank r takes its share of the tokens, rank 0 none when ep >= 3),
// else every rank passes all T. Returns the largest |out - expect| over
// max |expect|, or a negative value after reporting a failure.
double run(const Case& c, ep_moe_checkpoint_t* ck, const ep_moe_layer_config_t& base, int ep, int T, bool dp,
           const std::vector<float>& x, const std::vector<double>& expect) {
  const int H = c.H;
  // DP shares: rank r weighs r + 1 (uneven), rank 0 none when ep >= 3.
  std::vector<int> begin(static_cast<size_t>(ep) + 1, 0);
  int weight_sum = 0;
  for (int r = 0; r < ep; ++r) weight_sum += (ep >= 3 && r == 0) ? 0 : r + 1;
  for (int r = 0; r < ep; ++r) {
    const int w = (ep >= 3 && r == 0) ? 0 : r + 1;
    begin[static_cast<size_t>(r) + 1] = r + 1 == ep ? T : begin[static_cast<size_t>(r)] + T * w / weight_sum;
  }
  std::vector<int32_t> counts(static_cast<size_t>(ep));
  for (int r = 0; r < ep; ++r)
    counts[static_cast<size_t>(r)] = begin[static_cast<size_t>(r) + 1] - begin[static_cast<size_t>(r)];
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ep));
  if (ep_moe_comm_create_local(comms.data(), ep, nullptr) != EP_MOE_OK) {
    failf(c, std::string("comm: ") + ep_moe_last_error());
    return -1;
  }
  std::vector<std::string> errors(static_cast<size_t>(ep));
  std::vector<double> err(static_cast<size_t>(ep), 0), peak(static_cast<size_t>(ep), 0);
  std::vector<std::thread> th;
  for (int r = 0; r < ep; ++r) {
    th.emplace_back([&, r] {
      std::string& e = errors[static_cast<size_t>(r)];
      ep_moe_comm_t* comm = comms[static_cast<size_t>(r)];
      const int t0 = dp ? begin[static_cast<size_t>(r)] : 0, t1 = dp ? begin[static_cast<size_t>(r) + 1] : T;
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      ep_moe_expert_map_t* map = nullptr;
      ep_moe_layer_t* layer = nullptr;
      ep_moe_layer_config_t lc = base;
      lc.max_tokens = std::max(1, T);
      int64_t has_router = 0;
      if (ep_moe_expert_map_config_from_layer(&mc, &lc) != EP_MOE_OK)
        e = std::string("map config: ") + ep_moe_last_error();
      mc.ep_size = ep;
      mc.ep_rank = r;
      if (e.empty() && ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) e = std::string("map: ") + ep_moe_last_error();
      if (e.empty() && ep_moe_layer_create(&layer, &lc, map, comm, dp ? comm : nullptr) != EP_MOE_OK)
        e = std::string("create: ") + ep_moe_last_error();
      if (e.empty() && ep_moe_layer_load(layer, ck, c.layer) != EP_MOE_OK)
        e = std::string("load: ") + ep_moe_last_error();
      // Only this rank's experts' bytes were read (block formats as they are).
      if (e.empty() && lc.shared_intermediate_size == 0) {
        int64_t loaded = -1;
        const int64_t want = expected_bytes(ck, c.layer, map, lc.num_experts);
        ep_moe_layer_get_attr(&loaded, layer, EP_MOE_LAYER_ATTR_BYTES_LOADED);
        if (want < 0 || loaded != want)
          e = "read " + std::to_string(loaded) + " bytes of the checkpoint, its tensors' account is " +
              std::to_string(want);
      }
      if (e.empty() &&
          (ep_moe_layer_get_attr(&has_router, layer, EP_MOE_LAYER_ATTR_HAS_ROUTER) != EP_MOE_OK || has_router != 1))
        e = "EP_MOE_LAYER_ATTR_HAS_ROUTER is not 1 after loading a checkpoint with a router";
      std::vector<float> out(static_cast<size_t>(std::max(1, t1 - t0) * H), 0.0f);
      if (e.empty()) {
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = t1 - t0;
        a.hidden = x.data() + static_cast<size_t>(t0) * static_cast<size_t>(H);
        a.out = out.data();
        if (dp) a.dp_token_counts = counts.data();
        if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) e = std::string("forward: ") + ep_moe_last_error();
      }
      if (!e.empty()) ep_moe_comm_abort(comm);
      for (int t = t0; e.empty() && t < t1; ++t)
        for (int i = 0; i < H; ++i) {
          const double want = expect[static_cast<size_t>(t) * static_cast<size_t>(H) + static_cast<size_t>(i)];
          const double got = out[static_cast<size_t>(t - t0) * static_cast<size_t>(H) + static_cast<size_t>(i)];
          err[static_cast<size_t>(r)] = std::max(err[static_cast<size_t>(r)], std::fabs(got - want));
          peak[static_cast<size_t>(r)] = std::max(peak[static_cast<size_t>(r)], std::fabs(want));
        }
      ep_moe_layer_destroy(layer);
      ep_moe_expert_map_destroy(map);
    });
  }
  for (auto& t : th) t.join();
  for (auto* cm : comms) ep_moe_comm_destroy(cm);
  for (const std::string& e : errors)
    if (!e.empty()) {
      failf(c, "ep " + std::to_string(ep) + " T " + std::to_string(T) + ": " + e);
      return -1;
    }
  double e = 0, p = 0;
  for (int r = 0; r < ep; ++r) {
    e = std::max(e, err[static_cast<size_t>(r)]);
    p = std::max(p, peak[static_cast<size_t>(r)]);
  }
  return p > 0 ? e / p : 0.0;
}

// Applies one named mutation; false when it would change nothing.
bool mutate(ep_moe_layer_config_t* lc, const std::string& m) {
  if (m == "scoring")
    lc->scoring = lc->scoring == EP_MOE_SCORING_SIGMOID ? EP_MOE_SCORING_SOFTMAX : EP_MOE_SCORING_SIGMOID;
  else if (m == "renormalize") lc->renormalize = !lc->renormalize;
  else if (m == "activation") lc->activation = lc->activation == EP_MOE_ACT_SILU ? EP_MOE_ACT_GELU : EP_MOE_ACT_SILU;
  else if (m == "scale") lc->routed_scaling_factor = lc->routed_scaling_factor != 1.0f ? 1.0f : 2.0f;
  else if (m == "groups") {
    if (lc->num_expert_group == 0) return false;
    lc->num_expert_group = 0;
    lc->topk_group = 0;
  } else {
    return false;
  }
  return true;
}

void check_ok(const Case& c, const std::string& dir) {
  ep_moe_checkpoint_t* ck = nullptr;
  if (ep_moe_checkpoint_open(&ck, (dir + "/" + c.path).c_str(), nullptr) != EP_MOE_OK)
    return failf(c, std::string("open: ") + ep_moe_last_error());
  if (c.arch != ep_moe_checkpoint_architecture(ck))
    failf(c, "architecture '" + std::string(ep_moe_checkpoint_architecture(ck)) + "', expected '" + c.arch + "'");
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  if (ep_moe_checkpoint_layer_config(&lc, ck, c.layer) != EP_MOE_OK) {
    failf(c, std::string("layer config: ") + ep_moe_last_error());
    ep_moe_checkpoint_close(ck);
    return;
  }
  const size_t n = static_cast<size_t>(c.T) * static_cast<size_t>(c.H);
  const std::vector<float> x = read_all<float>(dir + "/" + c.name + "/hidden.f32", n);
  const std::vector<double> expect = read_all<double>(dir + "/" + c.name + "/expect.f64", n);
  if (x.empty() || expect.empty()) {
    failf(c, "short hidden.f32 / expect.f64");
    ep_moe_checkpoint_close(ck);
    return;
  }
  double worst = 0;
  for (int ep : {1, 2, 3, 4})
    for (int T : {1, 7, 64})
      for (bool dp : {false, true}) {
        if (dp && ep == 1) continue;
        const double e = run(c, ck, lc, ep, std::min(T, c.T), dp, x, expect);
        if (e < 0) continue;
        worst = std::max(worst, e);
        if (e > kTolerance) {
          std::ostringstream o;
          o << "ep " << ep << " T " << T << (dp ? " dp" : "") << ": relative error " << e << " > " << kTolerance;
          failf(c, o.str());
        }
      }
  std::string mutated;
  std::stringstream ms(c.mutations == "-" ? "" : c.mutations);
  for (std::string m; std::getline(ms, m, ',');) {
    ep_moe_layer_config_t wrong = lc;
    if (!mutate(&wrong, m)) {
      failf(c, "mutation '" + m + "' changes nothing in the derived config");
      continue;
    }
    const double e = run(c, ck, wrong, 2, c.T, false, x, expect);
    if (e >= 0 && e < kMutated) {
      std::ostringstream o;
      o << "with the mutation '" << m << "' the error is only " << e << ": the case cannot tell the semantics apart";
      failf(c, o.str());
    }
    std::ostringstream o;
    o << " " << m << " " << e;
    mutated += o.str();
  }
  std::printf("%-22s %-12s max relative error %.2e; mutated:%s\n", c.name.c_str(), c.arch.c_str(), worst,
              mutated.empty() ? " -" : mutated.c_str());
  ep_moe_checkpoint_close(ck);
}

void check_refused(const Case& c, const std::string& dir) {
  ep_moe_checkpoint_t* ck = nullptr;
  if (ep_moe_checkpoint_open(&ck, (dir + "/" + c.path).c_str(), nullptr) != EP_MOE_OK)
    return failf(c, std::string("open: ") + ep_moe_last_error());
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  const ep_moe_status_t st = ep_moe_checkpoint_layer_config(&lc, ck, c.layer);
  const std::string msg = ep_moe_last_error();
  if (st != EP_MOE_ERR_UNSUPPORTED && st != EP_MOE_ERR_FORMAT)
    failf(c, std::string("layer config returned ") + ep_moe_status_string(st) + ", expected a refusal");
  if (msg.find(c.needle) == std::string::npos) failf(c, "the message does not name '" + c.needle + "': " + msg);
  if (lc.hidden_size != 0) failf(c, "a refused layer config was still written");
  if (c.kind == "refuse_load") {
    // Filling the config by hand does not get past it either.
    lc.hidden_size = c.H;
    lc.intermediate_size = 32;
    lc.num_experts = 8;
    lc.top_k = 2;
    ep_moe_expert_map_config_t mc;
    ep_moe_expert_map_config_init(&mc);
    ep_moe_expert_map_config_from_layer(&mc, &lc);
    ep_moe_expert_map_t* map = nullptr;
    ep_moe_layer_t* layer = nullptr;
    if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK ||
        ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) != EP_MOE_OK)
      failf(c, std::string("create: ") + ep_moe_last_error());
    else if (int64_t r = -1; ep_moe_layer_get_attr(&r, layer, EP_MOE_LAYER_ATTR_HAS_ROUTER) != EP_MOE_OK || r != 0)
      failf(c, "EP_MOE_LAYER_ATTR_HAS_ROUTER is not 0 before any router is set");
    else if (ep_moe_layer_load(layer, ck, c.layer) != EP_MOE_ERR_UNSUPPORTED)
      failf(c, "ep_moe_layer_load did not refuse it");
    ep_moe_layer_destroy(layer);
    ep_moe_expert_map_destroy(map);
  }
  std::printf("%-22s refused: %s\n", c.name.c_str(), msg.c_str());
  ep_moe_checkpoint_close(ck);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: arch_test DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::ifstream in(dir + "/cases.txt");
  if (!in) {
    std::printf("skipped: the architecture writers did not run (no %s/cases.txt)\n", dir.c_str());
    return 77;
  }
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    std::istringstream ls(line);
    Case c;
    if (!(ls >> c.name >> c.kind >> c.path >> c.layer >> c.H >> c.T >> c.arch >> c.mutations >> c.needle)) {
      std::fprintf(stderr, "FAIL: bad line in cases.txt: %s\n", line.c_str());
      return 1;
    }
    if (c.kind == "ok") check_ok(c, dir);
    else check_refused(c, dir);
    ++n;
  }
  if (n == 0) {
    std::fprintf(stderr, "FAIL: no cases\n");
    return 1;
  }
  std::printf("%d architecture cases, %d failure(s)\n", n, failures);
  return failures ? 1 : 0;
}

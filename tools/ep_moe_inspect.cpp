// ep_moe_inspect PATH [--layer L] [--ep N] [--placement linear|round_robin]
//                     [--naming auto|hf|mixtral|hf-fused|hf-fused-transposed|gguf] [--prefix P]
//
// Lists the MoE layers of a checkpoint (safetensors, sharded safetensors or
// GGUF), their shapes and dtypes, and for an EP size the experts and bytes
// each rank would read. Public API only.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cli.hpp"
#include "ep_moe/ep_moe.h"

namespace {

std::string ranges(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(v[i]);
    if (j > i) s += "-" + std::to_string(v[j]);
    i = j + 1;
  }
  return s.empty() ? "-" : s;
}

std::string human(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int k = 0;
  while (b >= 1024 && k < 4) {
    b /= 1024;
    ++k;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, k ? "%.2f %s" : "%.0f %s", b, u[k]);
  return buf;
}

const char* weight_label(ep_moe_weight_t w) {
  switch (w) {
    case EP_MOE_WEIGHT_EXPERT_GATE: return "expert gate";
    case EP_MOE_WEIGHT_EXPERT_UP: return "expert up";
    case EP_MOE_WEIGHT_EXPERT_DOWN: return "expert down";
    case EP_MOE_WEIGHT_EXPERT_GATE_UP: return "expert gate_up";
    case EP_MOE_WEIGHT_SHARED_GATE: return "shared gate";
    case EP_MOE_WEIGHT_SHARED_UP: return "shared up";
    case EP_MOE_WEIGHT_SHARED_DOWN: return "shared down";
    case EP_MOE_WEIGHT_SHARED_EXPERT_GATE: return "shared expert gate";
    case EP_MOE_WEIGHT_SCORE_BIAS: return "score bias";
    case EP_MOE_WEIGHT_ROUTER: return "router";
    case EP_MOE_WEIGHT_ROUTER_BIAS: return "router bias";
    case EP_MOE_WEIGHT_EXPERT_GATE_BIAS: return "expert gate bias";
    case EP_MOE_WEIGHT_EXPERT_UP_BIAS: return "expert up bias";
    case EP_MOE_WEIGHT_EXPERT_DOWN_BIAS: return "expert down bias";
    case EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS: return "expert gate_up bias";
    default: return "?";
  }
}

bool info(ep_moe_tensor_info_t* ti, const ep_moe_checkpoint_t* ck, int32_t layer, ep_moe_weight_t w, int32_t e) {
  ep_moe_tensor_info_init(ti);
  return ep_moe_checkpoint_tensor_info(ti, ck, layer, w, e) == EP_MOE_OK;
}

}  // namespace

// Prints MoE layer L: the semantics derived, every weight's tensor and
// bytes, and with ep > 0 what each rank would read. 0, 1 when its config
// cannot be derived (said), -1 on a failure that ends the program.
int print_layer(const ep_moe_checkpoint_t* ck, int32_t L, int ep, int placement) {
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  if (ep_moe_checkpoint_layer_config(&lc, ck, L) != EP_MOE_OK) {
    std::printf("\nlayer %d: %s\n", L, ep_moe_checkpoint_last_error(ck));
    return 1;
  }
  // The semantics ep_moe derived for the architecture (docs/formats.md).
  const char* act = lc.activation == EP_MOE_ACT_GELU         ? "gelu"
                    : lc.activation == EP_MOE_ACT_GELU_TANH  ? "gelu-tanh"
                    : lc.activation == EP_MOE_ACT_SWIGLU_OAI ? "clamped swiglu (gpt-oss)"
                                                             : "silu";
  std::printf("\nlayer %d: H %d, I %d, %d experts, top-%d, %s%s%s, groups %d/%d, scale %g, %s, shared %d%s\n", L,
              lc.hidden_size, lc.intermediate_size, lc.num_experts, lc.top_k,
              lc.scoring == EP_MOE_SCORING_SIGMOID ? "sigmoid" : "softmax", lc.renormalize ? " renormalised" : "",
              lc.use_score_bias ? " + bias" : "", lc.num_expert_group, lc.topk_group,
              static_cast<double>(lc.routed_scaling_factor), act, lc.shared_intermediate_size,
              lc.shared_expert_gate ? " (gated)" : "");
  std::printf("  %-19s %-8s %-26s %12s  %s\n", "weight", "dtype", "shape", "bytes", "tensor");
  const ep_moe_weight_t ws[] = {
      EP_MOE_WEIGHT_EXPERT_GATE_UP, EP_MOE_WEIGHT_EXPERT_GATE,         EP_MOE_WEIGHT_EXPERT_UP,
      EP_MOE_WEIGHT_EXPERT_DOWN,    EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, EP_MOE_WEIGHT_EXPERT_GATE_BIAS,
      EP_MOE_WEIGHT_EXPERT_UP_BIAS, EP_MOE_WEIGHT_EXPERT_DOWN_BIAS,    EP_MOE_WEIGHT_ROUTER,
      EP_MOE_WEIGHT_ROUTER_BIAS,    EP_MOE_WEIGHT_SCORE_BIAS,          EP_MOE_WEIGHT_SHARED_GATE,
      EP_MOE_WEIGHT_SHARED_UP,      EP_MOE_WEIGHT_SHARED_DOWN,         EP_MOE_WEIGHT_SHARED_EXPERT_GATE};
  double expert_bytes = 0, other_bytes = 0, shared_bytes = 0;
  std::vector<std::pair<std::string, double>> by_type;  // one expert's bytes per dtype (block formats as they are)
  bool fused = false, fused_bias = false;
  for (ep_moe_weight_t w : ws) {
    const bool routed = w <= EP_MOE_WEIGHT_EXPERT_GATE_UP ||
                        (w >= EP_MOE_WEIGHT_EXPERT_GATE_BIAS && w <= EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS);
    if (fused && (w == EP_MOE_WEIGHT_EXPERT_GATE || w == EP_MOE_WEIGHT_EXPERT_UP)) continue;
    if (fused_bias && (w == EP_MOE_WEIGHT_EXPERT_GATE_BIAS || w == EP_MOE_WEIGHT_EXPERT_UP_BIAS)) continue;
    ep_moe_tensor_info_t ti;
    if (!info(&ti, ck, L, w, routed ? 0 : -1)) continue;
    if (w == EP_MOE_WEIGHT_EXPERT_GATE_UP) fused = true;
    if (w == EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS) fused_bias = true;
    std::string shape = "[";
    for (int d = 0; d < ti.n_dims; ++d) shape += (d ? ", " : "") + std::to_string(ti.dims[d]);
    shape += "]";
    std::printf("  %-19s %-8s %-26s %12s  %s%s\n", weight_label(w), ti.dtype, shape.c_str(),
                human(static_cast<double>(ti.bytes)).c_str(), ti.name, ti.transposed ? " (transposed)" : "");
    if (routed) {
      expert_bytes += static_cast<double>(ti.bytes);
      auto it = std::find_if(by_type.begin(), by_type.end(), [&](const auto& p) { return p.first == ti.dtype; });
      if (it == by_type.end()) by_type.emplace_back(ti.dtype, static_cast<double>(ti.bytes));
      else it->second += static_cast<double>(ti.bytes);
    } else if (w >= EP_MOE_WEIGHT_SHARED_GATE && w <= EP_MOE_WEIGHT_SHARED_DOWN)
      shared_bytes += static_cast<double>(ti.bytes);
    else other_bytes += static_cast<double>(ti.bytes);
  }
  std::printf("  per expert %s, all experts %s, router/bias/gates %s, shared expert %s\n", human(expert_bytes).c_str(),
              human(expert_bytes * lc.num_experts).c_str(), human(other_bytes).c_str(), human(shared_bytes).c_str());
  if (ep <= 0) return 0;
  std::printf("  EP %d (%s placement):\n  %-5s %-24s %12s %12s %12s  %s\n", ep,
              placement == EP_MOE_PLACEMENT_LINEAR ? "linear" : "round-robin", "rank", "experts", "expert bytes",
              "other bytes", "total", "expert bytes by type");
  for (int r = 0; r < ep; ++r) {
    ep_moe_expert_map_config_t mc;
    ep_moe_expert_map_config_init(&mc);
    mc.ep_size = ep;
    mc.ep_rank = r;
    ep_moe_expert_map_config_from_layer(&mc, &lc);
    mc.placement = placement;
    ep_moe_expert_map_t* map = nullptr;
    if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) {
      std::fprintf(stderr, "%s\n", ep_moe_last_error());
      return -1;
    }
    int32_t nl = 0;
    ep_moe_expert_map_get_attr(&nl, map, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED);
    std::vector<int32_t> l2g(static_cast<size_t>(nl));
    ep_moe_expert_map_copy_table(l2g.data(), l2g.size(), map, EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL);
    ep_moe_expert_map_destroy(map);
    // The shared expert's intermediate columns split like the experts.
    const int64_t Is = lc.shared_intermediate_size;
    const double shard = Is > 0 ? static_cast<double>(Is / ep + (r < Is % ep ? 1 : 0)) / static_cast<double>(Is) : 0;
    const double mine = expert_bytes * nl, other = other_bytes + shared_bytes * shard;
    std::string types;
    for (const auto& t : by_type) types += (types.empty() ? "" : ", ") + t.first + " " + human(t.second * nl);
    std::printf("  %-5d %-24s %12s %12s %12s  %s\n", r, ranges(l2g).c_str(), human(mine).c_str(), human(other).c_str(),
                human(mine + other).c_str(), types.c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  std::string path;
  int layer_only = -1, ep = 0, placement = EP_MOE_PLACEMENT_LINEAR;
  ep_moe_checkpoint_config_t cc;
  ep_moe_checkpoint_config_init(&cc);
  std::string prefix;
  cli::Parser args(
      "ep_moe_inspect PATH [options]",
      "What a checkpoint holds, the layer configuration derived from it, and what each EP rank would read.");
  args.positional("PATH", &path, "a safetensors file or directory, or a GGUF file")
      .option("--layer", &layer_only, "only this layer", 0, 1 << 24)
      .option("--ep", &ep, "EP size whose per-rank reads to show", 0, 1 << 24)
      .custom("--placement", "P", "linear (default) or round_robin",
              [&placement](const std::string& v, std::string* err) {
                if (v == "linear") placement = EP_MOE_PLACEMENT_LINEAR;
                else if (v == "round_robin") placement = EP_MOE_PLACEMENT_ROUND_ROBIN;
                else *err = "unknown placement " + v;
                return err->empty();
              })
      .custom("--naming", "N", "auto, hf, mixtral, hf-fused, hf-fused-transposed or gguf",
              [&cc](const std::string& v, std::string* err) {
                const char* names[] = {"auto", "hf", "mixtral", "hf-fused", "hf-fused-transposed", "gguf"};
                for (int k = 0; k < 6; ++k)
                  if (v == names[k]) {
                    cc.naming = k;
                    return true;
                  }
                *err = "unknown naming " + v;
                return false;
              })
      .option("--prefix", &prefix, "a name prefix before the layers (e.g. model.language_model.)", "P");
  if (const int rc = args.parse(argc, argv); rc != cli::Parser::kRun) return rc;
  if (!prefix.empty()) cc.name_prefix = prefix.c_str();
  ep_moe_checkpoint_t* ck = nullptr;
  const ep_moe_status_t st = ep_moe_checkpoint_open(&ck, path.c_str(), &cc);
  if (st != EP_MOE_OK) {
    std::fprintf(stderr, "%s: %s\n", ep_moe_status_string(st), ep_moe_last_error());
    return 1;
  }
  int64_t format = 0, naming = 0, files = 0, tensors = 0, layers = 0, header = 0;
  ep_moe_checkpoint_get_attr(&format, ck, EP_MOE_CHECKPOINT_ATTR_FORMAT);
  ep_moe_checkpoint_get_attr(&naming, ck, EP_MOE_CHECKPOINT_ATTR_NAMING);
  ep_moe_checkpoint_get_attr(&files, ck, EP_MOE_CHECKPOINT_ATTR_NUM_FILES);
  ep_moe_checkpoint_get_attr(&tensors, ck, EP_MOE_CHECKPOINT_ATTR_NUM_TENSORS);
  ep_moe_checkpoint_get_attr(&layers, ck, EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS);
  ep_moe_checkpoint_get_attr(&header, ck, EP_MOE_CHECKPOINT_ATTR_HEADER_BYTES);
  const char* naming_names[] = {"auto", "hf", "mixtral", "hf-fused", "hf-fused-transposed", "gguf"};
  size_t n_moe = 0;
  ep_moe_checkpoint_moe_layers(nullptr, 0, &n_moe, ck);
  std::vector<int32_t> moe(n_moe);
  ep_moe_checkpoint_moe_layers(moe.data(), moe.size(), &n_moe, ck);
  const char* arch = ep_moe_checkpoint_architecture(ck);
  std::printf("%s\n  format %s, architecture %s, naming %s, %" PRId64 " file(s), %" PRId64 " tensors, %" PRId64
              " layers, headers %s\n  MoE layers (%zu): %s\n",
              path.c_str(), format ? "gguf" : "safetensors", *arch ? arch : "(none named)",
              naming_names[naming < 6 ? naming : 0], files, tensors, layers, human(static_cast<double>(header)).c_str(),
              n_moe, ranges(moe).c_str());

  int rc = 0;
  if (layer_only >= 0 && std::find(moe.begin(), moe.end(), layer_only) == moe.end()) {
    std::fprintf(stderr, "ep_moe_inspect: layer %d is not an MoE layer of %s (%s)\n", layer_only, path.c_str(),
                 layer_only < layers ? "it has no routed experts" : "the checkpoint has fewer layers");
    ep_moe_checkpoint_close(ck);
    return 1;
  }
  for (int32_t L : moe) {
    if (layer_only >= 0 && L != layer_only) continue;
    const int r = print_layer(ck, L, ep, placement);
    if (r < 0) return 1;
    rc |= r;
  }
  ep_moe_checkpoint_close(ck);
  return rc;
}

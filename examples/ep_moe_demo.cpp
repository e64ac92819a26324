// ep_moe_demo: the placement plan of a real model's expert layout over an
// expert-parallel group, computed through the public C API only.
//
//   ep_moe_demo [--model NAME] [--ep N] [--placement linear|round_robin]
//               [--redundant R] [--list]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace {

struct Model {
  const char* name;
  int hidden, intermediate, experts, top_k, groups, topk_groups, shared_experts;
  const char* note;
};

// Expert layouts of public checkpoints (config.json of each model).
const Model kModels[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 0, 0, 0, "Qwen3-30B-A3B: 48 layers, 128 experts, top-8"},
    {"qwen2-57b-a14b", 3584, 2560, 64, 8, 0, 0, 1, "Qwen2-57B-A14B: 64 experts, top-8, gated shared expert"},
    {"deepseek-v3", 7168, 2048, 256, 8, 8, 4, 1, "DeepSeek-V3: 256 experts in 8 groups, top-8 of 4 groups, 1 shared"},
    {"mixtral-8x7b", 4096, 14336, 8, 2, 0, 0, 0, "Mixtral-8x7B: 8 experts, top-2"},
};

void usage() {
  std::printf(
      "usage: ep_moe_demo [--model NAME] [--ep N] [--placement linear|round_robin] [--redundant R] [--list]\n"
      "Prints which experts each rank of an EP group owns for a model's layout.\n");
}

void log_to_stderr(ep_moe_log_level_t level, const char* msg, void*) {
  static const char* names[] = {"error", "warn", "info", "debug"};
  std::fprintf(stderr, "[ep_moe %s] %s\n", names[level], msg);
}

bool check(ep_moe_status_t s, const char* what) {
  if (s == EP_MOE_OK) return true;
  std::fprintf(stderr, "%s failed: %s (%s)\n", what, ep_moe_status_string(s), ep_moe_last_error());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "qwen3-30b-a3b";
  int ep = 4, redundant = 0;
  int placement = EP_MOE_PLACEMENT_LINEAR;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") {
      model_name = next();
    } else if (a == "--ep") {
      ep = std::atoi(next());
    } else if (a == "--redundant") {
      redundant = std::atoi(next());
    } else if (a == "--placement") {
      const std::string p = next();
      if (p == "linear") placement = EP_MOE_PLACEMENT_LINEAR;
      else if (p == "round_robin") placement = EP_MOE_PLACEMENT_ROUND_ROBIN;
      else {
        std::fprintf(stderr, "unknown placement %s\n", p.c_str());
        return 2;
      }
    } else if (a == "--list") {
      for (const auto& m : kModels) std::printf("%-16s %s\n", m.name, m.note);
      return 0;
    } else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  const Model* model = nullptr;
  for (const auto& m : kModels)
    if (model_name == m.name) model = &m;
  if (!model) {
    std::fprintf(stderr, "unknown model %s (try --list)\n", model_name.c_str());
    return 2;
  }
  ep_moe_set_log_callback(log_to_stderr, EP_MOE_LOG_WARN, nullptr);

  std::printf("ep_moe %s — %s\n", ep_moe_version_string(), model->note);
  std::printf("EP size %d, requested placement %s, %d redundant slot(s)\n\n", ep,
              placement == EP_MOE_PLACEMENT_LINEAR ? "linear" : "round_robin", redundant);

  std::vector<int> owners(static_cast<size_t>(model->experts), 0);
  std::printf("%-5s %-8s %-10s %s\n", "rank", "experts", "placement", "local->global");
  for (int r = 0; r < ep; ++r) {
    ep_moe_expert_map_config_t cfg;
    if (!check(ep_moe_expert_map_config_init(&cfg), "config_init")) return 1;
    cfg.ep_size = ep;
    cfg.ep_rank = r;
    cfg.global_num_experts = model->experts;
    cfg.placement = placement;
    cfg.num_expert_group = model->groups;
    cfg.num_redundant_experts = redundant;
    ep_moe_expert_map_t* map = nullptr;
    if (!check(ep_moe_expert_map_create(&map, &cfg), "ep_moe_expert_map_create")) return 1;
    int32_t n_local = 0, eff = 0;
    check(ep_moe_expert_map_get_attr(&n_local, map, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED), "get_attr");
    check(ep_moe_expert_map_get_attr(&eff, map, EP_MOE_MAP_ATTR_PLACEMENT), "get_attr");
    size_t need = 0;
    check(ep_moe_expert_map_describe(nullptr, 0, &need, map), "describe");
    std::string text(need + 1, '\0');
    check(ep_moe_expert_map_describe(&text[0], text.size(), nullptr, map), "describe");
    text.resize(need);
    if (text.size() > 90) text = text.substr(0, 87) + "...";
    std::vector<int32_t> emap(static_cast<size_t>(model->experts));
    check(ep_moe_expert_map_copy_table(emap.data(), emap.size(), map, EP_MOE_MAP_TABLE_EXPERT_MAP), "copy_table");
    for (int g = 0; g < model->experts; ++g)
      if (emap[static_cast<size_t>(g)] >= 0) ++owners[static_cast<size_t>(g)];
    std::printf("%-5d %-8d %-10s %s\n", r, n_local, eff == EP_MOE_PLACEMENT_LINEAR ? "linear" : "round_robin",
                text.c_str());
    ep_moe_expert_map_destroy(map);
  }
  int unowned = 0, replicated = 0;
  for (int c : owners) {
    unowned += c == 0;
    replicated += c > 1;
  }
  std::printf("\n%d experts, %d owned by no rank, %d held by more than one rank\n", model->experts, unowned,
              replicated);
  return unowned == 0 ? 0 : 1;
}

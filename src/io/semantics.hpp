// What an architecture's MoE block computes (routing, activation), derived
// from a checkpoint's configuration: a table per known architecture gives
// what its code does, and only the keys the file actually has override it.
// An architecture the table does not know is accepted only when the file
// states every semantic key; otherwise the derivation throws
// EP_MOE_ERR_UNSUPPORTED naming what is missing. Never a silent default.
#pragma once

#include <climits>
#include <cstdint>
#include <map>
#include <string>

#include "ep_moe/ep_moe.h"
#include "io/gguf.hpp"

namespace ep_moe {
namespace io {

// The largest count (experts, top-k, groups, layers, sizes) a file may
// state; each is read in its own type and refused beyond this, never
// narrowed.
constexpr int64_t kMaxCount = INT32_MAX;

struct Semantics {
  int32_t top_k = 0;  // 0: the file does not say
  int32_t activation = EP_MOE_ACT_SILU;
  int32_t scoring = EP_MOE_SCORING_SOFTMAX;
  int32_t renormalize = 1;
  int32_t groups = 0, topk_group = 0;
  float scale = 1.0f;
  // The architecture chooses experts with the score-correction bias
  // (DeepSeek-V3's noaux_tc): the layer must have that tensor.
  bool needs_score_bias = false;
  std::string arch;  // model_type or general.architecture ("" when none)
};

// From config.json's values (parse_hf_config). `has_config`: a config.json
// was found; `has_score_bias`: the layer has a score-correction bias tensor
// (checked against what the routing method uses); `where` names the layer
// in messages.
Semantics hf_semantics(const std::map<std::string, double>& nums, const std::map<std::string, std::string>& strs,
                       bool has_config, bool has_score_bias, const std::string& where);

// How an HF architecture's code stores its fused 3-D experts where the
// table fixes it: x @ W ([E, H, 2I] and [E, I, H]; otherwise the shapes
// tell), and gate / up alternating in gate_up_proj and its bias (otherwise
// in halves).
struct HfFusedLayout {
  bool x_times_w = false, interleaved = false;
};
HfFusedLayout hf_fused_layout(const std::string& model_type);

// From GGUF metadata; `arch` is general.architecture.
Semantics gguf_semantics(const GgufFile& g, const std::string& arch, bool has_score_bias, const std::string& where);

}  // namespace io
}  // namespace ep_moe

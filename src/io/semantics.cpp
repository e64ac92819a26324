#include "io/semantics.hpp"

#include <cfloat>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/checkpoint.hpp"
#include "io/json_guard.hpp"
#include "io/json_release.hpp"

#include <nlohmann/json.hpp>

namespace ep_moe {
namespace io {

namespace {

// How an architecture picks its experts before the top-k.
enum class Grouping {
  Greedy,  // plain top-k unless the file's topk_method says otherwise
  NoAux,   // DeepSeek-V3: sigmoid scores + score-correction bias, grouped top-k
};

// What an architecture's own MoE block does when its configuration omits a
// key (the values of its transformers config class, or of llama.cpp's graph
// for GGUF).
struct Arch {
  const char* name;
  int32_t scoring;
  int32_t renormalize;
  float scale;
  Grouping grouping;
  int32_t n_group, topk_group;
  // false: the architecture's code does not read norm_topk_prob (it always
  // or never renormalises); a file stating the other value is refused.
  bool reads_norm = true;
  // >= 0: the architecture's fixed activation, whatever hidden_act says
  // (GPT-OSS's config.json says "silu", its code runs the clamped SwiGLU).
  int32_t activation = -1;
  // How its transformers class stores the fused experts (HfFusedLayout).
  bool fused_x_times_w = false, gate_up_interleaved = false;
};

// HF model_type values. Qwen2/3-MoE and OLMoE renormalise only with
// norm_topk_prob (their config classes default it to false); Mixtral
// always renormalises; DeepSeek-V2 never does (transformers' DeepseekV2Moe
// scales by routed_scaling_factor instead); DeepSeek-V3, Kimi-K2 (the
// DeepSeek-V3 layout) and GLM-4.5 route with sigmoid scores, the
// score-correction bias and grouped top-k, hard-coded in their code, so
// their config.json has no scoring_func / topk_method key.
const Arch kHfArchs[] = {
    {"qwen2_moe", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"qwen3_moe", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"qwen3_vl_moe", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"qwen3_vl_moe_text", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"mixtral", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0, false},
    {"olmoe", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"deepseek_v2", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0, false},
    {"deepseek_v3", EP_MOE_SCORING_SIGMOID, 1, 2.5f, Grouping::NoAux, 8, 4},
    {"kimi_k2", EP_MOE_SCORING_SIGMOID, 1, 2.5f, Grouping::NoAux, 8, 4},
    {"glm4_moe", EP_MOE_SCORING_SIGMOID, 1, 1.0f, Grouping::NoAux, 1, 1},
    // Softmax over the chosen experts' logits (router bias included) is a
    // softmax over all, renormalised.
    // Its experts compute x @ W ([E, H, 2I], [E, I, H]; its I may equal H),
    // gate and up alternating in gate_up_proj and its bias.
    {"gpt_oss", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0, false, EP_MOE_ACT_SWIGLU_OAI, true, true},
};

// GGUF general.architecture values, with llama.cpp's graphs: qwen3moe and
// llama (Mixtral-style) renormalise, qwen2moe and olmoe do not, deepseek2
// and glm4moe read their keys (defaults below), all use SiLU.
const Arch kGgufArchs[] = {
    {"qwen2moe", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"qwen3moe", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0},
    {"qwen3vlmoe", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0},
    {"llama", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0},
    {"olmoe", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"deepseek2", EP_MOE_SCORING_SOFTMAX, 0, 1.0f, Grouping::Greedy, 0, 0},
    {"glm4moe", EP_MOE_SCORING_SIGMOID, 1, 1.0f, Grouping::NoAux, 1, 1},
    {"gpt-oss", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0, false, EP_MOE_ACT_SWIGLU_OAI},
};

template <size_t N>
const Arch* find_arch(const Arch (&table)[N], const std::string& name) {
  for (const Arch& a : table)
    if (name == a.name) return &a;
  return nullptr;
}

// "a, b, c", for messages.
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

template <size_t N>
std::string known_names(const Arch (&table)[N]) {
  std::vector<std::string> names;
  for (const Arch& a : table) names.emplace_back(a.name);
  return join(names);
}

// An architecture that chooses experts with the score-correction bias
// computes something else without it: refuse rather than route without.
void check_bias(const Semantics& s, bool has_score_bias, const std::string& where) {
  if (s.needs_score_bias && !has_score_bias)
    fail(EP_MOE_ERR_FORMAT, "%s: %s routes with a score-correction bias (noaux_tc), but the layer has no such tensor",
         where.c_str(), s.arch.empty() ? "the configuration" : s.arch.c_str());
}

// ep_moe_activation_t of an HF hidden_act value; false when unknown.
bool activation_of(const std::string& a, int32_t* out) {
  if (a == "silu" || a == "swish") *out = EP_MOE_ACT_SILU;
  else if (a == "gelu") *out = EP_MOE_ACT_GELU;
  else if (a == "gelu_pytorch_tanh" || a == "gelu_new" || a == "gelu_fast") *out = EP_MOE_ACT_GELU_TANH;
  else return false;
  return true;
}

}  // namespace

HfFusedLayout hf_fused_layout(const std::string& model_type) {
  HfFusedLayout l;
  if (const Arch* a = find_arch(kHfArchs, model_type)) {
    l.x_times_w = a->fused_x_times_w;
    l.interleaved = a->gate_up_interleaved;
  }
  return l;
}

Semantics hf_semantics(const std::map<std::string, double>& nums, const std::map<std::string, std::string>& strs,
                       bool has_config, bool has_score_bias, const std::string& where) {
  Semantics s;
  const auto str = [&](const char* k) -> const std::string* {
    auto it = strs.find(k);
    return it == strs.end() ? nullptr : &it->second;
  };
  const auto num = [&](const char* k) -> const double* {
    auto it = nums.find(k);
    return it == nums.end() ? nullptr : &it->second;
  };
  if (const std::string* mt = str("model_type")) s.arch = *mt;
  const Arch* a = find_arch(kHfArchs, s.arch);
  const bool known = a != nullptr;
  if (!a) {
    // Every semantic key must be stated; name all that are not.
    std::vector<std::string> missing;
    for (const char* k :
         {"num_experts_per_tok", "hidden_act", "scoring_func", "norm_topk_prob", "routed_scaling_factor"})
      if (!str(k) && !num(k)) missing.push_back(k);
    const double* ng = num("n_group");
    if (ng && *ng > 1 && !str("topk_method")) missing.push_back("topk_method");
    if (ng && *ng > 1 && !num("topk_group")) missing.push_back("topk_group");
    if (!missing.empty()) {
      const std::string what = !has_config      ? std::string("has no config.json beside it")
                               : s.arch.empty() ? std::string("config.json names no model_type")
                                                : "config.json's model_type '" + s.arch +
                                                      "' is not one ep_moe knows (" + known_names(kHfArchs) + ")";
      fail(EP_MOE_ERR_UNSUPPORTED,
           "%s %s, and it does not state %s: the MoE block's routing cannot be derived; add %s to config.json, or "
           "fill ep_moe_layer_config_t yourself",
           where.c_str(), what.c_str(), join(missing).c_str(), missing.size() == 1 ? "it" : "them");
    }
  }
  static const Arch kGeneric = {"", EP_MOE_SCORING_SOFTMAX, 1, 1.0f, Grouping::Greedy, 0, 0};
  if (!a) a = &kGeneric;  // every key below is then stated by the file
  s.scoring = a->scoring;
  s.renormalize = a->renormalize;
  s.scale = a->scale;

  if (const double* k = num("num_experts_per_tok")) s.top_k = static_cast<int32_t>(*k);
  if (const double* v = num("norm_topk_prob")) {
    const int32_t norm = *v != 0 ? 1 : 0;
    // DeepSeek-V2's remote code renormalises *instead of* scaling when the
    // key is true, transformers' class never renormalises: no one reading.
    if (!a->reads_norm && norm != a->renormalize)
      fail(EP_MOE_ERR_UNSUPPORTED,
           "%s: model_type '%s' %s renormalises the top-k weights, but config.json sets norm_topk_prob to %s; "
           "fill ep_moe_layer_config_t yourself with the semantics you mean",
           where.c_str(), s.arch.c_str(), a->renormalize ? "always" : "never", norm ? "true" : "false");
    s.renormalize = norm;
  }
  if (const double* v = num("routed_scaling_factor")) s.scale = static_cast<float>(*v);
  if (const std::string* sf = str("scoring_func")) {
    if (*sf == "softmax") s.scoring = EP_MOE_SCORING_SOFTMAX;
    else if (*sf == "sigmoid") s.scoring = EP_MOE_SCORING_SIGMOID;
    else
      fail(EP_MOE_ERR_UNSUPPORTED, "%s: scoring_func '%s' is not supported (softmax, sigmoid)", where.c_str(),
           sf->c_str());
  }
  if (a->activation >= 0) {
    s.activation = a->activation;
    // The clamp is fixed at GPT-OSS's 7 (EP_MOE_ACT_SWIGLU_OAI).
    if (const double* lim = num("swiglu_limit"))
      if (*lim != 7.0)
        fail(EP_MOE_ERR_UNSUPPORTED, "%s: swiglu_limit %g is not supported (EP_MOE_ACT_SWIGLU_OAI clamps at 7)",
             where.c_str(), *lim);
  } else if (const std::string* act = str("hidden_act")) {
    if (!activation_of(*act, &s.activation))
      fail(EP_MOE_ERR_UNSUPPORTED, "%s: hidden_act '%s' is not supported (silu, gelu, gelu_pytorch_tanh)",
           where.c_str(), act->c_str());
  }
  const std::string* tm = str("topk_method");
  // Without the key: the architecture's method; for one the table does not
  // know, a score-correction bias tensor means noaux_tc (its only use).
  const bool noaux = a->grouping == Grouping::NoAux || (!known && has_score_bias);
  const std::string method = tm ? *tm : noaux ? "noaux_tc" : "greedy";
  const double* ng = num("n_group");
  const double* tg = num("topk_group");
  const auto ngroups = static_cast<int32_t>(ng ? *ng : a->n_group);
  if (method == "noaux_tc" || method == "group_limited_greedy") {
    s.needs_score_bias = method == "noaux_tc";
    if (ngroups > 1) {
      s.groups = ngroups;
      s.topk_group = static_cast<int32_t>(tg ? *tg : a->topk_group > 0 ? a->topk_group : ngroups);
    }
  } else if (method != "greedy") {
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: topk_method '%s' is not supported (greedy, group_limited_greedy, noaux_tc)",
         where.c_str(), method.c_str());
  }
  if (has_score_bias && !s.needs_score_bias)
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: the layer has a score-correction bias, which topk_method '%s'%s%s does not use",
         where.c_str(), method.c_str(), s.arch.empty() ? "" : " of model_type ", s.arch.c_str());
  check_bias(s, has_score_bias, where);
  return s;
}

Semantics gguf_semantics(const GgufFile& g, const std::string& arch, bool has_score_bias, const std::string& where) {
  Semantics s;
  s.arch = arch;
  const Arch* a = find_arch(kGgufArchs, arch);
  if (!a)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s: GGUF architecture '%s' is not one ep_moe knows (%s), and GGUF metadata does not state the experts' "
         "activation: fill ep_moe_layer_config_t yourself",
         where.c_str(), arch.c_str(), known_names(kGgufArchs).c_str());
  const auto find = [&](const char* key) { return g.find(arch + "." + key); };
  s.scoring = a->scoring;
  s.renormalize = a->renormalize;
  s.scale = a->scale;
  if (a->activation >= 0) s.activation = a->activation;
  // Every integer is range-checked in its own type (kMaxCount: what a
  // layer's counts can be) and refused naming the key.
  const auto count = [&](const GgufValue* v, const char* key) {
    return static_cast<int32_t>(v->checked_int(arch + "." + key, 1, kMaxCount, where));
  };
  if (const GgufValue* v = find("expert_used_count")) s.top_k = count(v, "expert_used_count");
  if (const GgufValue* v = find("expert_weights_norm"))
    s.renormalize = v->checked_int(arch + ".expert_weights_norm", 0, 1, where) != 0 ? 1 : 0;
  if (const GgufValue* v = find("expert_weights_scale")) {
    const double f = v->as_float();
    if (f != 0.0) s.scale = static_cast<float>(f);  // llama.cpp: 0 means no scaling
  }
  if (const GgufValue* v = find("expert_gating_func")) {
    // llama.cpp's llama_expert_gating_func_type: 1 softmax, 2 sigmoid, 3
    // softmax over the chosen experts' logits (softmax, then renormalise).
    switch (v->checked_int(arch + ".expert_gating_func", 0, kMaxCount, where)) {
      case 1: s.scoring = EP_MOE_SCORING_SOFTMAX; break;
      case 2: s.scoring = EP_MOE_SCORING_SIGMOID; break;
      case 3:
        s.scoring = EP_MOE_SCORING_SOFTMAX;
        s.renormalize = 1;
        break;
      default:
        fail(EP_MOE_ERR_UNSUPPORTED,
             "%s: %s.expert_gating_func %lld is not supported (1 softmax, 2 sigmoid, 3 "
             "softmax over the chosen)",
             where.c_str(), arch.c_str(), static_cast<long long>(v->as_int()));
    }
  }
  const GgufValue* gc = find("expert_group_count");
  const int32_t ngroups = gc ? count(gc, "expert_group_count") : a->n_group;
  if (ngroups > 1) {
    s.groups = ngroups;
    const GgufValue* gu = find("expert_group_used_count");
    s.topk_group = gu ? count(gu, "expert_group_used_count") : a->topk_group > 0 ? a->topk_group : ngroups;
  }
  s.needs_score_bias = a->grouping == Grouping::NoAux;
  check_bias(s, has_score_bias, where);
  return s;
}

namespace {

// The keys ep_moe reads from config.json, each with the one type it must
// have: a key of another type, a count that is not an integer in
// [1, kMaxCount] or a float that is not finite in f32 is refused naming
// the key, never dropped or narrowed (a top_k of 2.9 is not 2).
enum class Want { Count, Float, Flag, Text };
struct ConfigKey {
  const char* key;
  Want want;
};
constexpr ConfigKey kConfigKeys[] = {
    {"num_experts_per_tok", Want::Count}, {"n_group", Want::Count},       {"topk_group", Want::Count},
    {"num_hidden_layers", Want::Count},   {"hidden_size", Want::Count},   {"routed_scaling_factor", Want::Float},
    {"swiglu_limit", Want::Float},        {"norm_topk_prob", Want::Flag}, {"model_type", Want::Text},
    {"hidden_act", Want::Text},           {"scoring_func", Want::Text},   {"topk_method", Want::Text},
};

void check_config_value(const std::string& key, const nlohmann::json& v, const std::string& file) {
  if (v.is_null()) return;  // as if absent
  for (const ConfigKey& k : kConfigKeys) {
    if (key != k.key) continue;
    const char* bad = nullptr;
    switch (k.want) {
      case Want::Count:
        if (!v.is_number()) bad = "not a number";
        else if (v.is_number_float() &&
                 (!std::isfinite(v.get<double>()) || v.get<double>() != std::floor(v.get<double>())))
          bad = "not an integer";
        else if (v.get<double>() < 1 || v.get<double>() > static_cast<double>(kMaxCount))
          bad = "outside [1, 2147483647]";
        break;
      case Want::Float:
        if (!v.is_number()) bad = "not a number";
        else if (!(std::fabs(v.get<double>()) <= static_cast<double>(FLT_MAX))) bad = "not a finite f32";
        break;
      case Want::Flag:
        if (!v.is_boolean() && !v.is_number()) bad = "not a boolean";
        break;
      case Want::Text:
        if (!v.is_string()) bad = "not a string";
        break;
    }
    if (bad)
      fail(EP_MOE_ERR_FORMAT, "%s: %s is %s, %s", file.c_str(), key.c_str(), v.dump().substr(0, 40).c_str(), bad);
  }
}

}  // namespace

void parse_hf_config(const std::string& text, const std::string& name, std::map<std::string, double>* nums,
                     std::map<std::string, std::string>* strs) {
  check_json(text, name, JsonLimits{kConfigMaxDepth, kConfigMaxArray, true});
  nlohmann::json root;
  const JsonRelease release{root};
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(EP_MOE_ERR_FORMAT, "%s: not valid JSON: %s", name.c_str(), e.what());
  }
  if (!root.is_object()) fail(EP_MOE_ERR_FORMAT, "%s: not a JSON object", name.c_str());
  // Multimodal models keep the language model's settings in text_config.
  auto collect = [&](const nlohmann::json& obj) {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      check_config_value(it.key(), it.value(), name);
      if (it.value().is_number()) (*nums)[it.key()] = it.value().get<double>();
      else if (it.value().is_boolean()) (*nums)[it.key()] = it.value().get<bool>() ? 1.0 : 0.0;
      else if (it.value().is_string()) (*strs)[it.key()] = it.value().get<std::string>();
    }
  };
  collect(root);
  // Block-scaled FP8 (quantization_config: quant_method "fp8", fmt "e4m3",
  // weight_block_size [rows, cols]) as quantization_config.<key>[.<i>].
  const auto qc = root.find("quantization_config");
  if (qc != root.end() && qc->is_object())
    for (auto it = qc->begin(); it != qc->end(); ++it) {
      const std::string key = "quantization_config." + it.key();
      if (it.value().is_string()) (*strs)[key] = it.value().get<std::string>();
      if (it.value().is_number()) (*nums)[key] = it.value().get<double>();
      if (it.value().is_array())
        for (size_t i = 0; i < it.value().size() && i < 4; ++i)
          if (it.value()[i].is_number()) (*nums)[key + "." + std::to_string(i)] = it.value()[i].get<double>();
    }
  const auto tc = root.find("text_config");
  if (tc != root.end() && tc->is_object()) collect(*tc);
}

}  // namespace io
}  // namespace ep_moe

// Model presets and deterministic random weights shared by the demo and the
// benchmark. Public API only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace presets {

struct Model {
  const char* name;
  int hidden, intermediate, experts, top_k;
  int groups, topk_group;   // grouped top-k (0 = off)
  bool sigmoid, bias;       // DeepSeek-V3 scoring
  float scale;              // routed scaling factor
  int shared_intermediate;  // 0 = no shared expert
  bool shared_gate;         // Qwen2-MoE sigmoid gate
  int default_ep;           // EP size the benchmark simulates by default
  const char* note;
};

// Expert layouts from each checkpoint's config.json.
inline const std::vector<Model>& models() {
  static const std::vector<Model> m = {
      {"qwen3-30b-a3b", 2048, 768, 128, 8, 0, 0, false, false, 1.0f, 0, false, 4,
       "Qwen3-30B-A3B: 128 experts, top-8, no shared expert"},
      {"qwen2-57b-a14b", 3584, 2560, 64, 8, 0, 0, false, false, 1.0f, 20480, true, 4,
       "Qwen2-57B-A14B: 64 experts, top-8, gated shared expert"},
      {"deepseek-v3", 7168, 2048, 256, 8, 8, 4, true, true, 2.5f, 2048, false, 32,
       "DeepSeek-V3: 256 experts in 8 groups, top-8 of 4 groups, sigmoid + bias, 1 shared expert"},
      {"mixtral-8x7b", 4096, 14336, 8, 2, 0, 0, false, false, 1.0f, 0, false, 4, "Mixtral-8x7B: 8 experts, top-2"},
  };
  return m;
}

inline const Model* find(const std::string& name) {
  for (const auto& m : models())
    if (name == m.name) return &m;
  return nullptr;
}

// splitmix64: a fast, seedable generator; the same (seed, stream) always
// gives the same numbers, so every rank builds identical weights.
struct Rng {
  uint64_t s;
  Rng(uint64_t seed, uint64_t stream) : s(seed * 0x9E3779B97F4A7C15ull ^ (stream + 0x632BE59BD9B4E019ull)) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [-a, a).
  float uniform(float a) { return a * (static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f); }
};

inline void fill(std::vector<float>& v, size_t n, uint64_t seed, uint64_t stream, float scale) {
  v.resize(n);
  Rng r(seed, stream);
  for (auto& x : v) x = r.uniform(scale);
}

// Gives a layer every tensor it needs from deterministic random weights;
// experts without a slot on this rank are neither generated nor read.
// Returns an empty string or the error.
// `down` (a block format, or -1): the routed experts' down projections
// quantized to it by ep_moe_quantize and given as its blocks, the layout of
// GGUF "dynamic" quants (DeepSeek-R1 UD-IQ2_XXS: IQ2_XXS gate/up, Q3_K
// down); otherwise they are given in f32 like the rest and stored as the
// layer's weight_dtype.
inline std::string load_random_weights(ep_moe_layer_t* layer, const ep_moe_expert_map_t* map, const Model& m,
                                       int shared, uint64_t seed, int down = -1) {
  const int H = m.hidden, I = m.intermediate;
  // Uniform(-a, a) has variance a^2/3: a = sqrt(3/fan_in) keeps outputs O(1).
  const float a_in = std::sqrt(3.0f / static_cast<float>(H)), a_down = std::sqrt(3.0f / static_cast<float>(I));
  std::vector<float> buf;
  auto put = [&](ep_moe_weight_t w, int e, int rows, int cols, uint64_t stream, float a) -> bool {
    fill(buf, static_cast<size_t>(rows) * static_cast<size_t>(cols), seed, stream, a);
    return ep_moe_layer_set_weight(nullptr, layer, w, e, buf.data(), EP_MOE_DTYPE_F32, rows, cols) == EP_MOE_OK;
  };
  std::vector<uint8_t> blocks;
  auto put_down = [&](int e, uint64_t stream) -> bool {
    if (down < 0) return put(EP_MOE_WEIGHT_EXPERT_DOWN, e, H, I, stream, a_down);
    const auto dt = static_cast<ep_moe_dtype_t>(down);
    int64_t elems = 1, bytes = 0;
    if (ep_moe_dtype_block(&elems, &bytes, dt) != EP_MOE_OK) return false;
    fill(buf, static_cast<size_t>(H) * static_cast<size_t>(I), seed, stream, a_down);
    blocks.resize(static_cast<size_t>(H) * static_cast<size_t>(I / elems * bytes));
    return ep_moe_quantize(blocks.data(), dt, buf.data(), H, I) == EP_MOE_OK &&
           ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_DOWN, e, blocks.data(), dt, H, I) == EP_MOE_OK;
  };
  for (int e = 0; e < m.experts; ++e) {
    int32_t local = 0;
    if (ep_moe_expert_map_is_local(&local, map, e) != EP_MOE_OK) return ep_moe_last_error();
    if (!local) continue;
    const uint64_t base = static_cast<uint64_t>(e) * 8;
    if (!put(EP_MOE_WEIGHT_EXPERT_GATE, e, I, H, base + 0, a_in) ||
        !put(EP_MOE_WEIGHT_EXPERT_UP, e, I, H, base + 1, a_in) || !put_down(e, base + 2)) {
      const char* why = ep_moe_layer_last_error(layer);
      return why && *why ? why : ep_moe_last_error();
    }
  }
  if (shared > 0) {
    const uint64_t base = 1ull << 40;
    const float a_sd = std::sqrt(3.0f / static_cast<float>(shared));
    if (!put(EP_MOE_WEIGHT_SHARED_GATE, -1, shared, H, base, a_in) ||
        !put(EP_MOE_WEIGHT_SHARED_UP, -1, shared, H, base + 1, a_in) ||
        !put(EP_MOE_WEIGHT_SHARED_DOWN, -1, H, shared, base + 2, a_sd))
      return ep_moe_layer_last_error(layer);
    if (m.shared_gate && !put(EP_MOE_WEIGHT_SHARED_EXPERT_GATE, -1, 1, H, base + 3, a_in))
      return ep_moe_layer_last_error(layer);
  }
  if (m.bias && !put(EP_MOE_WEIGHT_SCORE_BIAS, -1, 1, m.experts, (1ull << 40) + 7, 0.05f))
    return ep_moe_layer_last_error(layer);
  return "";
}

// Rank `rank` of `ep` in the linear placement of `experts` experts, or
// nullptr (ep_moe_last_error() says why).
inline ep_moe_expert_map_t* linear_map(int ep, int rank, int experts) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = ep;
  mc.ep_rank = rank;
  mc.global_num_experts = experts;
  ep_moe_expert_map_t* map = nullptr;
  return ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK ? map : nullptr;
}

inline ep_moe_layer_config_t layer_config(const Model& m, int shared, ep_moe_dtype_t wdt, ep_moe_dtype_t adt,
                                          int max_tokens, int threads) {
  ep_moe_layer_config_t c;
  ep_moe_layer_config_init(&c);
  c.hidden_size = m.hidden;
  c.intermediate_size = m.intermediate;
  c.num_experts = m.experts;
  c.top_k = m.top_k;
  c.weight_dtype = wdt;
  c.act_dtype = adt;
  c.scoring = m.sigmoid ? EP_MOE_SCORING_SIGMOID : EP_MOE_SCORING_SOFTMAX;
  c.renormalize = 1;
  c.num_expert_group = m.groups;
  c.topk_group = m.topk_group;
  c.use_score_bias = m.bias;
  c.routed_scaling_factor = m.scale;
  c.shared_intermediate_size = shared;
  c.shared_expert_gate = shared > 0 && m.shared_gate;
  c.max_tokens = max_tokens;
  c.num_threads = threads;
  return c;
}

// The dtypes by the names the demo and the benchmarks take (the
// library's own, ep_moe_dtype_name): the float types and every block
// format.
inline const std::vector<std::pair<const char*, ep_moe_dtype_t>>& dtype_names() {
  static const std::vector<std::pair<const char*, ep_moe_dtype_t>> v = [] {
    std::vector<std::pair<const char*, ep_moe_dtype_t>> out;
    for (int i = 0; i < 64; ++i) {
      const auto t = static_cast<ep_moe_dtype_t>(i);
      const char* name = ep_moe_dtype_name(t);
      int64_t elems = 1, bytes = 0;
      if (!name || (i > EP_MOE_DTYPE_F16 && (ep_moe_dtype_block(&elems, &bytes, t) != EP_MOE_OK || elems == 1)))
        continue;  // not a dtype, or an integer type (collectives only)
      out.emplace_back(name, t);
    }
    return out;
  }();
  return v;
}

// "a, b or c": every name dtype_names() has (with block_formats), for
// messages.
inline std::string dtype_list(bool block_formats) {
  std::string s;
  const auto& v = dtype_names();
  for (size_t i = 0; i < v.size(); ++i) {
    if (!block_formats && v[i].second > EP_MOE_DTYPE_F16) break;
    if (!s.empty()) s += ", ";
    s += v[i].first;
  }
  return s;
}

// A float dtype by name, or (with block_formats) a GGUF block format too.
inline bool parse_dtype(const std::string& s, ep_moe_dtype_t* out, bool block_formats = false) {
  for (const auto& d : dtype_names())
    if (s == d.first && (block_formats || d.second <= EP_MOE_DTYPE_F16)) {
      *out = d.second;
      return true;
    }
  return false;
}

// "gate_up+down": a block format for gate/up (the layer's weight_dtype)
// and another for down, as dynamic GGUF quants mix them
// ("iq2_xxs+q3_k"); or one dtype (down -1).
inline bool parse_layout(const std::string& s, ep_moe_dtype_t* gate_up, int* down) {
  const auto plus = s.find('+');
  if (plus == std::string::npos) {
    *down = -1;
    return parse_dtype(s, gate_up, true);
  }
  ep_moe_dtype_t d;
  if (!parse_dtype(s.substr(0, plus), gate_up, true) || !parse_dtype(s.substr(plus + 1), &d, true)) return false;
  if (*gate_up <= EP_MOE_DTYPE_F16 || d <= EP_MOE_DTYPE_F16) return false;  // mixes of block formats
  *down = d;
  return true;
}

inline const char* dtype_name(ep_moe_dtype_t t) {
  for (const auto& d : dtype_names())
    if (d.second == t) return d.first;
  return "?";
}

// Activations of dtype `dt` from floats.
inline std::vector<uint8_t> encode(const std::vector<float>& v, ep_moe_dtype_t dt) {
  std::vector<uint8_t> out(v.size() * (dt == EP_MOE_DTYPE_F32 ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    if (dt == EP_MOE_DTYPE_F32) {
      std::memcpy(&out[4 * i], &u, 4);
    } else if (dt == EP_MOE_DTYPE_BF16) {
      const uint16_t h = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
      std::memcpy(&out[2 * i], &h, 2);
    } else {  // f16 for |v| well inside the normal range, round to nearest
      const uint32_t sign = (u >> 16) & 0x8000u;
      int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
      uint32_t man = u & 0x7fffffu;
      uint16_t h;
      if (e <= 0) h = static_cast<uint16_t>(sign);
      else if (e >= 31) h = static_cast<uint16_t>(sign | 0x7c00u);
      else {
        uint32_t r = (static_cast<uint32_t>(e) << 10 | (man >> 13)) + ((man >> 12) & 1u);
        h = static_cast<uint16_t>(sign | r);
      }
      std::memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

inline std::vector<float> decode(const std::vector<uint8_t>& b, ep_moe_dtype_t dt) {
  const size_t n = b.size() / (dt == EP_MOE_DTYPE_F32 ? 4 : 2);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dt == EP_MOE_DTYPE_F32) {
      std::memcpy(&out[i], &b[4 * i], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &b[2 * i], 2);
      if (dt == EP_MOE_DTYPE_BF16) {
        const uint32_t u = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[i], &u, 4);
      } else {
        const int e = (h >> 10) & 31, man = h & 1023;
        const float v =
            e == 0 ? std::ldexp(static_cast<float>(man), -24) : std::ldexp(static_cast<float>(1024 + man), e - 25);
        out[i] = (h & 0x8000) ? -v : v;
      }
    }
  }
  return out;
}

// One MoE layer of a real checkpoint in place of a preset (the demo's and
// the bench's --checkpoint): its derived configuration, a Model of its
// shape, and whether it has a router. Owns the open checkpoint.
struct CheckpointLayer {
  ep_moe_checkpoint_t* ck = nullptr;
  int32_t layer = -1;
  ep_moe_layer_config_t config{};
  Model model{};
  bool router = false;
  std::string arch;  // ep_moe_checkpoint_architecture()
  std::string note;  // "PATH layer L (architecture)", the model's note
  CheckpointLayer() = default;
  CheckpointLayer(const CheckpointLayer&) = delete;
  CheckpointLayer& operator=(const CheckpointLayer&) = delete;
  ~CheckpointLayer() { ep_moe_checkpoint_close(ck); }
};

// Opens `path` (a program's --checkpoint) and derives its MoE layer `layer`
// (-1: the first) into `out`; false after printing what failed.
inline bool open_checkpoint_layer(const std::string& path, int layer, CheckpointLayer* out) {
  const auto fail = [](const std::string& what) {
    std::fprintf(stderr, "--checkpoint: %s\n", what.c_str());
    return false;
  };
  if (ep_moe_checkpoint_open(&out->ck, path.c_str(), nullptr) != EP_MOE_OK) return fail(ep_moe_last_error());
  size_t n = 0;
  ep_moe_checkpoint_moe_layers(nullptr, 0, &n, out->ck);
  std::vector<int32_t> layers(n);
  ep_moe_checkpoint_moe_layers(layers.data(), n, &n, out->ck);
  if (layers.empty()) return fail(path + " has no MoE layer");
  out->layer = layer >= 0 ? layer : layers[0];
  ep_moe_layer_config_init(&out->config);
  if (ep_moe_checkpoint_layer_config(&out->config, out->ck, out->layer) != EP_MOE_OK)
    return fail(ep_moe_checkpoint_last_error(out->ck));
  ep_moe_tensor_info_t ti;
  ep_moe_tensor_info_init(&ti);
  out->router = ep_moe_checkpoint_tensor_info(&ti, out->ck, out->layer, EP_MOE_WEIGHT_ROUTER, -1) == EP_MOE_OK;
  const ep_moe_layer_config_t& c = out->config;
  out->arch = ep_moe_checkpoint_architecture(out->ck);
  out->note = path + " layer " + std::to_string(out->layer) + " (" + out->arch + ")";
  out->model = Model{"checkpoint",
                     c.hidden_size,
                     c.intermediate_size,
                     c.num_experts,
                     c.top_k,
                     c.num_expert_group,
                     c.topk_group,
                     c.scoring == EP_MOE_SCORING_SIGMOID,
                     c.use_score_bias != 0,
                     c.routed_scaling_factor,
                     c.shared_intermediate_size,
                     c.shared_expert_gate != 0,
                     1,
                     out->note.c_str()};
  return true;
}

}  // namespace presets

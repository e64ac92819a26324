// Test-side writers of safetensors and GGUF files, written from the format
// descriptions (independent of the library's parsers), plus MoE checkpoints
// in every naming scheme built from reference weights.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <system_error>
#include <vector>

#include "../common/reference_moe.hpp"

namespace writers {

struct Tensor {
  std::string name;
  std::string dtype;           // safetensors dtype name, or a GGUF block format ("Q8_0", "Q4_K", ...)
  std::vector<int64_t> shape;  // outermost first
  std::vector<uint8_t> data;
};

inline void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void put_u64(std::vector<uint8_t>& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void put_str(std::vector<uint8_t>& b, const std::string& s) {
  put_u64(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

// Encodes floats as a dtype ("F32", "F16", "BF16").
inline std::vector<uint8_t> encode(const std::vector<float>& v, const std::string& dtype) {
  return ref::encode(v, dtype == "F32" ? ref::F32 : dtype == "F16" ? ref::F16 : ref::BF16);
}

// Q8_0: blocks of 32 values as an f16 scale and 32 int8. `v` is replaced by
// the values the blocks decode to.
inline std::vector<uint8_t> quantize_q8_0(std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b + 32 <= v.size(); b += 32) {
    float amax = 0;
    for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[b + i]));
    const uint16_t d16 = ref::to_f16(amax / 127.0f);
    const float d = ref::from_f16(d16);
    out.push_back(static_cast<uint8_t>(d16 & 0xff));
    out.push_back(static_cast<uint8_t>(d16 >> 8));
    for (size_t i = 0; i < 32; ++i) {
      const int q = d > 0 ? static_cast<int>(std::lround(v[b + i] / d)) : 0;
      const int8_t qq = static_cast<int8_t>(std::max(-127, std::min(127, q)));
      out.push_back(static_cast<uint8_t>(qq));
      v[b + i] = d * static_cast<float>(qq);
    }
  }
  return out;
}

// safetensors bytes: u64 header length, JSON header padded with spaces to a
// multiple of 8, then the data in the given order.
inline std::vector<uint8_t> safetensors_bytes(const std::vector<Tensor>& ts,
                                              const std::map<std::string, std::string>& meta = {}) {
  std::string h = "{";
  bool first = true;
  if (!meta.empty()) {
    h += "\"__metadata__\":{";
    bool f2 = true;
    for (const auto& kv : meta) {
      h += (f2 ? "" : ",") + std::string("\"") + kv.first + "\":\"" + kv.second + "\"";
      f2 = false;
    }
    h += "}";
    first = false;
  }
  uint64_t off = 0;
  for (const auto& t : ts) {
    h += first ? "" : ",";
    first = false;
    h += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) h += (i ? "," : "") + std::to_string(t.shape[i]);
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + t.data.size()) + "]}";
    off += t.data.size();
  }
  h += "}";
  while (h.size() % 8) h += ' ';
  std::vector<uint8_t> b;
  put_u64(b, h.size());
  b.insert(b.end(), h.begin(), h.end());
  for (const auto& t : ts) b.insert(b.end(), t.data.begin(), t.data.end());
  return b;
}

// A GGUF metadata value.
struct Kv {
  std::string key;
  uint32_t type;  // 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 10 u64
  uint64_t u = 0;
  float f = 0;
  std::string s;
};

inline uint32_t ggml_type(const std::string& dtype) {
  if (dtype == "F32") return 0;
  if (dtype == "F16") return 1;
  if (dtype == "Q4_0") return 2;
  if (dtype == "Q4_1") return 3;
  if (dtype == "Q8_0") return 8;
  if (dtype == "Q4_K") return 12;
  if (dtype == "Q5_K") return 13;
  if (dtype == "Q6_K") return 14;
  if (dtype == "IQ4_XS") return 23;
  if (dtype == "BF16") return 30;
  if (dtype == "MXFP4") return 39;
  if (dtype == "Q5_0") return 6;
  if (dtype == "Q5_1") return 7;
  if (dtype == "Q2_K") return 10;
  if (dtype == "Q3_K") return 11;
  if (dtype == "IQ2_XXS") return 16;
  if (dtype == "IQ2_XS") return 17;
  if (dtype == "IQ3_XXS") return 18;
  if (dtype == "IQ1_S") return 19;
  if (dtype == "IQ4_NL") return 20;
  if (dtype == "IQ3_S") return 21;
  if (dtype == "IQ2_S") return 22;
  if (dtype == "IQ1_M") return 29;
  if (dtype == "TQ2_0") return 35;  // written as raw blocks (66 bytes for 256 elements): never loaded
  return 0xffffffffu;
}

inline std::vector<uint8_t> gguf_bytes(const std::vector<Tensor>& ts, const std::vector<Kv>& kvs, uint64_t align = 32) {
  std::vector<uint8_t> b;
  put_u32(b, 0x46554747u);
  put_u32(b, 3);
  put_u64(b, ts.size());
  put_u64(b, kvs.size());
  for (const auto& kv : kvs) {
    put_str(b, kv.key);
    put_u32(b, kv.type);
    switch (kv.type) {
      case 4:
      case 5: put_u32(b, static_cast<uint32_t>(kv.u)); break;
      case 6: {
        uint32_t x;
        std::memcpy(&x, &kv.f, 4);
        put_u32(b, x);
        break;
      }
      case 7: b.push_back(static_cast<uint8_t>(kv.u)); break;
      case 8: put_str(b, kv.s); break;
      case 10: put_u64(b, kv.u); break;
      default: break;
    }
  }
  uint64_t off = 0;
  std::vector<uint64_t> offs;
  for (const auto& t : ts) {
    put_str(b, t.name);
    put_u32(b, static_cast<uint32_t>(t.shape.size()));
    for (size_t i = t.shape.size(); i-- > 0;) put_u64(b, static_cast<uint64_t>(t.shape[i]));  // innermost first
    put_u32(b, ggml_type(t.dtype));
    put_u64(b, off);
    offs.push_back(off);
    off += (t.data.size() + align - 1) / align * align;
  }
  while (b.size() % align) b.push_back(0);
  for (const auto& t : ts) {
    b.insert(b.end(), t.data.begin(), t.data.end());
    while (b.size() % align) b.push_back(0);
  }
  return b;
}

inline void write_file(const std::string& path, const std::vector<uint8_t>& b) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  if (!b.empty() && std::fwrite(b.data(), 1, b.size(), f) != b.size()) {
    std::fclose(f);
    throw std::runtime_error("short write " + path);
  }
  std::fclose(f);
}

// A fresh directory under the system's temp directory (TMPDIR honoured),
// named after `tag`. Every directory made here is removed, with what the
// test wrote in it, when the test process exits normally: earlier versions
// left one behind per call, thousands of checkpoint copies over CI runs.
class TempDirs {
 public:
  ~TempDirs() {
    for (const auto& d : dirs_) {
      std::error_code ec;  // best effort: a test's exit never throws
      std::filesystem::remove_all(d, ec);
    }
  }
  std::string make(const std::string& tag) {
    std::string t = (std::filesystem::temp_directory_path() / ("ep_moe_test_" + tag + "_XXXXXX")).string();
    if (!mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed for " + t);
    dirs_.push_back(t);
    return t;
  }

 private:
  std::vector<std::string> dirs_;
};

inline std::string temp_dir(const std::string& tag) {
  static TempDirs dirs;
  return dirs.make(tag);
}

// ---- MoE checkpoints in every naming scheme --------------------------------

enum class Scheme { Qwen, Mixtral, DeepSeek, Fused, FusedTransposed, Gguf, GgufFused, Stacked };

struct Model {
  ref::Spec spec;
  ref::Weights w;             // as stored (rounded / dequantised)
  std::vector<float> router;  // [E, H]
  std::string dtype;          // element type of the expert tensors
  int layer = 0;              // index of the MoE layer written (others are dense)
};

// Rounds (or quantises) a weight to the file's dtype and returns its bytes.
inline std::vector<uint8_t> store(std::vector<float>& v, const std::string& dtype) {
  if (dtype == "Q8_0") return quantize_q8_0(v);
  for (auto& x : v) x = ref::round_to(x, dtype == "F32" ? ref::F32 : dtype == "F16" ? ref::F16 : ref::BF16);
  return encode(v, dtype);
}

// Transposes a row-major [rows, cols] matrix.
inline std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = v[static_cast<size_t>(r * cols + c)];
  return t;
}

// The experts' matrices back to back ([E, rows, cols] of per-expert
// [rows, cols]), and the stored values of such a stack back into them.
inline std::vector<float> stack(const std::vector<std::vector<float>>& per_expert) {
  std::vector<float> all;
  for (const auto& x : per_expert) all.insert(all.end(), x.begin(), x.end());
  return all;
}
inline void unstack(const std::vector<float>& all, std::vector<std::vector<float>>& per_expert) {
  auto at = all.begin();
  for (auto& x : per_expert) {
    std::copy(at, at + static_cast<long>(x.size()), x.begin());
    at += static_cast<long>(x.size());
  }
}

// Appends tensors, each rounded or quantised to its dtype; the floats it
// is given take the stored values.
struct TensorList {
  std::vector<Tensor> ts;
  void add(const std::string& name, std::vector<float>& v, std::vector<int64_t> shape, const std::string& dt) {
    ts.push_back(Tensor{name, dt, std::move(shape), store(v, dt)});
  }
  // The experts' [rows, cols] matrices as one [E, rows, cols] tensor, or
  // [E, cols, rows] with each transposed (tr); the stored values back into
  // them (the transposition is exact).
  void add_stacked(const std::string& name, std::vector<std::vector<float>>& per_expert, int64_t rows, int64_t cols,
                   bool tr, const std::string& dt) {
    if (tr)
      for (auto& x : per_expert) x = transpose(x, rows, cols);
    std::vector<float> all = stack(per_expert);
    const auto E = static_cast<int64_t>(per_expert.size());
    add(name, all, tr ? std::vector<int64_t>{E, cols, rows} : std::vector<int64_t>{E, rows, cols}, dt);
    unstack(all, per_expert);
    if (tr)
      for (auto& x : per_expert) x = transpose(x, cols, rows);
  }
  // Gate and up fused per expert, [2I, H]: each expert's gate rows, then
  // its up rows (transposed with tr); the stored values back into w.
  void add_fused_gate_up(const std::string& name, ref::Weights& w, int64_t I, int64_t H, bool tr,
                         const std::string& dt) {
    std::vector<std::vector<float>> gu(w.gate.size());
    for (size_t e = 0; e < gu.size(); ++e) {
      gu[e] = w.gate[e];
      gu[e].insert(gu[e].end(), w.up[e].begin(), w.up[e].end());
    }
    add_stacked(name, gu, 2 * I, H, tr, dt);
    const auto half = static_cast<long>(I * H);
    for (size_t e = 0; e < gu.size(); ++e) {
      std::copy(gu[e].begin(), gu[e].begin() + half, w.gate[e].begin());
      std::copy(gu[e].begin() + half, gu[e].end(), w.up[e].begin());
    }
  }
};

// llama.cpp's GGUF names: experts stacked [E, I, H] (gate and up fused
// into [E, 2I, H] for GgufFused).
inline void gguf_moe(TensorList& out, Model& m, bool fused) {
  const ref::Spec& s = m.spec;
  const std::string b = "blk." + std::to_string(m.layer) + ".", dt = m.dtype;
  out.add(b + "ffn_gate_inp.weight", m.router, {s.E, s.H}, "F32");
  if (fused) {
    out.add_fused_gate_up(b + "ffn_gate_up_exps.weight", m.w, s.I, s.H, false, dt);
  } else {
    out.add_stacked(b + "ffn_gate_exps.weight", m.w.gate, s.I, s.H, false, dt);
    out.add_stacked(b + "ffn_up_exps.weight", m.w.up, s.I, s.H, false, dt);
  }
  out.add_stacked(b + "ffn_down_exps.weight", m.w.down, s.H, s.I, false, dt);
  if (s.Is > 0) {
    out.add(b + "ffn_gate_shexp.weight", m.w.s_gate, {s.Is, s.H}, dt);
    out.add(b + "ffn_up_shexp.weight", m.w.s_up, {s.Is, s.H}, dt);
    out.add(b + "ffn_down_shexp.weight", m.w.s_down, {s.H, s.Is}, dt);
    if (s.shared_gate) out.add(b + "ffn_gate_inp_shexp.weight", m.w.s_gate_w, {s.H}, "F32");
  }
  if (s.use_bias) out.add(b + "exp_probs_b.bias", m.w.bias, {s.E}, "F32");
}

// The safetensors schemes' MoE layer: Mixtral's block_sparse_moe names,
// or mlp.experts per expert, fused or stacked, with the shared expert
// (DeepSeek's plural name) and the score bias.
inline void hf_moe(TensorList& out, Model& m, Scheme scheme, const std::string& lp) {
  const ref::Spec& s = m.spec;
  const std::string dt = m.dtype;
  if (scheme == Scheme::Mixtral) {
    out.add(lp + "block_sparse_moe.gate.weight", m.router, {s.E, s.H}, dt);
    for (int e = 0; e < s.E; ++e) {
      const std::string ep = lp + "block_sparse_moe.experts." + std::to_string(e) + ".";
      out.add(ep + "w1.weight", m.w.gate[static_cast<size_t>(e)], {s.I, s.H}, dt);
      out.add(ep + "w3.weight", m.w.up[static_cast<size_t>(e)], {s.I, s.H}, dt);
      out.add(ep + "w2.weight", m.w.down[static_cast<size_t>(e)], {s.H, s.I}, dt);
    }
    return;
  }
  out.add(lp + "mlp.gate.weight", m.router, {s.E, s.H}, dt);
  if (scheme == Scheme::Fused || scheme == Scheme::FusedTransposed) {
    // gate_up_proj [E, 2I, H] and down_proj [E, H, I], or transposed ([E,
    // H, 2I], [E, I, H]) as newer models store them.
    const bool tr = scheme == Scheme::FusedTransposed;
    out.add_fused_gate_up(lp + "mlp.experts.gate_up_proj", m.w, s.I, s.H, tr, dt);
    out.add_stacked(lp + "mlp.experts.down_proj", m.w.down, s.H, s.I, tr, dt);
  } else if (scheme == Scheme::Stacked) {  // separate 3-D gate/up/down [E, I, H], [E, H, I]
    out.add_stacked(lp + "mlp.experts.gate_proj", m.w.gate, s.I, s.H, false, dt);
    out.add_stacked(lp + "mlp.experts.up_proj", m.w.up, s.I, s.H, false, dt);
    out.add_stacked(lp + "mlp.experts.down_proj", m.w.down, s.H, s.I, false, dt);
  } else {
    for (int e = 0; e < s.E; ++e) {
      const std::string ep = lp + "mlp.experts." + std::to_string(e) + ".";
      out.add(ep + "gate_proj.weight", m.w.gate[static_cast<size_t>(e)], {s.I, s.H}, dt);
      out.add(ep + "up_proj.weight", m.w.up[static_cast<size_t>(e)], {s.I, s.H}, dt);
      out.add(ep + "down_proj.weight", m.w.down[static_cast<size_t>(e)], {s.H, s.I}, dt);
    }
  }
  if (s.Is > 0) {
    const std::string sp = lp + (scheme == Scheme::DeepSeek ? "mlp.shared_experts." : "mlp.shared_expert.");
    out.add(sp + "gate_proj.weight", m.w.s_gate, {s.Is, s.H}, dt);
    out.add(sp + "up_proj.weight", m.w.s_up, {s.Is, s.H}, dt);
    out.add(sp + "down_proj.weight", m.w.s_down, {s.H, s.Is}, dt);
    if (s.shared_gate) out.add(lp + "mlp.shared_expert_gate.weight", m.w.s_gate_w, {1, s.H}, "F32");
  }
  if (s.use_bias) out.add(lp + "mlp.gate.e_score_correction_bias", m.w.bias, {s.E}, "F32");
}

// Tensors of one MoE layer (plus a dense layer 0 and an embedding so the
// checkpoint has non-expert tensors too). `m.w` is updated to the stored values.
inline std::vector<Tensor> moe_tensors(Model& m, Scheme scheme, std::mt19937& rng) {
  const ref::Spec& s = m.spec;
  std::normal_distribution<float> n(0.0f, 1.0f);
  TensorList out;
  // Unrelated tensors: an embedding and a dense MLP in layer 0.
  std::vector<float> emb(static_cast<size_t>(37 * s.H));
  for (auto& x : emb) x = n(rng);
  std::vector<float> dense(static_cast<size_t>(s.H * 24));
  for (auto& x : dense) x = n(rng);
  m.router.resize(static_cast<size_t>(s.E * s.H));
  for (auto& x : m.router) x = n(rng) / std::sqrt(static_cast<float>(s.H));
  if (scheme == Scheme::Gguf || scheme == Scheme::GgufFused) {
    out.add("token_embd.weight", emb, {37, s.H}, "F32");
    out.add("blk.0.ffn_down.weight", dense, {s.H, 24}, "F32");
    gguf_moe(out, m, scheme == Scheme::GgufFused);
  } else {
    const std::string pre = scheme == Scheme::FusedTransposed ? "model.language_model." : "model.";
    out.add(pre + "embed_tokens.weight", emb, {37, s.H}, m.dtype == "Q8_0" ? "F32" : m.dtype);
    out.add(pre + "layers.0.mlp.down_proj.weight", dense, {s.H, 24}, m.dtype);
    hf_moe(out, m, scheme, pre + "layers." + std::to_string(m.layer) + ".");
  }
  return std::move(out.ts);
}

// config.json for an HF checkpoint of `m`.
inline std::string hf_config(const Model& m, Scheme scheme) {
  const ref::Spec& s = m.spec;
  std::string c = "{\"hidden_size\": " + std::to_string(s.H) + ", \"num_experts_per_tok\": " + std::to_string(s.K) +
                  ", \"num_hidden_layers\": " + std::to_string(m.layer + 2) +
                  ", \"norm_topk_prob\": " + (s.renormalize ? "true" : "false") + ", \"hidden_act\": \"" +
                  (s.act == ref::GELU        ? "gelu"
                   : s.act == ref::GELU_TANH ? "gelu_pytorch_tanh"
                                             : "silu") +
                  "\"";
  if (scheme == Scheme::Mixtral)
    c += ", \"intermediate_size\": " + std::to_string(s.I) + ", \"num_local_experts\": " + std::to_string(s.E);
  else c += ", \"moe_intermediate_size\": " + std::to_string(s.I) + ", \"num_experts\": " + std::to_string(s.E);
  // No model_type: ep_moe then needs every semantic key stated.
  c += std::string(", \"scoring_func\": \"") + (s.sigmoid ? "sigmoid" : "softmax") + "\"";
  if (s.groups > 0)
    c += ", \"n_group\": " + std::to_string(s.groups) + ", \"topk_group\": " + std::to_string(s.topk_group) +
         ", \"topk_method\": \"noaux_tc\"";
  c += ", \"routed_scaling_factor\": " + std::to_string(s.scale);
  c += "}";
  if (scheme == Scheme::FusedTransposed) c = "{\"text_config\": " + c + "}";
  return c;
}

inline std::vector<Kv> gguf_meta(const Model& m) {
  const ref::Spec& s = m.spec;
  std::vector<Kv> kv;
  Kv a;
  a.key = "general.architecture";
  a.type = 8;
  a.s = "qwen3moe";
  kv.push_back(a);
  auto u32 = [&](const std::string& k, uint64_t v) {
    Kv x;
    x.key = "qwen3moe." + k;
    x.type = 4;
    x.u = v;
    kv.push_back(x);
  };
  u32("block_count", static_cast<uint64_t>(m.layer + 2));
  u32("embedding_length", static_cast<uint64_t>(s.H));
  u32("expert_count", static_cast<uint64_t>(s.E));
  u32("expert_used_count", static_cast<uint64_t>(s.K));
  u32("expert_feed_forward_length", static_cast<uint64_t>(s.I));
  u32("expert_gating_func", s.sigmoid ? 2 : 1);
  if (s.groups > 0) {
    u32("expert_group_count", static_cast<uint64_t>(s.groups));
    u32("expert_group_used_count", static_cast<uint64_t>(s.topk_group));
  }
  Kv norm;
  norm.key = "qwen3moe.expert_weights_norm";
  norm.type = 7;
  norm.u = s.renormalize ? 1 : 0;
  kv.push_back(norm);
  Kv sc;
  sc.key = "qwen3moe.expert_weights_scale";
  sc.type = 6;
  sc.f = static_cast<float>(s.scale);
  kv.push_back(sc);
  return kv;
}

}  // namespace writers

namespace writers {

// A one-file Qwen-named safetensors checkpoint of `m` (its weights drawn
// here from `rng`, then replaced by the stored values) in a new temporary
// directory, with config.json when `with_config`. Returns the file's path.
inline std::string small_checkpoint(Model& m, std::mt19937& rng, bool with_config = true) {
  m.w = ref::random_weights(m.spec, ref::F32, rng);
  const auto ts = moe_tensors(m, Scheme::Qwen, rng);
  const std::string dir = temp_dir("small");
  if (with_config) {
    const std::string config = hf_config(m, Scheme::Qwen);
    write_file(dir + "/config.json", std::vector<uint8_t>(config.begin(), config.end()));
  }
  write_file(dir + "/model.safetensors", safetensors_bytes(ts, {{"format", "pt"}}));
  return dir + "/model.safetensors";
}

}  // namespace writers

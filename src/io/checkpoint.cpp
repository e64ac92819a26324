#include "io/checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <dirent.h>
#include <nlohmann/json.hpp>

#include "io/json_guard.hpp"
#include "io/json_release.hpp"
#include <set>
#include <tuple>

#include "common/error.hpp"
#include "common/log.hpp"
#include "io/safetensors.hpp"

namespace ep_moe {
namespace io {

namespace {

// Roles of tensors within a layer. Per-expert roles carry the expert id;
// 3-D roles hold every expert (outermost dimension) and use expert -1.
// R2_*: [E, n] tensors of every expert's bias. R_MXFP4_*: GPT-OSS's MXFP4
// expert blocks (4-D) and, one role on, their scales (3-D); see Slice.
enum Role : int {
  R_GATE = 0,
  R_UP,
  R_DOWN,
  R_ROUTER,
  R_BIAS,
  R_S_GATE,
  R_S_UP,
  R_S_DOWN,
  R_S_EXPERT_GATE,
  R_ROUTER_BIAS,
  R2_GATE_BIAS,
  R2_UP_BIAS,
  R2_DOWN_BIAS,
  R2_GATE_UP_BIAS,
  R_MXFP4_GATE_UP,
  R_MXFP4_GATE_UP_SCALES,
  R_MXFP4_DOWN,
  R_MXFP4_DOWN_SCALES,
  R_FP8S_GATE,  // block-scaled FP8's weight_scale_inv: per expert, R_FP8S_GATE + (role - R_GATE)
  R_FP8S_UP,
  R_FP8S_DOWN,
  R_FP8S_S_GATE,  // and the shared expert's, R_FP8S_S_GATE + (role - R_S_GATE)
  R_FP8S_S_UP,
  R_FP8S_S_DOWN,
  R3_GATE,
  R3_UP,
  R3_DOWN,
  R3_GATE_UP
};
// Roles that hold routed experts' weight matrices (the scheme votes, the
// MoE layers).
bool expert_role(int r) { return r <= R_DOWN || r >= R3_GATE || (r >= R_MXFP4_GATE_UP && r <= R_MXFP4_DOWN_SCALES); }
// Dimensions of a tensor that holds every expert of a layer in a role.
size_t role_dims(int r) { return r == R_MXFP4_GATE_UP || r == R_MXFP4_DOWN ? 4 : 3; }

// A 1-D or 2-D tensor's [rows, cols] (1-D: one row).
void matrix_dims(const std::string& fname, const TensorInfo* t, int64_t* r, int64_t* c) {
  if (t->shape.size() == 1) {
    *r = 1;
    *c = t->shape[0];
  } else if (t->shape.size() == 2) {
    *r = t->shape[0];
    *c = t->shape[1];
  } else {
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' should be 2-D", fname.c_str(), t->name.c_str());
  }
}

std::string dims_text(const std::vector<int64_t>& shape) {
  std::string t = "[";
  for (size_t i = 0; i < shape.size(); ++i) t += (i ? ", " : "") + std::to_string(shape[i]);
  return t + "]";
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}
std::string dir_of(const std::string& p) {
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : p.substr(0, slash));
}

// Reads "<digits>." at pos; advances past the dot.
bool take_index(const std::string& s, size_t& pos, int32_t* out) {
  size_t p = pos;
  int64_t v = 0;
  while (p < s.size() && s[p] >= '0' && s[p] <= '9') {
    v = v * 10 + (s[p] - '0');
    if (v > (1 << 24)) return false;
    ++p;
  }
  if (p == pos || p >= s.size() || s[p] != '.') return false;
  *out = static_cast<int32_t>(v);
  pos = p + 1;
  return true;
}

struct Parsed {
  Naming scheme;
  int32_t layer, expert;
  int role;
};

// HF names: <prefix>layers.<L>.<rest>.
bool parse_hf(const std::string& name, std::string* prefix, Parsed* out) {
  const size_t at = name.find("layers.");
  if (at == std::string::npos) return false;
  size_t pos = at + 7;
  int32_t L;
  if (!take_index(name, pos, &L)) return false;
  const std::string rest = name.substr(pos);
  *prefix = name.substr(0, at);
  out->layer = L;
  out->expert = -1;
  static const struct {
    const char* suffix;
    Naming scheme;
    int role;
  } fixed[] = {
      {"mlp.gate.weight", Naming::Auto, R_ROUTER},
      {"mlp.router.weight", Naming::Auto, R_ROUTER},  // GPT-OSS
      {"mlp.router.bias", Naming::Auto, R_ROUTER_BIAS},
      {"mlp.experts.gate_up_proj_bias", Naming::HfFused, R2_GATE_UP_BIAS},
      {"mlp.experts.down_proj_bias", Naming::HfFused, R2_DOWN_BIAS},
      {"mlp.experts.gate_up_proj_blocks", Naming::HfFused, R_MXFP4_GATE_UP},
      {"mlp.experts.gate_up_proj_scales", Naming::HfFused, R_MXFP4_GATE_UP_SCALES},
      {"mlp.experts.down_proj_blocks", Naming::HfFused, R_MXFP4_DOWN},
      {"mlp.experts.down_proj_scales", Naming::HfFused, R_MXFP4_DOWN_SCALES},
      {"block_sparse_moe.gate.weight", Naming::Mixtral, R_ROUTER},
      {"mlp.gate.e_score_correction_bias", Naming::Auto, R_BIAS},
      {"mlp.shared_expert.gate_proj.weight", Naming::Auto, R_S_GATE},
      {"mlp.shared_expert.up_proj.weight", Naming::Auto, R_S_UP},
      {"mlp.shared_expert.down_proj.weight", Naming::Auto, R_S_DOWN},
      {"mlp.shared_experts.gate_proj.weight", Naming::Auto, R_S_GATE},
      {"mlp.shared_experts.up_proj.weight", Naming::Auto, R_S_UP},
      {"mlp.shared_experts.down_proj.weight", Naming::Auto, R_S_DOWN},
      {"mlp.shared_expert_gate.weight", Naming::Auto, R_S_EXPERT_GATE},
      {"mlp.shared_expert.gate_proj.weight_scale_inv", Naming::Auto, R_FP8S_S_GATE},
      {"mlp.shared_expert.up_proj.weight_scale_inv", Naming::Auto, R_FP8S_S_UP},
      {"mlp.shared_expert.down_proj.weight_scale_inv", Naming::Auto, R_FP8S_S_DOWN},
      {"mlp.shared_experts.gate_proj.weight_scale_inv", Naming::Auto, R_FP8S_S_GATE},
      {"mlp.shared_experts.up_proj.weight_scale_inv", Naming::Auto, R_FP8S_S_UP},
      {"mlp.shared_experts.down_proj.weight_scale_inv", Naming::Auto, R_FP8S_S_DOWN},
      {"mlp.experts.gate_up_proj", Naming::HfFused, R3_GATE_UP},
      {"mlp.experts.gate_up_proj.weight", Naming::HfFused, R3_GATE_UP},
      {"mlp.experts.down_proj", Naming::HfFused, R3_DOWN},
      {"mlp.experts.down_proj.weight", Naming::HfFused, R3_DOWN},
      {"mlp.experts.gate_proj", Naming::HfFused, R3_GATE},
      {"mlp.experts.up_proj", Naming::HfFused, R3_UP},
  };
  for (const auto& f : fixed)
    if (rest == f.suffix) {
      out->scheme = f.scheme;
      out->role = f.role;
      return true;
    }
  static const struct {
    const char* head;
    Naming scheme;
    const char* names[3];
  } per_expert[] = {
      {"mlp.experts.", Naming::HfPerExpert, {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}},
      {"block_sparse_moe.experts.", Naming::Mixtral, {"w1.weight", "w3.weight", "w2.weight"}},
  };
  for (const auto& pe : per_expert) {
    const size_t hl = std::strlen(pe.head);
    if (rest.compare(0, hl, pe.head) != 0) continue;
    size_t p = hl;
    int32_t e;
    if (!take_index(rest, p, &e)) continue;
    const std::string tail = rest.substr(p);
    for (int r = 0; r < 3; ++r)
      for (int scale = 0; scale < 2; ++scale)  // the weight, or its FP8 weight_scale_inv
        if (tail == (scale ? std::string(pe.names[r]) + "_scale_inv" : std::string(pe.names[r]))) {
          out->scheme = pe.scheme;
          out->role = (scale ? R_FP8S_GATE : R_GATE) + r;
          out->expert = e;
          return true;
        }
  }
  return false;
}

bool parse_gguf_name(const std::string& name, Parsed* out) {
  if (name.compare(0, 4, "blk.") != 0) return false;
  size_t pos = 4;
  int32_t L;
  if (!take_index(name, pos, &L)) return false;
  const std::string rest = name.substr(pos);
  static const struct {
    const char* suffix;
    int role;
  } names[] = {
      {"ffn_gate_exps.weight", R3_GATE},    {"ffn_up_exps.weight", R3_UP},
      {"ffn_down_exps.weight", R3_DOWN},    {"ffn_gate_up_exps.weight", R3_GATE_UP},
      {"ffn_gate_inp.weight", R_ROUTER},    {"exp_probs_b.bias", R_BIAS},
      {"ffn_gate_shexp.weight", R_S_GATE},  {"ffn_up_shexp.weight", R_S_UP},
      {"ffn_down_shexp.weight", R_S_DOWN},  {"ffn_gate_inp_shexp.weight", R_S_EXPERT_GATE},
      {"ffn_gate_inp.bias", R_ROUTER_BIAS}, {"ffn_gate_exps.bias", R2_GATE_BIAS},
      {"ffn_up_exps.bias", R2_UP_BIAS},     {"ffn_down_exps.bias", R2_DOWN_BIAS},
  };
  for (const auto& n : names)
    if (rest == n.suffix) {
      out->scheme = Naming::Gguf;
      out->layer = L;
      out->expert = -1;
      out->role = n.role;
      return true;
    }
  // Mixtral GGUFs converted before the 3-D expert tensors (early 2024):
  // blk.L.ffn_{gate,up,down}.E.weight, one 2-D tensor per expert.
  static const struct {
    const char* head;
    int role;
  } per_expert[] = {{"ffn_gate.", R_GATE}, {"ffn_up.", R_UP}, {"ffn_down.", R_DOWN}};
  for (const auto& pe : per_expert) {
    const size_t hl = std::strlen(pe.head);
    if (rest.compare(0, hl, pe.head) != 0) continue;
    size_t p = hl;
    int32_t e;
    if (!take_index(rest, p, &e) || rest.compare(p, std::string::npos, "weight") != 0) continue;
    out->scheme = Naming::Gguf;
    out->layer = L;
    out->expert = e;
    out->role = pe.role;
    return true;
  }
  return false;
}

// Whether a tensor no role matched lies in a layer's MoE block (HF:
// <prefix>layers.L.mlp.* or block_sparse_moe.*; GGUF: blk.L.ffn_* but the
// norms), where the layer would silently ignore it; *layer gets L.
bool in_moe_namespace(const std::string& name, bool gguf, const std::string& prefix, int32_t* layer) {
  const std::string head = gguf ? "blk." : prefix + "layers.";
  if (name.compare(0, head.size(), head) != 0) return false;
  size_t pos = head.size();
  if (!take_index(name, pos, layer)) return false;
  const std::string rest = name.substr(pos);
  if (gguf) return rest.compare(0, 4, "ffn_") == 0 && rest.find("norm") == std::string::npos;
  return rest.compare(0, 4, "mlp.") == 0 || rest.compare(0, 17, "block_sparse_moe.") == 0;
}

double get_num(const std::map<std::string, double>& m, const char* k, double dflt, bool* found = nullptr) {
  auto it = m.find(k);
  if (found) *found = it != m.end();
  return it == m.end() ? dflt : it->second;
}

}  // namespace

const char* naming_name(Naming n) {
  switch (n) {
    case Naming::Auto: return "auto";
    case Naming::HfPerExpert: return "hf-per-expert";
    case Naming::Mixtral: return "mixtral";
    case Naming::HfFused: return "hf-fused";
    case Naming::HfFusedTransposed: return "hf-fused-transposed";
    case Naming::Gguf: return "gguf";
  }
  return "?";
}

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& path, Naming naming, const std::string& prefix) {
  std::unique_ptr<Checkpoint> ck(new Checkpoint());
  std::string file = path, index;
  std::string dir = path;
  if (is_dir(path)) {
    if (is_file(path + "/model.safetensors.index.json")) {
      index = path + "/model.safetensors.index.json";
    } else if (is_file(path + "/model.safetensors")) {
      file = path + "/model.safetensors";
    } else {
      // A directory with exactly one .gguf or one .safetensors file.
      std::vector<std::string> ggufs, sts;
      if (DIR* d = ::opendir(path.c_str())) {
        while (dirent* e = ::readdir(d)) {
          const std::string n = e->d_name;
          if (ends_with(n, ".gguf")) ggufs.push_back(path + "/" + n);
          if (ends_with(n, ".safetensors")) sts.push_back(path + "/" + n);
        }
        ::closedir(d);
      }
      if (ggufs.size() + sts.size() != 1)
        fail(EP_MOE_ERR_NOT_FOUND,
             "%s: no checkpoint found (looked for model.safetensors.index.json, model.safetensors, or exactly one "
             ".gguf or .safetensors file; found %zu)",
             path.c_str(), ggufs.size() + sts.size());
      file = ggufs.empty() ? sts[0] : ggufs[0];
    }
  } else {
    dir = dir_of(path);
    if (ends_with(path, ".json")) index = path;
  }

  if (!index.empty()) {
    const std::string text = read_small_file(index, 64ull << 20);
    ck->header_bytes_ += text.size();
    // {"metadata": {...}, "weight_map": {tensor: file}}: a few levels, no
    // long arrays (json_guard.hpp).
    check_json(text, index, JsonLimits{kIndexMaxDepth, kIndexMaxArray, true});
    nlohmann::json root;
    const JsonRelease release{root};
    try {
      root = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(EP_MOE_ERR_FORMAT, "%s: not valid JSON: %s", index.c_str(), e.what());
    }
    const auto wm = root.is_object() ? root.find("weight_map") : root.end();
    if (wm == root.end() || !wm->is_object()) fail(EP_MOE_ERR_FORMAT, "%s: no weight_map object", index.c_str());
    std::map<std::string, int> file_ids;
    std::vector<std::pair<std::string, std::string>> expect;  // tensor -> file
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        fail(EP_MOE_ERR_FORMAT, "%s: weight_map entry '%s' is not a file name", index.c_str(), it.key().c_str());
      const std::string f = it.value().get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        fail(EP_MOE_ERR_FORMAT, "%s: weight_map entry '%s' names '%s', not a file beside the index", index.c_str(),
             it.key().c_str(), f.c_str());
      if (!file_ids.count(f)) file_ids.emplace(f, 0);
      expect.emplace_back(it.key(), f);
    }
    int next = 0;
    for (auto& kv : file_ids) {
      kv.second = next++;
      ck->files_.push_back(
          std::make_unique<FileSource>(dir + "/" + kv.first));  // no raw owner if the vector grows and throws
      SafetensorsFile sf = parse_safetensors(*ck->files_.back(), kv.second);
      ck->header_bytes_ += sf.data_start;
      for (auto& t : sf.tensors) ck->tensors_.push_back(std::move(t));
    }
    std::map<std::string, int> where;
    for (size_t i = 0; i < ck->tensors_.size(); ++i)
      if (!where.emplace(ck->tensors_[i].name, ck->tensors_[i].file).second)
        fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' is stored in more than one file", index.c_str(),
             ck->tensors_[i].name.c_str());
    for (const auto& e : expect) {
      auto it = where.find(e.first);
      if (it == where.end() || it->second != file_ids[e.second])
        fail(EP_MOE_ERR_FORMAT, "%s: weight_map puts tensor '%s' in %s, which does not hold it", index.c_str(),
             e.first.c_str(), e.second.c_str());
    }
    ck->format_ = Format::Safetensors;
  } else {
    ck->files_.push_back(std::make_unique<FileSource>(file));
    const ByteSource& src = *ck->files_.back();
    uint8_t magic[4] = {0, 0, 0, 0};
    if (src.size() >= 4) src.read(0, magic, 4);
    // GGUF by its magic, or by its name (so a damaged GGUF says "bad magic").
    if (std::memcmp(magic, "GGUF", 4) == 0 || ends_with(file, ".gguf")) {
      ck->format_ = Format::Gguf;
      ck->gguf_ = parse_gguf(src, 0);
      ck->header_bytes_ += ck->gguf_.data_start;
      ck->tensors_ = ck->gguf_.tensors;
      ck->open_gguf_splits(file);
    } else {
      ck->format_ = Format::Safetensors;
      SafetensorsFile sf = parse_safetensors(src, 0);
      ck->header_bytes_ += sf.data_start;
      ck->tensors_ = std::move(sf.tensors);
    }
  }

  if (ck->format_ == Format::Gguf) {
    if (const GgufValue* a = ck->gguf_.find("general.architecture")) ck->arch_ = a->s;
  } else {
    ck->read_hf_config(dir);
  }
  ck->index_names(naming, prefix);
  return ck;
}

// A split GGUF (llama.cpp's gguf-split: PREFIX-00001-of-00003.gguf, each
// with split.no / split.count / split.tensors.count) is one model: opened
// from any of its files, every split is read and its tensors merged; the
// metadata comes from the first.
void Checkpoint::open_gguf_splits(const std::string& path) {
  const GgufValue* count = gguf_.find("split.count");
  if (!count) return;
  const std::string& name = files_[0]->name();
  const int64_t n = count->checked_int("split.count", 1, 9999, name);
  const GgufValue* no = gguf_.find("split.no");
  if (!no || no->checked_int("split.no", 0, 9998, name) >= n)
    fail(EP_MOE_ERR_FORMAT, "%s: split.count %lld / split.no %lld are not a split of a GGUF model", name.c_str(),
         static_cast<long long>(n), static_cast<long long>(no ? no->as_int() : -1));
  if (n == 1) return;
  // PREFIX-%05d-of-%05d.gguf, as llama.cpp names them.
  const std::string tail =
      ep_moe::format("-%05lld-of-%05lld.gguf", static_cast<long long>(no->as_int() + 1), static_cast<long long>(n));
  if (!ends_with(path, tail))
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s is split %lld of a %lld-file GGUF model (split.count), but its name does not end in '%s', so the "
         "other splits cannot be found: keep llama.cpp's split names, or merge them (llama-gguf-split --merge)",
         name.c_str(), static_cast<long long>(no->as_int() + 1), static_cast<long long>(n), tail.c_str());
  const std::string prefix = path.substr(0, path.size() - tail.size());
  const int64_t first = no->as_int();
  std::vector<std::unique_ptr<ByteSource>> files(static_cast<size_t>(n));
  std::vector<GgufFile> parts(static_cast<size_t>(n));
  files[static_cast<size_t>(first)] = std::move(files_[0]);
  parts[static_cast<size_t>(first)] = std::move(gguf_);
  for (int64_t i = 0; i < n; ++i) {
    if (i == first) continue;
    const std::string p =
        prefix + ep_moe::format("-%05lld-of-%05lld.gguf", static_cast<long long>(i + 1), static_cast<long long>(n));
    if (!is_file(p))
      fail(EP_MOE_ERR_NOT_FOUND, "%s: split %lld of %lld (%s) is missing", name.c_str(), static_cast<long long>(i + 1),
           static_cast<long long>(n), p.c_str());
    files[static_cast<size_t>(i)] = std::make_unique<FileSource>(p);
    parts[static_cast<size_t>(i)] = parse_gguf(*files[static_cast<size_t>(i)], static_cast<int>(i));
    const GgufValue* pno = parts[static_cast<size_t>(i)].find("split.no");
    const GgufValue* pcount = parts[static_cast<size_t>(i)].find("split.count");
    if (!pno || !pcount || !pno->is_int() || !pcount->is_int() || pno->as_int() != i || pcount->as_int() != n)
      fail(EP_MOE_ERR_FORMAT, "%s: its split.no / split.count do not say split %lld of %lld", p.c_str(),
           static_cast<long long>(i + 1), static_cast<long long>(n));
  }
  // The first split's parse used file index `first`'s slot 0: renumber.
  for (TensorInfo& t : parts[static_cast<size_t>(first)].tensors) t.file = static_cast<int>(first);
  files_ = std::move(files);
  tensors_.clear();
  header_bytes_ = 0;
  for (const GgufFile& g : parts) {
    header_bytes_ += g.data_start;
    tensors_.insert(tensors_.end(), g.tensors.begin(), g.tensors.end());
  }
  gguf_ = std::move(parts[0]);
  if (const GgufValue* total = gguf_.find("split.tensors.count"))
    if (total->checked_int("split.tensors.count", 0, INT64_MAX, name) != static_cast<int64_t>(tensors_.size()))
      fail(EP_MOE_ERR_FORMAT, "%s: split.tensors.count is %lld, but the %lld splits hold %zu tensors", name.c_str(),
           static_cast<long long>(total->as_int()), static_cast<long long>(n), tensors_.size());
  std::map<std::string, int> seen;
  for (const TensorInfo& t : tensors_)
    if (!seen.emplace(t.name, t.file).second)
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' is in more than one split", name.c_str(), t.name.c_str());
}

void Checkpoint::read_hf_config(const std::string& dir) {
  const std::string p = dir + "/config.json";
  if (!is_file(p)) return;
  parse_hf_config(read_small_file(p, 16ull << 20), p, &cfg_num_, &cfg_str_);
  has_config_ = true;
  const auto mt = cfg_str_.find("model_type");
  if (mt != cfg_str_.end()) arch_ = mt->second;
}

void Checkpoint::index_names(Naming want, const std::string& prefix) {
  if (format_ == Format::Gguf && want != Naming::Auto && want != Naming::Gguf)
    fail(EP_MOE_ERR_INVALID_ARGUMENT, "naming %s does not apply to a GGUF file", naming_name(want));
  if (format_ == Format::Safetensors && want == Naming::Gguf)
    fail(EP_MOE_ERR_INVALID_ARGUMENT, "naming gguf does not apply to a safetensors checkpoint");

  // First pass: which scheme and prefix hold the routed experts.
  std::map<std::pair<Naming, std::string>, size_t> votes;
  std::vector<std::tuple<size_t, Parsed, std::string>> parsed;
  std::vector<size_t> unparsed;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    Parsed p{};
    std::string pre;
    const bool ok =
        format_ == Format::Gguf ? parse_gguf_name(tensors_[i].name, &p) : parse_hf(tensors_[i].name, &pre, &p);
    if (!ok) {
      unparsed.push_back(i);
      continue;
    }
    if (!prefix.empty() && pre != prefix) continue;
    if (expert_role(p.role)) ++votes[{p.scheme, pre}];
    parsed.emplace_back(i, p, pre);
  }
  Naming scheme = Naming::Auto;
  std::string pre_best;
  size_t best = 0;
  for (const auto& v : votes) {
    Naming s = v.first.first;
    if (want != Naming::Auto && !(s == want || (s == Naming::HfFused && want == Naming::HfFusedTransposed))) continue;
    if (v.second > best) {
      best = v.second;
      scheme = s;
      pre_best = v.first.second;
    }
  }
  if (best == 0) {
    if (want != Naming::Auto)
      fail(EP_MOE_ERR_NOT_FOUND, "%s: no expert tensors named like the %s scheme%s%s", files_[0]->name().c_str(),
           naming_name(want), prefix.empty() ? "" : " under prefix ", prefix.c_str());
    // A checkpoint without experts is legal; it simply has no MoE layers.
    naming_ = want;
    return;
  }
  naming_ = want == Naming::HfFusedTransposed ? want : scheme;
  naming_forced_ = want != Naming::Auto;
  prefix_ = pre_best;

  std::set<int32_t> layers;
  for (const auto& e : parsed) {
    const Parsed& p = std::get<1>(e);
    if (std::get<2>(e) != pre_best) continue;
    const bool is_expert = expert_role(p.role);
    if (is_expert && p.scheme != scheme) continue;  // another scheme's expert names
    if (p.scheme == Naming::Mixtral && scheme != Naming::Mixtral) continue;
    const auto key = std::make_tuple(p.layer, p.role, p.expert);
    if (!roles_.emplace(key, std::get<0>(e)).second)
      fail(EP_MOE_ERR_FORMAT, "%s: two tensors play the same role in layer %d", files_[0]->name().c_str(), p.layer);
    num_layers_ = std::max(num_layers_, p.layer + 1);
    if (is_expert) {
      layers.insert(p.layer);
      int32_t& cnt = expert_count_[p.layer];
      if (p.expert >= 0) {
        cnt = std::max(cnt, p.expert + 1);
      } else {
        const TensorInfo& t = tensors_[std::get<0>(e)];
        if (t.shape.size() != role_dims(p.role))
          fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' should be %zu-D [experts, ...], it has %zu dimensions",
               file(t.file).name().c_str(), t.name.c_str(), role_dims(p.role), t.shape.size());
        cnt = std::max<int32_t>(cnt, static_cast<int32_t>(t.shape[0]));
      }
    }
  }
  moe_layers_.assign(layers.begin(), layers.end());
  for (size_t i : unparsed) {
    int32_t L = -1;
    if (in_moe_namespace(tensors_[i].name, format_ == Format::Gguf, pre_best, &L) && layers.count(L))
      unknown_[L].push_back(tensors_[i].name);
  }
  if (format_ == Format::Gguf) {
    if (const GgufValue* v = gguf_.find(arch_ + ".block_count"))
      num_layers_ = std::max<int32_t>(
          num_layers_, static_cast<int32_t>(v->checked_int(arch_ + ".block_count", 1, kMaxCount, files_[0]->name())));
  } else {
    num_layers_ = std::max<int32_t>(num_layers_, static_cast<int32_t>(get_num(cfg_num_, "num_hidden_layers", 0)));
  }
  log(EP_MOE_LOG_INFO, "checkpoint %s: %zu tensors in %zu file(s), naming %s%s%s, %zu MoE layers",
      files_[0]->name().c_str(), tensors_.size(), files_.size(), naming_name(naming_),
      prefix_.empty() ? "" : ", prefix ", prefix_.c_str(), moe_layers_.size());
}

bool Checkpoint::is_moe_layer(int32_t layer) const {
  return std::binary_search(moe_layers_.begin(), moe_layers_.end(), layer);
}

const TensorInfo* Checkpoint::tensor(int32_t layer, int role, int32_t expert) const {
  auto it = roles_.find(std::make_tuple(layer, role, expert));
  return it == roles_.end() ? nullptr : &tensors_[it->second];
}

int64_t Checkpoint::hidden_hint(int32_t layer) const {
  if (const TensorInfo* r = tensor(layer, R_ROUTER, -1))
    if (r->shape.size() == 2) return r->shape[1];
  if (format_ == Format::Gguf) {
    if (const GgufValue* v = gguf_.find(arch_ + ".embedding_length"))
      return v->checked_int(arch_ + ".embedding_length", 1, kMaxCount, files_[0]->name());
    return 0;
  }
  return static_cast<int64_t>(get_num(cfg_num_, "hidden_size", 0));
}

bool Checkpoint::fused_transposed(int32_t layer) const {
  const TensorInfo* gu3 = tensor(layer, R3_GATE_UP, -1);
  const TensorInfo* d3 = tensor(layer, R3_DOWN, -1);
  if (naming_ == Naming::HfFusedTransposed) return true;
  if (naming_forced_ || !gu3 || gu3->shape.size() != 3) return false;
  if (hf_fused_layout(arch_).x_times_w) return true;  // fixed by the architecture: the shapes may not tell
  const int64_t H = hidden_hint(layer);
  const int64_t a = gu3->shape[1], b = gu3->shape[2];
  if (H > 0 && b == H && a != H) return false;                         // [E, 2I, H]
  if (H > 0 && a == H && b != H) return true;                          // [E, H, 2I]
  if (H > 0 && d3 && d3->shape.size() == 3) return d3->shape[1] != H;  // down [E, H, I] or [E, I, H]
  // No hidden size to compare with: Qwen3-VL-style checkpoints (under a
  // language_model prefix) store the transposed layout.
  return prefix_.find("language_model") != std::string::npos;
}

LayerShape Checkpoint::layer_shape(int32_t layer) const {
  if (!is_moe_layer(layer))
    fail(EP_MOE_ERR_NOT_FOUND, "%s: layer %d has no routed experts (MoE layers: %zu)", files_[0]->name().c_str(), layer,
         moe_layers_.size());
  const std::string& fname = files_[0]->name();
  auto unknown = unknown_.find(layer);
  if (unknown != unknown_.end()) {
    const std::vector<std::string>& names = unknown->second;
    std::string list;
    for (size_t i = 0; i < names.size() && i < 4; ++i) list += (i ? ", '" : "'") + names[i] + "'";
    if (names.size() > 4) list += " and " + std::to_string(names.size() - 4) + " more";
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s: layer %d%s%s%s holds %zu tensor(s) that ep_moe's layer would ignore (%s): refusing rather than "
         "computing something else",
         fname.c_str(), layer, arch_.empty() ? "" : " (architecture '", arch_.c_str(), arch_.empty() ? "" : "')",
         names.size(), list.c_str());
  }
  LayerShape s;
  s.experts = expert_count_.at(layer);
  const auto dims2 = [&](const TensorInfo* t, int64_t* r, int64_t* c) { matrix_dims(fname, t, r, c); };
  int64_t H = hidden_hint(layer), I = 0;
  if (const TensorInfo* router = tensor(layer, R_ROUTER, -1)) {
    int64_t r, c;
    dims2(router, &r, &c);
    if (r != s.experts)
      fail(EP_MOE_ERR_FORMAT, "%s: router '%s' has %lld rows but layer %d has %d experts", fname.c_str(),
           router->name.c_str(), static_cast<long long>(r), layer, s.experts);
    s.router = true;
  }
  s.expert_elem = expert_sizes(layer, &H, &I);
  // Per-expert tensors: every expert below the highest number has its own
  // (a file naming only expert 1,000,000 does not hold 1,000,001 experts).
  for (int role : {R_GATE, R_UP, R_DOWN}) {
    int32_t next = 0;
    for (auto it = roles_.lower_bound(std::make_tuple(layer, role, 0));
         it != roles_.end() && std::get<0>(it->first) == layer && std::get<1>(it->first) == role &&
         std::get<2>(it->first) == next;
         ++it)
      ++next;
    if (next > 0 || roles_.count(std::make_tuple(layer, role, s.experts - 1)))
      if (next != s.experts)
        fail(EP_MOE_ERR_FORMAT,
             "%s: layer %d names experts up to %d in per-expert tensors, but has no %s tensor for expert %d",
             fname.c_str(), layer, s.experts - 1,
             role == R_GATE ? "gate"
             : role == R_UP ? "up"
                            : "down",
             next);
  }
  if (H <= 0 || I <= 0 || H > (1 << 24) || I > (1 << 24))
    fail(EP_MOE_ERR_FORMAT, "%s: cannot tell the hidden/intermediate sizes of layer %d", fname.c_str(), layer);
  s.hidden = static_cast<int32_t>(H);
  s.inter = static_cast<int32_t>(I);
  // MXFP4 blocks and scales: both there, in the shapes the sizes imply.
  Slice probe;
  locate_mxfp4(layer, R_MXFP4_GATE_UP, s.experts, 2 * I, H, 0, &probe);
  locate_mxfp4(layer, R_MXFP4_DOWN, s.experts, H, I, 0, &probe);

  if (const TensorInfo* sg = tensor(layer, R_S_GATE, -1)) {
    int64_t r, c;
    dims2(sg, &r, &c);
    s.shared_inter = static_cast<int32_t>(r);
  }
  s.shared_gate = tensor(layer, R_S_EXPERT_GATE, -1) != nullptr;
  s.score_bias = tensor(layer, R_BIAS, -1) != nullptr;
  s.router_bias = tensor(layer, R_ROUTER_BIAS, -1) != nullptr;
  for (int role : {R3_GATE_UP, R3_GATE, R3_UP, R3_DOWN, R_GATE, R_UP, R_DOWN}) {
    const TensorInfo* t = tensor(layer, role, role >= R3_GATE ? -1 : 0);
    // F8_E4M3 codes load with their weight_scale_inv (per-expert tensors).
    const bool fp8_alone =
        t && t->elem == Elem::F8_E4M3 && (role >= R3_GATE || !tensor(layer, R_FP8S_GATE + (role - R_GATE), 0));
    if (t && (t->elem == Elem::Other || fp8_alone) && s.unloadable.empty()) {
      s.unloadable = t->name;
      s.unloadable_type = fp8_alone ? t->type_name + " without a weight_scale_inv beside it" : t->type_name;
    }
  }
  if (s.router_bias && !s.router)
    fail(EP_MOE_ERR_FORMAT, "%s: layer %d has a router bias but no router weight", fname.c_str(), layer);
  // Expert biases: all of gate, up and down, or none.
  const bool gb = tensor(layer, R2_GATE_BIAS, -1) || tensor(layer, R2_GATE_UP_BIAS, -1);
  const bool ub = tensor(layer, R2_UP_BIAS, -1) || tensor(layer, R2_GATE_UP_BIAS, -1);
  const bool db = tensor(layer, R2_DOWN_BIAS, -1) != nullptr;
  if ((gb || ub || db) && !(gb && ub && db))
    fail(EP_MOE_ERR_FORMAT, "%s: layer %d has expert biases for %s%s%s but not for %s%s%s", fname.c_str(), layer,
         gb ? "gate " : "", ub ? "up " : "", db ? "down" : "", gb ? "" : "gate ", ub ? "" : "up ", db ? "" : "down");
  s.expert_bias = gb;
  // An architecture whose fused gate_up_proj (and its bias) alternates gate
  // and up (GPT-OSS: gate_up[..., ::2], [..., 1::2]).
  const bool interleaved = format_ == Format::Safetensors && hf_fused_layout(arch_).interleaved;
  s.gate_up_interleaved =
      interleaved && (tensor(layer, R3_GATE_UP, -1) != nullptr || tensor(layer, R_MXFP4_GATE_UP, -1) != nullptr);
  if (interleaved && !s.gate_up_interleaved)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s: layer %d: model_type '%s' stores gate and up interleaved in one gate_up_proj, and this layer has none: "
         "not a layout ep_moe knows",
         fname.c_str(), layer, arch_.c_str());

  return s;
}

// The hidden and intermediate sizes the routed experts' tensors give
// (H, I unchanged when none does), and their encoding.
Elem Checkpoint::expert_sizes(int32_t layer, int64_t* H, int64_t* I) const {
  const std::string& fname = files_[0]->name();
  Elem elem = Elem::Other;
  // Per-expert tensors: the lowest-numbered expert there is (not expert 0,
  // which a file may not hold; the expert count then says what is missing).
  const auto first = [&](int role) -> const TensorInfo* {
    const auto it = roles_.lower_bound(std::make_tuple(layer, role, 0));
    return it != roles_.end() && std::get<0>(it->first) == layer && std::get<1>(it->first) == role
               ? &tensors_[it->second]
               : nullptr;
  };
  const TensorInfo* g = first(R_GATE);
  const TensorInfo* g3 = tensor(layer, R3_GATE, -1);
  const TensorInfo* gu3 = tensor(layer, R3_GATE_UP, -1);
  const TensorInfo* d = first(R_DOWN);
  const TensorInfo* gub = tensor(layer, R_MXFP4_GATE_UP, -1);
  const TensorInfo* dnb = tensor(layer, R_MXFP4_DOWN, -1);
  if (g) {
    int64_t r, c;
    matrix_dims(fname, g, &r, &c);
    *I = r;
    *H = c;
    elem = g->elem == Elem::F8_E4M3 ? Elem::FP8 : g->elem;
  } else if (g3) {
    *I = g3->shape[1];
    *H = g3->shape[2];
    elem = g3->elem;
  } else if (gu3) {
    elem = gu3->elem;
    const bool transposed = fused_transposed(layer);
    const int64_t two_i = transposed ? gu3->shape[2] : gu3->shape[1];
    *H = transposed ? gu3->shape[1] : gu3->shape[2];
    if (two_i % 2)
      fail(EP_MOE_ERR_FORMAT, "%s: '%s' has an odd gate_up dimension %lld", fname.c_str(), gu3->name.c_str(),
           static_cast<long long>(two_i));
    *I = two_i / 2;
  } else if (gub) {  // [E, 2I, H / 32, 16]
    elem = Elem::MXFP4;
    *H = gub->shape[2] * 32;
    *I = gub->shape[1] / 2;
  } else if (d) {
    int64_t r, c;
    matrix_dims(fname, d, &r, &c);
    *H = r;
    *I = c;
    elem = d->elem == Elem::F8_E4M3 ? Elem::FP8 : d->elem;
  } else if (dnb) {  // [E, H, I / 32, 16]
    elem = Elem::MXFP4;
    *H = dnb->shape[1];
    *I = dnb->shape[2] * 32;
  }
  return elem;
}

Semantics Checkpoint::layer_semantics(int32_t layer, const LayerShape& shape) const {
  const std::string where = files_[0]->name() + ": layer " + std::to_string(layer);
  if (format_ == Format::Gguf) return gguf_semantics(gguf_, arch_, shape.score_bias, where);
  return hf_semantics(cfg_num_, cfg_str_, has_config_, shape.score_bias, where);
}

bool Checkpoint::locate(int32_t layer, ep_moe_weight_t which, int32_t expert, Slice* out) const {
  *out = Slice{};
  const LayerShape s = layer_shape(layer);
  const int64_t H = s.hidden, I = s.inter;
  const std::string& fname = files_[0]->name();
  auto whole = [&](const TensorInfo* t, int64_t rows, int64_t cols) {
    int64_t r = 1, c = 1;
    if (t->shape.size() == 2) {
      r = t->shape[0];
      c = t->shape[1];
    } else if (t->shape.size() == 1) {
      c = t->shape[0];
    } else {
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' should be 2-D", fname.c_str(), t->name.c_str());
    }
    if (r != rows || c != cols)
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' is [%lld, %lld], expected [%lld, %lld]", file(t->file).name().c_str(),
           t->name.c_str(), static_cast<long long>(r), static_cast<long long>(c), static_cast<long long>(rows),
           static_cast<long long>(cols));
    out->tensor = t;
    out->offset = t->offset;
    out->rows = rows;
    out->cols = cols;
    out->transposed = false;
    return true;
  };
  // A located F8_E4M3 weight joined with its weight_scale_inv (role
  // scale_role); any other weight as it is.
  auto fp8_pair = [&](const TensorInfo* t, int scale_role, int32_t e) {
    if (t->elem != Elem::F8_E4M3) return true;
    const TensorInfo* sc = tensor(layer, scale_role, e);
    if (!sc)
      fail(EP_MOE_ERR_FORMAT, "%s: F8_E4M3 tensor '%s' has no weight_scale_inv beside it", fname.c_str(),
           t->name.c_str());
    attach_fp8_scales(file(sc->file).name(), t, sc, out->rows, out->cols, fp8_block_rows(), out);
    return true;
  };
  // Expert e of a 3-D tensor [E, a, b] viewed as [rows, cols].
  auto sub = [&](const TensorInfo* t, int64_t rows, int64_t cols, bool transposed) {
    const int64_t a = transposed ? cols : rows, b = transposed ? rows : cols;
    // All three dimensions: expert e's rows are read at e's place in it, so
    // a tensor of fewer experts than the layer has would end before them.
    if (t->shape.size() != 3 || t->shape[0] != s.experts || t->shape[1] != a || t->shape[2] != b)
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' should be [%d, %lld, %lld], it is %s", file(t->file).name().c_str(),
           t->name.c_str(), s.experts, static_cast<long long>(a), static_cast<long long>(b),
           dims_text(t->shape).c_str());
    out->tensor = t;
    out->offset = t->offset + t->bytes_of(static_cast<uint64_t>(expert) * static_cast<uint64_t>(a * b));
    out->rows = rows;
    out->cols = cols;
    out->transposed = transposed;
    return true;
  };
  const bool fused_t = fused_transposed(layer);
  switch (which) {
    case EP_MOE_WEIGHT_EXPERT_GATE:
    case EP_MOE_WEIGHT_EXPERT_UP:
    case EP_MOE_WEIGHT_EXPERT_DOWN:
    case EP_MOE_WEIGHT_EXPERT_GATE_UP: {
      if (expert < 0 || expert >= s.experts)
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "expert %d is outside [0, %d) of layer %d", expert, s.experts, layer);
      if (which == EP_MOE_WEIGHT_EXPERT_GATE_UP) {
        const TensorInfo* t = tensor(layer, R3_GATE_UP, -1);
        return t ? sub(t, 2 * I, H, fused_t) : locate_mxfp4(layer, R_MXFP4_GATE_UP, s.experts, 2 * I, H, expert, out);
      }
      const int role = which == EP_MOE_WEIGHT_EXPERT_GATE ? R_GATE : which == EP_MOE_WEIGHT_EXPERT_UP ? R_UP : R_DOWN;
      const int64_t rows = which == EP_MOE_WEIGHT_EXPERT_DOWN ? H : I,
                    cols = which == EP_MOE_WEIGHT_EXPERT_DOWN ? I : H;
      if (const TensorInfo* t = tensor(layer, role, expert))
        return whole(t, rows, cols) && fp8_pair(t, R_FP8S_GATE + (role - R_GATE), expert);
      if (const TensorInfo* t = tensor(layer, role - R_GATE + R3_GATE, -1)) {
        const bool tr = which == EP_MOE_WEIGHT_EXPERT_DOWN && fused_t;
        return sub(t, rows, cols, tr);
      }
      return which == EP_MOE_WEIGHT_EXPERT_DOWN && locate_mxfp4(layer, R_MXFP4_DOWN, s.experts, H, I, expert, out);
    }
    case EP_MOE_WEIGHT_ROUTER:
      if (const TensorInfo* t = tensor(layer, R_ROUTER, -1)) return whole(t, s.experts, H);
      return false;
    case EP_MOE_WEIGHT_ROUTER_BIAS:
      if (const TensorInfo* t = tensor(layer, R_ROUTER_BIAS, -1)) return whole(t, 1, s.experts);
      return false;
    case EP_MOE_WEIGHT_EXPERT_GATE_BIAS:
    case EP_MOE_WEIGHT_EXPERT_UP_BIAS:
    case EP_MOE_WEIGHT_EXPERT_DOWN_BIAS:
    case EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS: {
      if (expert < 0 || expert >= s.experts)
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "expert %d is outside [0, %d) of layer %d", expert, s.experts, layer);
      const int role = which == EP_MOE_WEIGHT_EXPERT_GATE_BIAS   ? R2_GATE_BIAS
                       : which == EP_MOE_WEIGHT_EXPERT_UP_BIAS   ? R2_UP_BIAS
                       : which == EP_MOE_WEIGHT_EXPERT_DOWN_BIAS ? R2_DOWN_BIAS
                                                                 : R2_GATE_UP_BIAS;
      const int64_t n = which == EP_MOE_WEIGHT_EXPERT_DOWN_BIAS      ? H
                        : which == EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS ? 2 * I
                                                                     : I;
      const TensorInfo* t = tensor(layer, role, -1);
      if (!t) return false;
      // Row `expert` of an [E, n] tensor.
      if (t->shape.size() != 2 || t->shape[0] != s.experts || t->shape[1] != n)
        fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s' should be [%d, %lld]", file(t->file).name().c_str(), t->name.c_str(),
             s.experts, static_cast<long long>(n));
      out->tensor = t;
      out->offset = t->offset + t->bytes_of(static_cast<uint64_t>(expert) * static_cast<uint64_t>(n));
      out->rows = 1;
      out->cols = n;
      out->transposed = false;
      return true;
    }
    case EP_MOE_WEIGHT_SCORE_BIAS:
      if (const TensorInfo* t = tensor(layer, R_BIAS, -1)) return whole(t, 1, s.experts);
      return false;
    case EP_MOE_WEIGHT_SHARED_GATE:
      if (const TensorInfo* t = tensor(layer, R_S_GATE, -1))
        return whole(t, s.shared_inter, H) && fp8_pair(t, R_FP8S_S_GATE + (R_S_GATE - R_S_GATE), -1);
      return false;
    case EP_MOE_WEIGHT_SHARED_UP:
      if (const TensorInfo* t = tensor(layer, R_S_UP, -1))
        return whole(t, s.shared_inter, H) && fp8_pair(t, R_FP8S_S_GATE + (R_S_UP - R_S_GATE), -1);
      return false;
    case EP_MOE_WEIGHT_SHARED_DOWN:
      if (const TensorInfo* t = tensor(layer, R_S_DOWN, -1))
        return whole(t, H, s.shared_inter) && fp8_pair(t, R_FP8S_S_GATE + (R_S_DOWN - R_S_GATE), -1);
      return false;
    case EP_MOE_WEIGHT_SHARED_EXPERT_GATE:
      if (const TensorInfo* t = tensor(layer, R_S_EXPERT_GATE, -1)) return whole(t, 1, H);
      return false;
    default: break;
  }
  return false;
}

bool Checkpoint::locate_mxfp4(int32_t layer, int blocks_role, int32_t experts, int64_t rows, int64_t cols,
                              int32_t expert, Slice* out) const {
  const TensorInfo* b = tensor(layer, blocks_role, -1);
  const TensorInfo* sc = tensor(layer, blocks_role + 1, -1);
  if (!b && !sc) return false;
  const TensorInfo& any = b ? *b : *sc;
  const std::string& fname = file(any.file).name();
  if (!b || !sc)
    fail(EP_MOE_ERR_FORMAT, "%s: layer %d has MXFP4 %s '%s' but not its %s: they come in pairs", fname.c_str(), layer,
         b ? "blocks" : "scales", any.name.c_str(), b ? "scales" : "blocks");
  const int64_t groups = cols / 32;
  const std::vector<int64_t> want_b{experts, rows, groups, 16}, want_s{experts, rows, groups};
  if (cols % 32 != 0 || b->type_name != "U8" || b->shape != want_b)
    fail(EP_MOE_ERR_FORMAT,
         "%s: MXFP4 blocks '%s' should be U8 %s (rows of %lld elements in blocks of 32), it is %s %s",
         file(b->file).name().c_str(), b->name.c_str(), dims_text(want_b).c_str(), static_cast<long long>(cols),
         b->type_name.c_str(), dims_text(b->shape).c_str());
  if (sc->type_name != "U8" || sc->shape != want_s)
    fail(EP_MOE_ERR_FORMAT, "%s: MXFP4 scales '%s' should be U8 %s, one exponent per block of '%s', it is %s %s",
         file(sc->file).name().c_str(), sc->name.c_str(), dims_text(want_s).c_str(), b->name.c_str(),
         sc->type_name.c_str(), dims_text(sc->shape).c_str());
  const auto per_expert = static_cast<uint64_t>(rows) * static_cast<uint64_t>(groups);
  out->tensor = b;
  out->offset = b->offset + static_cast<uint64_t>(expert) * per_expert * 16;
  out->scales = sc;
  out->scales_offset = sc->offset + static_cast<uint64_t>(expert) * per_expert;
  out->rows = rows;
  out->cols = cols;
  out->transposed = false;
  return true;
}

}  // namespace io
}  // namespace ep_moe

// Random mutations of small GGUF MoE checkpoints whose experts are in the
// block formats (gate/up in one, down in another, as Q4_K_M files mix them):
// every mutated file goes through open, layer config, layer create, load and
// a forward, and each step must return a status (an error with a message) —
// never crash, hang, or touch memory it does not own (the sanitizer builds
// run this test too). Safetensors checkpoints get the same, with digits
// changed in their JSON header and config.json. test_corrupt.cpp has the
// targeted faults and their exact messages; this one reaches the
// combinations nobody listed, from the header through to the kernels.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "../common/reference_quant.hpp"
#include "writers.hpp"

namespace {

// A block format's GGUF type name (the writer's) and its test-side type.
struct BlockFormat {
  const char* name;
  refq::Type type;
};

const BlockFormat kFormats[] = {
    {"Q8_0", refq::Q8_0},       {"Q4_0", refq::Q4_0},       {"MXFP4", refq::MXFP4},   {"Q4_K", refq::Q4_K},
    {"Q5_K", refq::Q5_K},       {"Q6_K", refq::Q6_K},       {"IQ4_XS", refq::IQ4_XS}, {"Q2_K", refq::Q2_K},
    {"Q3_K", refq::Q3_K},       {"Q4_1", refq::Q4_1},       {"Q5_0", refq::Q5_0},     {"Q5_1", refq::Q5_1},
    {"IQ4_NL", refq::IQ4_NL},   {"IQ2_XXS", refq::IQ2_XXS}, {"IQ2_XS", refq::IQ2_XS}, {"IQ2_S", refq::IQ2_S},
    {"IQ3_XXS", refq::IQ3_XXS}, {"IQ3_S", refq::IQ3_S},     {"IQ1_S", refq::IQ1_S},   {"IQ1_M", refq::IQ1_M}};

// `rows` rows of k elements in the format named `name`: random valid blocks
// of values about 1/sqrt(k), so that the unmutated file computes finite
// outputs.
std::vector<uint8_t> random_blocks(const std::string& name, int64_t rows, int64_t k, std::mt19937& rng) {
  for (const auto& f : kFormats)
    if (name == f.name) {
      std::vector<float> values;
      return refq::random_blocks(f.type, static_cast<int>(rows), static_cast<int>(k),
                                 1.0f / std::sqrt(static_cast<float>(k)), rng, &values);
    }
  throw std::runtime_error("no block format " + name);
}

// A qwen3moe MoE layer (layer 1) in GGUF tensors: experts [E, I, H] in
// `gate_up`, down [E, H, I] in `down`, the router and an embedding in F32;
// and its metadata.
struct QuantMoe {
  writers::Model m;
  std::vector<writers::Tensor> tensors;
};
QuantMoe quant_tensors(int H, int I, int E, int K, const std::string& gate_up, const std::string& down,
                       std::mt19937& rng) {
  QuantMoe q;
  q.m.spec.H = H;
  q.m.spec.I = I;
  q.m.spec.E = E;
  q.m.spec.K = K;
  q.m.layer = 1;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> emb(static_cast<size_t>(37 * H)), router(static_cast<size_t>(E * H));
  for (auto& x : emb) x = n(rng);
  for (auto& x : router) x = n(rng) / std::sqrt(static_cast<float>(H));
  auto& ts = q.tensors;
  ts.push_back({"token_embd.weight", "F32", {37, H}, writers::encode(emb, "F32")});
  ts.push_back({"blk.1.ffn_gate_inp.weight", "F32", {E, H}, writers::encode(router, "F32")});
  ts.push_back({"blk.1.ffn_gate_exps.weight", gate_up, {E, I, H}, random_blocks(gate_up, int64_t{E} * I, H, rng)});
  ts.push_back({"blk.1.ffn_up_exps.weight", gate_up, {E, I, H}, random_blocks(gate_up, int64_t{E} * I, H, rng)});
  ts.push_back({"blk.1.ffn_down_exps.weight", down, {E, H, I}, random_blocks(down, int64_t{E} * H, I, rng)});
  return q;
}

// A GGUF file's bytes and where its header (metadata, tensor infos,
// padding) ends.
struct GgufFile {
  std::vector<uint8_t> bytes;
  size_t header = 0;
};
GgufFile gguf_file(const std::vector<writers::Tensor>& ts, const std::vector<writers::Kv>& kv) {
  GgufFile f{writers::gguf_bytes(ts, kv), 0};
  size_t data = 0;
  for (const auto& t : ts) data += (t.data.size() + 31) / 32 * 32;  // gguf_bytes' default alignment
  f.header = f.bytes.size() - data;
  return f;
}

GgufFile quant_moe(int H, int I, int E, int K, const std::string& gate_up, const std::string& down, std::mt19937& rng) {
  const QuantMoe q = quant_tensors(H, I, E, K, gate_up, down, rng);
  return gguf_file(q.tensors, writers::gguf_meta(q.m));
}

// One to three random changes: bits flipped or a word replaced in the header
// (the first `header` bytes), bytes inserted or cut there, bytes set in the
// tensor data, or the file cut short.
void mutate(std::vector<uint8_t>& b, size_t header, std::mt19937& rng) {
  static const uint64_t kWords[] = {0,
                                    1,
                                    2,
                                    3,
                                    7,
                                    31,
                                    32,
                                    255,
                                    256,
                                    1024,
                                    0x7fffffffull,
                                    0x80000000ull,
                                    0xffffffffull,
                                    1ull << 32,
                                    1ull << 40,
                                    0x7fffffffffffffffull,
                                    ~0ull};
  const auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const int changes = 1 + static_cast<int>(pick(3));
  for (int c = 0; c < changes && !b.empty(); ++c) {
    const size_t hdr = std::min(header, b.size());
    switch (pick(7)) {
      case 0:
      case 1: {  // bits in the header
        for (int i = 1 + static_cast<int>(pick(3)); i > 0; --i) b[pick(hdr)] ^= static_cast<uint8_t>(1u << pick(8));
        break;
      }
      case 2: {  // a u32 or u64 in the header replaced by a boundary value
        const size_t w = pick(2) ? 8 : 4, at = pick(hdr > w ? hdr - w : 1);
        const uint64_t v = kWords[pick(sizeof kWords / sizeof kWords[0])];
        std::memcpy(&b[at], &v, std::min(w, b.size() - at));
        break;
      }
      case 3: {  // bytes inserted into or cut from the header
        const size_t at = pick(hdr), n = 1 + pick(8);
        if (pick(2)) b.insert(b.begin() + static_cast<long>(at), n, static_cast<uint8_t>(pick(256)));
        else b.erase(b.begin() + static_cast<long>(at), b.begin() + static_cast<long>(std::min(b.size(), at + n)));
        break;
      }
      case 4:
      case 5: {  // tensor data: random bytes, all ones (f16 NaN scales), zeros
        if (b.size() <= hdr) break;
        const uint8_t v = static_cast<uint8_t>(pick(3) == 0 ? 0xff : pick(3) == 0 ? 0 : pick(256));
        for (int i = 1 + static_cast<int>(pick(16)); i > 0; --i) b[hdr + pick(b.size() - hdr)] = v;
        break;
      }
      default: b.resize(pick(b.size()));  // cut short
    }
  }
}

bool is_error(ep_moe_status_t s) {
  return s == EP_MOE_ERR_FORMAT || s == EP_MOE_ERR_IO || s == EP_MOE_ERR_NOT_FOUND || s == EP_MOE_ERR_UNSUPPORTED ||
         s == EP_MOE_ERR_INVALID_ARGUMENT || s == EP_MOE_ERR_OUT_OF_MEMORY;
}

// What became of one mutated file.
enum Outcome {
  kOpenFailed,
  kNoLayer,
  kConfigFailed,
  kTooLarge,
  kCreateFailed,
  kLoadFailed,
  kForwardFailed,
  kRan,
  kOutcomes
};
const char* const kOutcomeNames[] = {"open refused",   "no MoE layer", "config refused",  "too large to create",
                                     "create refused", "load refused", "forward refused", "loaded and ran"};

// A failed step: an error status from the documented set, with a message.
void check_error(ep_moe_status_t s, const std::string& message) {
  INFO("status " << s << ": " << message);
  CHECK(is_error(s));
  CHECK(!message.empty());
}

// "open refused 113, config refused 5, ..., loaded and ran 29".
std::string summary_of(const int (&outcomes)[kOutcomes]) {
  std::string s;
  for (int o = 0; o < kOutcomes; ++o)
    if (outcomes[o]) s += std::string(s.empty() ? "" : ", ") + kOutcomeNames[o] + " " + std::to_string(outcomes[o]);
  return s;
}

// Mutants a file: EP_MOE_MUTANTS (a longer search by hand), else `fallback`.
int mutants_per_file(int fallback) {
  const char* env = std::getenv("EP_MOE_MUTANTS");
  return env && std::atoi(env) > 0 ? std::atoi(env) : fallback;
}

Outcome run_file(const std::string& path, std::mt19937& rng) {
  ep_moe_checkpoint_t* ck = nullptr;
  ep_moe_status_t s = ep_moe_checkpoint_open(&ck, path.c_str(), nullptr);
  if (s != EP_MOE_OK) {
    check_error(s, ep_moe_last_error());
    CHECK(ck == nullptr);
    return kOpenFailed;
  }
  struct Closer {
    ep_moe_checkpoint_t* c;
    ~Closer() { ep_moe_checkpoint_close(c); }
  } closer{ck};
  int32_t layers[8];
  size_t count = 0;
  REQUIRE(ep_moe_checkpoint_moe_layers(layers, 8, &count, ck) == EP_MOE_OK);
  if (count == 0) return kNoLayer;
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  s = ep_moe_checkpoint_layer_config(&lc, ck, layers[0]);
  if (s != EP_MOE_OK) {
    check_error(s, ep_moe_checkpoint_last_error(ck));
    return kConfigFailed;
  }
  // A header may claim any size the tensors agree with; the layer below
  // must stay within this test's memory.
  const int64_t elems = int64_t{lc.hidden_size} * (lc.intermediate_size + lc.shared_intermediate_size) *
                        std::max<int64_t>(1, lc.num_experts);
  if (elems > (int64_t{4} << 20) || lc.num_experts > 1024) return kTooLarge;
  lc.max_tokens = 4;
  lc.num_threads = 1;
  lc.act_dtype = EP_MOE_DTYPE_F32;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = 1;
  mc.ep_rank = 0;
  mc.global_num_experts = lc.num_experts;
  ep_moe_expert_map_t* map = nullptr;
  ep_moe_layer_t* layer = nullptr;
  s = ep_moe_expert_map_create(&map, &mc);
  if (s == EP_MOE_OK) s = ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr);
  ep_moe_expert_map_destroy(map);
  if (s != EP_MOE_OK) {
    check_error(s, ep_moe_last_error());
    return kCreateFailed;
  }
  Outcome out = kLoadFailed;
  s = ep_moe_layer_load(layer, ck, layers[0]);
  if (s != EP_MOE_OK) {
    check_error(s, ep_moe_layer_last_error(layer));
  } else {
    // A layer that loaded runs: 3 tokens, routed by its own router.
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(3 * lc.hidden_size)), y(x.size());
    for (auto& v : x) v = n(rng);
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = 3;
    a.hidden = x.data();
    a.out = y.data();
    // It may refuse its input: router logits made NaN or infinite by the
    // router's mutated values, or no router at all (a mutated name) and no
    // logits given.
    s = ep_moe_layer_forward(layer, &a);
    if (s != EP_MOE_OK) check_error(s, ep_moe_layer_last_error(layer));
    out = s == EP_MOE_OK ? kRan : kForwardFailed;
  }
  ep_moe_layer_destroy(layer);
  return out;
}

// One to three digits in [from, to) of b replaced by others: a safetensors
// header or a config.json stays well-formed JSON, with other shapes,
// offsets and sizes.
void mutate_digits(std::vector<uint8_t>& b, size_t from, size_t to, std::mt19937& rng) {
  std::vector<size_t> digits;
  for (size_t i = from; i < std::min(to, b.size()); ++i)
    if (b[i] >= '0' && b[i] <= '9') digits.push_back(i);
  if (digits.empty()) return;
  std::uniform_int_distribution<size_t> any(0, digits.size() - 1);
  std::uniform_int_distribution<int> digit(0, 9);
  for (int c = 1 + digit(rng) % 3; c > 0; --c) b[digits[any(rng)]] = static_cast<uint8_t>('0' + digit(rng));
}

}  // namespace

TEST_CASE("randomly mutated block-format GGUF checkpoints: every step returns a status", "[checkpoint][corrupt]") {
  struct File {
    int H, I, E, K;
    const char *gate_up, *down;
  };
  // Every block format a layer keeps, each file a mix.
  const File files[] = {
      {256, 256, 4, 2, "Q4_K", "Q6_K"},    {256, 256, 4, 2, "IQ4_XS", "Q5_K"},  {64, 32, 4, 2, "MXFP4", "Q8_0"},
      {64, 64, 3, 2, "Q4_0", "Q4_0"},      {256, 256, 4, 2, "IQ2_XXS", "Q3_K"}, {256, 256, 4, 2, "IQ1_S", "IQ1_M"},
      {256, 256, 3, 2, "Q2_K", "IQ3_XXS"}, {256, 256, 3, 2, "IQ2_XS", "IQ3_S"}, {256, 256, 3, 2, "IQ2_S", "Q2_K"},
      {64, 32, 4, 2, "Q4_1", "Q5_0"},      {64, 64, 3, 2, "Q5_1", "IQ4_NL"}};
  const int mutants = mutants_per_file(150);
  const std::string dir = writers::temp_dir("mutate");
  std::mt19937 rng(20261207);
  for (const File& f : files) {
    const GgufFile gf = quant_moe(f.H, f.I, f.E, f.K, f.gate_up, f.down, rng);
    const std::vector<uint8_t>& good = gf.bytes;
    const std::string path = dir + "/" + f.gate_up + "_" + f.down + ".gguf";
    SECTION(std::string(f.gate_up) + " gate/up, " + f.down + " down") {
      writers::write_file(path, good);
      REQUIRE(run_file(path, rng) == kRan);  // the unmutated file loads and runs
      int outcomes[kOutcomes] = {};
      for (int i = 0; i < mutants; ++i) {
        std::vector<uint8_t> b = good;
        mutate(b, gf.header, rng);
        writers::write_file(path, b);
        INFO("mutant " << i << " of " << path);
        ++outcomes[run_file(path, rng)];
      }
      const std::string summary = summary_of(outcomes);
      WARN(f.gate_up << "/" << f.down << ": " << summary);
      // The mutations reach past the header: some files still load.
      CHECK(outcomes[kRan] > 0);
      CHECK(outcomes[kOpenFailed] > 0);
    }
  }
}

TEST_CASE("a stacked expert tensor holding fewer experts than the layer is refused at load, naming it",
          "[checkpoint][corrupt]") {
  // Such a file passes open and layer config; its load must refuse it as
  // malformed, naming the tensor, before reading where the missing experts
  // would be. A Q4_K/Q6_K layer of 4 experts whose ffn_up_exps holds one:
  std::mt19937 rng(7);
  QuantMoe q = quant_tensors(256, 256, 4, 2, "Q4_K", "Q6_K", rng);
  writers::Tensor& up = q.tensors[3];
  REQUIRE(up.name == "blk.1.ffn_up_exps.weight");
  up.shape[0] = 1;
  up.data.resize(up.data.size() / 4);
  const std::string path = writers::temp_dir("fewer") + "/fewer.gguf";
  writers::write_file(path, writers::gguf_bytes(q.tensors, writers::gguf_meta(q.m)));
  ep_moe_checkpoint_t* ck = nullptr;
  REQUIRE(ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) == EP_MOE_OK);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  REQUIRE(ep_moe_checkpoint_layer_config(&lc, ck, 1) == EP_MOE_OK);
  lc.max_tokens = 4;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 4;
  ep_moe_expert_map_t* map = nullptr;
  REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
  ep_moe_layer_t* layer = nullptr;
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  CHECK(ep_moe_layer_load(layer, ck, 1) == EP_MOE_ERR_FORMAT);
  const std::string msg = ep_moe_layer_last_error(layer);
  INFO(msg);
  CHECK(msg.find(path) != std::string::npos);
  CHECK(msg.find("'blk.1.ffn_up_exps.weight' should be [4, 256, 256], it is [1, 256, 256]") != std::string::npos);
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  ep_moe_checkpoint_close(ck);
}

TEST_CASE("safetensors checkpoints with mutated numbers: every step returns a status", "[checkpoint][corrupt]") {
  struct Case {
    writers::Scheme scheme;
    const char* dtype;
    int Is;  // shared expert
  };
  const Case cases[] = {{writers::Scheme::Qwen, "BF16", 32},
                        {writers::Scheme::Stacked, "F16", 0},
                        {writers::Scheme::Fused, "BF16", 0},
                        {writers::Scheme::FusedTransposed, "F32", 0},
                        {writers::Scheme::DeepSeek, "BF16", 32}};
  const int mutants = mutants_per_file(100);
  std::mt19937 rng(20261208);
  for (const Case& c : cases) {
    SECTION("scheme " + std::to_string(static_cast<int>(c.scheme)) + " " + c.dtype) {
      writers::Model m;
      m.spec.H = 64;
      m.spec.I = 32;
      m.spec.E = 8;
      m.spec.K = 2;
      m.spec.Is = c.Is;
      if (c.scheme == writers::Scheme::DeepSeek) {
        m.spec.sigmoid = true;
        m.spec.groups = 4;
        m.spec.topk_group = 2;
        m.spec.use_bias = true;
      }
      m.dtype = c.dtype;
      m.layer = 1;
      m.w = ref::random_weights(m.spec, ref::F32, rng);
      const std::vector<uint8_t> good = writers::safetensors_bytes(writers::moe_tensors(m, c.scheme, rng));
      const std::string config = writers::hf_config(m, c.scheme);
      const std::vector<uint8_t> good_config(config.begin(), config.end());
      uint64_t header = 0;
      std::memcpy(&header, good.data(), 8);
      const std::string dir = writers::temp_dir("mutate_st");
      const std::string path = dir + "/model.safetensors";
      writers::write_file(dir + "/config.json", good_config);
      writers::write_file(path, good);
      REQUIRE(run_file(path, rng) == kRan);
      int outcomes[kOutcomes] = {};
      for (int i = 0; i < mutants; ++i) {
        std::vector<uint8_t> b = good, cfg = good_config;
        if (i % 3 == 0) mutate_digits(cfg, 0, cfg.size(), rng);
        else mutate_digits(b, 8, 8 + static_cast<size_t>(header), rng);
        writers::write_file(dir + "/config.json", cfg);
        writers::write_file(path, b);
        INFO("mutant " << i << " of " << path);
        ++outcomes[run_file(path, rng)];
      }
      const std::string summary = summary_of(outcomes);
      WARN("scheme " << static_cast<int>(c.scheme) << " " << c.dtype << ": " << summary);
      CHECK(outcomes[kRan] > 0);
    }
  }
}

TEST_CASE("split GGUF checkpoints with one split mutated: every step returns a status", "[checkpoint][corrupt]") {
  // Three splits as llama.cpp's gguf-split names and keys them: the metadata
  // and the router in the first, the gate experts in the second, up and
  // down in the third.
  std::mt19937 rng(20261209);
  const QuantMoe q = quant_tensors(256, 256, 4, 2, "Q4_K", "Q6_K", rng);
  const auto& ts = q.tensors;
  const std::vector<std::vector<writers::Tensor>> parts = {{ts[0], ts[1]}, {ts[2]}, {ts[3], ts[4]}};
  std::vector<GgufFile> good;
  for (size_t p = 0; p < parts.size(); ++p) {
    std::vector<writers::Kv> kv = p == 0 ? writers::gguf_meta(q.m) : std::vector<writers::Kv>{};
    const uint64_t keys[3][2] = {{4, p}, {4, parts.size()}, {5, ts.size()}};
    const char* names[3] = {"split.no", "split.count", "split.tensors.count"};
    for (int k = 0; k < 3; ++k) {
      writers::Kv x;
      x.key = names[k];
      x.type = static_cast<uint32_t>(keys[k][0]);
      x.u = keys[k][1];
      kv.push_back(x);
    }
    good.push_back(gguf_file(parts[p], kv));
  }
  const std::string dir = writers::temp_dir("mutate_split");
  const auto path_of = [&](size_t p) { return dir + "/moe-0000" + std::to_string(p + 1) + "-of-00003.gguf"; };
  for (size_t p = 0; p < good.size(); ++p) writers::write_file(path_of(p), good[p].bytes);
  REQUIRE(run_file(path_of(0), rng) == kRan);
  const int mutants = mutants_per_file(150);
  int outcomes[kOutcomes] = {};
  for (int i = 0; i < mutants; ++i) {
    const size_t p = static_cast<size_t>(i) % good.size();
    std::vector<uint8_t> b = good[p].bytes;
    mutate(b, good[p].header, rng);
    writers::write_file(path_of(p), b);
    INFO("mutant " << i << " of " << path_of(p));
    ++outcomes[run_file(path_of(i % 2 ? p : 0), rng)];  // opened from the mutated split or the first
    writers::write_file(path_of(p), good[p].bytes);
  }
  const std::string summary = summary_of(outcomes);
  WARN("3 splits: " << summary);
  CHECK(outcomes[kRan] > 0);
  CHECK(outcomes[kOpenFailed] > 0);
}

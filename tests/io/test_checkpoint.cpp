// Checkpoint loading through the C API: every naming scheme and element
// type, several EP sizes, only local bytes read, sharded checkpoints, and
// the forward pass of the loaded layer against the double reference.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <thread>

#include "../common/seed.hpp"
#include "ep_moe/ep_moe.h"
#include "writers.hpp"

using writers::Scheme;

namespace {

std::mt19937& rng() {
  static std::mt19937 g(test_seed() + 101);
  return g;
}

double esize(const std::string& dt) { return dt == "F32" ? 4 : dt == "Q8_0" ? 34.0 / 32.0 : 2; }

struct Written {
  writers::Model m;
  std::string path;  // what to open
  Scheme scheme;
};

// The split.* keys llama.cpp's gguf-split writes into split `no` of `count`.
std::vector<writers::Kv> split_keys(uint64_t no, uint64_t count, uint64_t tensors) {
  std::vector<writers::Kv> kv(3);
  kv[0].key = "split.no";
  kv[0].type = 4;
  kv[0].u = no;
  kv[1].key = "split.count";
  kv[1].type = 4;
  kv[1].u = count;
  kv[2].key = "split.tensors.count";
  kv[2].type = 5;
  kv[2].u = tensors;
  return kv;
}

Written write_model(Scheme scheme, const std::string& dtype, ref::Spec spec, bool sharded = false) {
  Written out;
  out.scheme = scheme;
  out.m.spec = spec;
  out.m.dtype = dtype;
  out.m.layer = 3;
  out.m.w = ref::random_weights(spec, ref::F32, rng());
  auto ts = writers::moe_tensors(out.m, scheme, rng());
  const std::string dir = writers::temp_dir("ckpt");
  if (scheme == Scheme::Gguf || scheme == Scheme::GgufFused) {
    out.path = dir + "/model.gguf";
    writers::write_file(out.path, writers::gguf_bytes(ts, writers::gguf_meta(out.m)));
    return out;
  }
  const std::string config = writers::hf_config(out.m, scheme);
  writers::write_file(dir + "/config.json", std::vector<uint8_t>(config.begin(), config.end()));
  if (!sharded) {
    out.path = dir + "/model.safetensors";
    writers::write_file(out.path, writers::safetensors_bytes(ts, {{"format", "pt"}}));
    return out;
  }
  // Three shards and an index.
  std::vector<std::vector<writers::Tensor>> parts(3);
  std::string wm;
  for (size_t i = 0; i < ts.size(); ++i) {
    const size_t p = i % 3;
    const std::string file = "model-0000" + std::to_string(p + 1) + "-of-00003.safetensors";
    wm += (wm.empty() ? "" : ",") + std::string("\"") + ts[i].name + "\":\"" + file + "\"";
    parts[p].push_back(ts[i]);
  }
  for (size_t p = 0; p < 3; ++p)
    writers::write_file(dir + "/model-0000" + std::to_string(p + 1) + "-of-00003.safetensors",
                        writers::safetensors_bytes(parts[p]));
  const std::string index = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {" + wm + "}}";
  writers::write_file(dir + "/model.safetensors.index.json", std::vector<uint8_t>(index.begin(), index.end()));
  out.path = dir;
  return out;
}

struct CkHolder {
  ep_moe_checkpoint_t* c = nullptr;
  explicit CkHolder(const std::string& path) {
    const ep_moe_status_t s = ep_moe_checkpoint_open(&c, path.c_str(), nullptr);
    INFO(ep_moe_last_error());
    REQUIRE(s == EP_MOE_OK);
  }
  ~CkHolder() { ep_moe_checkpoint_close(c); }
};

// Runs the loaded layer on `ep` ranks (router inside the layer) and compares
// with the reference; returns the bytes each rank read.
std::vector<int64_t> run_loaded(const Written& wr, int ep, int tokens) {
  // Q8_0 experts are kept as blocks: the reference quantizes their
  // activations as the kernels state (blocks of 32). So is the shared
  // expert's gate/up, and its down where every rank's shard of it is whole
  // blocks (else it is dequantized and its input stays f32); the cases have
  // no sizes where only some ranks' shards are.
  ref::Spec s = wr.m.spec;
  const bool q8 = wr.m.dtype == "Q8_0";
  if (q8) s.act_block_gu = s.act_block_down = 32;
  if (q8 && s.Is > 0) {
    bool whole = true;
    for (int r = 0, start = 0; r < ep; ++r) {
      const int shard = s.Is / ep + (r < s.Is % ep ? 1 : 0);
      whole = whole && start % 32 == 0 && shard % 32 == 0;
      start += shard;
    }
    s.shared_act_block_gu = 32;
    s.shared_act_block_down = whole ? 32 : 0;
  }
  INFO("scheme " << static_cast<int>(wr.scheme) << " dtype " << wr.m.dtype << " ep " << ep);
  CkHolder ck(wr.path);
  // Tokens whose routing has no near-ties (logits from the stored router).
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> hid(static_cast<size_t>(tokens * s.H));
  std::vector<double> expect(static_cast<size_t>(tokens * s.H)), slack(expect.size());
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> ids;
    std::vector<double> wts;
    std::vector<float> logits(static_cast<size_t>(s.E));
    float* x = hid.data() + static_cast<size_t>(t) * s.H;
    do {
      for (int i = 0; i < s.H; ++i) x[i] = n(rng());
      for (int e = 0; e < s.E; ++e) {
        double acc = 0;
        for (int i = 0; i < s.H; ++i) acc += static_cast<double>(wr.m.router[static_cast<size_t>(e * s.H + i)]) * x[i];
        logits[static_cast<size_t>(e)] = static_cast<float>(acc);
      }
    } while (!ref::route(s, logits.data(), wr.m.w, ids, wts, 1e-3));
    ref::moe_token(s, wr.m.w, x, ids, wts, expect.data() + static_cast<size_t>(t) * s.H,
                   slack.data() + static_cast<size_t>(t) * s.H);
  }
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ep));
  REQUIRE(ep_moe_comm_create_local(comms.data(), ep, nullptr) == EP_MOE_OK);
  std::vector<std::string> errors(static_cast<size_t>(ep));
  std::vector<std::vector<float>> outs(static_cast<size_t>(ep));
  std::vector<int64_t> bytes(static_cast<size_t>(ep), -1);
  std::vector<std::thread> th;
  for (int r = 0; r < ep; ++r) {
    th.emplace_back([&, r] {
      std::string& err = errors[static_cast<size_t>(r)];
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      mc.ep_size = ep;
      mc.ep_rank = r;
      mc.global_num_experts = s.E;
      ep_moe_expert_map_t* map = nullptr;
      ep_moe_expert_map_create(&map, &mc);
      ep_moe_layer_config_t lc;
      ep_moe_layer_config_init(&lc);
      lc.max_tokens = tokens;
      ep_moe_layer_t* layer = nullptr;
      if (ep_moe_checkpoint_layer_config(&lc, ck.c, wr.m.layer) != EP_MOE_OK) {
        err = std::string("layer_config: ") + ep_moe_checkpoint_last_error(ck.c);
      } else if (ep_moe_layer_create(&layer, &lc, map, comms[static_cast<size_t>(r)], nullptr) != EP_MOE_OK) {
        err = std::string("create: ") + ep_moe_last_error();
      } else if (ep_moe_layer_load(layer, ck.c, wr.m.layer) != EP_MOE_OK) {
        err = std::string("load: ") + ep_moe_layer_last_error(layer);
      }
      ep_moe_expert_map_destroy(map);
      if (!err.empty()) {
        ep_moe_comm_abort(comms[static_cast<size_t>(r)]);
        ep_moe_layer_destroy(layer);
        return;
      }
      ep_moe_layer_get_attr(&bytes[static_cast<size_t>(r)], layer, EP_MOE_LAYER_ATTR_BYTES_LOADED);
      std::vector<float> out(hid.size());
      ep_moe_forward_args_t a;
      ep_moe_forward_args_init(&a);
      a.num_tokens = tokens;
      a.hidden = hid.data();
      a.out = out.data();  // no logits, no top-k: the loaded router routes
      if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) err = std::string("forward: ") + ep_moe_layer_last_error(layer);
      outs[static_cast<size_t>(r)] = out;
      ep_moe_layer_destroy(layer);
    });
  }
  for (auto& t : th) t.join();
  for (auto* c : comms) ep_moe_comm_destroy(c);
  for (int r = 0; r < ep; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<size_t>(r)]);
    REQUIRE(errors[static_cast<size_t>(r)].empty());
    // Beyond each output's slack: what an h element on a rounding boundary
    // of the int8 activations (f32 in the kernels, float64 here) may move it.
    double scale = 1e-6, err = 0;
    size_t worst = 0;
    for (double v : expect) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < expect.size(); ++i) {
      const double e = std::fabs(outs[static_cast<size_t>(r)][i] - expect[i]) - slack[i];
      if (e > err) err = e, worst = i;
    }
    INFO("worst element " << worst << ": " << outs[static_cast<size_t>(r)][worst] << " against " << expect[worst]
                          << ", slack " << slack[worst]);
    // f32 activations and accumulation; the weights are the stored values,
    // Q8_0's activations quantized as the kernels state.
    CHECK(err / scale <= (q8 ? 1e-5 : 1e-4));
  }
  return bytes;
}

// Bytes rank r must read: its experts, the router, the bias, the shared
// gate and its shard of the shared expert.
int64_t expected_bytes(const writers::Model& m, bool gguf, int ep, int r) {
  const ref::Spec& s = m.spec;
  const double es = esize(m.dtype);
  const int n_local = s.E / ep + (r < s.E % ep ? 1 : 0);
  double b = n_local * 3.0 * s.I * s.H * es;
  b += s.E * static_cast<double>(s.H) * (gguf ? 4 : es);  // router (written F32 in GGUF)
  if (s.use_bias) b += 4.0 * s.E;
  if (s.Is > 0) {
    const int shard = s.Is / ep + (r < s.Is % ep ? 1 : 0);
    if (shard > 0) {
      b += 2.0 * shard * s.H * es;
      // A column window of Q8_0 that would split blocks reads whole rows.
      const int start = r * (s.Is / ep) + std::min(r, s.Is % ep);
      const bool split = m.dtype == "Q8_0" && (start % 32 != 0 || shard % 32 != 0);
      b += s.H * (split ? static_cast<double>(s.Is) : shard) * es;
    }
    if (s.shared_gate) b += 4.0 * s.H;
  }
  return static_cast<int64_t>(std::llround(b));
}

// Runs the loaded layer on EP 1 .. 4 (run_loaded): every rank read exactly
// its expected bytes.
void check_loaded_bytes(const Written& wr, bool gguf, int tokens) {
  for (int ep : {1, 2, 3, 4}) {
    const auto bytes = run_loaded(wr, ep, tokens);
    for (int r = 0; r < ep; ++r) {
      INFO("ep " << ep << " rank " << r);
      CHECK(bytes[static_cast<size_t>(r)] == expected_bytes(wr.m, gguf, ep, r));
    }
  }
}

}  // namespace

TEST_CASE("every naming scheme and element type loads at several EP sizes and matches the reference",
          "[checkpoint][load]") {
  struct C {
    Scheme scheme;
    const char* dtype;
    bool shared, shared_gate, sigmoid_bias_groups;
  };
  const C cases[] = {
      {Scheme::Qwen, "BF16", true, true, false},     {Scheme::Qwen, "F32", false, false, false},
      {Scheme::Mixtral, "F16", false, false, false}, {Scheme::DeepSeek, "F32", true, false, true},
      {Scheme::Fused, "BF16", true, false, false},   {Scheme::FusedTransposed, "F32", false, false, false},
      {Scheme::Gguf, "Q8_0", true, true, false},     {Scheme::Gguf, "BF16", false, false, true},
      {Scheme::Gguf, "F16", true, false, false},     {Scheme::GgufFused, "Q8_0", false, false, false},
      {Scheme::Stacked, "BF16", true, false, false},
  };
  for (const C& c : cases) {
    ref::Spec s;
    s.H = 64;
    // Fused: I = 32 makes gate_up [E, 64, 64] (ambiguous: the down tensor
    // decides); transposed: I = 16 makes [E, 64, 32] (told by its shape).
    s.I = c.scheme == Scheme::FusedTransposed ? 16 : 32;
    s.E = 12;
    s.K = 3;
    s.Is = c.shared ? 32 : 0;
    s.shared_gate = c.shared_gate;
    if (c.sigmoid_bias_groups) {
      s.sigmoid = true;
      s.use_bias = true;
      s.groups = 4;
      s.topk_group = 2;
      s.scale = 2.5;
    }
    const Written wr = write_model(c.scheme, c.dtype, s);
    INFO("scheme " << static_cast<int>(c.scheme) << " dtype " << c.dtype << " path " << wr.path);
    {
      CkHolder ck(wr.path);
      int64_t v = -1;
      REQUIRE(ep_moe_checkpoint_get_attr(&v, ck.c, EP_MOE_CHECKPOINT_ATTR_FORMAT) == EP_MOE_OK);
      const bool gguf = c.scheme == Scheme::Gguf || c.scheme == Scheme::GgufFused;
      CHECK(v == (gguf ? 1 : 0));
      REQUIRE(ep_moe_checkpoint_get_attr(&v, ck.c, EP_MOE_CHECKPOINT_ATTR_NAMING) == EP_MOE_OK);
      const int naming[] = {EP_MOE_NAMING_HF,       EP_MOE_NAMING_MIXTRAL, EP_MOE_NAMING_HF,   EP_MOE_NAMING_HF_FUSED,
                            EP_MOE_NAMING_HF_FUSED, EP_MOE_NAMING_GGUF,    EP_MOE_NAMING_GGUF, EP_MOE_NAMING_HF_FUSED};
      CHECK(v == naming[static_cast<int>(c.scheme)]);
      REQUIRE(ep_moe_checkpoint_get_attr(&v, ck.c, EP_MOE_CHECKPOINT_ATTR_NUM_MOE_LAYERS) == EP_MOE_OK);
      CHECK(v == 1);
      REQUIRE(ep_moe_checkpoint_get_attr(&v, ck.c, EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS) == EP_MOE_OK);
      CHECK(v == 5);
      int32_t layers[4] = {-1, -1, -1, -1};
      size_t count = 0;
      REQUIRE(ep_moe_checkpoint_moe_layers(layers, 4, &count, ck.c) == EP_MOE_OK);
      CHECK(count == 1);
      CHECK(layers[0] == 3);
      ep_moe_layer_config_t lc;
      ep_moe_layer_config_init(&lc);
      REQUIRE(ep_moe_checkpoint_layer_config(&lc, ck.c, 3) == EP_MOE_OK);
      CHECK(lc.hidden_size == s.H);
      CHECK(lc.intermediate_size == s.I);
      CHECK(lc.num_experts == s.E);
      CHECK(lc.top_k == s.K);
      CHECK(lc.shared_intermediate_size == s.Is);
      CHECK(lc.shared_expert_gate == (s.shared_gate ? 1 : 0));
      CHECK(lc.use_score_bias == (s.use_bias ? 1 : 0));
      CHECK(lc.scoring == (s.sigmoid ? EP_MOE_SCORING_SIGMOID : EP_MOE_SCORING_SOFTMAX));
      CHECK(lc.num_expert_group == s.groups);
      CHECK(lc.topk_group == s.topk_group);
      CHECK(lc.routed_scaling_factor == Approx(s.scale));
      const std::string dt = c.dtype;
      // Q8_0 experts: their format (kept as blocks).
      CHECK(lc.weight_dtype == (dt == "BF16"   ? EP_MOE_DTYPE_BF16
                                : dt == "F16"  ? EP_MOE_DTYPE_F16
                                : dt == "Q8_0" ? EP_MOE_DTYPE_Q8_0
                                               : EP_MOE_DTYPE_F32));
      // For a CUDA layer (device kept): bf16, which it widens blocks to.
      ep_moe_layer_config_t gc;
      ep_moe_layer_config_init(&gc);
      gc.device = 0;
      REQUIRE(ep_moe_checkpoint_layer_config(&gc, ck.c, 3) == EP_MOE_OK);
      CHECK(gc.device == 0);
      CHECK(gc.weight_dtype == (dt == "Q8_0" ? EP_MOE_DTYPE_BF16 : lc.weight_dtype));
      // Dense layers have no experts.
      CHECK(ep_moe_checkpoint_layer_config(&lc, ck.c, 0) == EP_MOE_ERR_NOT_FOUND);
    }
    check_loaded_bytes(wr, c.scheme == Scheme::Gguf || c.scheme == Scheme::GgufFused, 9);
  }
}

TEST_CASE("GGUF Q8_0 shared expert: a shard on whole blocks reads only its blocks, another whole rows",
          "[checkpoint][bytes][quant]") {
  ref::Spec s;
  s.H = 64;
  s.I = 32;
  s.E = 8;
  s.K = 2;
  s.Is = 128;
  s.shared_gate = true;
  const Written wr = write_model(Scheme::Gguf, "Q8_0", s);
  check_loaded_bytes(wr, true, 7);  // shards 128, 64, 32 on EP 1, 2, 4: whole blocks; 43/43/42 on EP 3: not
}

TEST_CASE("rank r of R reads at most expert_bytes/R + non-expert bytes + 5%", "[checkpoint][bytes]") {
  ref::Spec s;
  s.H = 64;
  s.I = 64;
  s.E = 16;
  s.K = 2;
  s.Is = 64;
  const Written wr = write_model(Scheme::Qwen, "BF16", s);
  const double expert_bytes = 16.0 * 3 * 64 * 64 * 2;
  const double non_expert = 16.0 * 64 * 2 + 3.0 * 64 * 64 * 2;  // router + full shared expert
  for (int R : {1, 2, 4, 8}) {
    const auto bytes = run_loaded(wr, R, 4);
    for (int r = 0; r < R; ++r) {
      INFO("R " << R << " rank " << r << " read " << bytes[static_cast<size_t>(r)]);
      CHECK(static_cast<double>(bytes[static_cast<size_t>(r)]) <= (expert_bytes / R + non_expert) * 1.05);
    }
  }
}

TEST_CASE("sharded safetensors with an index: open by directory or index file", "[checkpoint][sharded]") {
  ref::Spec s;
  s.H = 32;
  s.I = 16;
  s.E = 6;
  s.K = 2;
  s.Is = 16;
  const Written wr = write_model(Scheme::Qwen, "BF16", s, true);
  {
    CkHolder ck(wr.path + "/model.safetensors.index.json");
    int64_t files = 0;
    REQUIRE(ep_moe_checkpoint_get_attr(&files, ck.c, EP_MOE_CHECKPOINT_ATTR_NUM_FILES) == EP_MOE_OK);
    CHECK(files == 3);
    ep_moe_tensor_info_t info;
    ep_moe_tensor_info_init(&info);
    REQUIRE(ep_moe_checkpoint_tensor_info(&info, ck.c, 3, EP_MOE_WEIGHT_EXPERT_DOWN, 5) == EP_MOE_OK);
    CHECK(std::string(info.name) == "model.layers.3.mlp.experts.5.down_proj.weight");
    CHECK(std::string(info.dtype) == "BF16");
    CHECK(info.n_dims == 2);
    CHECK(info.dims[0] == 32);
    CHECK(info.bytes == 32 * 16 * 2);
    CHECK(ep_moe_checkpoint_tensor_info(&info, ck.c, 3, EP_MOE_WEIGHT_EXPERT_GATE_UP, 0) == EP_MOE_ERR_NOT_FOUND);
    CHECK(ep_moe_checkpoint_tensor_info(&info, ck.c, 3, EP_MOE_WEIGHT_EXPERT_DOWN, 6) == EP_MOE_ERR_INVALID_ARGUMENT);
  }
  run_loaded(wr, 2, 5);
  run_loaded(wr, 3, 5);
}

TEST_CASE("split GGUF: opened from any split, every split read; missing, renamed or inconsistent ones refused",
          "[checkpoint][gguf][split]") {
  ref::Spec s;
  s.H = 32;
  s.I = 16;
  s.E = 6;
  s.K = 2;
  Written wr;
  wr.scheme = Scheme::Gguf;
  wr.m.spec = s;
  wr.m.dtype = "F32";
  wr.m.layer = 3;
  wr.m.w = ref::random_weights(s, ref::F32, rng());
  const auto ts = writers::moe_tensors(wr.m, Scheme::Gguf, rng());
  REQUIRE(ts.size() >= 3);
  const std::string dir = writers::temp_dir("split");
  const auto name = [&](int i, int n, const std::string& stem) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "-%05d-of-%05d.gguf", i, n);
    return dir + "/" + stem + buf;
  };
  // Three splits: the metadata and the first tensor, then the rest.
  const auto write = [&](const std::string& stem, uint64_t claimed_total) {
    std::vector<std::vector<writers::Tensor>> parts(3);
    parts[0].push_back(ts[0]);
    for (size_t i = 1; i < ts.size(); ++i) parts[1 + i % 2].push_back(ts[i]);
    for (int p = 0; p < 3; ++p) {
      std::vector<writers::Kv> kv = p == 0 ? writers::gguf_meta(wr.m) : std::vector<writers::Kv>{};
      const auto sk = split_keys(static_cast<uint64_t>(p), 3, claimed_total);
      kv.insert(kv.end(), sk.begin(), sk.end());
      writers::write_file(name(p + 1, 3, stem), writers::gguf_bytes(parts[static_cast<size_t>(p)], kv));
    }
  };
  write("model", ts.size());
  for (int from : {1, 2, 3}) {
    INFO("opened from split " << from);
    wr.path = name(from, 3, "model");
    CkHolder ck(wr.path);
    int64_t files = 0;
    REQUIRE(ep_moe_checkpoint_get_attr(&files, ck.c, EP_MOE_CHECKPOINT_ATTR_NUM_FILES) == EP_MOE_OK);
    CHECK(files == 3);
    CHECK(std::string(ep_moe_checkpoint_architecture(ck.c)) == "qwen3moe");
  }
  wr.path = name(1, 3, "model");
  run_loaded(wr, 2, 5);
  run_loaded(wr, 3, 4);
  ep_moe_checkpoint_t* ck = nullptr;
  // A split's count of tensors that the files do not hold.
  write("bad_total", ts.size() + 1);
  CHECK(ep_moe_checkpoint_open(&ck, name(1, 3, "bad_total").c_str(), nullptr) == EP_MOE_ERR_FORMAT);
  CHECK(std::string(ep_moe_last_error()).find("split.tensors.count") != std::string::npos);
  // A missing split.
  write("gone", ts.size());
  std::remove(name(3, 3, "gone").c_str());
  CHECK(ep_moe_checkpoint_open(&ck, name(1, 3, "gone").c_str(), nullptr) == EP_MOE_ERR_NOT_FOUND);
  CHECK(std::string(ep_moe_last_error()).find("split 3 of 3") != std::string::npos);
  // A split renamed so that its siblings cannot be found.
  write("renamed", ts.size());
  const std::string plain = dir + "/renamed.gguf";
  REQUIRE(std::rename(name(1, 3, "renamed").c_str(), plain.c_str()) == 0);
  CHECK(ep_moe_checkpoint_open(&ck, plain.c_str(), nullptr) == EP_MOE_ERR_UNSUPPORTED);
  CHECK(std::string(ep_moe_last_error()).find("-00001-of-00003.gguf") != std::string::npos);
  CHECK(ck == nullptr);
}

TEST_CASE("block-quantized experts the loader cannot read: true sizes, refused at layer config and load",
          "[checkpoint][gguf][quantized]") {
  // TQ2_0 (66 bytes a block of 256; not one of the formats layers keep): 4
  // experts of [I=256, H=256] gate/up and [256, 256] down.
  const int64_t E = 4, I = 256, H = 256;
  const size_t expert_bytes = static_cast<size_t>(I * H / 256 * 66);
  auto q = [&](const std::string& n, std::vector<int64_t> shape) {
    return writers::Tensor{"blk.1." + n, "TQ2_0", shape, std::vector<uint8_t>(E * expert_bytes, 0x11)};
  };
  writers::Model m;
  m.spec.H = H;
  m.spec.I = I;
  m.spec.E = E;
  m.spec.K = 2;
  m.layer = 1;
  std::vector<float> router(static_cast<size_t>(E * H), 0.5f);
  const std::vector<writers::Tensor> ts = {{"blk.1.ffn_gate_inp.weight", "F32", {E, H}, writers::encode(router, "F32")},
                                           q("ffn_gate_exps.weight", {E, I, H}),
                                           q("ffn_up_exps.weight", {E, I, H}),
                                           q("ffn_down_exps.weight", {E, H, I})};
  const std::string dir = writers::temp_dir("q4");
  writers::write_file(dir + "/model.gguf", writers::gguf_bytes(ts, writers::gguf_meta(m)));
  CkHolder ck(dir + "/model.gguf");
  ep_moe_tensor_info_t info;
  ep_moe_tensor_info_init(&info);
  REQUIRE(ep_moe_checkpoint_tensor_info(&info, ck.c, 1, EP_MOE_WEIGHT_EXPERT_DOWN, 2) == EP_MOE_OK);
  CHECK(std::string(info.dtype) == "TQ2_0");
  CHECK(info.bytes == static_cast<int64_t>(expert_bytes));  // one expert's, not the tensor's
  CHECK(info.tensor_bytes == static_cast<int64_t>(E * expert_bytes));
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  CHECK(ep_moe_checkpoint_layer_config(&lc, ck.c, 1) == EP_MOE_ERR_UNSUPPORTED);
  CHECK(std::string(ep_moe_checkpoint_last_error(ck.c)).find("'blk.1.ffn_gate_exps.weight' is TQ2_0") !=
        std::string::npos);
  CHECK(lc.hidden_size == 0);
  // Filled by hand, the load still refuses it by name.
  lc.hidden_size = H;
  lc.intermediate_size = I;
  lc.num_experts = E;
  lc.top_k = 2;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  ep_moe_expert_map_config_from_layer(&mc, &lc);
  ep_moe_expert_map_t* map = nullptr;
  REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
  ep_moe_layer_t* layer = nullptr;
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  CHECK(ep_moe_layer_load(layer, ck.c, 1) == EP_MOE_ERR_UNSUPPORTED);
  CHECK(std::string(ep_moe_layer_last_error(layer)).find("TQ2_0") != std::string::npos);
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
}

TEST_CASE("loading refuses what does not fit, and says why", "[checkpoint][errors]") {
  ref::Spec s;
  s.H = 32;
  s.I = 16;
  s.E = 4;
  s.K = 2;
  const Written wr = write_model(Scheme::Qwen, "F32", s);
  CkHolder ck(wr.path);
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 4;
  ep_moe_expert_map_t* map = nullptr;
  REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  REQUIRE(ep_moe_checkpoint_layer_config(&lc, ck.c, 3) == EP_MOE_OK);
  lc.intermediate_size = 24;  // wrong
  ep_moe_layer_t* layer = nullptr;
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  CHECK(ep_moe_layer_load(layer, ck.c, 3) == EP_MOE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(ep_moe_layer_last_error(layer)).find("intermediate size 16") != std::string::npos);
  CHECK(ep_moe_layer_load(layer, ck.c, 0) == EP_MOE_ERR_NOT_FOUND);
  CHECK(ep_moe_layer_load(layer, nullptr, 3) == EP_MOE_ERR_INVALID_HANDLE);
  ep_moe_layer_destroy(layer);
  // A layer configured with a shared expert the checkpoint does not have.
  REQUIRE(ep_moe_checkpoint_layer_config(&lc, ck.c, 3) == EP_MOE_OK);
  lc.shared_intermediate_size = 16;
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  CHECK(ep_moe_layer_load(layer, ck.c, 3) == EP_MOE_ERR_INVALID_ARGUMENT);
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);

  // Experts stored as F64 (a valid safetensors dtype that cannot be loaded).
  writers::Tensor t{"model.layers.1.mlp.experts.0.gate_proj.weight", "F64", {2, 4}, std::vector<uint8_t>(64, 0)};
  writers::Tensor u{"model.layers.1.mlp.experts.0.up_proj.weight", "F64", {2, 4}, std::vector<uint8_t>(64, 0)};
  writers::Tensor d{"model.layers.1.mlp.experts.0.down_proj.weight", "F64", {4, 2}, std::vector<uint8_t>(64, 0)};
  const std::string dir = writers::temp_dir("f64");
  writers::write_file(dir + "/model.safetensors", writers::safetensors_bytes({t, u, d}));
  CkHolder ck2(dir);
  ep_moe_layer_config_init(&lc);
  // What the loader cannot read is said when the layer config is derived.
  CHECK(ep_moe_checkpoint_layer_config(&lc, ck2.c, 1) == EP_MOE_ERR_UNSUPPORTED);
  CHECK(std::string(ep_moe_checkpoint_last_error(ck2.c)).find("experts.0.gate_proj.weight' is F64") !=
        std::string::npos);
  CHECK(lc.hidden_size == 0);
  lc.hidden_size = 4;
  lc.intermediate_size = 2;
  lc.num_experts = 1;
  lc.top_k = 1;
  mc.global_num_experts = 1;
  REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  CHECK(ep_moe_layer_load(layer, ck2.c, 1) == EP_MOE_ERR_UNSUPPORTED);
  CHECK(std::string(ep_moe_layer_last_error(layer)).find("experts.0.gate_proj.weight' is F64") != std::string::npos);
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);

  ep_moe_checkpoint_t* bad = nullptr;
  CHECK(ep_moe_checkpoint_open(&bad, "/nonexistent/ep_moe/path.safetensors", nullptr) == EP_MOE_ERR_IO);
  CHECK(std::string(ep_moe_last_error()).find("/nonexistent/ep_moe/path.safetensors") != std::string::npos);
  CHECK(ep_moe_checkpoint_open(&bad, writers::temp_dir("empty").c_str(), nullptr) == EP_MOE_ERR_NOT_FOUND);
  CHECK(ep_moe_checkpoint_open(&bad, nullptr, nullptr) == EP_MOE_ERR_INVALID_ARGUMENT);
  ep_moe_checkpoint_config_t cc;
  ep_moe_checkpoint_config_init(&cc);
  cc.naming = EP_MOE_NAMING_MIXTRAL;
  CHECK(ep_moe_checkpoint_open(&bad, wr.path.c_str(), &cc) == EP_MOE_ERR_NOT_FOUND);
  cc.naming = 42;
  CHECK(ep_moe_checkpoint_open(&bad, wr.path.c_str(), &cc) == EP_MOE_ERR_INVALID_ARGUMENT);
  cc.naming = EP_MOE_NAMING_HF;
  cc.name_prefix = "model.";
  ep_moe_checkpoint_t* ok = nullptr;
  CHECK(ep_moe_checkpoint_open(&ok, wr.path.c_str(), &cc) == EP_MOE_OK);
  ep_moe_checkpoint_close(ok);
  CHECK(bad == nullptr);
}

TEST_CASE("loading reports its progress at INFO: the experts and bytes it will read, then what it read",
          "[checkpoint][log]") {
  ref::Spec s;
  s.H = 32;
  s.I = 16;
  s.E = 6;
  s.K = 2;
  const Written wr = write_model(Scheme::Fused, "BF16", s);
  struct Lines {
    std::vector<std::string> v;
  } lines;
  ep_moe_set_log_callback(
      [](ep_moe_log_level_t level, const char* msg, void* u) {
        if (level == EP_MOE_LOG_INFO) static_cast<Lines*>(u)->v.emplace_back(msg);
      },
      EP_MOE_LOG_INFO, &lines);
  CkHolder ck(wr.path);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  REQUIRE(ep_moe_checkpoint_layer_config(&lc, ck.c, 3) == EP_MOE_OK);
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  ep_moe_expert_map_config_from_layer(&mc, &lc);
  mc.ep_size = 3;
  mc.ep_rank = 1;
  ep_moe_expert_map_t* map = nullptr;
  REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
  ep_moe_layer_t* layer = nullptr;
  REQUIRE(ep_moe_layer_create(&layer, &lc, map, nullptr, nullptr) == EP_MOE_OK);
  REQUIRE(ep_moe_layer_load(layer, ck.c, 3) == EP_MOE_OK);
  ep_moe_set_log_callback(nullptr, EP_MOE_LOG_ERROR, nullptr);
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  // Rank 1 of 3 holds 2 of the 6 experts: 2 x 3 x 16 x 32 bf16 values.
  bool start = false, end = false;
  for (const std::string& l : lines.v) {
    start = start || l.find("[EP rank 1/3] loading layer 3") != std::string::npos &&
                         l.find("2 experts, 6144 bytes of expert weights") != std::string::npos;
    end = end || l.find("[EP rank 1/3] loaded layer 3") != std::string::npos;
  }
  for (const std::string& l : lines.v) UNSCOPED_INFO(l);
  CHECK(start);
  CHECK(end);
}

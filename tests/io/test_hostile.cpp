// Hostile checkpoint paths and files that used to hang or take memory out of
// proportion to their size: a path that is not a regular file, a header
// with very many tensors, deeply nested or very long JSON. Each must end
// quickly with a clear status.
#include <catch2/catch.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <string>
#include <random>
#include <thread>

#include "ep_moe/ep_moe.h"
#include "writers.hpp"

namespace {

struct Opened {
  ep_moe_status_t status;
  std::string message;
};

// ep_moe_checkpoint_open(path) on a thread of its own, waited for up to
// `seconds`: a hang fails the test instead of stalling the run (the thread
// is left behind, blocked; the process's exit ends it).
Opened open_within(const std::string& path, int seconds) {
  auto done = std::make_shared<std::promise<Opened>>();
  std::future<Opened> f = done->get_future();
  std::thread([path, done] {
    ep_moe_checkpoint_t* c = nullptr;
    const ep_moe_status_t s = ep_moe_checkpoint_open(&c, path.c_str(), nullptr);
    const std::string msg = s == EP_MOE_OK ? "" : ep_moe_last_error();
    ep_moe_checkpoint_close(c);
    done->set_value(Opened{s, msg});
  }).detach();
  if (f.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    FAIL("ep_moe_checkpoint_open(" << path << ") did not return within " << seconds << " s");
  }
  return f.get();
}

std::vector<uint8_t> safetensors_raw(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> b;
  writers::put_u64(b, header.size());
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data_bytes, 0);
  return b;
}

void write_text(const std::string& path, const std::string& text) {
  writers::write_file(path, std::vector<uint8_t>(text.begin(), text.end()));
}

// Resets the process's peak resident set to its current one; false where
// the kernel does not let this process.
bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}
// A field of /proc/self/status in MiB (VmHWM: the peak since the reset,
// VmRSS: now); -1 where absent.
long status_mib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(key.size())) / 1024;
  return -1;
}

}  // namespace

TEST_CASE("a checkpoint path that is not a regular file is refused at once, never waited on", "[checkpoint][hostile]") {
  const std::string dir = writers::temp_dir("fifo");
  // The path itself.
  const std::string fifo = dir + "/model.safetensors.fifo";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  Opened o = open_within(fifo, 20);
  CHECK(o.status == EP_MOE_ERR_IO);
  CHECK(o.message.find("not a regular file") != std::string::npos);
  // The only .gguf of a directory.
  const std::string gdir = dir + "/gguf";
  REQUIRE(mkdir(gdir.c_str(), 0700) == 0);
  REQUIRE(mkfifo((gdir + "/model.gguf").c_str(), 0600) == 0);
  o = open_within(gdir, 20);
  CHECK(o.status == EP_MOE_ERR_IO);
  CHECK(o.message.find("model.gguf") != std::string::npos);
  // A shard an index names.
  const std::string sdir = dir + "/sharded";
  REQUIRE(mkdir(sdir.c_str(), 0700) == 0);
  write_text(sdir + "/model.safetensors.index.json",
             R"({"weight_map": {"model.layers.0.mlp.gate.weight": "model-00001-of-00001.safetensors"}})");
  REQUIRE(mkfifo((sdir + "/model-00001-of-00001.safetensors").c_str(), 0600) == 0);
  o = open_within(sdir, 20);
  CHECK(o.status == EP_MOE_ERR_IO);
  CHECK(o.message.find("model-00001-of-00001.safetensors") != std::string::npos);
  // A character device.
  o = open_within("/dev/zero", 20);
  CHECK(o.status != EP_MOE_OK);
}

TEST_CASE("a safetensors header with very many tensors opens in time linear in its size", "[checkpoint][hostile]") {
  // 100k one-element tensors (a 12 MB header): the callback-driven JSON
  // parse this replaced took minutes here (quadratic in the entries).
  const std::string dir = writers::temp_dir("many");
  constexpr int kTensors = 100000;
  std::string h = "{";
  for (int i = 0; i < kTensors; ++i) {
    if (i) h += ",";
    h += "\"model.layers.0.mlp.experts." + std::to_string(i) + ".gate_proj.weight\":{\"dtype\":\"F32\",\"shape\":[1]," +
         "\"data_offsets\":[" + std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
  }
  h += "}";
  const std::string path = dir + "/model.safetensors";
  writers::write_file(path, safetensors_raw(h, 4 * static_cast<size_t>(kTensors)));
  const Opened o = open_within(path, 120);
  INFO(o.message);
  CHECK(o.status == EP_MOE_OK);
}

TEST_CASE("JSON shapes no checkpoint has are refused before a document is built", "[checkpoint][hostile]") {
  const std::string dir = writers::temp_dir("json");
  struct Case {
    const char* name;
    std::string file;  // in dir
    std::string text;
    bool safetensors;
    const char* needle;
  };
  const std::string deep(100000, '[');
  std::string long_shape = "[";
  for (int i = 0; i < 100; ++i) long_shape += i ? ",1" : "1";
  long_shape += "]";
  const std::vector<Case> cases = {
      {"a header nested 4 deep", "a.safetensors", R"({"t":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", true,
       "nested deeper than 3"},
      {"a header of unclosed arrays", "b.safetensors", "{\"t\":" + deep, true, "nested deeper than 3"},
      {"a shape of 100 dimensions", "c.safetensors",
       R"({"t":{"dtype":"F32","shape":)" + long_shape + R"(,"data_offsets":[0,4]}})", true, "more than 64 elements"},
      {"an index of unclosed arrays", "d/model.safetensors.index.json", deep, false, "nested deeper than 4"},
      {"an index with a key twice", "e/model.safetensors.index.json",
       R"({"weight_map": {"a": "x.safetensors"}, "weight_map": {"b": "y.safetensors"}})", false,
       "'weight_map' appears twice"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const std::string path = dir + "/" + c.file;
    const auto slash = c.file.find('/');
    if (slash != std::string::npos) mkdir((dir + "/" + c.file.substr(0, slash)).c_str(), 0700);
    if (c.safetensors) writers::write_file(path, safetensors_raw(c.text, 4));
    else write_text(path, c.text);
    const Opened o = open_within(path, 60);
    INFO(o.message);
    CHECK(o.status == EP_MOE_ERR_FORMAT);
    CHECK(o.message.find(c.needle) != std::string::npos);
  }
  // A config.json nested past its limit beside a valid checkpoint.
  const std::string cdir = writers::temp_dir("deep_config");
  writers::write_file(cdir + "/model.safetensors",
                      safetensors_raw(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  write_text(cdir + "/config.json", "{\"a\":" + std::string(64, '[') + std::string(64, ']') + "}");
  const Opened o = open_within(cdir, 60);
  INFO(o.message);
  CHECK(o.status == EP_MOE_ERR_FORMAT);
  CHECK(o.message.find("config.json: nested deeper than 16") != std::string::npos);
}

TEST_CASE("a 16 MB index of nested arrays costs memory of the order of its size, not 77x", "[checkpoint][hostile]") {
  const std::string dir = writers::temp_dir("deep_index");
  const std::string path = dir + "/model.safetensors.index.json";
  write_text(path, std::string(16u << 20, '['));
  const long before = status_mib("VmRSS");
  const bool measured = reset_peak() && before >= 0;
  if (!measured) WARN("skipped the memory figure: /proc/self/clear_refs cannot reset this process's peak");
  const Opened o = open_within(path, 60);
  CHECK(o.status == EP_MOE_ERR_FORMAT);
  const long peak = status_mib("VmHWM");
  INFO("resident set " << before << " MiB before, peak " << peak << " MiB while opening");
  // The text is 16 MiB (read once); a document of it took 1.2 GB.
  if (measured) CHECK(peak - before < 300);
}

namespace {

// Status and message of deriving layer `layer`'s configuration from the
// checkpoint at path (the failure may come at open or at the derivation).
Opened layer_config(const std::string& path, int layer) {
  ep_moe_checkpoint_t* c = nullptr;
  ep_moe_status_t s = ep_moe_checkpoint_open(&c, path.c_str(), nullptr);
  if (s != EP_MOE_OK) return Opened{s, ep_moe_last_error()};
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  s = ep_moe_checkpoint_layer_config(&lc, c, layer);
  Opened o{s, s == EP_MOE_OK ? "" : ep_moe_checkpoint_last_error(c)};
  ep_moe_checkpoint_close(c);
  return o;
}

writers::Model small_model() {
  writers::Model m;
  m.spec.H = 32;
  m.spec.I = 16;
  m.spec.E = 4;
  m.spec.K = 2;
  m.dtype = "F32";
  m.layer = 1;
  return m;
}

}  // namespace

TEST_CASE("integers read from a file are range-checked in their own type, never narrowed", "[checkpoint][hostile]") {
  std::mt19937 rng(Catch::rngSeed() + 71);
  SECTION("GGUF metadata") {
    writers::Model m = small_model();
    m.w = ref::random_weights(m.spec, ref::F32, rng);
    const auto ts = writers::moe_tensors(m, writers::Scheme::Gguf, rng);
    struct Case {
      const char* key;
      uint32_t type;
      uint64_t u;
      const char* needle;
    };
    const Case cases[] = {
        {"expert_used_count", 10, (1ull << 32) + 2, "qwen3moe.expert_used_count is 4294967298, outside"},
        {"expert_group_count", 10, (1ull << 32) + 2, "qwen3moe.expert_group_count is 4294967298, outside"},
        {"expert_group_count", 4, 4294967295u, "qwen3moe.expert_group_count is 4294967295, outside"},
        {"expert_used_count", 6, 0, "qwen3moe.expert_used_count is a float, not an integer"},
        {"expert_used_count", 5, static_cast<uint32_t>(-3), "qwen3moe.expert_used_count is -3, outside"},
        {"block_count", 10, 1ull << 40, "qwen3moe.block_count is 1099511627776, outside"},
    };
    for (const Case& c : cases) {
      INFO(c.key << " type " << c.type);
      std::vector<writers::Kv> kv = writers::gguf_meta(m);
      for (auto& x : kv)
        if (x.key == std::string("qwen3moe.") + c.key) x.key = "unused." + x.key;
      writers::Kv bad;
      bad.key = std::string("qwen3moe.") + c.key;
      bad.type = c.type;
      bad.u = c.u;
      bad.f = 2.0f;
      kv.push_back(bad);
      const std::string path = writers::temp_dir("narrow") + "/model.gguf";
      writers::write_file(path, writers::gguf_bytes(ts, kv));
      const Opened o = layer_config(path, m.layer);
      INFO(o.message);
      CHECK(o.status == EP_MOE_ERR_FORMAT);
      CHECK(o.message.find(c.needle) != std::string::npos);
      CHECK(o.message.find(path) != std::string::npos);
    }
  }
  SECTION("config.json") {
    writers::Model m = small_model();
    const std::string path = writers::small_checkpoint(m, rng);
    const std::string cfg_path = path.substr(0, path.rfind('/')) + "/config.json";
    const std::string good = writers::hf_config(m, writers::Scheme::Qwen);
    REQUIRE(layer_config(path, m.layer).status == EP_MOE_OK);
    const std::string key = "\"num_experts_per_tok\": 2";
    REQUIRE(good.find(key) != std::string::npos);
    struct Case {
      std::string value;
      const char* needle;
    };
    const Case cases[] = {
        {"2.9", "num_experts_per_tok is 2.9, not an integer"},
        {"1e300", "num_experts_per_tok is 1e+300, outside [1, 2147483647]"},
        {"-1", "num_experts_per_tok is -1, outside"},
        {"0", "num_experts_per_tok is 0, outside"},
        {"\"2\"", "num_experts_per_tok is \"2\", not a number"},
        {"[2]", "num_experts_per_tok is [2], not a number"},
        {"4294967298", "num_experts_per_tok is 4294967298, outside"},
    };
    for (const Case& c : cases) {
      INFO(c.value);
      std::string text = good;
      text.replace(text.find(key), key.size(), "\"num_experts_per_tok\": " + c.value);
      write_text(cfg_path, text);
      const Opened o = layer_config(path, m.layer);
      INFO(o.message);
      CHECK(o.status == EP_MOE_ERR_FORMAT);
      CHECK(o.message.find(c.needle) != std::string::npos);
      CHECK(o.message.find("config.json") != std::string::npos);
    }
    std::string text = good;
    text.replace(text.find("\"hidden_act\": \"silu\""), 20, "\"hidden_act\": 5");
    write_text(cfg_path, text);
    const Opened o = layer_config(path, m.layer);
    CHECK(o.status == EP_MOE_ERR_FORMAT);
    CHECK(o.message.find("hidden_act is 5, not a string") != std::string::npos);
  }
}

TEST_CASE("a layer whose only expert is number 1,000,000 is described by the tensors it has", "[checkpoint][hostile]") {
  // Per-expert GGUF names (blk.L.ffn_gate.E.weight): the sizes come from
  // expert 1,000,000's tensors, and the message says what is wrong.
  writers::Model m = small_model();
  const int64_t H = m.spec.H, I = m.spec.I;
  std::vector<float> gate(static_cast<size_t>(H * I), 0.5f), down(gate.size(), 0.25f);
  const std::vector<writers::Tensor> ts = {
      {"blk.1.ffn_gate.1000000.weight", "F32", {I, H}, writers::encode(gate, "F32")},
      {"blk.1.ffn_up.1000000.weight", "F32", {I, H}, writers::encode(gate, "F32")},
      {"blk.1.ffn_down.1000000.weight", "F32", {H, I}, writers::encode(down, "F32")},
  };
  const std::string path = writers::temp_dir("far_expert") + "/model.gguf";
  writers::write_file(path, writers::gguf_bytes(ts, writers::gguf_meta(m)));
  const Opened o = layer_config(path, 1);
  INFO(o.message);
  CHECK(o.status != EP_MOE_OK);
  CHECK(o.message.find("cannot tell the hidden/intermediate sizes") == std::string::npos);
  CHECK(o.message.find("expert") != std::string::npos);
}

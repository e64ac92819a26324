// Corrupt safetensors and GGUF files: each fault gets its own clear status
// and a message naming the file (and the tensor where there is one); none
// crashes, hangs or allocates without bound.
#include <catch2/catch.hpp>

#include <functional>

#include "ep_moe/ep_moe.h"
#include "writers.hpp"

using writers::put_str;
using writers::put_u32;
using writers::put_u64;

namespace {

// Raw safetensors from a header text and a data size.
std::vector<uint8_t> st_raw(const std::string& header, size_t data_bytes, uint64_t claimed_len = UINT64_MAX) {
  std::vector<uint8_t> b;
  put_u64(b, claimed_len == UINT64_MAX ? header.size() : claimed_len);
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data_bytes, 0);
  return b;
}

struct Fault {
  const char* name;
  std::vector<uint8_t> bytes;
  ep_moe_status_t status;
  const char* needle;  // in the message (besides the file name)
};

void check_faults(const std::vector<Fault>& faults, const char* ext) {
  const std::string dir = writers::temp_dir("corrupt");
  int i = 0;
  for (const Fault& f : faults) {
    const std::string path = dir + "/f" + std::to_string(i++) + ext;
    writers::write_file(path, f.bytes);
    INFO(f.name << " (" << path << ")");
    ep_moe_checkpoint_t* c = nullptr;
    const ep_moe_status_t s = ep_moe_checkpoint_open(&c, path.c_str(), nullptr);
    const std::string msg = ep_moe_last_error();
    INFO("message: " << msg);
    CHECK(s == f.status);
    CHECK(c == nullptr);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(f.needle) != std::string::npos);
    ep_moe_checkpoint_close(c);
  }
}

const char* kT = R"("model.layers.0.mlp.experts.0.gate_proj.weight")";

}  // namespace

TEST_CASE("corrupt safetensors files are rejected with FORMAT naming the file and tensor", "[checkpoint][corrupt]") {
  auto one = [](const std::string& body) { return std::string("{") + kT + ":" + body + "}"; };
  const std::string good = one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})");
  std::vector<Fault> f = {
      {"empty file", {}, EP_MOE_ERR_FORMAT, "too small"},
      {"too small", {1, 2, 3, 4, 5}, EP_MOE_ERR_FORMAT, "too small"},
      {"header length past the end", st_raw(good, 16, 4096), EP_MOE_ERR_FORMAT, "past the end"},
      {"header length above 100 MB", st_raw(good, 16, 1ull << 40), EP_MOE_ERR_FORMAT, "100 MB"},
      {"not JSON", st_raw("{not json", 0), EP_MOE_ERR_FORMAT, "not valid JSON"},
      {"JSON but not an object", st_raw("[1, 2, 3]", 0), EP_MOE_ERR_FORMAT, "not a JSON object"},
      {"unknown dtype", st_raw(one(R"({"dtype":"F12","shape":[2,2],"data_offsets":[0,16]})"), 16), EP_MOE_ERR_FORMAT,
       "unknown dtype 'F12'"},
      {"missing dtype", st_raw(one(R"({"shape":[2,2],"data_offsets":[0,16]})"), 16), EP_MOE_ERR_FORMAT, "dtype"},
      {"negative shape", st_raw(one(R"({"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]})"), 16), EP_MOE_ERR_FORMAT,
       "non-negative"},
      {"shape overflow", st_raw(one(R"({"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]})"), 16),
       EP_MOE_ERR_FORMAT, "overflows"},
      {"size mismatch", st_raw(one(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,16]})"), 16), EP_MOE_ERR_FORMAT,
       "give 24 bytes"},
      {"end before begin", st_raw(one(R"({"dtype":"F32","shape":[0],"data_offsets":[16,8]})"), 16), EP_MOE_ERR_FORMAT,
       "before begin"},
      {"offsets past the data", st_raw(one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})"), 8),
       EP_MOE_ERR_FORMAT, "past the data"},
      {"gap", st_raw(one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[8,24]})"), 24), EP_MOE_ERR_FORMAT, "gap of 8"},
      {"overlap",
       st_raw(
           R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
           24),
       EP_MOE_ERR_FORMAT, "overlaps"},
      {"duplicate name",
       st_raw(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       EP_MOE_ERR_FORMAT, "'a' appears twice"},
      {"trailing bytes", st_raw(good, 20), EP_MOE_ERR_FORMAT, "4 trailing bytes"},
      {"data_offsets arity", st_raw(one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0]})"), 16), EP_MOE_ERR_FORMAT,
       "data_offsets must be"},
      {"entry not an object", st_raw(one(R"([1,2])"), 0), EP_MOE_ERR_FORMAT, "not an object"},
      {"metadata not an object", st_raw(R"({"__metadata__":[1]})", 0), EP_MOE_ERR_FORMAT, "__metadata__"},
      {"metadata value not a string", st_raw(R"({"__metadata__":{"k":1}})", 0), EP_MOE_ERR_FORMAT, "'k'"},
      {"fractional offsets", st_raw(one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0.5,16]})"), 16),
       EP_MOE_ERR_FORMAT, "data_offsets must be non-negative integers"},
  };
  // Messages that concern one tensor name it.
  for (auto& x : f)
    if (std::string(x.needle).find("dtype") != std::string::npos || std::string(x.name) == "size mismatch") CHECK(true);
  check_faults(f, ".safetensors");
  // And the tensor name is in the per-tensor messages.
  const std::string dir = writers::temp_dir("corrupt2");
  writers::write_file(dir + "/t.safetensors",
                      st_raw(one(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,16]})"), 16));
  ep_moe_checkpoint_t* c = nullptr;
  CHECK(ep_moe_checkpoint_open(&c, (dir + "/t.safetensors").c_str(), nullptr) == EP_MOE_ERR_FORMAT);
  CHECK(std::string(ep_moe_last_error()).find("model.layers.0.mlp.experts.0.gate_proj.weight") != std::string::npos);
}

namespace {

// A GGUF header built field by field.
struct G {
  std::vector<uint8_t> b;
  G(uint32_t magic = 0x46554747u, uint32_t version = 3, uint64_t n_tensors = 0, uint64_t n_kv = 0) {
    put_u32(b, magic);
    put_u32(b, version);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
  }
  G& kv_u32(const std::string& k, uint32_t v) {
    put_str(b, k);
    put_u32(b, 4);
    put_u32(b, v);
    return *this;
  }
  G& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    put_str(b, name);
    put_u32(b, static_cast<uint32_t>(ne.size()));
    for (auto d : ne) put_u64(b, d);
    put_u32(b, type);
    put_u64(b, offset);
    return *this;
  }
  G& pad(size_t align = 32) {
    while (b.size() % align) b.push_back(0);
    return *this;
  }
  G& data(size_t n) {
    b.resize(b.size() + n, 0);
    return *this;
  }
};

}  // namespace

TEST_CASE("corrupt GGUF files are rejected with FORMAT naming the file and tensor", "[checkpoint][corrupt]") {
  std::vector<Fault> f;
  f.push_back({"too small", {1, 2, 3}, EP_MOE_ERR_FORMAT, "too small"});
  f.push_back({"bad magic", G(0x46554746u).data(64).b, EP_MOE_ERR_FORMAT, "bad magic"});
  f.push_back({"unknown version", G(0x46554747u, 7).data(64).b, EP_MOE_ERR_FORMAT, "version 7"});
  f.push_back({"version 1", G(0x46554747u, 1).data(64).b, EP_MOE_ERR_FORMAT, "version 1"});
  f.push_back({"huge tensor count", G(0x46554747u, 3, 1ull << 40, 0).data(64).b, EP_MOE_ERR_FORMAT, "limit"});
  f.push_back({"huge kv count", G(0x46554747u, 3, 0, 1ull << 23).data(64).b, EP_MOE_ERR_FORMAT, "can hold"});
  {
    G g(0x46554747u, 3, 0, 1);
    put_u64(g.b, 1ull << 40);  // key length
    g.data(64);
    f.push_back({"huge key length", g.b, EP_MOE_ERR_FORMAT, "metadata key"});
  }
  {
    G g(0x46554747u, 3, 0, 1);
    put_str(g.b, "tokenizer.ggml.tokens");
    put_u32(g.b, 9);
    put_u32(g.b, 8);  // array of strings
    put_u64(g.b, 1ull << 50);
    g.data(64);
    f.push_back({"huge array length", g.b, EP_MOE_ERR_FORMAT, "cannot fit"});
  }
  {
    G g(0x46554747u, 3, 0, 1);
    put_str(g.b, "general.name");
    put_u32(g.b, 8);
    put_u64(g.b, 1ull << 33);  // string length
    g.data(64);
    f.push_back({"huge string length", g.b, EP_MOE_ERR_FORMAT, "metadata string of 'general.name'"});
  }
  {
    G g(0x46554747u, 3, 0, 1);
    put_str(g.b, "x");
    put_u32(g.b, 99);
    g.data(64);
    f.push_back({"bad value type", g.b, EP_MOE_ERR_FORMAT, "value type 99"});
  }
  {
    G g(0x46554747u, 3, 0, 1);
    put_str(g.b, "x");
    put_u32(g.b, 7);
    g.b.push_back(2);
    g.data(64);
    f.push_back({"bool not 0/1", g.b, EP_MOE_ERR_FORMAT, "bool"});
  }
  f.push_back({"duplicate key", G(0x46554747u, 3, 0, 2).kv_u32("a", 1).kv_u32("a", 2).data(64).b, EP_MOE_ERR_FORMAT,
               "'a' appears twice"});
  f.push_back({"alignment not a power of two", G(0x46554747u, 3, 0, 1).kv_u32("general.alignment", 24).data(64).b,
               EP_MOE_ERR_FORMAT, "power of two"});
  f.push_back({"bad tensor type",
               G(0x46554747u, 3, 1, 0).tensor("blk.0.ffn_gate_exps.weight", {32, 2}, 99, 0).pad().data(256).b,
               EP_MOE_ERR_FORMAT, "blk.0.ffn_gate_exps.weight': ggml type 99"});
  f.push_back({"n_dims 5",
               G(0x46554747u, 3, 1, 0).tensor("blk.0.ffn_up_exps.weight", {2, 2, 2, 2, 2}, 0, 0).pad().data(256).b,
               EP_MOE_ERR_FORMAT, "blk.0.ffn_up_exps.weight': 5 dimensions"});
  f.push_back({"misaligned offset", G(0x46554747u, 3, 1, 0).tensor("t.weight", {4}, 0, 3).pad().data(64).b,
               EP_MOE_ERR_FORMAT, "'t.weight': offset 3 is not a multiple"});
  f.push_back({"out-of-file offset", G(0x46554747u, 3, 1, 0).tensor("t.weight", {4}, 0, 1ull << 40).pad().data(64).b,
               EP_MOE_ERR_FORMAT, "'t.weight': data"});
  f.push_back({"truncated data", G(0x46554747u, 3, 1, 0).tensor("t.weight", {64, 64}, 0, 0).pad().data(100).b,
               EP_MOE_ERR_FORMAT, "'t.weight': data"});
  f.push_back({"size overflow",
               G(0x46554747u, 3, 1, 0).tensor("t.weight", {1ull << 40, 1ull << 40}, 0, 0).pad().data(64).b,
               EP_MOE_ERR_FORMAT, "'t.weight'"});
  f.push_back({"partial Q8_0 block", G(0x46554747u, 3, 1, 0).tensor("q.weight", {33, 2}, 8, 0).pad().data(256).b,
               EP_MOE_ERR_FORMAT, "'q.weight': row of 33 elements"});
  // The block formats layers keep: rows of whole blocks, data inside the file.
  f.push_back({"partial Q4_K block", G(0x46554747u, 3, 1, 0).tensor("k.weight", {300, 2}, 12, 0).pad().data(1024).b,
               EP_MOE_ERR_FORMAT, "'k.weight': row of 300 elements is not a whole number of Q4_K blocks"});
  f.push_back({"partial IQ4_XS block", G(0x46554747u, 3, 1, 0).tensor("x.weight", {128, 2}, 23, 0).pad().data(512).b,
               EP_MOE_ERR_FORMAT, "'x.weight': row of 128 elements is not a whole number of IQ4_XS blocks"});
  f.push_back({"partial MXFP4 block", G(0x46554747u, 3, 1, 0).tensor("m.weight", {48, 2}, 39, 0).pad().data(256).b,
               EP_MOE_ERR_FORMAT, "'m.weight': row of 48 elements is not a whole number of MXFP4 blocks"});
  f.push_back({"partial IQ2_XXS block", G(0x46554747u, 3, 1, 0).tensor("q.weight", {128, 2}, 16, 0).pad().data(512).b,
               EP_MOE_ERR_FORMAT, "'q.weight': row of 128 elements is not a whole number of IQ2_XXS blocks"});
  f.push_back({"partial Q5_1 block", G(0x46554747u, 3, 1, 0).tensor("q.weight", {48, 2}, 7, 0).pad().data(256).b,
               EP_MOE_ERR_FORMAT, "'q.weight': row of 48 elements is not a whole number of Q5_1 blocks"});
  f.push_back({"truncated Q6_K data", G(0x46554747u, 3, 1, 0).tensor("q6.weight", {256, 8}, 14, 0).pad().data(1000).b,
               EP_MOE_ERR_FORMAT, "'q6.weight': data"});
  f.push_back({"truncated Q5_K data", G(0x46554747u, 3, 1, 0).tensor("q5.weight", {512, 4}, 13, 0).pad().data(700).b,
               EP_MOE_ERR_FORMAT, "'q5.weight': data"});
  f.push_back({"duplicate tensor",
               G(0x46554747u, 3, 2, 0).tensor("t.weight", {4}, 0, 0).tensor("t.weight", {4}, 0, 32).pad().data(64).b,
               EP_MOE_ERR_FORMAT, "'t.weight' appears twice"});
  {
    G g(0x46554747u, 3, 0, 1);
    put_str(g.b, "general.name");  // cut inside the value
    put_u32(g.b, 8);
    put_u64(g.b, 30);
    g.b.insert(g.b.end(), {'a', 'b'});
    f.push_back({"truncated header", g.b, EP_MOE_ERR_FORMAT, "claims 30 bytes"});
  }
  {
    G g(0x46554747u, 3, 0, 1);
    put_str(g.b, "nested");
    put_u32(g.b, 9);                // an array ...
    for (int d = 0; d < 12; ++d) {  // ... of arrays, 12 deep, one element each
      put_u32(g.b, 9);
      put_u64(g.b, 1);
    }
    g.data(64);
    f.push_back({"arrays nested too deep", g.b, EP_MOE_ERR_FORMAT, "nested deeper"});
  }
  check_faults(f, ".gguf");
}

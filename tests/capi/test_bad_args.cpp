// Every exported function fed bad arguments, from one table: NULL for each
// pointer, out-of-range integers and enum values, wrong struct_size, and
// destroyed handles. Each call must return the documented status with a
// message, leave its out-parameters untouched, and leave the handles it
// was given usable. The last test reads the exported names from ep_moe.h
// and fails when one of them has no row in the table.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../io/writers.hpp"
#include "ep_moe/ep_moe.h"

#ifndef EP_MOE_PUBLIC_HEADER
#error "EP_MOE_PUBLIC_HEADER must name include/ep_moe/ep_moe.h"
#endif

namespace {

constexpr int32_t kBadEnum = 0x7654321;

// Live objects every row may use, rebuilt for each row.
struct Fixture {
  ep_moe_expert_map_t* map = nullptr;   // ep 2, rank 0, 8 experts
  ep_moe_expert_map_t* map1 = nullptr;  // ep 1, 8 experts (the layer's)
  ep_moe_comm_t* comm = nullptr;        // one in-process rank
  ep_moe_layer_t* layer = nullptr;      // H 16, I 8, E 8, top-2, every weight set
  ep_moe_checkpoint_t* ck = nullptr;    // a small safetensors checkpoint of one MoE layer
  int ck_layer = 0;

  Fixture() {
    ep_moe_expert_map_config_t mc;
    ep_moe_expert_map_config_init(&mc);
    mc.ep_size = 2;
    mc.global_num_experts = 8;
    REQUIRE(ep_moe_expert_map_create(&map, &mc) == EP_MOE_OK);
    mc.ep_size = 1;
    REQUIRE(ep_moe_expert_map_create(&map1, &mc) == EP_MOE_OK);
    REQUIRE(ep_moe_comm_create_local(&comm, 1, nullptr) == EP_MOE_OK);
    ep_moe_layer_config_t lc = layer_config();
    REQUIRE(ep_moe_layer_create(&layer, &lc, map1, comm, nullptr) == EP_MOE_OK);
    std::vector<float> w(16 * 8, 0.01f);
    for (int e = 0; e < 8; ++e) {
      REQUIRE(ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_GATE, e, w.data(), EP_MOE_DTYPE_F32, 8,
                                      16) == EP_MOE_OK);
      REQUIRE(ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_UP, e, w.data(), EP_MOE_DTYPE_F32, 8, 16) ==
              EP_MOE_OK);
      REQUIRE(ep_moe_layer_set_weight(nullptr, layer, EP_MOE_WEIGHT_EXPERT_DOWN, e, w.data(), EP_MOE_DTYPE_F32, 16,
                                      8) == EP_MOE_OK);
    }
    REQUIRE(ep_moe_checkpoint_open(&ck, ck_path().c_str(), nullptr) == EP_MOE_OK);
    ck_layer = 1;
  }
  ~Fixture() {
    ep_moe_layer_destroy(layer);
    ep_moe_comm_destroy(comm);
    ep_moe_expert_map_destroy(map);
    ep_moe_expert_map_destroy(map1);
    ep_moe_checkpoint_close(ck);
  }
  // A small safetensors checkpoint of one MoE layer (index 1), written once.
  static const std::string& ck_path() {
    static const std::string path = [] {
      writers::Model m;
      m.spec.H = 16;
      m.spec.I = 8;
      m.spec.E = 8;
      m.spec.K = 2;
      m.dtype = "F32";
      m.layer = 1;
      std::mt19937 rng(3);
      return writers::small_checkpoint(m, rng, false);
    }();
    return path;
  }
  static ep_moe_layer_config_t layer_config() {
    ep_moe_layer_config_t lc;
    ep_moe_layer_config_init(&lc);
    lc.hidden_size = 16;
    lc.intermediate_size = 8;
    lc.num_experts = 8;
    lc.top_k = 2;
    lc.max_tokens = 4;
    lc.num_threads = 1;
    return lc;
  }
  // The handles still work.
  void usable() const {
    int32_t v = -1;
    CHECK(ep_moe_expert_map_get_attr(&v, map, EP_MOE_MAP_ATTR_EP_SIZE) == EP_MOE_OK);
    CHECK(v == 2);
    CHECK(ep_moe_comm_barrier(comm) == EP_MOE_OK);
    int64_t ready = -1;
    CHECK(ep_moe_layer_get_attr(&ready, layer, EP_MOE_LAYER_ATTR_READY) == EP_MOE_OK);
    CHECK(ready == 1);
    std::vector<float> x(16, 0.5f), out(16, 0.0f);
    std::vector<int32_t> ids = {1, 5};
    std::vector<float> wts = {0.5f, 0.5f};
    ep_moe_forward_args_t a;
    ep_moe_forward_args_init(&a);
    a.num_tokens = 1;
    a.hidden = x.data();
    a.topk_ids = ids.data();
    a.topk_weights = wts.data();
    a.out = out.data();
    CHECK(ep_moe_layer_forward(layer, &a) == EP_MOE_OK);
    int64_t n = -1;
    CHECK(ep_moe_checkpoint_get_attr(&n, ck, EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS) == EP_MOE_OK);
  }
};

// A handle that was created and destroyed (not reused before it is passed:
// each helper is called right where the dead pointer is used).
ep_moe_expert_map_t* dead_map() {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 4;
  ep_moe_expert_map_t* m = nullptr;
  REQUIRE(ep_moe_expert_map_create(&m, &mc) == EP_MOE_OK);
  ep_moe_expert_map_destroy(m);
  return m;
}
ep_moe_comm_t* dead_comm() {
  ep_moe_comm_t* c = nullptr;
  REQUIRE(ep_moe_comm_create_local(&c, 1, nullptr) == EP_MOE_OK);
  ep_moe_comm_destroy(c);
  return c;
}
ep_moe_layer_t* dead_layer(const Fixture& f) {
  const ep_moe_layer_config_t lc = Fixture::layer_config();
  ep_moe_layer_t* l = nullptr;
  REQUIRE(ep_moe_layer_create(&l, &lc, f.map1, nullptr, nullptr) == EP_MOE_OK);
  ep_moe_layer_destroy(l);
  return l;
}
ep_moe_checkpoint_t* dead_ck() {
  ep_moe_checkpoint_t* c = nullptr;
  REQUIRE(ep_moe_checkpoint_open(&c, Fixture::ck_path().c_str(), nullptr) == EP_MOE_OK);
  ep_moe_checkpoint_close(c);
  return c;
}

// The status, and a message in the thread's slot.
void expect(ep_moe_status_t got, ep_moe_status_t want, const char* what) {
  INFO(what << ": got " << ep_moe_status_string(got) << ", message '" << ep_moe_last_error() << "'");
  CHECK(got == want);
  CHECK(std::strlen(ep_moe_last_error()) > 0);
}
#define BAD(call, want) expect((call), (want), #call)

constexpr ep_moe_status_t ARG = EP_MOE_ERR_INVALID_ARGUMENT;
constexpr ep_moe_status_t HANDLE = EP_MOE_ERR_INVALID_HANDLE;
constexpr ep_moe_status_t SIZE = EP_MOE_ERR_STRUCT_SIZE;

template <class T>
T with_size(T v, size_t size) {
  v.struct_size = size;
  return v;
}

using Row = std::function<void(Fixture&)>;

std::map<std::string, Row>& table() {
  static std::map<std::string, Row> t;
  return t;
}
struct Add {
  Add(const char* name, Row r) { table()[name] = std::move(r); }
};
#define ROW(name)                           \
  static void row_##name(Fixture& f);       \
  static Add add_##name(#name, row_##name); \
  static void row_##name(Fixture& f)

// ---- base ------------------------------------------------------------------

ROW(ep_moe_version) {
  (void)f;
  CHECK(ep_moe_version() == static_cast<uint32_t>(EP_MOE_VERSION_NUMBER));
}
ROW(ep_moe_version_string) {
  (void)f;
  CHECK(ep_moe_version_string() != nullptr);
}
ROW(ep_moe_status_string) {
  (void)f;
  CHECK(ep_moe_status_string(static_cast<ep_moe_status_t>(kBadEnum)) != nullptr);
  CHECK(ep_moe_status_string(static_cast<ep_moe_status_t>(-1)) != nullptr);
}
ROW(ep_moe_last_error) {
  (void)f;
  CHECK(ep_moe_last_error() != nullptr);
}
ROW(ep_moe_has_feature) {
  (void)f;
  CHECK(ep_moe_has_feature(0x80000000u) == 0);  // an unknown bit is not a feature
  CHECK(ep_moe_has_feature(0) == 0);            // documented: 0 for an empty mask
}
ROW(ep_moe_dtype_name) {
  (void)f;
  CHECK(ep_moe_dtype_name(static_cast<ep_moe_dtype_t>(kBadEnum)) == nullptr);
  CHECK(ep_moe_dtype_name(static_cast<ep_moe_dtype_t>(EP_MOE_DTYPE_FP8_E4M3 + 1)) == nullptr);
  CHECK(ep_moe_dtype_name(static_cast<ep_moe_dtype_t>(-1)) == nullptr);
  CHECK(std::string(ep_moe_dtype_name(EP_MOE_DTYPE_BF16)) == "bf16");
  CHECK(std::string(ep_moe_dtype_name(EP_MOE_DTYPE_IQ2_XXS)) == "iq2_xxs");
}
ROW(ep_moe_quantize) {
  (void)f;
  std::vector<float> x(64, 0.5f);
  std::vector<uint8_t> out(2 * 34, 0xAB);
  const std::vector<uint8_t> before = out;
  BAD(ep_moe_quantize(out.data(), EP_MOE_DTYPE_BF16, x.data(), 2, 32), ARG);  // not a block format
  BAD(ep_moe_quantize(out.data(), static_cast<ep_moe_dtype_t>(kBadEnum), x.data(), 2, 32), ARG);
  BAD(ep_moe_quantize(out.data(), EP_MOE_DTYPE_Q8_0, x.data(), 2, 31), ARG);  // not whole blocks
  BAD(ep_moe_quantize(out.data(), EP_MOE_DTYPE_Q8_0, x.data(), -1, 32), ARG);
  BAD(ep_moe_quantize(nullptr, EP_MOE_DTYPE_Q8_0, x.data(), 2, 32), ARG);
  BAD(ep_moe_quantize(out.data(), EP_MOE_DTYPE_Q8_0, nullptr, 2, 32), ARG);
  x[40] = NAN;
  BAD(ep_moe_quantize(out.data(), EP_MOE_DTYPE_Q8_0, x.data(), 2, 32), ARG);
  CHECK(std::string(ep_moe_last_error()).find("in[1][8]") != std::string::npos);
  CHECK(out == before);  // untouched on failure
  x[40] = 0.25f;
  CHECK(ep_moe_quantize(nullptr, EP_MOE_DTYPE_Q8_0, nullptr, 0, 32) == EP_MOE_OK);
  CHECK(ep_moe_quantize(out.data(), EP_MOE_DTYPE_Q8_0, x.data(), 2, 32) == EP_MOE_OK);
  std::vector<float> back(64);
  CHECK(ep_moe_dequantize(back.data(), out.data(), EP_MOE_DTYPE_Q8_0, 2, 32) == EP_MOE_OK);
  CHECK(std::fabs(back[40] - 0.25f) < 0.005f);  // within a Q8_0 step (0.5 / 127)
}
ROW(ep_moe_dequantize) {
  (void)f;
  std::vector<uint8_t> in(34, 0);
  std::vector<float> out(32, -7.0f);
  BAD(ep_moe_dequantize(out.data(), in.data(), EP_MOE_DTYPE_F32, 1, 32), ARG);
  BAD(ep_moe_dequantize(out.data(), in.data(), EP_MOE_DTYPE_Q8_0, 1, 16), ARG);
  BAD(ep_moe_dequantize(out.data(), in.data(), EP_MOE_DTYPE_Q8_0, 1, -32), ARG);
  BAD(ep_moe_dequantize(nullptr, in.data(), EP_MOE_DTYPE_Q8_0, 1, 32), ARG);
  BAD(ep_moe_dequantize(out.data(), nullptr, EP_MOE_DTYPE_Q8_0, 1, 32), ARG);
  CHECK(out[0] == -7.0f);  // untouched on failure
  CHECK(ep_moe_dequantize(out.data(), in.data(), EP_MOE_DTYPE_Q8_0, 1, 32) == EP_MOE_OK);
  CHECK(out[0] == 0.0f);
}
ROW(ep_moe_fp8_pack) {
  (void)f;
  std::vector<uint8_t> w(2 * 128, 0x38);  // 1.0
  std::vector<float> s(1, 0.5f);
  std::vector<uint8_t> out(2 * 132, 0xAB);
  const std::vector<uint8_t> before = out;
  BAD(ep_moe_fp8_pack(out.data(), w.data(), s.data(), 2, 64), ARG);  // not whole blocks of columns
  BAD(ep_moe_fp8_pack(out.data(), w.data(), s.data(), -2, 128), ARG);
  BAD(ep_moe_fp8_pack(nullptr, w.data(), s.data(), 2, 128), ARG);
  BAD(ep_moe_fp8_pack(out.data(), nullptr, s.data(), 2, 128), ARG);
  BAD(ep_moe_fp8_pack(out.data(), w.data(), nullptr, 2, 128), ARG);
  s[0] = INFINITY;
  BAD(ep_moe_fp8_pack(out.data(), w.data(), s.data(), 2, 128), ARG);
  s[0] = 0.5f;
  w[128 + 5] = 0xFF;  // NaN
  BAD(ep_moe_fp8_pack(out.data(), w.data(), s.data(), 2, 128), ARG);
  CHECK(std::string(ep_moe_last_error()).find("weight[1][5]") != std::string::npos);
  CHECK(out == before);  // untouched on failure
  w[128 + 5] = 0x38;
  CHECK(ep_moe_fp8_pack(out.data(), w.data(), s.data(), 2, 128) == EP_MOE_OK);
  std::vector<float> back(2 * 128);
  CHECK(ep_moe_dequantize(back.data(), out.data(), EP_MOE_DTYPE_FP8_E4M3, 2, 128) == EP_MOE_OK);
  CHECK(back[200] == 0.5f);  // 1.0 x 0.5
}
ROW(ep_moe_dtype_block) {
  (void)f;
  int64_t elems = -7, bytes = -7;
  BAD(ep_moe_dtype_block(&elems, &bytes, static_cast<ep_moe_dtype_t>(kBadEnum)), ARG);
  BAD(ep_moe_dtype_block(&elems, &bytes, static_cast<ep_moe_dtype_t>(EP_MOE_DTYPE_FP8_E4M3 + 1)), ARG);
  CHECK((elems == -7 && bytes == -7));  // untouched on failure
  CHECK(ep_moe_dtype_block(nullptr, nullptr, EP_MOE_DTYPE_Q4_K) == EP_MOE_OK);
  CHECK(ep_moe_dtype_block(&elems, &bytes, EP_MOE_DTYPE_Q4_K) == EP_MOE_OK);
  CHECK((elems == 256 && bytes == 144));
  CHECK(ep_moe_dtype_block(&elems, &bytes, EP_MOE_DTYPE_MXFP4) == EP_MOE_OK);
  CHECK((elems == 32 && bytes == 17));
  CHECK(ep_moe_dtype_block(&elems, &bytes, EP_MOE_DTYPE_BF16) == EP_MOE_OK);
  CHECK((elems == 1 && bytes == 2));
}
ROW(ep_moe_set_log_callback) {
  (void)f;
  BAD(ep_moe_set_log_callback(nullptr, static_cast<ep_moe_log_level_t>(kBadEnum), nullptr), ARG);
  CHECK(ep_moe_set_log_callback(nullptr, EP_MOE_LOG_ERROR, nullptr) == EP_MOE_OK);
}

// ---- expert map -------------------------------------------------------------

ROW(ep_moe_expert_map_config_init) {
  (void)f;
  BAD(ep_moe_expert_map_config_init(nullptr), ARG);
}
ROW(ep_moe_expert_map_create) {
  (void)f;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 8;
  ep_moe_expert_map_t* sentinel = reinterpret_cast<ep_moe_expert_map_t*>(0x1);
  ep_moe_expert_map_t* out = sentinel;
  BAD(ep_moe_expert_map_create(nullptr, &mc), ARG);
  BAD(ep_moe_expert_map_create(&out, nullptr), ARG);
  const auto wrong = with_size(mc, sizeof mc - 1);
  BAD(ep_moe_expert_map_create(&out, &wrong), SIZE);
  for (auto bad : {-1, 0}) {
    auto c = mc;
    c.ep_size = bad;
    BAD(ep_moe_expert_map_create(&out, &c), ARG);
  }
  auto c = mc;
  c.ep_rank = 5;
  BAD(ep_moe_expert_map_create(&out, &c), ARG);
  c = mc;
  c.global_num_experts = -3;
  BAD(ep_moe_expert_map_create(&out, &c), ARG);
  c = mc;
  c.placement = kBadEnum;
  BAD(ep_moe_expert_map_create(&out, &c), ARG);
  c = mc;
  c.placement = EP_MOE_PLACEMENT_CUSTOM;  // no table
  BAD(ep_moe_expert_map_create(&out, &c), ARG);
  CHECK(out == sentinel);
}
ROW(ep_moe_expert_map_destroy) {
  ep_moe_expert_map_destroy(nullptr);
  ep_moe_expert_map_destroy(dead_map());
  ep_moe_expert_map_destroy(reinterpret_cast<ep_moe_expert_map_t*>(f.comm));  // another type: ignored
}
ROW(ep_moe_expert_map_update) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 8;
  mc.ep_size = 2;
  BAD(ep_moe_expert_map_update(nullptr, &mc), HANDLE);
  BAD(ep_moe_expert_map_update(dead_map(), &mc), HANDLE);
  BAD(ep_moe_expert_map_update(f.map, nullptr), ARG);
  const auto wrong = with_size(mc, 0);
  BAD(ep_moe_expert_map_update(f.map, &wrong), SIZE);
  mc.ep_rank = 9;
  BAD(ep_moe_expert_map_update(f.map, &mc), ARG);
  CHECK(std::strlen(ep_moe_expert_map_last_error(f.map)) > 0);
}
ROW(ep_moe_expert_map_last_error) {
  CHECK(ep_moe_expert_map_last_error(nullptr) != nullptr);
  CHECK(ep_moe_expert_map_last_error(dead_map()) != nullptr);
  CHECK(ep_moe_expert_map_last_error(f.map) != nullptr);
}
ROW(ep_moe_expert_map_get_attr) {
  int32_t v = -77;
  BAD(ep_moe_expert_map_get_attr(nullptr, f.map, EP_MOE_MAP_ATTR_EP_SIZE), ARG);
  BAD(ep_moe_expert_map_get_attr(&v, nullptr, EP_MOE_MAP_ATTR_EP_SIZE), HANDLE);
  BAD(ep_moe_expert_map_get_attr(&v, dead_map(), EP_MOE_MAP_ATTR_EP_SIZE), HANDLE);
  BAD(ep_moe_expert_map_get_attr(&v, f.map, static_cast<ep_moe_map_attr_t>(kBadEnum)), ARG);
  BAD(ep_moe_expert_map_get_attr(&v, f.map, static_cast<ep_moe_map_attr_t>(-1)), ARG);
  CHECK(v == -77);
}
ROW(ep_moe_expert_map_global_to_local) {
  int32_t v = -77;
  BAD(ep_moe_expert_map_global_to_local(nullptr, f.map, 0), ARG);
  BAD(ep_moe_expert_map_global_to_local(&v, nullptr, 0), HANDLE);
  BAD(ep_moe_expert_map_global_to_local(&v, f.map, 8), ARG);
  BAD(ep_moe_expert_map_global_to_local(&v, f.map, -1), ARG);
  CHECK(v == -77);
}
ROW(ep_moe_expert_map_local_to_global) {
  int32_t v = -77;
  BAD(ep_moe_expert_map_local_to_global(nullptr, f.map, 0), ARG);
  BAD(ep_moe_expert_map_local_to_global(&v, dead_map(), 0), HANDLE);
  BAD(ep_moe_expert_map_local_to_global(&v, f.map, 4), ARG);
  BAD(ep_moe_expert_map_local_to_global(&v, f.map, -1), ARG);
  CHECK(v == -77);
}
ROW(ep_moe_expert_map_is_local) {
  int32_t v = -77;
  BAD(ep_moe_expert_map_is_local(nullptr, f.map, 0), ARG);
  BAD(ep_moe_expert_map_is_local(&v, nullptr, 0), HANDLE);
  BAD(ep_moe_expert_map_is_local(&v, f.map, 1 << 30), ARG);
  CHECK(v == -77);
}
ROW(ep_moe_expert_map_table_length) {
  size_t v = 77;
  BAD(ep_moe_expert_map_table_length(nullptr, f.map, EP_MOE_MAP_TABLE_EXPERT_MAP), ARG);
  BAD(ep_moe_expert_map_table_length(&v, nullptr, EP_MOE_MAP_TABLE_EXPERT_MAP), HANDLE);
  BAD(ep_moe_expert_map_table_length(&v, f.map, static_cast<ep_moe_map_table_t>(kBadEnum)), ARG);
  CHECK(v == 77);
}
ROW(ep_moe_expert_map_copy_table) {
  std::vector<int32_t> out(64, -77);
  BAD(ep_moe_expert_map_copy_table(nullptr, 64, f.map, EP_MOE_MAP_TABLE_EXPERT_MAP), ARG);
  BAD(ep_moe_expert_map_copy_table(out.data(), 64, dead_map(), EP_MOE_MAP_TABLE_EXPERT_MAP), HANDLE);
  BAD(ep_moe_expert_map_copy_table(out.data(), 64, f.map, static_cast<ep_moe_map_table_t>(kBadEnum)), ARG);
  BAD(ep_moe_expert_map_copy_table(out.data(), 1, f.map, EP_MOE_MAP_TABLE_EXPERT_MAP), EP_MOE_ERR_BUFFER_TOO_SMALL);
  for (int32_t v : out) CHECK(v == -77);
}
ROW(ep_moe_expert_map_describe) {
  char buf[4] = {'x', 'x', 'x', 'x'};
  size_t needed = 77;
  BAD(ep_moe_expert_map_describe(buf, sizeof buf, &needed, nullptr), HANDLE);
  BAD(ep_moe_expert_map_describe(buf, sizeof buf, &needed, dead_map()), HANDLE);
  BAD(ep_moe_expert_map_describe(nullptr, 16, &needed, f.map), ARG);
  CHECK(needed == 77);
  CHECK(buf[0] == 'x');
}
ROW(ep_moe_mask_and_remap) {
  std::vector<int32_t> ids = {0, 5}, out_ids(2, -77);
  std::vector<float> w = {0.5f, 0.5f}, out_w(2, -77.0f);
  std::vector<uint8_t> mask(2, 0xAB);
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), nullptr, ids.data(), w.data(), EP_MOE_DTYPE_F32,
                            1, 2, EP_MOE_REMAP_SPREAD),
      HANDLE);
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), f.map, nullptr, w.data(), EP_MOE_DTYPE_F32, 1, 2,
                            EP_MOE_REMAP_SPREAD),
      ARG);
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), f.map, ids.data(), w.data(),
                            static_cast<ep_moe_dtype_t>(kBadEnum), 1, 2, EP_MOE_REMAP_SPREAD),
      ARG);
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), f.map, ids.data(), w.data(), EP_MOE_DTYPE_F32,
                            -1, 2, EP_MOE_REMAP_SPREAD),
      ARG);
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), f.map, ids.data(), w.data(), EP_MOE_DTYPE_F32, 1,
                            0, EP_MOE_REMAP_SPREAD),
      ARG);
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), f.map, ids.data(), w.data(), EP_MOE_DTYPE_F32, 1,
                            2, static_cast<ep_moe_remap_mode_t>(kBadEnum)),
      ARG);
  ids[1] = 99;  // not an expert
  BAD(ep_moe_mask_and_remap(out_ids.data(), out_w.data(), mask.data(), f.map, ids.data(), w.data(), EP_MOE_DTYPE_F32, 1,
                            2, EP_MOE_REMAP_SPREAD),
      ARG);
  CHECK(out_ids == std::vector<int32_t>{-77, -77});
  CHECK(mask[0] == 0xAB);
}

// ---- communicators -----------------------------------------------------------

ROW(ep_moe_comm_config_init) {
  (void)f;
  BAD(ep_moe_comm_config_init(nullptr), ARG);
}
ROW(ep_moe_comm_create_local) {
  (void)f;
  ep_moe_comm_t* out[2] = {reinterpret_cast<ep_moe_comm_t*>(0x1), reinterpret_cast<ep_moe_comm_t*>(0x1)};
  BAD(ep_moe_comm_create_local(nullptr, 2, nullptr), ARG);
  BAD(ep_moe_comm_create_local(out, 0, nullptr), ARG);
  BAD(ep_moe_comm_create_local(out, -2, nullptr), ARG);
  ep_moe_comm_config_t cc;
  ep_moe_comm_config_init(&cc);
  const auto wrong = with_size(cc, sizeof cc + 8);
  BAD(ep_moe_comm_create_local(out, 2, &wrong), SIZE);
  cc.timeout_ms = -5;
  BAD(ep_moe_comm_create_local(out, 2, &cc), ARG);
  CHECK(out[0] == reinterpret_cast<ep_moe_comm_t*>(0x1));
}
ROW(ep_moe_comm_create_mpi) {
  (void)f;
  ep_moe_comm_t* out = reinterpret_cast<ep_moe_comm_t*>(0x1);
  const ep_moe_status_t s = ep_moe_comm_create_mpi(&out, nullptr, 8, nullptr);
  CHECK((s == ARG || s == EP_MOE_ERR_UNSUPPORTED));
  CHECK(std::strlen(ep_moe_last_error()) > 0);
  BAD(ep_moe_comm_create_mpi(nullptr, &out, sizeof out, nullptr),
      ep_moe_has_feature(EP_MOE_FEATURE_MPI) ? ARG : EP_MOE_ERR_UNSUPPORTED);
  CHECK(out == reinterpret_cast<ep_moe_comm_t*>(0x1));
}
ROW(ep_moe_comm_create_nccl) {
  (void)f;
  ep_moe_comm_t* out = reinterpret_cast<ep_moe_comm_t*>(0x1);
  const ep_moe_status_t s = ep_moe_comm_create_nccl(&out, nullptr, nullptr);
  CHECK((s == ARG || s == EP_MOE_ERR_UNSUPPORTED));
  CHECK(std::strlen(ep_moe_last_error()) > 0);
  CHECK(out == reinterpret_cast<ep_moe_comm_t*>(0x1));
}
ROW(ep_moe_nccl_get_unique_id) {
  (void)f;
  char id[8] = {0};
  const ep_moe_status_t s = ep_moe_nccl_get_unique_id(nullptr, 128);
  CHECK((s == ARG || s == EP_MOE_ERR_UNSUPPORTED));
  const ep_moe_status_t t = ep_moe_nccl_get_unique_id(id, sizeof id);  // too small for an id
  CHECK((t == EP_MOE_ERR_BUFFER_TOO_SMALL || t == ARG || t == EP_MOE_ERR_UNSUPPORTED));
  CHECK(std::strlen(ep_moe_last_error()) > 0);
}
ROW(ep_moe_comm_create_nccl_from_id) {
  (void)f;
  ep_moe_comm_t* out = reinterpret_cast<ep_moe_comm_t*>(0x1);
  char id[128] = {0};
  const ep_moe_status_t s = ep_moe_comm_create_nccl_from_id(&out, nullptr, 128, 0, 1, nullptr);
  CHECK((s == ARG || s == EP_MOE_ERR_UNSUPPORTED));
  const ep_moe_status_t t = ep_moe_comm_create_nccl_from_id(&out, id, sizeof id, 3, 2, nullptr);  // rank >= size
  CHECK((t == ARG || t == EP_MOE_ERR_UNSUPPORTED));
  CHECK(std::strlen(ep_moe_last_error()) > 0);
  CHECK(out == reinterpret_cast<ep_moe_comm_t*>(0x1));
}
ROW(ep_moe_comm_callbacks_init) {
  (void)f;
  BAD(ep_moe_comm_callbacks_init(nullptr), ARG);
}
ROW(ep_moe_comm_create_callbacks) {
  (void)f;
  ep_moe_comm_t* out = reinterpret_cast<ep_moe_comm_t*>(0x1);
  ep_moe_comm_callbacks_t cb;
  ep_moe_comm_callbacks_init(&cb);
  cb.size = 2;
  BAD(ep_moe_comm_create_callbacks(nullptr, &cb, nullptr), ARG);
  BAD(ep_moe_comm_create_callbacks(&out, nullptr, nullptr), ARG);
  BAD(ep_moe_comm_create_callbacks(&out, &cb, nullptr), ARG);  // required callbacks missing
  const auto wrong = with_size(cb, 1);
  BAD(ep_moe_comm_create_callbacks(&out, &wrong, nullptr), SIZE);
  cb.rank = 7;
  BAD(ep_moe_comm_create_callbacks(&out, &cb, nullptr), ARG);
  CHECK(out == reinterpret_cast<ep_moe_comm_t*>(0x1));
}
ROW(ep_moe_comm_get_async_error) {
  ep_moe_status_t st = static_cast<ep_moe_status_t>(77);
  int32_t peer = -77;
  BAD(ep_moe_comm_get_async_error(&st, &peer, nullptr), HANDLE);
  BAD(ep_moe_comm_get_async_error(&st, &peer, dead_comm()), HANDLE);
  BAD(ep_moe_comm_get_async_error(nullptr, &peer, f.comm), ARG);
  CHECK(st == static_cast<ep_moe_status_t>(77));
  CHECK(peer == -77);
}
ROW(ep_moe_comm_backend) {
  CHECK(ep_moe_comm_backend(nullptr) != nullptr);
  CHECK(ep_moe_comm_backend(dead_comm()) != nullptr);
  CHECK(std::string(ep_moe_comm_backend(f.comm)) == "local");
}
ROW(ep_moe_comm_split) {
  ep_moe_comm_t* out = reinterpret_cast<ep_moe_comm_t*>(0x1);
  BAD(ep_moe_comm_split(nullptr, f.comm, 0, 0), ARG);
  BAD(ep_moe_comm_split(&out, nullptr, 0, 0), HANDLE);
  BAD(ep_moe_comm_split(&out, dead_comm(), 0, 0), HANDLE);
  CHECK(out == reinterpret_cast<ep_moe_comm_t*>(0x1));
  // Every int32 colour and key is valid (negative: join no group, out NULL).
  CHECK(ep_moe_comm_split(&out, f.comm, -2, -5) == EP_MOE_OK);
  CHECK(out == nullptr);
}
ROW(ep_moe_comm_destroy) {
  ep_moe_comm_destroy(nullptr);
  ep_moe_comm_destroy(dead_comm());
  ep_moe_comm_destroy(reinterpret_cast<ep_moe_comm_t*>(f.map));  // another type: ignored
}
ROW(ep_moe_comm_abort) {
  (void)f;
  BAD(ep_moe_comm_abort(nullptr), HANDLE);
  BAD(ep_moe_comm_abort(dead_comm()), HANDLE);
}
ROW(ep_moe_comm_get_rank) {
  int32_t v = -77;
  BAD(ep_moe_comm_get_rank(nullptr, f.comm), ARG);
  BAD(ep_moe_comm_get_rank(&v, nullptr), HANDLE);
  BAD(ep_moe_comm_get_rank(&v, dead_comm()), HANDLE);
  CHECK(v == -77);
}
ROW(ep_moe_comm_get_size) {
  int32_t v = -77;
  BAD(ep_moe_comm_get_size(nullptr, f.comm), ARG);
  BAD(ep_moe_comm_get_size(&v, reinterpret_cast<ep_moe_comm_t*>(f.layer)), HANDLE);  // another type
  CHECK(v == -77);
}
ROW(ep_moe_comm_set_timeout) {
  BAD(ep_moe_comm_set_timeout(nullptr, 100), HANDLE);
  BAD(ep_moe_comm_set_timeout(f.comm, -3), ARG);
  CHECK(std::strlen(ep_moe_comm_last_error(f.comm)) > 0);
}
ROW(ep_moe_comm_last_error) {
  CHECK(ep_moe_comm_last_error(nullptr) != nullptr);
  CHECK(ep_moe_comm_last_error(dead_comm()) != nullptr);
  CHECK(ep_moe_comm_last_error(f.comm) != nullptr);
}
// The collectives on one rank: bad arguments fail, the communicator stays usable.
ROW(ep_moe_comm_all_reduce) {
  float x[4] = {1, 2, 3, 4}, y[4] = {-7, -7, -7, -7};
  BAD(ep_moe_comm_all_reduce(nullptr, x, 4, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_reduce(y, nullptr, 4, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_reduce(y, x, 4, static_cast<ep_moe_dtype_t>(kBadEnum), f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_reduce(y, x, 4, EP_MOE_DTYPE_F32, nullptr, nullptr), HANDLE);
  BAD(ep_moe_comm_all_reduce(y, x, 4, EP_MOE_DTYPE_F32, dead_comm(), nullptr), HANDLE);
  CHECK(y[0] == -7);
}
ROW(ep_moe_comm_reduce_scatter) {
  float x[4] = {1, 2, 3, 4}, y[4] = {-7, -7, -7, -7};
  BAD(ep_moe_comm_reduce_scatter(nullptr, x, 4, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_reduce_scatter(y, x, 4, static_cast<ep_moe_dtype_t>(-1), f.comm, nullptr), ARG);
  BAD(ep_moe_comm_reduce_scatter(y, x, 4, EP_MOE_DTYPE_F32, nullptr, nullptr), HANDLE);
  CHECK(y[0] == -7);
}
ROW(ep_moe_comm_all_gather) {
  float x[4] = {1, 2, 3, 4}, y[4] = {-7, -7, -7, -7};
  BAD(ep_moe_comm_all_gather(y, nullptr, 4, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_gather(y, x, 4, static_cast<ep_moe_dtype_t>(kBadEnum), f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_gather(y, x, 4, EP_MOE_DTYPE_F32, dead_comm(), nullptr), HANDLE);
  CHECK(y[0] == -7);
}
ROW(ep_moe_comm_all_gather_v) {
  float x[4] = {1, 2, 3, 4}, y[4] = {-7, -7, -7, -7};
  size_t counts[1] = {4};
  BAD(ep_moe_comm_all_gather_v(y, x, nullptr, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_gather_v(nullptr, x, counts, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_gather_v(y, x, counts, EP_MOE_DTYPE_F32, nullptr, nullptr), HANDLE);
  CHECK(y[0] == -7);
}
ROW(ep_moe_comm_all_to_all_v) {
  float x[4] = {1, 2, 3, 4}, y[4] = {-7, -7, -7, -7};
  size_t c[1] = {4};
  BAD(ep_moe_comm_all_to_all_v(y, nullptr, x, c, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_to_all_v(y, c, x, nullptr, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_to_all_v(y, c, nullptr, c, EP_MOE_DTYPE_F32, f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_to_all_v(y, c, x, c, static_cast<ep_moe_dtype_t>(kBadEnum), f.comm, nullptr), ARG);
  BAD(ep_moe_comm_all_to_all_v(y, c, x, c, EP_MOE_DTYPE_F32, nullptr, nullptr), HANDLE);
  CHECK(y[0] == -7);
}
ROW(ep_moe_comm_barrier) {
  (void)f;
  BAD(ep_moe_comm_barrier(nullptr), HANDLE);
  BAD(ep_moe_comm_barrier(dead_comm()), HANDLE);
}

// ---- layer -------------------------------------------------------------------

ROW(ep_moe_layer_config_init) {
  (void)f;
  BAD(ep_moe_layer_config_init(nullptr), ARG);
}
ROW(ep_moe_expert_map_config_from_layer) {
  (void)f;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = 77;
  ep_moe_layer_config_t lc = Fixture::layer_config();
  BAD(ep_moe_expert_map_config_from_layer(nullptr, &lc), ARG);
  BAD(ep_moe_expert_map_config_from_layer(&mc, nullptr), ARG);
  auto wrong_map = with_size(mc, 3);
  BAD(ep_moe_expert_map_config_from_layer(&wrong_map, &lc), SIZE);
  auto wrong_layer = with_size(lc, 3);
  BAD(ep_moe_expert_map_config_from_layer(&mc, &wrong_layer), SIZE);
  ep_moe_layer_config_t none;
  ep_moe_layer_config_init(&none);
  BAD(ep_moe_expert_map_config_from_layer(&mc, &none), ARG);  // num_experts 0: not derived yet
  lc.num_expert_group = -1;
  BAD(ep_moe_expert_map_config_from_layer(&mc, &lc), ARG);
  CHECK(mc.global_num_experts == 77);
  lc.num_expert_group = 2;
  REQUIRE(ep_moe_expert_map_config_from_layer(&mc, &lc) == EP_MOE_OK);
  CHECK(mc.global_num_experts == lc.num_experts);
  CHECK(mc.num_expert_group == 2);
}
ROW(ep_moe_layer_create) {
  ep_moe_layer_t* out = reinterpret_cast<ep_moe_layer_t*>(0x1);
  const ep_moe_layer_config_t lc = Fixture::layer_config();
  BAD(ep_moe_layer_create(nullptr, &lc, f.map1, nullptr, nullptr), ARG);
  BAD(ep_moe_layer_create(&out, nullptr, f.map1, nullptr, nullptr), ARG);
  BAD(ep_moe_layer_create(&out, &lc, nullptr, nullptr, nullptr), HANDLE);
  BAD(ep_moe_layer_create(&out, &lc, dead_map(), nullptr, nullptr), HANDLE);
  BAD(ep_moe_layer_create(&out, &lc, f.map1, dead_comm(), nullptr), HANDLE);
  const auto wrong = with_size(lc, 4);
  BAD(ep_moe_layer_create(&out, &wrong, f.map1, nullptr, nullptr), SIZE);
  auto c = lc;
  c.hidden_size = 0;
  BAD(ep_moe_layer_create(&out, &c, f.map1, nullptr, nullptr), ARG);
  c = lc;
  c.top_k = 9;
  BAD(ep_moe_layer_create(&out, &c, f.map1, nullptr, nullptr), ARG);
  c = lc;
  c.activation = kBadEnum;
  BAD(ep_moe_layer_create(&out, &c, f.map1, nullptr, nullptr), ARG);
  c = lc;
  c.weight_dtype = EP_MOE_DTYPE_I32;
  BAD(ep_moe_layer_create(&out, &c, f.map1, nullptr, nullptr), ARG);
  c = lc;
  c.dispatch_mode = kBadEnum;
  BAD(ep_moe_layer_create(&out, &c, f.map1, nullptr, nullptr), ARG);
  c = lc;
  c.max_tokens = -1;
  BAD(ep_moe_layer_create(&out, &c, f.map1, nullptr, nullptr), ARG);
  BAD(ep_moe_layer_create(&out, &lc, f.map, f.comm, nullptr), ARG);  // a map of 2 ranks, a group of 1
  CHECK(out == reinterpret_cast<ep_moe_layer_t*>(0x1));
}
ROW(ep_moe_layer_destroy) {
  ep_moe_layer_destroy(nullptr);
  ep_moe_layer_destroy(dead_layer(f));
  ep_moe_layer_destroy(reinterpret_cast<ep_moe_layer_t*>(f.ck));  // another type: ignored
}
ROW(ep_moe_layer_last_error) {
  CHECK(ep_moe_layer_last_error(nullptr) != nullptr);
  CHECK(ep_moe_layer_last_error(dead_layer(f)) != nullptr);
  CHECK(ep_moe_layer_last_error(f.layer) != nullptr);
}
ROW(ep_moe_layer_set_weight) {
  std::vector<float> w(16 * 8, 0.01f);
  int32_t stored = -77;
  BAD(ep_moe_layer_set_weight(&stored, nullptr, EP_MOE_WEIGHT_EXPERT_GATE, 0, w.data(), EP_MOE_DTYPE_F32, 8, 16),
      HANDLE);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, EP_MOE_WEIGHT_EXPERT_GATE, 0, nullptr, EP_MOE_DTYPE_F32, 8, 16), ARG);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, static_cast<ep_moe_weight_t>(kBadEnum), 0, w.data(), EP_MOE_DTYPE_F32,
                              8, 16),
      ARG);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, EP_MOE_WEIGHT_EXPERT_GATE, 8, w.data(), EP_MOE_DTYPE_F32, 8, 16), ARG);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, EP_MOE_WEIGHT_EXPERT_GATE, -1, w.data(), EP_MOE_DTYPE_F32, 8, 16), ARG);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, EP_MOE_WEIGHT_EXPERT_GATE, 0, w.data(), EP_MOE_DTYPE_I64, 8, 16), ARG);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, EP_MOE_WEIGHT_EXPERT_GATE, 0, w.data(), EP_MOE_DTYPE_F32, 16, 8), ARG);
  BAD(ep_moe_layer_set_weight(&stored, f.layer, EP_MOE_WEIGHT_SHARED_GATE, -1, w.data(), EP_MOE_DTYPE_F32, 8, 16), ARG);
  CHECK(stored == -77);
  CHECK(std::strlen(ep_moe_layer_last_error(f.layer)) > 0);
}
ROW(ep_moe_forward_args_init) {
  (void)f;
  BAD(ep_moe_forward_args_init(nullptr), ARG);
}
ROW(ep_moe_layer_forward) {
  std::vector<float> x(16, 0.5f), out(16, -7.0f);
  std::vector<int32_t> ids = {1, 5};
  std::vector<float> w = {0.5f, 0.5f};
  ep_moe_forward_args_t a;
  ep_moe_forward_args_init(&a);
  a.num_tokens = 1;
  a.hidden = x.data();
  a.topk_ids = ids.data();
  a.topk_weights = w.data();
  a.out = out.data();
  BAD(ep_moe_layer_forward(nullptr, &a), HANDLE);
  BAD(ep_moe_layer_forward(dead_layer(f), &a), HANDLE);
  BAD(ep_moe_layer_forward(f.layer, nullptr), ARG);
  const auto wrong = with_size(a, sizeof a * 2);
  BAD(ep_moe_layer_forward(f.layer, &wrong), SIZE);
  auto b = a;
  b.num_tokens = 5;  // > max_tokens
  BAD(ep_moe_layer_forward(f.layer, &b), ARG);
  b = a;
  b.num_tokens = -1;
  BAD(ep_moe_layer_forward(f.layer, &b), ARG);
  b = a;
  b.hidden = nullptr;
  BAD(ep_moe_layer_forward(f.layer, &b), ARG);
  b = a;
  b.out = nullptr;
  BAD(ep_moe_layer_forward(f.layer, &b), ARG);
  b = a;
  b.topk_ids = nullptr;
  BAD(ep_moe_layer_forward(f.layer, &b), ARG);
  std::vector<int32_t> bad_ids = {1, 8};
  b = a;
  b.topk_ids = bad_ids.data();
  BAD(ep_moe_layer_forward(f.layer, &b), ARG);
  for (float v : out) CHECK(v == -7.0f);
}
ROW(ep_moe_layer_get_attr) {
  int64_t v = -77;
  BAD(ep_moe_layer_get_attr(nullptr, f.layer, EP_MOE_LAYER_ATTR_READY), ARG);
  BAD(ep_moe_layer_get_attr(&v, nullptr, EP_MOE_LAYER_ATTR_READY), HANDLE);
  BAD(ep_moe_layer_get_attr(&v, dead_layer(f), EP_MOE_LAYER_ATTR_READY), HANDLE);
  BAD(ep_moe_layer_get_attr(&v, f.layer, static_cast<ep_moe_layer_attr_t>(kBadEnum)), ARG);
  BAD(ep_moe_layer_get_attr(&v, f.layer, static_cast<ep_moe_layer_attr_t>(-1)), ARG);
  CHECK(v == -77);
}
ROW(ep_moe_layer_expert_load) {
  std::vector<int64_t> out(8, -77);
  BAD(ep_moe_layer_expert_load(nullptr, 8, f.layer, 0, 0), ARG);
  BAD(ep_moe_layer_expert_load(out.data(), 7, f.layer, 1, 0), ARG);
  BAD(ep_moe_layer_expert_load(out.data(), 8, nullptr, 0, 0), HANDLE);
  BAD(ep_moe_layer_expert_load(out.data(), 8, dead_layer(f), 0, 0), HANDLE);
  for (int64_t v : out) CHECK(v == -77);
}
ROW(ep_moe_layer_replace) {
  BAD(ep_moe_layer_replace(nullptr, f.map1, nullptr, nullptr, 0), HANDLE);
  BAD(ep_moe_layer_replace(dead_layer(f), f.map1, nullptr, nullptr, 0), HANDLE);
  BAD(ep_moe_layer_replace(f.layer, nullptr, nullptr, nullptr, 0), HANDLE);
  BAD(ep_moe_layer_replace(f.layer, dead_map(), nullptr, nullptr, 0), HANDLE);
  BAD(ep_moe_layer_replace(f.layer, f.map, nullptr, nullptr, 0), ARG);  // 2 ranks on a group of 1
  BAD(ep_moe_layer_replace(f.layer, f.map1, dead_comm(), nullptr, 0), HANDLE);
  BAD(ep_moe_layer_replace(f.layer, f.map1, nullptr, reinterpret_cast<const ep_moe_checkpoint_t*>(f.map), 0), HANDLE);
}

// ---- load balancing ------------------------------------------------------------

ROW(ep_moe_rebalance_config_init) {
  (void)f;
  BAD(ep_moe_rebalance_config_init(nullptr), ARG);
}
ROW(ep_moe_rebalance) {
  (void)f;
  ep_moe_rebalance_config_t rc;
  ep_moe_rebalance_config_init(&rc);
  rc.num_experts = 4;
  rc.num_slots = 4;
  rc.num_ranks = 2;
  std::vector<double> load(4, 1.0);
  std::vector<int32_t> out(4, -77);
  double imb = -77;
  BAD(ep_moe_rebalance(nullptr, 4, &imb, load.data(), 4, &rc), ARG);
  BAD(ep_moe_rebalance(out.data(), 4, &imb, nullptr, 4, &rc), ARG);
  BAD(ep_moe_rebalance(out.data(), 4, &imb, load.data(), 4, nullptr), ARG);
  const auto wrong = with_size(rc, 0);
  BAD(ep_moe_rebalance(out.data(), 4, &imb, load.data(), 4, &wrong), SIZE);
  auto c = rc;
  c.num_ranks = 0;
  BAD(ep_moe_rebalance(out.data(), 4, &imb, load.data(), 4, &c), ARG);
  c = rc;
  c.num_slots = 5;  // not a multiple of the ranks
  BAD(ep_moe_rebalance(out.data(), 8, &imb, load.data(), 4, &c), ARG);
  load[2] = -1;
  BAD(ep_moe_rebalance(out.data(), 4, &imb, load.data(), 4, &rc), ARG);
  for (int32_t v : out) CHECK(v == -77);
  CHECK(imb == -77);
}

// ---- checkpoints ---------------------------------------------------------------

ROW(ep_moe_checkpoint_config_init) {
  (void)f;
  BAD(ep_moe_checkpoint_config_init(nullptr), ARG);
}
ROW(ep_moe_checkpoint_open) {
  (void)f;
  ep_moe_checkpoint_t* out = reinterpret_cast<ep_moe_checkpoint_t*>(0x1);
  BAD(ep_moe_checkpoint_open(nullptr, "/nonexistent", nullptr), ARG);
  BAD(ep_moe_checkpoint_open(&out, nullptr, nullptr), ARG);
  BAD(ep_moe_checkpoint_open(&out, "/nonexistent/model.safetensors", nullptr), EP_MOE_ERR_IO);
  ep_moe_checkpoint_config_t cc;
  ep_moe_checkpoint_config_init(&cc);
  const auto wrong = with_size(cc, 3);
  BAD(ep_moe_checkpoint_open(&out, "/nonexistent", &wrong), SIZE);
  cc.naming = kBadEnum;
  BAD(ep_moe_checkpoint_open(&out, "/nonexistent", &cc), ARG);
  CHECK(out == reinterpret_cast<ep_moe_checkpoint_t*>(0x1));
}
ROW(ep_moe_checkpoint_close) {
  ep_moe_checkpoint_close(nullptr);
  ep_moe_checkpoint_close(reinterpret_cast<ep_moe_checkpoint_t*>(f.layer));  // another type: ignored
  ep_moe_checkpoint_close(dead_ck());
}
ROW(ep_moe_checkpoint_last_error) {
  CHECK(ep_moe_checkpoint_last_error(nullptr) != nullptr);
  CHECK(ep_moe_checkpoint_last_error(dead_ck()) != nullptr);
  CHECK(ep_moe_checkpoint_last_error(f.ck) != nullptr);
}
ROW(ep_moe_checkpoint_architecture) {
  CHECK(std::string(ep_moe_checkpoint_architecture(nullptr)).empty());
  CHECK(std::string(ep_moe_checkpoint_architecture(dead_ck())).empty());
  CHECK(std::string(ep_moe_checkpoint_architecture(reinterpret_cast<const ep_moe_checkpoint_t*>(f.comm))).empty());
  CHECK(std::string(ep_moe_checkpoint_architecture(f.ck)).empty());  // the fixture's has no config.json
}
ROW(ep_moe_checkpoint_get_attr) {
  int64_t v = -77;
  BAD(ep_moe_checkpoint_get_attr(nullptr, f.ck, EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS), ARG);
  BAD(ep_moe_checkpoint_get_attr(&v, nullptr, EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS), HANDLE);
  BAD(ep_moe_checkpoint_get_attr(&v, dead_ck(), EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS), HANDLE);
  BAD(ep_moe_checkpoint_get_attr(&v, f.ck, static_cast<ep_moe_checkpoint_attr_t>(kBadEnum)), ARG);
  CHECK(v == -77);
}
ROW(ep_moe_checkpoint_moe_layers) {
  int32_t out[4] = {-77, -77, -77, -77};
  size_t count = 77;
  BAD(ep_moe_checkpoint_moe_layers(out, 4, nullptr, f.ck), ARG);
  BAD(ep_moe_checkpoint_moe_layers(out, 4, &count, nullptr), HANDLE);
  BAD(ep_moe_checkpoint_moe_layers(out, 4, &count, reinterpret_cast<const ep_moe_checkpoint_t*>(f.comm)), HANDLE);
  CHECK(out[0] == -77);
  CHECK(count == 77);
}
ROW(ep_moe_checkpoint_layer_config) {
  ep_moe_layer_config_t lc = Fixture::layer_config();
  lc.hidden_size = 77;
  BAD(ep_moe_checkpoint_layer_config(nullptr, f.ck, f.ck_layer), ARG);
  BAD(ep_moe_checkpoint_layer_config(&lc, nullptr, f.ck_layer), HANDLE);
  BAD(ep_moe_checkpoint_layer_config(&lc, f.ck, 999), EP_MOE_ERR_NOT_FOUND);
  BAD(ep_moe_checkpoint_layer_config(&lc, f.ck, -1), EP_MOE_ERR_NOT_FOUND);
  auto wrong = with_size(lc, 2);
  BAD(ep_moe_checkpoint_layer_config(&wrong, f.ck, f.ck_layer), SIZE);
  // The fixture's checkpoint has no config.json: its routing is unknown.
  BAD(ep_moe_checkpoint_layer_config(&lc, f.ck, f.ck_layer), EP_MOE_ERR_UNSUPPORTED);
  CHECK(lc.hidden_size == 77);
}
ROW(ep_moe_tensor_info_init) {
  (void)f;
  BAD(ep_moe_tensor_info_init(nullptr), ARG);
}
ROW(ep_moe_checkpoint_tensor_info) {
  ep_moe_tensor_info_t ti;
  ep_moe_tensor_info_init(&ti);
  ti.n_dims = 77;
  BAD(ep_moe_checkpoint_tensor_info(nullptr, f.ck, f.ck_layer, EP_MOE_WEIGHT_EXPERT_GATE, 0), ARG);
  BAD(ep_moe_checkpoint_tensor_info(&ti, nullptr, f.ck_layer, EP_MOE_WEIGHT_EXPERT_GATE, 0), HANDLE);
  BAD(ep_moe_checkpoint_tensor_info(&ti, f.ck, f.ck_layer, static_cast<ep_moe_weight_t>(kBadEnum), 0), ARG);
  BAD(ep_moe_checkpoint_tensor_info(&ti, f.ck, f.ck_layer, EP_MOE_WEIGHT_EXPERT_GATE, 99), ARG);
  BAD(ep_moe_checkpoint_tensor_info(&ti, f.ck, 999, EP_MOE_WEIGHT_EXPERT_GATE, 0), EP_MOE_ERR_NOT_FOUND);
  auto wrong = with_size(ti, 1);
  BAD(ep_moe_checkpoint_tensor_info(&wrong, f.ck, f.ck_layer, EP_MOE_WEIGHT_EXPERT_GATE, 0), SIZE);
  CHECK(ti.n_dims == 77);
}
ROW(ep_moe_layer_load) {
  BAD(ep_moe_layer_load(nullptr, f.ck, f.ck_layer), HANDLE);
  BAD(ep_moe_layer_load(f.layer, nullptr, f.ck_layer), HANDLE);
  BAD(ep_moe_layer_load(dead_layer(f), f.ck, f.ck_layer), HANDLE);
  BAD(ep_moe_layer_load(f.layer, f.ck, 999), EP_MOE_ERR_NOT_FOUND);
}

// The exported names, read from the public header.
std::set<std::string> exported() {
  std::ifstream in(EP_MOE_PUBLIC_HEADER);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::set<std::string> names;
  const std::regex re(R"(EP_MOE_API\s+[^;]*?\b(ep_moe_\w+)\s*\()");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
    names.insert((*it)[1]);
  return names;
}

}  // namespace

TEST_CASE("every exported function rejects bad arguments with its documented status and a message", "[capi][badargs]") {
  for (auto& row : table()) {
    INFO("function " << row.first);
    Fixture f;
    row.second(f);
    f.usable();
  }
}

TEST_CASE("the bad-argument table covers every export of ep_moe.h", "[capi][badargs]") {
  const auto names = exported();
  REQUIRE(names.size() > 50);
  for (const auto& n : names) {
    INFO("exported " << n << " has no row in tests/capi/test_bad_args.cpp");
    CHECK(table().count(n) == 1);
  }
  for (const auto& row : table()) {
    INFO("row " << row.first << " is not an export of ep_moe.h");
    CHECK(names.count(row.first) == 1);
  }
}

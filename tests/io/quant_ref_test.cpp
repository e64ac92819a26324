// Block formats against the `gguf` Python package (quant_writers.py):
// ep_moe's dequantization of random valid blocks of every format (each
// entry of common/quant.hpp's traits) is
// gguf.quants.dequantize's, bit for bit; its Q8_0, Q4_0 and MXFP4
// quantizers give gguf.quants.quantize's bytes; and GGUF files that
// gguf.GGUFWriter wrote with block-format experts load (only the local
// experts' bytes, exactly) and run at EP 1, 2 and 3 within the stated
// tolerance of the float64 output computed from gguf's dequantization with
// the activations quantized as the kernels state. Exit 77 (skipped) when
// the writers did not run.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/quant.hpp"
#include "ep_moe/ep_moe.h"
#include "ref_files.hpp"

namespace {

using ref_files::fail;
using ref_files::read_all;

void check_blocks(const std::string& dir) {
  for (int i = ep_moe::kQuantFirst; i <= ep_moe::kQuantLast; ++i) {
    const auto t = static_cast<ep_moe_dtype_t>(i);
    if (ep_moe::quant_traits(t)->gguf_type < 0) continue;  // not a GGUF format (FP8: fp8_writers.py)
    const std::string n = ep_moe::quant_traits(t)->gguf_name;
    const auto blocks = read_all<uint8_t>(dir + "/blocks_" + n + ".bin");
    const auto want = read_all<float>(dir + "/deq_" + n + ".f32");
    const int64_t per_row = 1024;
    if (blocks.empty() || want.size() != 16 * per_row) {
      fail(n + ": reference files missing");
      continue;
    }
    std::vector<float> got(want.size());
    for (int r = 0; r < 16; ++r)
      ep_moe::dequantize_row(t, blocks.data() + ep_moe::quant_row_bytes(t, per_row) * r, got.data() + r * per_row,
                             per_row);
    int bad = 0;
    for (size_t k = 0; k < want.size(); ++k)
      if (std::memcmp(&got[k], &want[k], 4) != 0 && !(std::isnan(got[k]) && std::isnan(want[k]))) ++bad;
    if (bad) fail(n + ": " + std::to_string(bad) + " elements differ from gguf.quants.dequantize");
    else std::printf("%s: dequantization = gguf.quants.dequantize on %zu elements\n", n.c_str(), want.size());
    const auto src = read_all<float>(dir + "/src_" + n + ".f32");
    if (src.empty()) continue;
    const auto gq = read_all<uint8_t>(dir + "/gguf_" + n + ".bin");
    std::vector<uint8_t> mine(gq.size());
    for (int r = 0; r < 16; ++r)
      ep_moe::quantize_row(t, src.data() + r * per_row, mine.data() + ep_moe::quant_row_bytes(t, per_row) * r, per_row);
    if (mine != gq) fail(n + ": quantize_row differs from gguf.quants.quantize");
    else std::printf("%s: quantize_row = gguf.quants.quantize, %zu bytes\n", n.c_str(), gq.size());
  }
}

// One model at `ep` in-process ranks: the derived config, the bytes each
// rank read, the output against the float64 reference.
void check_model(const std::string& dir, const std::string& name, int E, int H, int I, int K, int L, int T, int gu,
                 int down, int ep) {
  const std::string where = name + " at EP " + std::to_string(ep);
  const std::string path = dir + "/model_" + name + ".gguf";
  ep_moe_checkpoint_t* ck = nullptr;
  if (ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) != EP_MOE_OK) return fail(where + ": " + ep_moe_last_error());
  const auto x = read_all<float>(dir + "/model_" + name + ".x");
  const auto want = read_all<double>(dir + "/model_" + name + ".out");
  const auto slack = read_all<double>(dir + "/model_" + name + ".slack");
  if (slack.size() != want.size()) {
    fail(where + ": the reference's .slack and .out differ in length");
    ep_moe_checkpoint_close(ck);
    return;
  }
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  if (ep_moe_checkpoint_layer_config(&lc, ck, L) != EP_MOE_OK) {
    fail(where + ": layer_config: " + ep_moe_checkpoint_last_error(ck));
    ep_moe_checkpoint_close(ck);
    return;
  }
  if (lc.hidden_size != H || lc.intermediate_size != I || lc.num_experts != E || lc.top_k != K || lc.weight_dtype != gu)
    fail(where + ": derived config (weight_dtype " + std::to_string(lc.weight_dtype) + ")");
  ep_moe_tensor_info_t info;
  ep_moe_tensor_info_init(&info);
  int64_t gu_bytes = 0, down_bytes = 0, elems = 0, bb = 0;
  ep_moe_dtype_block(&elems, &bb, static_cast<ep_moe_dtype_t>(gu));
  gu_bytes = static_cast<int64_t>(I) * (H / elems) * bb;
  ep_moe_dtype_block(&elems, &bb, static_cast<ep_moe_dtype_t>(down));
  down_bytes = static_cast<int64_t>(H) * (I / elems) * bb;
  if (ep_moe_checkpoint_tensor_info(&info, ck, L, EP_MOE_WEIGHT_EXPERT_DOWN, 1) != EP_MOE_OK ||
      info.bytes != down_bytes)
    fail(where + ": tensor_info of an expert's down");
  lc.max_tokens = T;
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ep));
  ep_moe_comm_create_local(comms.data(), ep, nullptr);
  std::vector<std::vector<float>> outs(static_cast<size_t>(ep), std::vector<float>(static_cast<size_t>(T) * H));
  std::vector<std::string> errs(static_cast<size_t>(ep));
  std::vector<int64_t> bytes(static_cast<size_t>(ep), -1), local(static_cast<size_t>(ep), 0);
  std::vector<std::thread> th;
  for (int r = 0; r < ep; ++r)
    th.emplace_back([&, r] {
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      ep_moe_expert_map_config_from_layer(&mc, &lc);
      mc.ep_size = ep;
      mc.ep_rank = r;
      ep_moe_expert_map_t* map = nullptr;
      ep_moe_layer_t* layer = nullptr;
      std::string& err = errs[static_cast<size_t>(r)];
      if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) err = ep_moe_last_error();
      else if (ep_moe_layer_create(&layer, &lc, map, comms[static_cast<size_t>(r)], nullptr) != EP_MOE_OK)
        err = ep_moe_last_error();
      else if (ep_moe_layer_load(layer, ck, L) != EP_MOE_OK) err = ep_moe_layer_last_error(layer);
      if (err.empty()) {
        ep_moe_layer_get_attr(&bytes[static_cast<size_t>(r)], layer, EP_MOE_LAYER_ATTR_BYTES_LOADED);
        ep_moe_layer_get_attr(&local[static_cast<size_t>(r)], layer, EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS);
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = T;
        a.hidden = x.data();
        a.out = outs[static_cast<size_t>(r)].data();  // the file's router routes
        if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) err = ep_moe_layer_last_error(layer);
      } else {
        ep_moe_comm_abort(comms[static_cast<size_t>(r)]);
      }
      ep_moe_layer_destroy(layer);
      ep_moe_expert_map_destroy(map);
    });
  for (auto& t : th) t.join();
  for (auto* c : comms) ep_moe_comm_destroy(c);
  ep_moe_checkpoint_close(ck);
  for (int r = 0; r < ep; ++r) {
    const auto R = static_cast<size_t>(r);
    if (!errs[R].empty()) {
      fail(where + " rank " + std::to_string(r) + ": " + errs[R]);
      continue;
    }
    // Its experts' blocks and the router (F32), nothing more.
    const int64_t expect = local[R] * (2 * gu_bytes + down_bytes) + static_cast<int64_t>(E) * H * 4;
    if (bytes[R] != expect)
      fail(where + " rank " + std::to_string(r) + ": read " + std::to_string(bytes[R]) + " bytes, expected " +
           std::to_string(expect));
    double scale = 1e-12, err = 0;
    for (size_t k = 0; k < want.size(); ++k) {
      scale = std::max(scale, std::fabs(want[k]));
      const double e = std::fabs(double(outs[R][k]) - want[k]) - slack[k];
      err = std::isnan(e) || std::isnan(err) ? NAN : std::max(err, e);  // a NaN anywhere fails
    }
    err /= scale;
    // harness::tolerance for block formats: f32 accumulation, beyond the
    // slack of h elements on a rounding boundary (one step each).
    if (!(err <= 1e-5)) fail(where + " rank " + std::to_string(r) + ": max error " + std::to_string(err));
    else if (r == 0)
      std::printf("%s: %lld bytes read by rank 0, max error %.3g against gguf's values\n", where.c_str(),
                  static_cast<long long>(bytes[R]), err);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: quant_ref_test DIR\n");
    return 1;
  }
  const std::string dir = argv[1];
  std::ifstream models(dir + "/models.txt");
  if (!models) {
    std::printf("skipped: the block-format reference writers did not run\n");
    return 77;
  }
  check_blocks(dir);
  std::string line;
  while (std::getline(models, line)) {
    std::istringstream s(line);
    std::string name;
    int E, H, I, K, L, T, gu, down;
    if (!(s >> name >> E >> H >> I >> K >> L >> T >> gu >> down)) continue;
    for (int ep : {1, 2, 3}) check_model(dir, name, E, H, I, K, L, T, gu, down, ep);
  }
  if (ref_files::failures()) return 1;
  std::printf("PASS\n");
  return 0;
}

// Block-scaled FP8 against ml_dtypes (fp8_writers.py), through the public
// API only: ep_moe_fp8_pack + ep_moe_dequantize give ml_dtypes' E4M3 values
// times the scales bit for bit (every non-NaN code, a last partial block of
// rows); checkpoints of F8_E4M3 experts with weight_scale_inv derive
// weight_dtype FP8_E4M3, load only the local experts' bytes and run at EP
// 1, 2 and 3 within f32 rounding of the float64 output (the activations
// quantized as the kernels state); hostile files (NaN codes, NaN and
// infinite scales, a scale of the wrong shape, a weight without its
// scales, a block size ep_moe cannot keep) are refused with the status and
// a word of the message the writer names. Exit 77 (skipped) when the
// writers did not run.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "ref_files.hpp"

namespace {

using ref_files::fail;
using ref_files::read_all;

void check_blocks(const std::string& dir) {
  const int64_t rows = 200, cols = 256;
  const auto codes = read_all<uint8_t>(dir + "/codes.u8");
  const auto scales = read_all<float>(dir + "/scales.f32");
  const auto want = read_all<float>(dir + "/deq.f32");
  if (codes.size() != static_cast<size_t>(rows * cols) || want.size() != codes.size())
    return fail("codes: reference files missing");
  std::vector<uint8_t> blocks(static_cast<size_t>(rows * cols / 128 * 132));
  if (ep_moe_fp8_pack(blocks.data(), codes.data(), scales.data(), rows, cols) != EP_MOE_OK)
    return fail(std::string("fp8_pack: ") + ep_moe_last_error());
  std::vector<float> got(want.size());
  if (ep_moe_dequantize(got.data(), blocks.data(), EP_MOE_DTYPE_FP8_E4M3, rows, cols) != EP_MOE_OK)
    return fail(std::string("dequantize: ") + ep_moe_last_error());
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += std::memcmp(&got[i], &want[i], 4) != 0;
  if (bad) fail("FP8: " + std::to_string(bad) + " elements differ from ml_dtypes' value x scale");
  else std::printf("FP8: pack + dequantize = ml_dtypes.float8_e4m3fn x scale on %zu elements\n", want.size());
}

struct Result {
  ep_moe_status_t status = EP_MOE_OK;
  std::string message;
};

// The model at `ep` in-process ranks: the first failing step's status and
// message, else OK with the outputs checked against the reference.
Result run_model(const std::string& dir, const std::string& name, int E, int H, int I, int K, int L, int T, int ep,
                 bool check) {
  const std::string where = name + " at EP " + std::to_string(ep);
  ep_moe_checkpoint_t* ck = nullptr;
  const std::string path = dir + "/" + name;
  if (ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) != EP_MOE_OK)
    return {ep_moe_checkpoint_open(&ck, path.c_str(), nullptr), ep_moe_last_error()};
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  const ep_moe_status_t st = ep_moe_checkpoint_layer_config(&lc, ck, L);
  if (st != EP_MOE_OK) {
    Result r{st, ep_moe_checkpoint_last_error(ck)};
    ep_moe_checkpoint_close(ck);
    return r;
  }
  if (lc.weight_dtype != EP_MOE_DTYPE_FP8_E4M3 || lc.hidden_size != H || lc.intermediate_size != I ||
      lc.num_experts != E || lc.top_k != K)
    fail(where + ": derived config (weight_dtype " + std::to_string(lc.weight_dtype) + ")");
  lc.max_tokens = T;
  const auto x = read_all<float>(dir + "/" + name + ".x");
  const auto want = read_all<double>(dir + "/" + name + ".out");
  const auto slack = read_all<double>(dir + "/" + name + ".slack");
  std::vector<ep_moe_comm_t*> comms(static_cast<size_t>(ep));
  ep_moe_comm_create_local(comms.data(), ep, nullptr);
  std::vector<std::vector<float>> outs(static_cast<size_t>(ep), std::vector<float>(static_cast<size_t>(T) * H));
  std::vector<Result> res(static_cast<size_t>(ep));
  std::vector<int64_t> bytes(static_cast<size_t>(ep), -1), local(static_cast<size_t>(ep), 0);
  std::vector<std::thread> th;
  for (int r = 0; r < ep; ++r)
    th.emplace_back([&, r] {
      const auto R = static_cast<size_t>(r);
      ep_moe_expert_map_config_t mc;
      ep_moe_expert_map_config_init(&mc);
      ep_moe_expert_map_config_from_layer(&mc, &lc);
      mc.ep_size = ep;
      mc.ep_rank = r;
      ep_moe_expert_map_t* map = nullptr;
      ep_moe_layer_t* layer = nullptr;
      ep_moe_status_t s = ep_moe_expert_map_create(&map, &mc);
      if (s != EP_MOE_OK) res[R] = {s, ep_moe_last_error()};
      else if ((s = ep_moe_layer_create(&layer, &lc, map, comms[R], nullptr)) != EP_MOE_OK)
        res[R] = {s, ep_moe_last_error()};
      else if ((s = ep_moe_layer_load(layer, ck, L)) != EP_MOE_OK) res[R] = {s, ep_moe_layer_last_error(layer)};
      if (res[R].status == EP_MOE_OK && check) {
        ep_moe_layer_get_attr(&bytes[R], layer, EP_MOE_LAYER_ATTR_BYTES_LOADED);
        ep_moe_layer_get_attr(&local[R], layer, EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS);
        ep_moe_forward_args_t a;
        ep_moe_forward_args_init(&a);
        a.num_tokens = T;
        a.hidden = x.data();
        a.out = outs[R].data();
        if ((s = ep_moe_layer_forward(layer, &a)) != EP_MOE_OK) res[R] = {s, ep_moe_layer_last_error(layer)};
      } else if (res[R].status != EP_MOE_OK) {
        ep_moe_comm_abort(comms[R]);
      }
      ep_moe_layer_destroy(layer);
      ep_moe_expert_map_destroy(map);
    });
  for (auto& t : th) t.join();
  for (auto* c : comms) ep_moe_comm_destroy(c);
  ep_moe_checkpoint_close(ck);
  for (const Result& r : res)
    if (r.status != EP_MOE_OK) return r;
  if (!check) return {};
  for (int r = 0; r < ep; ++r) {
    const auto R = static_cast<size_t>(r);
    // Its experts' codes and scales (4 bytes per 128 x 128: 3 weights of
    // H x I each) and the router (F32), nothing more.
    const int64_t expert = 3 * (int64_t{H} * I + int64_t{H} * I / (128 * 128) * 4);
    const int64_t expect = local[R] * expert + int64_t{E} * H * 4;
    if (name == "fp8" && bytes[R] != expect)
      fail(where + " rank " + std::to_string(r) + ": read " + std::to_string(bytes[R]) + " bytes, expected " +
           std::to_string(expect));
    double scale = 1e-12, err = 0;
    for (size_t k = 0; k < want.size(); ++k) {
      scale = std::max(scale, std::fabs(want[k]));
      const double e = std::fabs(double(outs[R][k]) - want[k]) - slack[k];
      err = std::isnan(e) || std::isnan(err) ? NAN : std::max(err, e);
    }
    err /= scale;
    if (!(err <= 1e-5)) fail(where + " rank " + std::to_string(r) + ": max error " + std::to_string(err));
    else if (r == 0)
      std::printf("%s: %lld bytes read by rank 0, max error %.3g against ml_dtypes' values\n", where.c_str(),
                  static_cast<long long>(bytes[R]), err);
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: fp8_ref_test DIR\n");
    return 1;
  }
  const std::string dir = argv[1];
  std::ifstream models(dir + "/models.txt");
  if (!models) {
    std::printf("skipped: the FP8 reference writers did not run\n");
    return 77;
  }
  check_blocks(dir);
  std::string line;
  while (std::getline(models, line)) {
    std::istringstream s(line);
    std::string name, expect, word;
    int E, H, I, K, L, T;
    if (!(s >> name >> E >> H >> I >> K >> L >> T >> expect)) continue;
    s >> word;
    if (expect == "ok" || expect == "ok12") {  // ok12: EP 1 and 2 only (a shared expert's shards on whole blocks)
      for (int ep : {1, 2, 3}) {
        if (expect == "ok12" && ep == 3) continue;
        const Result r = run_model(dir, name, E, H, I, K, L, T, ep, true);
        if (r.status != EP_MOE_OK) fail(name + " at EP " + std::to_string(ep) + ": " + r.message);
      }
      continue;
    }
    const ep_moe_status_t want = expect == "FORMAT" ? EP_MOE_ERR_FORMAT : EP_MOE_ERR_UNSUPPORTED;
    const Result r = run_model(dir, name, E, H, I, K, L, T, 2, false);
    if (r.status != want || r.message.find(word) == std::string::npos)
      fail(name + ": expected " + expect + " '" + word + "', got " + ep_moe_status_string(r.status) + ": " + r.message);
    else std::printf("%s: refused, %s: %s\n", name.c_str(), ep_moe_status_string(r.status), r.message.c_str());
  }
  if (ref_files::failures()) return 1;
  std::printf("PASS\n");
  return 0;
}

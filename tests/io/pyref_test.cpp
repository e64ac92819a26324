// Reads checkpoints written by the reference Python writers (see
// reference_writers.py) and checks that loading them gives the same layer as
// the stored values given through ep_moe_layer_set_weight: the same forward
// output, bit for bit. Exit 77 (skipped) when the writers did not run.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace {

int fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  return 1;
}

// `down_blocks`: the experts' down in Q8_0 blocks, as the file holds them
// (a layer keeps blocks as they are, so the given layer gets them too).
int check(const std::string& path, const std::string& raw_path, int E, int H, int I, int K, int L,
          const std::string& down_blocks = "") {
  ep_moe_checkpoint_t* ck = nullptr;
  if (ep_moe_checkpoint_open(&ck, path.c_str(), nullptr) != EP_MOE_OK) return fail(ep_moe_last_error());
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = E;
  ep_moe_expert_map_t* map = nullptr;
  ep_moe_expert_map_create(&map, &mc);
  ep_moe_layer_config_t lc;
  ep_moe_layer_config_init(&lc);
  if (ep_moe_checkpoint_layer_config(&lc, ck, L) != EP_MOE_OK) return fail(ep_moe_checkpoint_last_error(ck));
  if (lc.hidden_size != H || lc.intermediate_size != I || lc.num_experts != E || lc.top_k != K)
    return fail(path + ": layer config differs from what the writer wrote");
  lc.max_tokens = 8;
  lc.weight_dtype = EP_MOE_DTYPE_F32;  // hold exactly what was stored
  ep_moe_layer_t *loaded = nullptr, *given = nullptr;
  ep_moe_layer_create(&loaded, &lc, map, nullptr, nullptr);
  ep_moe_layer_create(&given, &lc, map, nullptr, nullptr);
  if (ep_moe_layer_load(loaded, ck, L) != EP_MOE_OK) return fail(ep_moe_layer_last_error(loaded));

  std::ifstream in(raw_path, std::ios::binary);
  std::vector<float> v(static_cast<size_t>(E * H + E * 3 * I * H));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  if (!in) return fail("short " + raw_path);
  std::vector<uint8_t> q8;
  if (!down_blocks.empty()) {
    std::ifstream qin(down_blocks, std::ios::binary);
    q8.resize(static_cast<size_t>(E) * H * (I / 32) * 34);
    qin.read(reinterpret_cast<char*>(q8.data()), static_cast<std::streamsize>(q8.size()));
    if (!qin) return fail("short " + down_blocks);
  }
  const float* p = v.data();
  ep_moe_layer_set_weight(nullptr, given, EP_MOE_WEIGHT_ROUTER, -1, p, EP_MOE_DTYPE_F32, E, H);
  p += E * H;
  for (int e = 0; e < E; ++e) {
    ep_moe_layer_set_weight(nullptr, given, EP_MOE_WEIGHT_EXPERT_GATE, e, p, EP_MOE_DTYPE_F32, I, H);
    p += I * H;
    ep_moe_layer_set_weight(nullptr, given, EP_MOE_WEIGHT_EXPERT_UP, e, p, EP_MOE_DTYPE_F32, I, H);
    p += I * H;
    if (q8.empty()) ep_moe_layer_set_weight(nullptr, given, EP_MOE_WEIGHT_EXPERT_DOWN, e, p, EP_MOE_DTYPE_F32, H, I);
    else if (ep_moe_layer_set_weight(nullptr, given, EP_MOE_WEIGHT_EXPERT_DOWN, e,
                                     q8.data() + static_cast<size_t>(e) * H * (I / 32) * 34, EP_MOE_DTYPE_Q8_0, H,
                                     I) != EP_MOE_OK)
      return fail(ep_moe_layer_last_error(given));
    p += H * I;
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int T = 8;
  std::vector<float> x(static_cast<size_t>(T * H)), a(x.size()), b(x.size());
  for (auto& z : x) z = n(rng);
  ep_moe_forward_args_t args;
  ep_moe_forward_args_init(&args);
  args.num_tokens = T;
  args.hidden = x.data();
  args.out = a.data();
  if (ep_moe_layer_forward(loaded, &args) != EP_MOE_OK) return fail(ep_moe_layer_last_error(loaded));
  args.out = b.data();
  if (ep_moe_layer_forward(given, &args) != EP_MOE_OK) return fail(ep_moe_layer_last_error(given));
  if (std::memcmp(a.data(), b.data(), a.size() * 4) != 0) return fail(path + ": loaded and given layers differ");
  double mx = 0;
  for (float z : a) mx = std::max(mx, static_cast<double>(std::fabs(z)));
  if (!(mx > 0)) return fail(path + ": output is all zeros");
  std::printf("%s: loaded layer matches the stored values (max |out| %.3f)\n", path.c_str(), mx);
  ep_moe_layer_destroy(loaded);
  ep_moe_layer_destroy(given);
  ep_moe_expert_map_destroy(map);
  ep_moe_checkpoint_close(ck);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return fail("usage: pyref_test DIR");
  const std::string dir = argv[1];
  std::ifstream ready(dir + "/ready");
  int E, H, I, K, L;
  if (!(ready >> E >> H >> I >> K >> L)) {
    std::printf("skipped: the reference Python writers did not run (no %s/ready)\n", dir.c_str());
    return 77;
  }
  int rc = check(dir + "/hf", dir + "/hf.raw", E, H, I, K, L);
  rc |= check(dir + "/model.gguf", dir + "/gguf.raw", E, H, I, K, L, dir + "/gguf_down.q8_0");
  return rc;
}

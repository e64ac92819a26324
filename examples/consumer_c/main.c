/* A C99 program using an installed ep_moe, built with nothing but
 *   cc -std=c99 main.c $(pkg-config --cflags --libs ep_moe)
 * It asks the expert map where experts live, then runs one MoE layer on a
 * single rank (no communicator) and checks the output against a direct
 * computation. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <ep_moe/ep_moe.h>

#define H 8
#define I 4
#define E 4
#define T 3

static int fail(const char* what, const char* msg) {
  fprintf(stderr, "%s failed: %s\n", what, msg);
  return 1;
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

int main(void) {
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_t* map = NULL;
  ep_moe_layer_config_t lc;
  ep_moe_layer_t* layer = NULL;
  ep_moe_forward_args_t args;
  char text[128];
  int32_t n_local = -1, ids[T * 1];
  float gate[E][I * H], up[E][I * H], down[E][H * I], x[T * H], wts[T], out[T * H];
  int e, t, i, j;
  double worst = 0;

  if (ep_moe_version() != EP_MOE_VERSION_NUMBER) return fail("version check", "header and library differ");
  /* Where do experts live? Rank 1 of 4 with 10 experts holds 3..5. */
  ep_moe_expert_map_config_init(&mc);
  mc.ep_size = 4;
  mc.ep_rank = 1;
  mc.global_num_experts = 10;
  if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) return fail("ep_moe_expert_map_create", ep_moe_last_error());
  ep_moe_expert_map_get_attr(&n_local, map, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED);
  ep_moe_expert_map_describe(text, sizeof text, NULL, map);
  ep_moe_expert_map_destroy(map);
  printf("ep_moe %s: rank 1 of 4 holds %d experts: %s\n", ep_moe_version_string(), (int)n_local, text);
  if (n_local != 3 || strcmp(text, "0->3, 1->4, 2->5") != 0) return fail("map check", text);

  /* One layer on one rank: 4 experts, top-1 chosen by the caller. */
  ep_moe_expert_map_config_init(&mc);
  mc.global_num_experts = E;
  if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK) return fail("map", ep_moe_last_error());
  ep_moe_layer_config_init(&lc);
  lc.hidden_size = H;
  lc.intermediate_size = I;
  lc.num_experts = E;
  lc.top_k = 1;
  lc.max_tokens = T;
  if (ep_moe_layer_create(&layer, &lc, map, NULL, NULL) != EP_MOE_OK) return fail("layer", ep_moe_last_error());
  ep_moe_expert_map_destroy(map);
  for (e = 0; e < E; ++e) {
    for (i = 0; i < I * H; ++i) {
      gate[e][i] = 0.05f * (float)((e * 7 + i * 3) % 11 - 5);
      up[e][i] = 0.04f * (float)((e * 5 + i * 7) % 13 - 6);
      down[e][i] = 0.03f * (float)((e * 3 + i * 5) % 9 - 4);
    }
    ep_moe_layer_set_weight(NULL, layer, EP_MOE_WEIGHT_EXPERT_GATE, e, gate[e], EP_MOE_DTYPE_F32, I, H);
    ep_moe_layer_set_weight(NULL, layer, EP_MOE_WEIGHT_EXPERT_UP, e, up[e], EP_MOE_DTYPE_F32, I, H);
    ep_moe_layer_set_weight(NULL, layer, EP_MOE_WEIGHT_EXPERT_DOWN, e, down[e], EP_MOE_DTYPE_F32, H, I);
  }
  for (t = 0; t < T; ++t) {
    ids[t] = (t * 3) % E;
    wts[t] = 0.5f + 0.25f * (float)t;
    for (i = 0; i < H; ++i) x[t * H + i] = 0.1f * (float)(i - t);
  }
  ep_moe_forward_args_init(&args);
  args.num_tokens = T;
  args.hidden = x;
  args.topk_ids = ids;
  args.topk_weights = wts;
  args.out = out;
  if (ep_moe_layer_forward(layer, &args) != EP_MOE_OK) return fail("forward", ep_moe_layer_last_error(layer));
  ep_moe_layer_destroy(layer);
  for (t = 0; t < T; ++t) {
    float h[I];
    e = ids[t];
    for (j = 0; j < I; ++j) {
      float g = 0, u = 0;
      for (i = 0; i < H; ++i) {
        g += gate[e][j * H + i] * x[t * H + i];
        u += up[e][j * H + i] * x[t * H + i];
      }
      h[j] = silu(g) * u;
    }
    for (i = 0; i < H; ++i) {
      float y = 0;
      for (j = 0; j < I; ++j) y += down[e][i * I + j] * h[j];
      y *= wts[t];
      if (fabs(y - out[t * H + i]) > worst) worst = fabs(y - out[t * H + i]);
    }
  }
  printf("single-rank layer: max |difference| to the direct computation %.2g\n", worst);
  printf("backends: cuda=%d nccl=%d mpi=%d\n", ep_moe_has_feature(EP_MOE_FEATURE_CUDA),
         ep_moe_has_feature(EP_MOE_FEATURE_NCCL), ep_moe_has_feature(EP_MOE_FEATURE_MPI));
  return worst < 1e-5 ? 0 : 1;
}

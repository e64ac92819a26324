/* load_checkpoint.c: one MoE layer of a real checkpoint through the C API,
 * run on EP ranks that are threads of this process.
 *
 *   load_checkpoint PATH [--layer L] [--ep N] [--tokens T]
 *
 * PATH is a safetensors file, a sharded safetensors index or directory, or a
 * GGUF file (the first of a split one). The steps: open the checkpoint, list
 * its MoE layers, derive the layer configuration from the file, build each
 * rank's expert map from it, create the layers, load each rank's experts,
 * and run one forward on the same tokens everywhere (the checkpoint's router
 * computes the logits when it has one). Every rank then holds the full
 * output; the program checks that they agree and prints a checksum.
 * Build: cc -std=c11 load_checkpoint.c $(pkg-config --cflags --libs ep_moe) -lpthread */
#include <ep_moe/ep_moe.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  int rank, ep, layer_index, tokens;
  ep_moe_comm_t* comm;
  const ep_moe_checkpoint_t* ck;
  ep_moe_layer_config_t config;
  const float* hidden; /* [tokens, H] */
  const float* logits; /* [tokens, E], used when the layer has no router */
  float* out;          /* [tokens, H] */
  char error[512];
} Rank;

static void* run_rank(void* arg) {
  Rank* r = (Rank*)arg;
  ep_moe_expert_map_config_t mc;
  ep_moe_expert_map_t* map = NULL;
  ep_moe_layer_t* layer = NULL;
  int64_t has_router = 0;
  ep_moe_forward_args_t a;

  ep_moe_expert_map_config_init(&mc);
  ep_moe_expert_map_config_from_layer(&mc, &r->config); /* experts and groups from the layer */
  mc.ep_size = r->ep;
  mc.ep_rank = r->rank;
  if (ep_moe_expert_map_create(&map, &mc) != EP_MOE_OK ||
      ep_moe_layer_create(&layer, &r->config, map, r->comm, NULL) != EP_MOE_OK) {
    snprintf(r->error, sizeof r->error, "create: %s", ep_moe_last_error());
    goto fail;
  }
  if (ep_moe_layer_load(layer, r->ck, r->layer_index) != EP_MOE_OK) { /* only this rank's experts are read */
    snprintf(r->error, sizeof r->error, "load: %s", ep_moe_layer_last_error(layer));
    goto fail;
  }
  ep_moe_layer_get_attr(&has_router, layer, EP_MOE_LAYER_ATTR_HAS_ROUTER);
  ep_moe_forward_args_init(&a);
  a.num_tokens = r->tokens;
  a.hidden = r->hidden;
  a.router_logits = has_router ? NULL : r->logits;
  a.out = r->out;
  if (ep_moe_layer_forward(layer, &a) != EP_MOE_OK) {
    snprintf(r->error, sizeof r->error, "forward: %s", ep_moe_layer_last_error(layer));
    goto fail;
  }
  if (r->rank == 0) printf("routing: %s\n", has_router ? "the checkpoint's router" : "random logits");
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  return NULL;
fail:
  ep_moe_comm_abort(r->comm); /* the other ranks must not wait for this one */
  ep_moe_layer_destroy(layer);
  ep_moe_expert_map_destroy(map);
  return NULL;
}

/* Reproducible values in [-1, 1). */
static void fill(float* v, size_t n, unsigned seed) {
  size_t i;
  for (i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
  }
}

int main(int argc, char** argv) {
  const char* path = NULL;
  int layer_index = -1, ep = 2, tokens = 8, i, rc = 0;
  ep_moe_checkpoint_t* ck = NULL;
  ep_moe_layer_config_t config;
  int32_t layers[4096];
  size_t n_layers = 0;
  ep_moe_comm_t** comms;
  Rank* ranks;
  pthread_t* threads;
  float *hidden, *logits;
  double checksum = 0;

  for (i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--layer") == 0 && i + 1 < argc) layer_index = atoi(argv[++i]);
    else if (strcmp(argv[i], "--ep") == 0 && i + 1 < argc) ep = atoi(argv[++i]);
    else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) tokens = atoi(argv[++i]);
    else if (!path && argv[i][0] != '-') path = argv[i];
    else {
      fprintf(stderr, "usage: load_checkpoint PATH [--layer L] [--ep N] [--tokens T]\n");
      return 2;
    }
  }
  if (!path || ep < 1 || tokens < 1) {
    fprintf(stderr, "usage: load_checkpoint PATH [--layer L] [--ep N] [--tokens T]\n");
    return 2;
  }

  /* 1. Open: every header is validated here. */
  if (ep_moe_checkpoint_open(&ck, path, NULL) != EP_MOE_OK) {
    fprintf(stderr, "open: %s\n", ep_moe_last_error());
    return 1;
  }
  /* 2. Its MoE layers. */
  ep_moe_checkpoint_moe_layers(layers, sizeof layers / sizeof layers[0], &n_layers, ck);
  if (n_layers == 0) {
    fprintf(stderr, "%s has no MoE layer\n", path);
    ep_moe_checkpoint_close(ck);
    return 1;
  }
  if (layer_index < 0) layer_index = layers[0];
  /* 3. The layer configuration: shapes from the tensors, routing and
   *    activation from the architecture. Fields the file does not decide
   *    (max_tokens, threads, activation dtype) keep what init set. */
  ep_moe_layer_config_init(&config);
  config.max_tokens = tokens;
  if (ep_moe_checkpoint_layer_config(&config, ck, layer_index) != EP_MOE_OK) {
    fprintf(stderr, "layer config: %s\n", ep_moe_checkpoint_last_error(ck));
    ep_moe_checkpoint_close(ck);
    return 1;
  }
  printf("%s (%s), layer %d of %zu MoE layers: H=%d I=%d E=%d top-%d, shared %d, on %d EP ranks\n", path,
         ep_moe_checkpoint_architecture(ck), layer_index, n_layers, config.hidden_size, config.intermediate_size,
         config.num_experts, config.top_k, config.shared_intermediate_size, ep);

  /* 4. The ranks: one in-process communicator each, one thread each. */
  comms = calloc((size_t)ep, sizeof *comms);
  ranks = calloc((size_t)ep, sizeof *ranks);
  threads = calloc((size_t)ep, sizeof *threads);
  hidden = malloc(sizeof(float) * (size_t)tokens * (size_t)config.hidden_size);
  logits = malloc(sizeof(float) * (size_t)tokens * (size_t)config.num_experts);
  if (!comms || !ranks || !threads || !hidden || !logits || ep_moe_comm_create_local(comms, ep, NULL) != EP_MOE_OK) {
    fprintf(stderr, "setup: %s\n", ep_moe_last_error());
    return 1;
  }
  fill(hidden, (size_t)tokens * (size_t)config.hidden_size, 1);
  fill(logits, (size_t)tokens * (size_t)config.num_experts, 2);
  for (i = 0; i < ep; ++i) {
    Rank* r = &ranks[i];
    r->rank = i;
    r->ep = ep;
    r->layer_index = layer_index;
    r->tokens = tokens;
    r->comm = comms[i];
    r->ck = ck;
    r->config = config;
    r->hidden = hidden;
    r->logits = logits;
    r->out = malloc(sizeof(float) * (size_t)tokens * (size_t)config.hidden_size);
    if (!r->out) return 1;
    pthread_create(&threads[i], NULL, run_rank, r);
  }
  for (i = 0; i < ep; ++i) pthread_join(threads[i], NULL);

  /* 5. Every rank holds the whole output: they must agree. */
  for (i = 0; i < ep; ++i)
    if (ranks[i].error[0]) {
      fprintf(stderr, "rank %d: %s\n", i, ranks[i].error);
      rc = 1;
    }
  if (rc == 0) {
    size_t n = (size_t)tokens * (size_t)config.hidden_size, j;
    for (j = 0; j < n; ++j) checksum += fabs(ranks[0].out[j]);
    for (i = 1; i < ep; ++i)
      if (memcmp(ranks[i].out, ranks[0].out, n * sizeof(float)) != 0) rc = 1;
    printf("sum |out| over %d tokens = %.6g; out[0][0..3] = %.5f %.5f %.5f %.5f\n", tokens, checksum, ranks[0].out[0],
           ranks[0].out[1], ranks[0].out[2], ranks[0].out[3]);
    printf(rc == 0 ? "all %d ranks agree\n" : "the ranks' outputs differ (%d ranks)\n", ep);
  }
  for (i = 0; i < ep; ++i) {
    free(ranks[i].out);
    ep_moe_comm_destroy(comms[i]);
  }
  free(comms);
  free(ranks);
  free(threads);
  free(hidden);
  free(logits);
  ep_moe_checkpoint_close(ck);
  return rc;
}

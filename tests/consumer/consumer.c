/* A C99 consumer of an installed ep_moe: builds with nothing but what
 * pkg-config or find_package(ep_moe) say, creates a map and checks it. */
#include <stdio.h>
#include <string.h>

#include <ep_moe/ep_moe.h>

int main(void) {
  ep_moe_expert_map_config_t cfg;
  ep_moe_expert_map_t* map = NULL;
  char text[128];
  size_t needed = 0;
  int32_t n_local = -1;

  if (ep_moe_version() != EP_MOE_VERSION_NUMBER) {
    fprintf(stderr, "header %d but library %u\n", EP_MOE_VERSION_NUMBER, (unsigned)ep_moe_version());
    return 1;
  }
  if (ep_moe_expert_map_config_init(&cfg) != EP_MOE_OK) return 1;
  cfg.ep_size = 4;
  cfg.ep_rank = 1;
  cfg.global_num_experts = 10;
  if (ep_moe_expert_map_create(&map, &cfg) != EP_MOE_OK) {
    fprintf(stderr, "create failed: %s\n", ep_moe_last_error());
    return 1;
  }
  if (ep_moe_expert_map_get_attr(&n_local, map, EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED) != EP_MOE_OK) return 1;
  if (ep_moe_expert_map_describe(text, sizeof text, &needed, map) != EP_MOE_OK) return 1;
  ep_moe_expert_map_destroy(map);
  printf("ep_moe %s: rank 1 of 4 holds %d experts: %s\n", ep_moe_version_string(), (int)n_local, text);
  return (n_local == 3 && strcmp(text, "0->3, 1->4, 2->5") == 0) ? 0 : 1;
}

/* Compiled with -std=c99/c11 (and as C++17) -Wall -Wextra -pedantic -Werror:
 * the public header must be self-contained and warning-free. */
#include "ep_moe/ep_moe.h"
#include "ep_moe/ep_moe.h" /* include guard */

int header_test_use(void);
int header_test_use(void) {
  ep_moe_expert_map_config_t cfg;
  ep_moe_status_t s = ep_moe_expert_map_config_init(&cfg);
  return (int)s + (int)sizeof(ep_moe_expert_map_t*) + EP_MOE_VERSION_NUMBER;
}

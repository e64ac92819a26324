// The optional C++ wrappers compile cleanly on their own (C++17, -pedantic -Werror).
#include "ep_moe/ep_moe.hpp"
#include "ep_moe/ep_moe.hpp"  // include guard

int wrappers_use();
int wrappers_use() {
  try {
    ep_moe_expert_map_config_t c;
    ep_moe_expert_map_config_init(&c);
    const ep_moe::expert_map m(c);
    return static_cast<int>(m.describe().size());
  } catch (const ep_moe::error& e) {
    return static_cast<int>(e.status());
  }
}

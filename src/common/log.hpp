// Process-wide logging through the caller's callback. Without a callback
// nothing is formatted and nothing is written anywhere.
#pragma once

#include "ep_moe/ep_moe.h"

namespace ep_moe {

void set_log_callback(ep_moe_log_fn fn, ep_moe_log_level_t max_level, void* user_data);
bool log_enabled(ep_moe_log_level_t level);

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void log(ep_moe_log_level_t level, const char* fmt, ...);

}  // namespace ep_moe

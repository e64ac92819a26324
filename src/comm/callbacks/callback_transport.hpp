// The `callbacks` backend: the host runtime's own collectives through a
// table of function pointers with start/test completion.
#pragma once

#include <memory>

#include "comm/message_comm.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {

// Validates the table (throws INVALID_ARGUMENT naming the missing entry).
std::unique_ptr<Transport> make_callback_transport(const ep_moe_comm_callbacks_t& cb);

}  // namespace ep_moe

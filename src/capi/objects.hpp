// The concrete types behind the opaque handles, shared by the C API shims.
#pragma once

#include <memory>

#include "capi/handle.hpp"
#include "comm/comm.hpp"
#include "core/expert_map.hpp"
#include "io/checkpoint.hpp"
#include "layer/layer.hpp"

struct ep_moe_expert_map : ep_moe::capi::HandleBase {
  ep_moe_expert_map() : HandleBase(ep_moe::capi::Kind::ExpertMap) {}
  std::unique_ptr<ep_moe::ExpertMap> map;
};

struct ep_moe_comm : ep_moe::capi::HandleBase {
  ep_moe_comm() : HandleBase(ep_moe::capi::Kind::Comm) {}
  std::unique_ptr<ep_moe::Comm> comm;
};

struct ep_moe_layer : ep_moe::capi::HandleBase {
  ep_moe_layer() : HandleBase(ep_moe::capi::Kind::Layer) {}
  std::unique_ptr<ep_moe::Layer> layer;
};

struct ep_moe_checkpoint : ep_moe::capi::HandleBase {
  ep_moe_checkpoint() : HandleBase(ep_moe::capi::Kind::Checkpoint) {}
  std::unique_ptr<ep_moe::io::Checkpoint> ck;
};

// The concrete types behind the opaque handles, shared by the C API shims.
#pragma once

#include <atomic>
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

// A communicator handle. Layers that borrow it share the Comm itself, so a
// handle destroyed before them leaves no dangling pointer in the layer;
// `alive` turns false at ep_moe_comm_destroy, and the layer then refuses
// the calls that would use it (EP_MOE_ERR_INVALID_HANDLE).
struct ep_moe_comm : ep_moe::capi::HandleBase {
  ep_moe_comm() : HandleBase(ep_moe::capi::Kind::Comm) {}
  std::shared_ptr<ep_moe::Comm> comm;
  std::shared_ptr<std::atomic<bool>> alive = std::make_shared<std::atomic<bool>>(true);
};

struct ep_moe_layer : ep_moe::capi::HandleBase {
  ep_moe_layer() : HandleBase(ep_moe::capi::Kind::Layer) {}
  std::unique_ptr<ep_moe::Layer> layer;
  // The communicators the layer borrows (ep, dp), kept alive with it.
  struct Borrowed {
    std::shared_ptr<ep_moe::Comm> comm;
    std::shared_ptr<std::atomic<bool>> alive;
    void take(const ep_moe_comm* h) {
      comm = h ? h->comm : nullptr;
      alive = h ? h->alive : nullptr;
    }
  };
  Borrowed ep, dp;
  // Throw EP_MOE_ERR_INVALID_HANDLE when a borrowed handle was destroyed.
  void check_comm(const Borrowed& b) const {
    if (b.alive && !b.alive->load())
      ep_moe::fail(EP_MOE_ERR_INVALID_HANDLE,
                   "the layer's %s was destroyed (ep_moe_comm_destroy) while the layer still borrows it: destroy "
                   "layers before their communicators",
                   &b == &ep ? "ep_comm" : "dp_comm");
  }
  void check_comms() const {
    check_comm(ep);
    check_comm(dp);
  }
};

struct ep_moe_checkpoint : ep_moe::capi::HandleBase {
  ep_moe_checkpoint() : HandleBase(ep_moe::capi::Kind::Checkpoint) {}
  std::unique_ptr<ep_moe::io::Checkpoint> ck;
};

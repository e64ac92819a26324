// C API shims of expert load balancing: load statistics, rebalancing, live
// re-placement.
#include <memory>

#include "capi/handle.hpp"
#include "capi/objects.hpp"
#include "core/eplb.hpp"

using namespace ep_moe;
using namespace ep_moe::capi;

extern "C" {

ep_moe_status_t ep_moe_layer_expert_load(int64_t* out, size_t out_len, ep_moe_layer_t* layer, int32_t across_ranks,
                                         int32_t reset) {
  return guard(__func__, layer, Kind::Layer, [&] {
    checked(layer, Kind::Layer, "layer");
    if (across_ranks) layer->check_comms();
    Layer& l = *layer->layer;
    try {
      checked_out(out, "out");
      const int32_t E = l.num_experts();
      if (out_len < static_cast<size_t>(E))
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "out has %zu entries; the layer has %d experts", out_len, E);
    } catch (const Error& e) {
      // Join the all-reduce as a failure so that the peers return too.
      if (across_ranks && l.ep_comm()) l.ep_comm()->fail_collective(e.status(), e.what());
      throw;
    }
    l.expert_load(out, across_ranks != 0, reset != 0);
  });
}

ep_moe_status_t ep_moe_rebalance_config_init(ep_moe_rebalance_config_t* out) {
  return guard(__func__, nullptr, Kind::Layer, [&] {
    checked_out(out, "out");
    ep_moe_rebalance_config_t c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    *out = c;
  });
}

ep_moe_status_t ep_moe_rebalance(int32_t* out_slots, size_t out_len, double* out_imbalance, const double* load,
                                 size_t load_len, const ep_moe_rebalance_config_t* config) {
  return guard(__func__, nullptr, Kind::Layer, [&] {
    checked_out(out_slots, "out_slots");
    const auto& c = checked_config(config, "config");
    if (load == nullptr) fail(EP_MOE_ERR_INVALID_ARGUMENT, "load is NULL");
    EP_MOE_CHECK_ARG(load_len == static_cast<size_t>(c.num_experts) && c.num_experts >= 1,
                     "load has %zu entries but num_experts is %d", load_len, c.num_experts);
    EP_MOE_CHECK_ARG(c.num_slots >= 0 && out_len >= static_cast<size_t>(c.num_slots),
                     "out_slots has %zu entries; num_slots is %d", out_len, c.num_slots);
    RebalanceParams p;
    p.num_experts = c.num_experts;
    p.num_slots = c.num_slots;
    p.num_ranks = c.num_ranks;
    p.ranks_per_node = c.ranks_per_node;
    p.num_groups = c.num_expert_groups;
    EP_MOE_CHECK_ARG(c.num_current_slots >= 0 && c.num_current_slots <= (1 << 22),
                     "num_current_slots must be in [0, %d], got %d", 1 << 22, c.num_current_slots);
    if (c.num_current_slots > 0) {
      if (c.current_slots == nullptr)
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "current_slots is NULL but num_current_slots is %d", c.num_current_slots);
      p.current.assign(c.current_slots, c.current_slots + c.num_current_slots);
    }
    const std::vector<double> w(load, load + load_len);
    const std::vector<int32_t> slots = rebalance(w, p);
    std::copy(slots.begin(), slots.end(), out_slots);
    if (out_imbalance) *out_imbalance = placement_imbalance(w, slots, c.num_ranks);
  });
}

ep_moe_status_t ep_moe_layer_replace(ep_moe_layer_t* layer, const ep_moe_expert_map_t* new_map,
                                     ep_moe_comm_t* new_ep_comm, const ep_moe_checkpoint_t* checkpoint,
                                     int32_t layer_index) {
  return guard(__func__, layer, Kind::Layer, [&] {
    checked(layer, Kind::Layer, "layer");
    Layer& l = *layer->layer;
    // Without a usable communicator this rank cannot tell its peers; it
    // fails alone (they fail at their communicator's timeout).
    Comm* comm = new_ep_comm ? checked(new_ep_comm, Kind::Comm, "new_ep_comm")->comm.get() : l.ep_comm();
    if (!new_ep_comm) layer->check_comms();
    else if (layer->dp.comm != layer->ep.comm) layer->check_comm(layer->dp);  // a separate DP group stays
    ep_moe_status_t pre = EP_MOE_OK;
    std::string why;
    const ExpertMap* map = nullptr;
    const io::Checkpoint* ck = nullptr;
    // Held while read: a destroy or close waits for this call.
    const HandleUse map_use(new_map, Kind::ExpertMap, __func__), ck_use(checkpoint, Kind::Checkpoint, __func__);
    try {
      map = checked(new_map, Kind::ExpertMap, "new_map")->map.get();
      if (checkpoint) ck = checked(checkpoint, Kind::Checkpoint, "checkpoint")->ck.get();
    } catch (const Error& e) {
      pre = e.status();
      why = e.what();
    }
    std::unique_ptr<Layer> next = l.replace(map, comm, ck, layer_index, pre, why);
    layer->layer = std::move(next);
    if (new_ep_comm) {  // the layer now borrows the new group (and as its DP group, if that was the EP one)
      if (layer->dp.comm && layer->dp.comm.get() == layer->ep.comm.get()) layer->dp.take(new_ep_comm);
      layer->ep.take(new_ep_comm);
    }
  });
}

}  // extern "C"

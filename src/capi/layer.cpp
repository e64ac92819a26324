// C API shims of the MoE layer.
#include <memory>

#include "capi/handle.hpp"
#include "capi/objects.hpp"

using namespace ep_moe;
using namespace ep_moe::capi;

extern "C" {

ep_moe_status_t ep_moe_layer_config_init(ep_moe_layer_config_t* out) {
  return guard(__func__, nullptr, Kind::Layer, [&] {
    checked_out(out, "out");
    ep_moe_layer_config_t c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.activation = EP_MOE_ACT_SILU;
    c.weight_dtype = EP_MOE_DTYPE_F32;
    c.act_dtype = EP_MOE_DTYPE_F32;
    c.router_dtype = EP_MOE_DTYPE_F32;
    c.scoring = EP_MOE_SCORING_SOFTMAX;
    c.renormalize = 1;
    c.routed_scaling_factor = 1.0f;
    c.max_tokens = 256;
    c.skip_mode = EP_MOE_SKIP_TOKENS;
    c.device = -1;
    c.sync_free_tokens = 64;
    *out = c;
  });
}

ep_moe_status_t ep_moe_expert_map_config_from_layer(ep_moe_expert_map_config_t* config,
                                                    const ep_moe_layer_config_t* layer) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    ep_moe_expert_map_config_t m = checked_config(static_cast<const ep_moe_expert_map_config_t*>(config), "config");
    const auto& l = checked_config(layer, "layer");
    EP_MOE_CHECK_ARG(l.num_experts >= 1, "layer->num_experts is %d; derive the layer config first", l.num_experts);
    EP_MOE_CHECK_ARG(l.num_expert_group >= 0, "layer->num_expert_group is %d", l.num_expert_group);
    m.global_num_experts = l.num_experts;
    m.num_expert_group = l.num_expert_group;
    *config = m;
  });
}

ep_moe_status_t ep_moe_layer_create(ep_moe_layer_t** out, const ep_moe_layer_config_t* config,
                                    const ep_moe_expert_map_t* map, ep_moe_comm_t* ep_comm, ep_moe_comm_t* dp_comm) {
  return guard(__func__, nullptr, Kind::Layer, [&] {
    checked_out(out, "out");
    const auto& c = checked_config(config, "config");
    const HandleUse map_use(map, Kind::ExpertMap, __func__);  // held while read: a destroy waits
    checked(map, Kind::ExpertMap, "map");
    Comm* ep = ep_comm ? checked(ep_comm, Kind::Comm, "ep_comm")->comm.get() : nullptr;
    Comm* dp = dp_comm ? checked(dp_comm, Kind::Comm, "dp_comm")->comm.get() : nullptr;
    auto h = std::make_unique<ep_moe_layer>();
    h->layer = std::make_unique<Layer>(c, *map->map, ep, dp);
    h->ep.take(ep_comm);
    h->dp.take(dp_comm);
    register_handle(h.get());
    *out = h.release();
  });
}

void ep_moe_layer_destroy(ep_moe_layer_t* layer) {
  if (layer == nullptr || !retire_handle(layer, Kind::Layer)) return;
  delete layer;
}

const char* ep_moe_layer_last_error(const ep_moe_layer_t* layer) {
  return handle_last_error(layer, layer, Kind::Layer);
}

ep_moe_status_t ep_moe_layer_set_weight(int32_t* out_stored, ep_moe_layer_t* layer, ep_moe_weight_t which,
                                        int32_t expert, const void* data, ep_moe_dtype_t dtype, int64_t rows,
                                        int64_t cols) {
  return guard(__func__, layer, Kind::Layer, [&] {
    checked(layer, Kind::Layer, "layer");
    const bool stored = layer->layer->set_weight(which, expert, data, dtype, rows, cols);
    if (out_stored) *out_stored = stored ? 1 : 0;
  });
}

ep_moe_status_t ep_moe_forward_args_init(ep_moe_forward_args_t* out) {
  return guard(__func__, nullptr, Kind::Layer, [&] {
    checked_out(out, "out");
    ep_moe_forward_args_t a;
    std::memset(&a, 0, sizeof a);
    a.struct_size = sizeof a;
    *out = a;
  });
}

ep_moe_status_t ep_moe_layer_forward(ep_moe_layer_t* layer, const ep_moe_forward_args_t* args) {
  return guard(__func__, layer, Kind::Layer, [&] {
    checked(layer, Kind::Layer, "layer");
    layer->check_comms();
    Layer& l = *layer->layer;
    const ep_moe_forward_args_t* a = args;
    try {
      checked_config(args, "args");
    } catch (const Error& e) {
      // Still take part in this step's collectives so the peers return.
      ep_moe_forward_args_t empty;
      std::memset(&empty, 0, sizeof empty);
      empty.struct_size = sizeof empty;
      empty.num_tokens = -1;  // fails validation: joins every collective as a failure
      try {
        l.forward(empty);
      } catch (...) {
      }
      throw;
    }
    l.forward(*a);
  });
}

ep_moe_status_t ep_moe_layer_get_attr(int64_t* out, const ep_moe_layer_t* layer, ep_moe_layer_attr_t attr) {
  return guard(__func__, layer, Kind::Layer, [&] {
    checked(layer, Kind::Layer, "layer");
    checked_out(out, "out");
    *out = layer->layer->attr(attr);
  });
}

}  // extern "C"

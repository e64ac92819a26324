// C API shims of the expert map manager: argument checks and conversions only.
#include <algorithm>
#include <cmath>
#include <memory>

#include "capi/handle.hpp"
#include "capi/objects.hpp"
#include "common/dtype.hpp"
#include "core/expert_map.hpp"

using namespace ep_moe;
using namespace ep_moe::capi;

namespace {

ExpertMapParams to_params(const ep_moe_expert_map_config_t& c) {
  ExpertMapParams p;
  p.ep_size = c.ep_size;
  p.ep_rank = c.ep_rank;
  p.num_experts = c.global_num_experts;
  EP_MOE_CHECK_ARG(c.placement >= EP_MOE_PLACEMENT_LINEAR && c.placement <= EP_MOE_PLACEMENT_CUSTOM,
                   "config->placement %d is not an ep_moe_placement_t value", c.placement);
  p.placement = static_cast<Placement>(c.placement);
  p.num_fused_shared = c.num_fused_shared_experts;
  p.num_expert_group = c.num_expert_group;
  p.num_redundant = c.num_redundant_experts;
  p.enable_eplb = c.enable_eplb != 0;
  p.use_all2all_kernels = c.use_all2all_kernels != 0;
  p.all2all_supports_routing_tables = c.all2all_supports_routing_tables != 0;
  if (p.placement == Placement::Custom) {
    EP_MOE_CHECK_ARG(c.num_custom_slots > 0, "config->num_custom_slots must be > 0 for custom placement, got %d",
                     c.num_custom_slots);
    EP_MOE_CHECK_ARG(c.custom_slots != nullptr, "config->custom_slots is NULL with custom placement");
    // Bound before copying so a wild count cannot allocate without limit.
    EP_MOE_CHECK_ARG(c.num_custom_slots <= (1 << 22), "config->num_custom_slots %d is above the limit %d",
                     c.num_custom_slots, 1 << 22);
    p.custom_slots.assign(c.custom_slots, c.custom_slots + c.num_custom_slots);
    if (c.custom_slots_per_rank) {
      EP_MOE_CHECK_ARG(c.ep_size >= 1 && c.ep_size <= (1 << 16), "config->ep_size must be in [1, %d], got %d", 1 << 16,
                       c.ep_size);
      p.custom_slots_per_rank.assign(c.custom_slots_per_rank, c.custom_slots_per_rank + c.ep_size);
    }
  }
  return p;
}

const ExpertMap& map_of(const ep_moe_expert_map_t* m) { return *m->map; }

const std::vector<int32_t>& table_of(const ExpertMap& m, ep_moe_map_table_t t) {
  switch (t) {
    case EP_MOE_MAP_TABLE_EXPERT_MAP: return m.expert_map();
    case EP_MOE_MAP_TABLE_EXPERT_MASK: return m.expert_mask();
    case EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL: return m.local_to_global();
    case EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL: return m.global_to_physical();
    case EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL: return m.physical_to_global();
    case EP_MOE_MAP_TABLE_SLOT_RANK: return m.slot_rank();
    case EP_MOE_MAP_TABLE_SLOTS_PER_RANK: return m.slots_per_rank();
    case EP_MOE_MAP_TABLE_REPLICA_COUNT: return m.replica_count();
    default: break;
  }
  fail(EP_MOE_ERR_INVALID_ARGUMENT, "table %d is not an ep_moe_map_table_t value", static_cast<int>(t));
}

void check_global_id(const ExpertMap& m, int32_t g) {
  EP_MOE_CHECK_ARG(g >= 0 && g < m.num_experts() + m.num_fused_shared(),
                   "global_id %d is outside [0, %d) (E=%d routed + %d fused shared experts)", g,
                   m.num_experts() + m.num_fused_shared(), m.num_experts(), m.num_fused_shared());
}

}  // namespace

extern "C" {

ep_moe_status_t ep_moe_expert_map_config_init(ep_moe_expert_map_config_t* out) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    checked_out(out, "out");
    ep_moe_expert_map_config_t c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.ep_size = 1;
    c.ep_rank = 0;
    c.global_num_experts = 0;
    c.placement = EP_MOE_PLACEMENT_LINEAR;
    c.all2all_supports_routing_tables = 1;
    *out = c;
  });
}

ep_moe_status_t ep_moe_expert_map_create(ep_moe_expert_map_t** out, const ep_moe_expert_map_config_t* config) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    checked_out(out, "out");
    const auto& c = checked_config(config, "config");
    auto h = std::make_unique<ep_moe_expert_map>();
    h->map = std::make_unique<ExpertMap>(to_params(c));
    register_handle(h.get());
    *out = h.release();
  });
}

void ep_moe_expert_map_destroy(ep_moe_expert_map_t* map) {
  if (map == nullptr || !retire_handle(map, Kind::ExpertMap)) return;
  delete map;
}

ep_moe_status_t ep_moe_expert_map_update(ep_moe_expert_map_t* map, const ep_moe_expert_map_config_t* config) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    const auto& c = checked_config(config, "config");
    auto fresh = std::make_unique<ExpertMap>(to_params(c));
    map->map = std::move(fresh);  // only after the new layout is fully built
  });
}

const char* ep_moe_expert_map_last_error(const ep_moe_expert_map_t* map) {
  return handle_last_error(map, map, Kind::ExpertMap);
}

ep_moe_status_t ep_moe_expert_map_get_attr(int32_t* out, const ep_moe_expert_map_t* map, ep_moe_map_attr_t attr) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    checked_out(out, "out");
    const ExpertMap& m = map_of(map);
    int32_t v = 0;
    switch (attr) {
      case EP_MOE_MAP_ATTR_EP_SIZE: v = m.ep_size(); break;
      case EP_MOE_MAP_ATTR_EP_RANK: v = m.ep_rank(); break;
      case EP_MOE_MAP_ATTR_GLOBAL_NUM_EXPERTS: v = m.num_experts(); break;
      case EP_MOE_MAP_ATTR_NUM_FUSED_SHARED: v = m.num_fused_shared(); break;
      case EP_MOE_MAP_ATTR_NUM_PHYSICAL: v = m.num_physical(); break;
      case EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED: v = m.num_local_routed(); break;
      case EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL: v = m.num_local_total(); break;
      case EP_MOE_MAP_ATTR_PLACEMENT: v = static_cast<int32_t>(m.placement()); break;
      case EP_MOE_MAP_ATTR_REQUESTED_PLACEMENT: v = static_cast<int32_t>(m.requested_placement()); break;
      case EP_MOE_MAP_ATTR_FELL_BACK: v = m.fell_back() ? 1 : 0; break;
      case EP_MOE_MAP_ATTR_NUM_REDUNDANT: v = m.num_physical() - m.num_experts(); break;
      case EP_MOE_MAP_ATTR_MAX_SLOTS_PER_RANK: v = m.max_slots_per_rank(); break;
      default: fail(EP_MOE_ERR_INVALID_ARGUMENT, "attr %d is not an ep_moe_map_attr_t value", static_cast<int>(attr));
    }
    *out = v;
  });
}

ep_moe_status_t ep_moe_expert_map_global_to_local(int32_t* out, const ep_moe_expert_map_t* map, int32_t global_id) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    checked_out(out, "out");
    check_global_id(map_of(map), global_id);
    *out = map_of(map).global_to_local(global_id);
  });
}

ep_moe_status_t ep_moe_expert_map_local_to_global(int32_t* out, const ep_moe_expert_map_t* map, int32_t local_id) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    checked_out(out, "out");
    const ExpertMap& m = map_of(map);
    EP_MOE_CHECK_ARG(local_id >= 0 && local_id < m.num_local_total(),
                     "local_id %d is outside [0, %d) (this rank's local experts)", local_id, m.num_local_total());
    *out = m.local_to_global()[static_cast<size_t>(local_id)];
  });
}

ep_moe_status_t ep_moe_expert_map_is_local(int32_t* out, const ep_moe_expert_map_t* map, int32_t global_id) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    checked_out(out, "out");
    check_global_id(map_of(map), global_id);
    *out = map_of(map).is_local(global_id) ? 1 : 0;
  });
}

ep_moe_status_t ep_moe_expert_map_table_length(size_t* out, const ep_moe_expert_map_t* map, ep_moe_map_table_t table) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    checked_out(out, "out");
    *out = table_of(map_of(map), table).size();
  });
}

ep_moe_status_t ep_moe_expert_map_copy_table(int32_t* out, size_t out_len, const ep_moe_expert_map_t* map,
                                             ep_moe_map_table_t table) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    const auto& t = table_of(map_of(map), table);
    if (out_len < t.size())
      fail(EP_MOE_ERR_BUFFER_TOO_SMALL, "out_len is %zu entries, the table needs %zu", out_len, t.size());
    if (!t.empty()) checked_out(out, "out");
    std::copy(t.begin(), t.end(), out);
  });
}

ep_moe_status_t ep_moe_expert_map_describe(char* out, size_t out_size, size_t* out_needed,
                                           const ep_moe_expert_map_t* map) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    EP_MOE_CHECK_ARG(out != nullptr || out_size == 0, "out is NULL but out_size is %zu", out_size);
    const std::string s = map_of(map).describe();
    if (out_size > 0) {
      const size_t n = std::min(s.size(), out_size - 1);
      std::memcpy(out, s.data(), n);
      out[n] = '\0';
    }
    if (out_needed) *out_needed = s.size();
  });
}

ep_moe_status_t ep_moe_mask_and_remap(int32_t* out_ids, void* out_weights, uint8_t* out_mask,
                                      const ep_moe_expert_map_t* map, const int32_t* topk_ids, const void* topk_weights,
                                      ep_moe_dtype_t weights_dtype, int64_t num_tokens, int32_t top_k,
                                      ep_moe_remap_mode_t mode) {
  return guard(__func__, map, Kind::ExpertMap, [&] {
    checked(map, Kind::ExpertMap, "map");
    EP_MOE_CHECK_ARG(num_tokens >= 0, "num_tokens must be >= 0, got %lld", static_cast<long long>(num_tokens));
    EP_MOE_CHECK_ARG(top_k >= 1, "top_k must be >= 1, got %d", top_k);
    EP_MOE_CHECK_ARG(mode == EP_MOE_REMAP_SPREAD || mode == EP_MOE_REMAP_MINUS_ONE,
                     "mode %d is not an ep_moe_remap_mode_t value", static_cast<int>(mode));
    EP_MOE_CHECK_ARG(dtype_is_float(weights_dtype), "weights_dtype %d is not f32, bf16 or f16",
                     static_cast<int>(weights_dtype));
    EP_MOE_CHECK_ARG(num_tokens <= (int64_t(1) << 40) / top_k, "num_tokens * top_k is too large");
    const int64_t n = num_tokens * top_k;
    if (n == 0) return;
    checked_out(out_ids, "out_ids");
    checked_out(out_weights, "out_weights");
    checked_out(topk_ids, "topk_ids");
    checked_out(topk_weights, "topk_weights");
    const ExpertMap& m = map_of(map);
    const int32_t limit = m.num_experts() + m.num_fused_shared();
    for (int64_t i = 0; i < n; ++i) {
      const int32_t g = topk_ids[i];
      if (g < 0 || g >= limit)
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_ids[token %lld, slot %lld] = %d is outside [0, %d)",
             static_cast<long long>(i / top_k), static_cast<long long>(i % top_k), g, limit);
    }
    const int32_t n_local = m.num_local_routed();
    const auto& g2l = m.expert_map();
    for (int64_t i = 0; i < n; ++i) {
      const int32_t g = topk_ids[i];
      const int32_t l = g2l[static_cast<size_t>(g)];
      const bool local = l >= 0;
      if (out_mask) out_mask[i] = local ? 1 : 0;
      if (!local) set_zero(out_weights, weights_dtype, i);
      else if (out_weights != topk_weights) copy_elem(out_weights, topk_weights, weights_dtype, i);
      out_ids[i] = local ? l : (mode == EP_MOE_REMAP_SPREAD && n_local > 0 ? g % n_local : -1);
    }
  });
}

}  // extern "C"

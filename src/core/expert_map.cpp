#include "core/expert_map.hpp"

#include <algorithm>
#include <utility>

#include "common/error.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"

namespace ep_moe {

namespace {
// Limits that keep every table allocation and index inside int32 and
// reasonable memory; real models are far below them.
constexpr int32_t kMaxEpSize = 1 << 16;
constexpr int32_t kMaxExperts = 1 << 20;
constexpr int32_t kMaxShared = 1 << 10;
constexpr int32_t kMaxSlots = 1 << 22;
}  // namespace

const char* placement_name(Placement p) {
  switch (p) {
    case Placement::Linear: return "linear";
    case Placement::RoundRobin: return "round_robin";
    case Placement::Custom: return "custom";
  }
  return "unknown";
}

ExpertMap::ExpertMap(ExpertMapParams p) : p_(std::move(p)) {
  EP_MOE_CHECK_ARG(p_.ep_size >= 1 && p_.ep_size <= kMaxEpSize, "ep_size must be in [1, %d], got %d", kMaxEpSize,
                   p_.ep_size);
  EP_MOE_CHECK_ARG(p_.ep_rank >= 0 && p_.ep_rank < p_.ep_size, "ep_rank must be in [0, ep_size=%d), got %d", p_.ep_size,
                   p_.ep_rank);
  EP_MOE_CHECK_ARG(p_.num_experts >= 1 && p_.num_experts <= kMaxExperts,
                   "global_num_experts must be in [1, %d], got %d", kMaxExperts, p_.num_experts);
  EP_MOE_CHECK_ARG(p_.num_fused_shared >= 0 && p_.num_fused_shared <= kMaxShared,
                   "num_fused_shared_experts must be in [0, %d], got %d", kMaxShared, p_.num_fused_shared);
  EP_MOE_CHECK_ARG(p_.num_expert_group >= 0, "num_expert_group must be >= 0, got %d", p_.num_expert_group);
  build_slots();
  build_tables();
}

void ExpertMap::build_slots() {
  const int32_t E = p_.num_experts, ep = p_.ep_size;
  EP_MOE_CHECK_ARG(p_.num_redundant >= 0 && p_.num_redundant <= kMaxSlots - E,
                   "num_redundant_experts must be in [0, %d], got %d", kMaxSlots - E, p_.num_redundant);

  placement_ = p_.placement;
  fallback_reason_.clear();
  if (placement_ == Placement::RoundRobin) {
    if (ep == 1) {
      fallback_reason_ = "ep_size is 1: every expert is local";
    } else if (p_.num_expert_group <= 1 || p_.num_redundant > 0 || p_.enable_eplb) {
      fallback_reason_ =
          "round-robin placement is only supported for models with multiple expert groups "
          "(num_expert_group > 1), no redundant experts and no load balancing";
    } else if (p_.use_all2all_kernels && !p_.all2all_supports_routing_tables) {
      fallback_reason_ = "round-robin placement needs all-to-all kernels that accept its routing tables";
    }
    if (!fallback_reason_.empty()) {
      placement_ = Placement::Linear;
      log(ep == 1 ? EP_MOE_LOG_DEBUG : EP_MOE_LOG_WARN, "[EP rank %d/%d] %s; falling back to linear expert placement",
          p_.ep_rank, ep, fallback_reason_.c_str());
    }
  }

  slots_per_rank_.assign(static_cast<size_t>(ep), 0);
  switch (placement_) {
    case Placement::Linear: {
      const int32_t P = E + p_.num_redundant;
      slot_expert_.resize(static_cast<size_t>(P));
      for (int32_t s = 0; s < P; ++s) slot_expert_[static_cast<size_t>(s)] = s % E;
      for (int32_t r = 0; r < ep; ++r) slots_per_rank_[static_cast<size_t>(r)] = split_count(P, ep, r);
      break;
    }
    case Placement::RoundRobin: {
      slot_expert_.resize(static_cast<size_t>(E));
      for (int32_t r = 0; r < ep; ++r) {
        const int32_t n = split_count(E, ep, r);
        const int32_t off = split_start(E, ep, r);
        slots_per_rank_[static_cast<size_t>(r)] = n;
        for (int32_t j = 0; j < n; ++j) slot_expert_[static_cast<size_t>(off + j)] = r + j * ep;
      }
      break;
    }
    case Placement::Custom: {
      const auto P = p_.custom_slots.size();
      EP_MOE_CHECK_ARG(P >= static_cast<size_t>(E) && P <= static_cast<size_t>(kMaxSlots),
                       "custom placement needs num_custom_slots in [global_num_experts=%d, %d], got %zu", E, kMaxSlots,
                       P);
      std::vector<int32_t> seen(static_cast<size_t>(E), 0);
      for (size_t s = 0; s < P; ++s) {
        const int32_t e = p_.custom_slots[s];
        EP_MOE_CHECK_ARG(e >= 0 && e < E, "custom_slots[%zu] = %d is not an expert id in [0, %d)", s, e, E);
        seen[static_cast<size_t>(e)] = 1;
      }
      for (int32_t e = 0; e < E; ++e)
        EP_MOE_CHECK_ARG(seen[static_cast<size_t>(e)], "custom_slots holds no slot for expert %d", e);
      slot_expert_ = p_.custom_slots;
      if (p_.custom_slots_per_rank.empty()) {
        for (int32_t r = 0; r < ep; ++r)
          slots_per_rank_[static_cast<size_t>(r)] = split_count(static_cast<int32_t>(P), ep, r);
      } else {
        EP_MOE_CHECK_ARG(p_.custom_slots_per_rank.size() == static_cast<size_t>(ep),
                         "custom_slots_per_rank must have ep_size=%d entries", ep);
        int64_t sum = 0;
        for (int32_t r = 0; r < ep; ++r) {
          const int32_t n = p_.custom_slots_per_rank[static_cast<size_t>(r)];
          EP_MOE_CHECK_ARG(n >= 0, "custom_slots_per_rank[%d] = %d is negative", r, n);
          sum += n;
          slots_per_rank_[static_cast<size_t>(r)] = n;
        }
        EP_MOE_CHECK_ARG(sum == static_cast<int64_t>(P),
                         "custom_slots_per_rank sums to %lld, but num_custom_slots is %zu", static_cast<long long>(sum),
                         P);
      }
      break;
    }
    default:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "placement %d is not an ep_moe_placement_t value",
           static_cast<int>(p_.placement));
  }
}

void ExpertMap::build_tables() {
  const int32_t E = p_.num_experts, S = p_.num_fused_shared, ep = p_.ep_size;
  const int32_t P = static_cast<int32_t>(slot_expert_.size());

  rank_slot_begin_.assign(static_cast<size_t>(ep) + 1, 0);
  for (int32_t r = 0; r < ep; ++r)
    rank_slot_begin_[static_cast<size_t>(r) + 1] =
        rank_slot_begin_[static_cast<size_t>(r)] + slots_per_rank_[static_cast<size_t>(r)];

  slot_rank_.resize(static_cast<size_t>(P));
  for (int32_t r = 0; r < ep; ++r)
    for (int32_t s = rank_slot_begin_[static_cast<size_t>(r)]; s < rank_slot_begin_[static_cast<size_t>(r) + 1]; ++s)
      slot_rank_[static_cast<size_t>(s)] = r;

  global_to_physical_.assign(static_cast<size_t>(E), -1);
  replica_count_.assign(static_cast<size_t>(E), 0);
  for (int32_t s = 0; s < P; ++s) {
    const auto e = static_cast<size_t>(slot_expert_[static_cast<size_t>(s)]);
    if (global_to_physical_[e] < 0) global_to_physical_[e] = s;
    ++replica_count_[e];
  }

  const int32_t begin = rank_slot_begin_[static_cast<size_t>(p_.ep_rank)];
  const int32_t nl = slots_per_rank_[static_cast<size_t>(p_.ep_rank)];
  global_to_local_.assign(static_cast<size_t>(E + S), -1);
  local_to_global_.resize(static_cast<size_t>(nl + S));
  for (int32_t j = 0; j < nl; ++j) {
    const int32_t e = slot_expert_[static_cast<size_t>(begin + j)];
    local_to_global_[static_cast<size_t>(j)] = e;
    if (global_to_local_[static_cast<size_t>(e)] < 0) global_to_local_[static_cast<size_t>(e)] = j;
  }
  for (int32_t i = 0; i < S; ++i) {
    global_to_local_[static_cast<size_t>(E + i)] = nl + i;
    local_to_global_[static_cast<size_t>(nl + i)] = E + i;
  }

  mask_.assign(static_cast<size_t>(E + S) + 1, 0);
  for (int32_t g = 0; g < E + S; ++g)
    mask_[static_cast<size_t>(g)] = global_to_local_[static_cast<size_t>(g)] >= 0 ? 1 : 0;
}

int32_t ExpertMap::max_slots_per_rank() const {
  return *std::max_element(slots_per_rank_.begin(), slots_per_rank_.end());
}

std::string ExpertMap::describe() const {
  if (p_.ep_size == 1 && num_physical() == p_.num_experts && placement_ != Placement::Custom)
    return format("[0..%d]", p_.num_experts - 1);
  std::string s;
  for (size_t j = 0; j < local_to_global_.size(); ++j) {
    if (j) s += ", ";
    s += std::to_string(j);
    s += "->";
    s += std::to_string(local_to_global_[j]);
  }
  return s;
}

uint64_t ExpertMap::fingerprint() const {
  const int32_t head[3] = {ep_size(), num_experts(), num_physical()};
  uint64_t h = fnv1a(kFnvBasis, head, sizeof head);
  h = fnv1a(h, physical_to_global().data(), physical_to_global().size() * 4);
  return fnv1a(h, slots_per_rank().data(), slots_per_rank().size() * 4);
}

}  // namespace ep_moe

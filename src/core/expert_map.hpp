// The expert map manager: which rank owns which expert (seed 002 semantics,
// plus redundant replicas and custom placements). Pure computation, no I/O.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ep_moe {

enum class Placement : int32_t { Linear = 0, RoundRobin = 1, Custom = 2 };

struct ExpertMapParams {
  int32_t ep_size = 1;
  int32_t ep_rank = 0;
  int32_t num_experts = 0;  // E, logical routed experts
  Placement placement = Placement::Linear;
  int32_t num_fused_shared = 0;  // S
  int32_t num_expert_group = 0;
  int32_t num_redundant = 0;  // R, linear placement only
  bool enable_eplb = false;
  bool use_all2all_kernels = false;
  bool all2all_supports_routing_tables = true;
  std::vector<int32_t> custom_slots;           // physical slot -> logical expert
  std::vector<int32_t> custom_slots_per_rank;  // empty: linear split
};

// Linear split of `n` items over `parts` ranks: the first n % parts ranks get
// one more. Returns the count and the start of part `idx`.
inline int32_t split_count(int32_t n, int32_t parts, int32_t idx) { return n / parts + (idx < n % parts ? 1 : 0); }
inline int32_t split_start(int32_t n, int32_t parts, int32_t idx) {
  const int32_t base = n / parts, rem = n % parts;
  return idx * base + (idx < rem ? idx : rem);
}

class ExpertMap {
 public:
  // Validates `p` (throws ep_moe::Error naming the bad field) and computes
  // every table.
  explicit ExpertMap(ExpertMapParams p);

  const ExpertMapParams& params() const { return p_; }
  int32_t ep_size() const { return p_.ep_size; }
  int32_t ep_rank() const { return p_.ep_rank; }
  int32_t num_experts() const { return p_.num_experts; }
  int32_t num_fused_shared() const { return p_.num_fused_shared; }
  int32_t num_physical() const { return static_cast<int32_t>(slot_expert_.size()); }
  int32_t num_local_routed() const { return rank_slot_begin_[p_.ep_rank + 1] - rank_slot_begin_[p_.ep_rank]; }
  int32_t num_local_total() const { return num_local_routed() + p_.num_fused_shared; }
  int32_t max_slots_per_rank() const;
  // A fingerprint of the placement every rank of the group must share (EP
  // size, experts, slots, which expert each slot holds, slots per rank),
  // which ranks compare to check that they agree.
  uint64_t fingerprint() const;
  Placement placement() const { return placement_; }
  Placement requested_placement() const { return p_.placement; }
  bool fell_back() const { return !fallback_reason_.empty(); }
  const std::string& fallback_reason() const { return fallback_reason_; }

  // global -> local (-1 if not local); length E + S.
  const std::vector<int32_t>& expert_map() const { return global_to_local_; }
  // 1 for local experts, S ones, trailing 0; length E + S + 1.
  const std::vector<int32_t>& expert_mask() const { return mask_; }
  // local -> global; length n_local + S.
  const std::vector<int32_t>& local_to_global() const { return local_to_global_; }
  // global -> first physical slot; length E.
  const std::vector<int32_t>& global_to_physical() const { return global_to_physical_; }
  // physical slot -> global; length P.
  const std::vector<int32_t>& physical_to_global() const { return slot_expert_; }
  // physical slot -> rank; length P.
  const std::vector<int32_t>& slot_rank() const { return slot_rank_; }
  // slots of each rank; length ep_size.
  const std::vector<int32_t>& slots_per_rank() const { return slots_per_rank_; }
  // replicas of each logical expert; length E.
  const std::vector<int32_t>& replica_count() const { return replica_count_; }
  // First slot of each rank; length ep_size + 1.
  const std::vector<int32_t>& rank_slot_begin() const { return rank_slot_begin_; }

  int32_t global_to_local(int32_t g) const { return global_to_local_[static_cast<size_t>(g)]; }
  bool is_local(int32_t g) const { return global_to_local(g) >= 0; }

  // "0->4, 1->5" or "[0..E-1]" for ep_size 1.
  std::string describe() const;

 private:
  void build_slots();
  void build_tables();

  ExpertMapParams p_;
  Placement placement_ = Placement::Linear;
  std::string fallback_reason_;
  std::vector<int32_t> slot_expert_;
  std::vector<int32_t> slot_rank_;
  std::vector<int32_t> slots_per_rank_;
  std::vector<int32_t> rank_slot_begin_;
  std::vector<int32_t> global_to_local_;
  std::vector<int32_t> mask_;
  std::vector<int32_t> local_to_global_;
  std::vector<int32_t> global_to_physical_;
  std::vector<int32_t> replica_count_;
};

const char* placement_name(Placement p);

}  // namespace ep_moe

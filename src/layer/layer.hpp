// One rank's MoE layer: the forward data flow of docs/architecture.md
// (route -> DP gather -> plan -> experts -> combine -> + shared -> one
// reduction), written once here and in alltoall.cpp; the storage of the
// weights and the steps that touch activations run on a backend
// (backend.hpp: cpu_backend.cpp, or cuda_backend.cpp for a layer whose
// config names a device).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "common/source.hpp"
#include "core/expert_map.hpp"
#include "core/routing.hpp"
#include "ep_moe/ep_moe.h"
#include "io/checkpoint.hpp"
#include "layer/backend.hpp"

namespace ep_moe {

const char* weight_name(ep_moe_weight_t w);

class Layer {
 public:
  // Validates the config against the map and the communicators (throws).
  Layer(const ep_moe_layer_config_t& cfg, const ExpertMap& map, Comm* ep_comm, Comm* dp_comm);
  ~Layer();

  // Returns true when stored, false when skipped as a non-local expert.
  bool set_weight(ep_moe_weight_t which, int32_t expert, const void* data, ep_moe_dtype_t dtype, int64_t rows,
                  int64_t cols);

  // Loads this rank's part of MoE layer `layer_index` of a checkpoint;
  // returns the bytes read from its files (src/layer/load.cpp).
  uint64_t load(const io::Checkpoint& ck, int32_t layer_index);

  // The [rows, cols] a weight must have (throws for an unknown `which`).
  void expected_shape(ep_moe_weight_t which, int64_t* rows, int64_t* cols) const;
  // Whether this rank keeps anything of the weight (a local expert, a shard).
  bool wants(ep_moe_weight_t which, int32_t expert) const;

  // A token whose hidden row holds a NaN or an Inf (host memory) gets an
  // all-NaN output row, on every dtype and path: it is computed as a row of
  // zeros (so that a block format's int8 quantization cannot turn it into
  // finite values, routing from a router weight sees finite logits, and
  // no other token is touched), and its output row is NaN at the end.
  void forward(const ep_moe_forward_args_t& args);

  int64_t attr(ep_moe_layer_attr_t a) const;

  // Empty when ready; else what is missing.
  std::string missing_weight() const;

  // Per-logical-expert pairs computed here since the last reset; summed over
  // the EP group (one all-reduce) when `across_ranks`. `out` has E entries.
  void expert_load(int64_t* out, bool across_ranks, bool reset);

  // Live re-placement (replace.cpp), collective over `comm` (the new EP
  // group, or the current one). Returns the layer of the new placement; on
  // any failure, on any rank, throws on every rank and leaves `this` as it
  // was. `pre_status` not OK: this rank's arguments were bad (`pre_error`
  // says how); it still takes part so that the peers fail too.
  std::unique_ptr<Layer> replace(const ExpertMap* new_map, Comm* comm, const io::Checkpoint* ck, int32_t layer_index,
                                 ep_moe_status_t pre_status, const std::string& pre_error);
  Comm* ep_comm() const { return ep_; }
  int32_t num_experts() const { return cfg_.num_experts; }

 private:
  friend class Replacement;  // replace.cpp: the re-placement's steps
  friend class CpuBackend;   // cpu_backend.cpp, cpu_flows.cpp
  friend class CudaBackend;  // cuda_backend.cpp

  // Which weights a local slot (or the shared shard) has been given.
  struct Held {
    bool gate = false, up = false, down = false;
    bool gate_bias = false, up_bias = false, down_bias = false;
    bool complete() const { return gate && up && down; }
    bool biases() const { return gate_bias && up_bias && down_bias; }
  };
  // Which parts of a checkpoint layer to read: the routed experts flagged
  // in `experts` (empty: every local one), this rank's shard of the shared
  // expert, and the small replicated weights (router, bias, shared gate).
  struct LoadParts {
    std::vector<char> experts;
    bool shared = true, others = true;
  };

  // --- construction (layer.cpp) ---------------------------------------------
  void build_replica_tables();
  void size_plans(int64_t* max_rows, int64_t* send_rows, int64_t* fanout);

  // --- weights (layer.cpp) ------------------------------------------------------
  void check_weight(ep_moe_weight_t which, int32_t expert) const;
  // Stores a weight read through `src` into the backend, one step for
  // either backend; shared-expert sources are shard-relative when
  // `shard_relative`, else full size. `src_on_device`: device memory.
  bool store(ep_moe_weight_t which, int32_t expert, Source src, bool shard_relative, bool src_on_device = false);
  void store_routed(ep_moe_weight_t which, int32_t expert, const Source& src, bool src_on_device);
  void store_shared(ep_moe_weight_t which, Source src, bool shard_relative, bool src_on_device);
  // A routed expert's gate, up, gate_up or down bias into its local slots.
  void store_expert_bias(ep_moe_weight_t which, int32_t expert, const Source& src);
  // The score bias, the shared gate or the router bias: checked, kept here
  // and given to the backend.
  void store_vector(ep_moe_weight_t which, const Source& src);
  // `n` values of a vector from `src` (column c0 on) into `dst`; rejects
  // values that are not finite.
  void set_bias(std::vector<float>& dst, const Source& src, int64_t c0, int64_t n, ep_moe_weight_t which) const;
  // Reads the chosen parts of a checkpoint layer (load.cpp).
  uint64_t load_parts(const io::Checkpoint& ck, int32_t layer_index, const LoadParts& parts);
  // Weights in the transfer format of replace.cpp (see there).
  void store_units(int32_t expert, const uint8_t* units);  // expert -1: the shared shard
  void store_biases(int32_t expert, const uint8_t* in);
  // A routed expert's [gate rows | up rows | down rows], each row as stored
  // in `gu` / `down` (blocks of a block format, or elements).
  void store_rows(int32_t expert, const uint8_t* in, ep_moe_dtype_t gu, ep_moe_dtype_t down);
  static size_t row_bytes_of(ep_moe_dtype_t t, int64_t n);
  // The dtype of the float parts in transfer (units): weight_dtype, or f32
  // when that is a block format.
  ep_moe_dtype_t unit_dtype() const;

  // --- the forward (layer.cpp) --------------------------------------------------
  void validate_forward(const ep_moe_forward_args_t& a, int64_t* dp_offset, int64_t* dp_padded, Gather* gather) const;
  // The replica of `expert` that pair (token, k) of the gathered batch uses.
  int32_t pick_slot(int32_t expert, int64_t token, int32_t k) const;
  // The all-gather flow's DP gather: the per-rank element counts of the
  // compact gather in counts_ (`words` 4-byte words a row); returns the
  // rows gathered.
  int64_t gathered_rows(const ep_moe_forward_args_t& a, Gather gather, int64_t padded, size_t words);
  // The rows of the all-gather flow that get the shared expert: this
  // rank's shard on every row, or the whole expert on a share of them.
  void shared_rows(int64_t T, int64_t T_all, int64_t dp_offset, int64_t* begin, int64_t* end) const;

  // --- the all-to-all plan, on the host (alltoall.cpp) --------------------------
  void build_a2a_choice();
  int32_t pick_slot_a2a(int32_t expert, int64_t token, int32_t k) const;
  void plan_sends(int64_t tokens);
  void exchange_counts(Comm* ep, const ep_moe_forward_args_t& a);
  // After exchange_counts: recv_count_ (rows from each rank) and the
  // per-rank element counts of the row exchange (`outbound`: counts_ =
  // sent, recv_words_ = received) or of the return trip (the reverse), at
  // `per_row` elements a row. Returns the rows received.
  int64_t a2a_counts(size_t per_row, bool outbound);
  // back_off_/back_idx_: each own token's returned rows (CSR, in send order).
  void build_back_csr(int64_t T);
  int32_t cheaper_mode(Gather gather, int64_t padded);
  // Pairs of the step's own tokens sent to other ranks.
  int64_t sent_pairs(int64_t T) const;

  ep_moe_layer_config_t cfg_;
  ExpertMap map_;
  Comm* ep_;
  Comm* dp_;
  int dp_size_ = 1, dp_rank_ = 0;
  bool dp_is_ep_ = false;
  int32_t dispatch_ = EP_MOE_DISPATCH_ALLGATHER;
  bool shared_replicated_ = false;  // all-to-all modes keep the whole shared expert
  RoutingParams routing_;

  std::unique_ptr<LayerBackend> backend_;
  std::unique_ptr<Comm> ep_host_;  // host buffers over a device ep_ (the counts, the load), or null

  std::vector<Held> held_;  // one per local routed slot
  Held shared_held_;
  int32_t shared_begin_ = 0, shared_count_ = 0;  // this rank's shard of the shared intermediate
  std::vector<float> shared_gate_;               // [H] when cfg.shared_expert_gate
  bool has_shared_gate_ = false;
  std::vector<float> bias_;  // [E] when cfg.use_score_bias
  bool has_bias_ = false;
  bool has_router_ = false;
  std::vector<float> router_bias_;  // [E], added to the computed logits, when given
  // Some routed expert bias was given: every local expert then needs all three.
  bool expert_bias_ = false;
  // Replica slots of each expert, for choosing one replica per pair.
  std::vector<int32_t> replica_begin_, replica_slots_;
  // All-to-all choice: the replica this rank keeps its pairs on (-1: none),
  // and per expert the weighted table for tokens of other ranks.
  std::vector<int32_t> a2a_local_, a2a_begin_, a2a_table_;

  // The plans, sized at create for max_tokens; forward allocates nothing.
  int64_t max_all_ = 0;       // tokens after the DP gather
  size_t row_bytes_ = 0;      // one gathered row: hidden + ids + weights
  size_t ids_off_ = 0;        // where the ids start: H * act size rounded up to 4 bytes
  std::vector<int32_t> ids_;  // the host top-k choice [rows, K]
  std::vector<float> weights_;
  std::vector<size_t> counts_, recv_words_, recv_count_;
  // forward()'s tokens with a NaN or Inf in their hidden row, and the copy
  // of the hidden rows with those rows zeroed (only when there are any).
  // Whether this EP group's ranks have checked that they agree on the layer
  // (the first forward, collective: check_agreement). Every rank fails,
  // naming the first difference, where they do not.
  bool agreed_ = false;
  static constexpr size_t kAgreeFields = 22;
  std::vector<int64_t> agree_all_;  // [ep_size, kAgreeFields]
  void check_agreement(Comm* ep, const ep_moe_forward_args_t& a);
  std::vector<int64_t> nonfinite_rows_;
  std::vector<uint8_t> clean_hidden_;
  // Finds them; on any, points a->hidden at the copy. True when any.
  bool hide_nonfinite_rows(ep_moe_forward_args_t* a);
  // Their output rows all NaN.
  void poison_rows(const ep_moe_forward_args_t& a) const;
  std::vector<int64_t> send_count_, send_off_, stamp_, cursor64_, count_row_, count_matrix_;
  std::vector<int32_t> send_tok_, dest_;
  std::vector<int64_t> back_off_, back_idx_;  // all-to-all combine: returned rows per own token (CSR)

  uint64_t bytes_loaded_ = 0;
  std::vector<int64_t> load_;  // [E] pairs computed here in the window
  int64_t load_steps_ = 0;
  int64_t replace_sent_ = 0, replace_received_ = 0, replace_read_ = 0, replace_kept_ = 0;
  Gather last_gather_ = Gather::None;
  int32_t last_dispatch_ = EP_MOE_DISPATCH_ALLGATHER, last_auto_choice_ = -1;
  double last_bytes_alltoall_ = 0, last_bytes_allgather_ = 0;
};

}  // namespace ep_moe

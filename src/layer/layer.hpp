// One rank's MoE layer on the CPU backend: the forward data flow of
// docs/architecture.md (route -> DP gather -> plan -> experts -> combine
// -> + shared -> one reduction).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm.hpp"
#include "comm/staged_comm.hpp"
#include "core/expert_map.hpp"
#include "core/routing.hpp"
#include "cpu/aligned.hpp"
#include "cpu/ffn.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/thread_pool.hpp"
#include "cuda/device_layer.hpp"
#include "ep_moe/ep_moe.h"
#include "io/checkpoint.hpp"

namespace ep_moe {

const char* weight_name(ep_moe_weight_t w);

class Layer {
 public:
  // Validates the config against the map and the communicators (throws).
  Layer(const ep_moe_layer_config_t& cfg, const ExpertMap& map, Comm* ep_comm, Comm* dp_comm);

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
  struct Expert {
    cpu::PackedWeight gate_up, down;
    bool has_gate = false, has_up = false, has_down = false;
    // Biases (routed experts, when the layer has them: expert_bias_), f32,
    // padded as cpu::ExpertJob reads them; empty until given.
    std::vector<float> gate_bias, up_bias, down_bias;
    bool complete() const { return has_gate && has_up && has_down; }
  };
  // Which parts of a checkpoint layer to read: the routed experts flagged
  // in `experts` (empty: every local one), this rank's shard of the shared
  // expert, and the small replicated weights (router, bias, shared gate).
  struct LoadParts {
    std::vector<char> experts;
    bool shared = true, others = true;
  };
  enum class Gather : int { None = 0, Padded = 1, Compact = 2 };

  void validate_forward(const ep_moe_forward_args_t& a, int64_t* dp_offset, int64_t* dp_padded, Gather* gather) const;
  // Forward steps (layer.cpp). `stages` is the step's list of collectives.
  void route_tokens(const ep_moe_forward_args_t& a);
  void route_all(const void* logits, ep_moe_dtype_t dtype, int64_t T);  // route() over the pool
  void forward_allgather(const ep_moe_forward_args_t& a, void* stages, int64_t dp_offset, int64_t padded,
                         Gather gather);
  void forward_alltoall(const ep_moe_forward_args_t& a, void* stages);
  void plan_sends(int64_t tokens);
  void exchange_counts(Comm* ep, const ep_moe_forward_args_t& a);
  // All-to-all, after exchange_counts: recv_count_ (rows from each rank) and
  // the per-rank element counts of the row exchange (`outbound`: counts_ =
  // sent, recv_words_ = received) or of the return trip (the reverse), at
  // `per_row` elements a row. Returns the rows received.
  int64_t a2a_counts(size_t per_row, bool outbound);
  // back_off_/back_idx_: each own token's returned rows (CSR, in send order).
  void build_back_csr(int64_t T);
  int32_t cheaper_mode(const ep_moe_forward_args_t& a, Gather gather, int64_t padded);
  int64_t plan_pairs(int64_t rows, const int32_t* ids, const float* w, bool assigned, int64_t* skipped);
  void add_expert_jobs();
  // The shared expert's job over rows [row0, row0 + n_rows) of x (f32), or
  // of x16 (bf16, ld16 apart) when x is null.
  void add_shared_job(const float* x, int64_t row0, int64_t n_rows, const int32_t* ids, const uint16_t* x16 = nullptr,
                      int64_t ld16 = 0);
  void record(int64_t tokens, int64_t local_pairs, int64_t skipped);
  void pack_row(char* row, const char* hidden, const int32_t* ids, const float* w) const;
  void unpack_ids(int64_t n);  // recv_rows_[0, n) -> ids_, weights_ (the rows stay)
  // The same, and the rows widened into x (on the pool) unless the experts
  // read them in place (direct_bf16_); returns the bytes written.
  int64_t unpack_rows(int64_t n, float* x);
  // n hidden rows in the activation dtype -> f32 (src rows src_stride bytes
  // apart, 0: packed), and back (on the pool).
  void widen_rows(const void* src, int64_t n, float* dst, size_t src_stride = 0);
  // The caller's n hidden rows as f32 rows of hidden_size: `hidden` itself
  // when the activations are f32 (and float-aligned), read where they are;
  // else widened into `scratch` (on the pool), the bytes widened added to
  // *bytes (if not null).
  const float* f32_rows(const void* hidden, int64_t n, float* scratch, int64_t* bytes);
  // n rows of hidden_size zeros at dst, over the pool.
  void zero_rows(float* dst, int64_t n);
  void narrow_rows(const float* src, int64_t n, void* dst);
  int32_t pick_slot_a2a(int32_t expert, int64_t token, int32_t k) const;
  void build_a2a_choice();
  void check_weight(ep_moe_weight_t which, int32_t expert) const;
  // Reads the chosen parts of a checkpoint layer (load.cpp).
  uint64_t load_parts(const io::Checkpoint& ck, int32_t layer_index, const LoadParts& parts);
  // Weights in the transfer format of replace.cpp: `n` units of
  // [gate row | up row | down column], H elements each, in weight_dtype.
  void extract_units(const Expert& x, int32_t j0, int32_t n, uint8_t* out) const;
  void store_units(int32_t expert, const uint8_t* units);  // expert -1: the shared shard
  // A routed expert's biases in the transfer format: [gate (I) | up (I) | down (H)], f32.
  void extract_biases(const Expert& x, uint8_t* out) const;
  void store_biases(int32_t expert, const uint8_t* in);
  static void copy_expert(Expert& dst, const Expert& src);
  // Stores a weight read through `src`; shared-expert sources are
  // shard-relative when `shard_relative`, else full size.
  // `src_on_device`: the source is device memory (CUDA layers only).
  bool store(ep_moe_weight_t which, int32_t expert, Source src, bool shard_relative, bool src_on_device = false);
  // CUDA layers (cfg.device >= 0): the device part and its forward.
  void store_device(ep_moe_weight_t which, int32_t expert, Source src, bool shard_relative, bool src_on_device);
  // The constructor's steps: replica tables, the flows' and host plans'
  // sizes, then the CPU workspace or the CUDA part (layer_device.cpp).
  void build_replica_tables();
  void size_plans(int64_t* max_rows, int64_t* send_rows, int64_t* fanout);
  void setup_cpu(int64_t max_rows, int64_t send_rows, int64_t fanout);
  void setup_device(int64_t max_rows, int64_t send_rows, int64_t fanout);
  bool route_device(const ep_moe_forward_args_t& a);
  void choice_to_host(const ep_moe_forward_args_t& a, bool capturing);
  // A collective on device buffers (staged through pinned host memory for
  // host communicators; `counts`: per-rank counts of the v variants).
  void dev_collective(Comm* c, CollectiveOp op, void* out, const void* in, size_t count, const size_t* counts,
                      const size_t* out_counts, ep_moe_dtype_t dt, void* stream, bool capturing);
  void device_allgather(const ep_moe_forward_args_t& a, void* stages, int64_t dp_offset, int64_t padded, Gather gather,
                        bool capturing);
  void device_alltoall(const ep_moe_forward_args_t& a, void* stages);
  // Host buffers over a device communicator (staged through device memory),
  // for the re-placement's records and weight units.
  std::unique_ptr<Comm> host_view(Comm* c);
  void set_gate_up_part(Expert& x, int half, const Source& src, int32_t inter, int32_t k);
  // A routed expert's gate, up, gate_up or down bias into its local slots.
  void store_expert_bias(ep_moe_weight_t which, int32_t expert, const Source& src);
  // Stores `n` values of a vector from `src` (column c0 on) into `dst`,
  // zero-padded to `padded` values; rejects values that are not finite.
  void set_bias(std::vector<float>& dst, const Source& src, int64_t c0, int64_t n, int64_t padded,
                ep_moe_weight_t which) const;
  void finish_gate_up(Expert& x, int32_t inter, int32_t k);
  int32_t pick_slot(int32_t expert, int64_t token, int32_t k) const;
  void compute_logits(const float* x, int64_t T, float* logits);
  static cpu::ExpertJob job(const Expert& x, int32_t inter, const int32_t* rows, const float* weights, int64_t n);

  ep_moe_layer_config_t cfg_;
  ExpertMap map_;
  Comm* ep_;
  Comm* dp_;
  int dp_size_ = 1, dp_rank_ = 0;
  bool dp_is_ep_ = false;
  int32_t dispatch_ = EP_MOE_DISPATCH_ALLGATHER;
  bool shared_replicated_ = false;  // all-to-all modes keep the whole shared expert
  bool direct_bf16_ = false;        // bf16 rows go straight into the bf16 tiles (no x_f32_)
  RoutingParams routing_;
  std::vector<RouteScratch> route_scratch_;  // one per pool thread (route_all)
  cpu::Act act_;

  const cpu::Kernels& kern_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  std::unique_ptr<cpu::FfnRunner> ffn_;
  std::unique_ptr<cuda::DeviceLayer> dev_;  // CUDA layers only
  std::unique_ptr<Comm> ep_staged_;         // CUDA layer, NCCL, all-to-all: host counts over ep_ (host_view)

  std::vector<Expert> experts_;  // one per local routed slot
  Expert shared_;
  int32_t shared_begin_ = 0, shared_count_ = 0;  // this rank's shard of the shared intermediate
  std::vector<float> shared_gate_;               // [H] when cfg.shared_expert_gate
  bool has_shared_gate_ = false;
  std::vector<float> bias_;   // [E] when cfg.use_score_bias
  cpu::PackedWeight router_;  // [E, H] f32, when given
  bool has_router_ = false;
  bool has_bias_ = false;
  std::vector<float> router_bias_;  // [E], added to the computed logits, when given
  // Some routed expert bias was given: every local expert then needs all three.
  bool expert_bias_ = false;
  // Replica slots of each expert, for choosing one replica per pair.
  std::vector<int32_t> replica_begin_, replica_slots_;
  // All-to-all choice: the replica this rank keeps its pairs on (-1: none),
  // and per expert the weighted table for tokens of other ranks.
  std::vector<int32_t> a2a_local_, a2a_begin_, a2a_table_;

  // Workspace, sized at create for max_tokens; forward allocates nothing.
  int64_t max_all_ = 0;   // tokens after the DP gather
  size_t row_bytes_ = 0;  // one gathered row: hidden + ids + weights
  size_t ids_off_ = 0;    // where the ids start: H * act size rounded up to 4 bytes
  AlignedBuffer send_rows_, recv_rows_, x_f32_, acc_, partial_, scatter_out_;
  AlignedBuffer own_x_, own_acc_, ret_send_, ret_recv_;  // own tokens; all-to-all returns
  std::vector<size_t> counts_, recv_words_, recv_count_;
  std::vector<int64_t> send_count_, send_off_, stamp_, cursor64_, count_row_, count_matrix_;
  std::vector<int32_t> send_tok_, dest_, cursor_, row_ids_;
  std::vector<int64_t> back_off_, back_idx_;  // all-to-all combine: returned rows per own token (CSR)
  std::vector<const void*> back_ptr_;         // the CPU combine: back_idx_'s rows in the received buffer
  std::vector<int32_t> ids_, pair_rows_, pair_count_, shared_rows_;
  std::vector<float> weights_, pair_weights_, shared_weights_, logits_;
  std::vector<cpu::ExpertJob> jobs_;

  uint64_t bytes_loaded_ = 0;
  std::vector<int64_t> load_;  // [E] pairs computed here in the window
  int64_t load_steps_ = 0;
  int64_t replace_sent_ = 0, replace_received_ = 0, replace_read_ = 0, replace_kept_ = 0;
  int64_t last_tokens_ = 0, last_local_pairs_ = 0, last_skipped_ = 0, last_active_ = 0;
  // This rank's time (and bytes) per phase of the last forward, collectives
  // excluded (EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS ...).
  struct PhaseTimes {
    int64_t permute_ns = 0, permute_bytes = 0, expert_ns = 0, combine_ns = 0, combine_bytes = 0;
  };
  PhaseTimes last_phase_;
  Gather last_gather_ = Gather::None;
  int32_t last_dispatch_ = EP_MOE_DISPATCH_ALLGATHER, last_auto_choice_ = -1;
  double last_bytes_alltoall_ = 0, last_bytes_allgather_ = 0;
};

}  // namespace ep_moe

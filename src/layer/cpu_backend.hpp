// The CPU backend of a layer (backend.hpp): weights packed into the panels
// the CPU tiles read, the layer's own thread pool, and the forward steps on
// host memory. cpu_backend.cpp holds the set-up, the weights and the
// routing; cpu_flows.cpp the all-gather and all-to-all flows.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/routing.hpp"
#include "cpu/aligned.hpp"
#include "cpu/ffn.hpp"
#include "cpu/kernels.hpp"
#include "cpu/pack.hpp"
#include "cpu/rows.hpp"
#include "cpu/thread_pool.hpp"
#include "layer/backend.hpp"
#include "layer/layer.hpp"

namespace ep_moe {

class CpuBackend final : public LayerBackend {
 public:
  CpuBackend(Layer& layer, int64_t max_rows, int64_t send_rows, int64_t fanout);

  void put(WeightPart part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
           bool src_on_device) override;
  bool takes_biases() const override { return true; }
  void routed_types(int32_t* gate_up, int32_t* down) const override {
    *gate_up = gu_type_;
    *down = down_type_;
  }
  int pointer_device(const void*) const override { return -1; }
  void download(void*, const void*, size_t) const override;
  void extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) const override;
  void extract_rows(int32_t slot, uint8_t* out) const override;
  void extract_biases(int32_t slot, uint8_t* out) const override;
  void keep_before_vote(const LayerBackend& old, const std::vector<KeptSlot>& kept, bool router) override;
  void keep_at_commit(LayerBackend& old, const std::vector<KeptSlot>& kept, bool router) noexcept override;
  bool keep_shared(const LayerBackend& old) override;

  void wake() override { pool_->wake(); }
  void route(const ep_moe_forward_args_t& a) override;
  void choice_to_host(const ep_moe_forward_args_t&) override {}  // route() wrote it there
  void allgather(const ep_moe_forward_args_t& a, Stages& st, int64_t dp_offset, int64_t padded, Gather gather) override;
  void alltoall(const ep_moe_forward_args_t& a, Stages& st) override;

  void read_load(int64_t*) override {}  // plan_pairs counts into the layer's window
  void reset_load() override {}
  bool attr(ep_moe_layer_attr_t a, int64_t* value) const override;
  std::unique_ptr<Comm> host_view(Comm*) override { return nullptr; }

 private:
  // One local slot's weights (or the shared shard's): gate/up interleaved
  // and down, packed; biases (when the layer has them) in f32, padded as
  // cpu::ExpertJob reads them.
  struct Slot {
    cpu::PackedWeight gate_up, down;
    std::vector<float> gate_bias, up_bias, down_bias;
  };
  // This rank's time (and bytes) per phase of the last forward, collectives
  // excluded (EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS ...).
  struct PhaseTimes {
    int64_t permute_ns = 0, permute_bytes = 0, expert_ns = 0, combine_ns = 0, combine_bytes = 0;
  };
  // The rows the experts read in a step: f32 rows (x), or bf16 rows read
  // where they are (x16, ld16 elements apart) when direct_bf16_.
  struct Rows {
    const float* x = nullptr;
    const uint16_t* x16 = nullptr;
    int64_t ld16 = 0;
  };

  // --- weights and routing (cpu_backend.cpp) ---------------------------------
  Slot& slot(int32_t s) { return s < 0 ? shared_ : slots_[static_cast<size_t>(s)]; }
  const Slot& slot(int32_t s) const { return s < 0 ? shared_ : slots_[static_cast<size_t>(s)]; }
  void put_gate_up_half(Slot& x, int half, const Source& src, int32_t inter, ep_moe_dtype_t dtype);
  // The storage type of a shared-expert part of k columns from `src`: its
  // block format, or a block weight_dtype's that floats are quantized to
  // (not dequantized values), where the columns are whole blocks; else
  // float_type_.
  ep_moe_dtype_t shared_type(const Source& src, int64_t k) const;
  // The shared expert's gate (half 0) or up (half 1): held in blocks when
  // both halves come in the same format, else both in float_type_.
  void put_shared_gate_up(int half, const Source& src, int32_t inter);
  // A block-format gate/up pair re-packed in float_type_, dequantized.
  void dequantize_gate_up(cpu::PackedWeight& gu, int32_t inter) const;
  // The storage type of a routed expert's part from a source of `src`:
  // a block format as it is, else weight_dtype; checked against the type
  // the part already has (*fixed, -1 before the first).
  ep_moe_dtype_t routed_type(ep_moe_dtype_t src, int32_t* fixed, const char* part) const;
  // A block-format part of format t: int8 activation rows and f32 x rows
  // (the first), the int8 tiles' room (the first of a format that has them).
  void enable_quant(ep_moe_dtype_t t);
  // `n` values into a bias padded to `padded` values.
  static void put_bias(std::vector<float>& dst, const Source& src, int64_t n, int64_t padded);
  void compute_logits(const float* x, int64_t T, float* logits);
  void route_all(const void* logits, ep_moe_dtype_t dtype, int64_t T);

  // --- the flows (cpu_flows.cpp) ------------------------------------------------
  // The all-gather flow's steps: the DP gather (returns the rows gathered),
  // the experts into acc, and the reduction into out.
  int64_t dp_gather(const ep_moe_forward_args_t& a, Stages& st, int64_t padded, Gather gather, Rows* rows,
                    PhaseTimes* ph);
  void reduce(const ep_moe_forward_args_t& a, Stages& st, float* acc, int64_t T_all, int64_t dp_offset, int64_t padded,
              Gather gather, PhaseTimes* ph);
  // The all-to-all flow's steps: rows out, the experts on the rows
  // received and their partial sums back, then the own tokens' combine.
  int64_t send_rows(const ep_moe_forward_args_t& a, Stages& st, PhaseTimes* ph);
  void experts_and_return(const ep_moe_forward_args_t& a, Stages& st, int64_t R, PhaseTimes* ph);
  void combine_own(const ep_moe_forward_args_t& a, PhaseTimes* ph);
  // The local pairs of `rows` rows (pair_rows_/pair_weights_ by local
  // slot, pair_count_ its CSR); counts the layer's load window.
  int64_t plan_pairs(int64_t rows, const int32_t* ids, const float* w, bool assigned, int64_t* skipped);
  void add_expert_jobs();
  // The shared expert's job over rows [row0, row0 + n_rows) (rows with a
  // DP padding id skipped when `ids`), gated when the layer has a gate.
  void add_shared_job(const Rows& x, int64_t row0, int64_t n_rows, const int32_t* ids);
  void record(int64_t tokens, int64_t local_pairs, int64_t skipped);
  void pack_row(char* row, const char* hidden, const int32_t* ids, const float* w) const;
  void unpack_ids(int64_t n);  // recv_rows_[0, n) -> the layer's ids_, weights_ (the rows stay)
  // The same, and the rows widened into x (on the pool) unless the experts
  // read them in place (direct_bf16_); returns the bytes written.
  int64_t unpack_rows(int64_t n, float* x);
  // The caller's n hidden rows as f32 rows of hidden_size: `hidden` itself
  // when the activations are f32 (and float-aligned), read where they are;
  // else widened into `scratch`, the bytes widened added to *bytes (if set).
  const float* f32_rows(const void* hidden, int64_t n, float* scratch, int64_t* bytes);
  cpu::ExpertJob job(const Slot& x, int32_t inter, const int32_t* rows, const float* weights, int64_t n) const;

  Layer& L_;
  const ep_moe_layer_config_t& cfg_;
  const cpu::Kernels& kern_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  // The matrix engine for prefill (null: none), borrowed by ffn_, so
  // declared before it; from engine_min_rows_ rows an expert.
  std::unique_ptr<cpu::MatrixEngine> engine_;
  int64_t engine_min_rows_ = 0;
  int64_t engine_mark_ = 0;  // ffn_->engine_rows() when the last forward began
  std::unique_ptr<cpu::FfnRunner> ffn_;
  std::unique_ptr<cpu::RowOps> rows_;
  cpu::Act act_;
  bool direct_bf16_ = false;                 // bf16 rows go straight into the bf16 tiles (no x_f32_)
  std::vector<RouteScratch> route_scratch_;  // one per pool thread (route_all)

  std::vector<Slot> slots_;  // one per local routed slot
  Slot shared_;
  cpu::PackedWeight router_;  // [E, H] f32, when given
  // The routed parts' storage types (-1: none stored yet), and the type of
  // the float parts (a shared expert given in floats, or whose blocks cannot
  // be kept): weight_dtype, or f32 when that is a block format (dequantized
  // values kept exactly).
  int32_t gu_type_ = -1, down_type_ = -1;
  ep_moe_dtype_t float_type_ = EP_MOE_DTYPE_F32;
  int64_t max_rows_ = 0;

  // Workspace, sized at create for max_tokens; forward allocates nothing.
  AlignedBuffer send_rows_, recv_rows_, x_f32_, acc_, partial_, scatter_out_;
  AlignedBuffer own_x_, own_acc_, ret_send_, ret_recv_;  // own tokens; all-to-all returns
  std::vector<int32_t> cursor_, row_ids_;
  std::vector<const void*> back_ptr_;  // the combine: the layer's back_idx_ rows in the received buffer
  std::vector<int32_t> pair_rows_, pair_count_, shared_rows_;
  std::vector<float> pair_weights_, shared_weights_, logits_;
  std::vector<cpu::ExpertJob> jobs_;

  // Picks and sets up the matrix engine (cpu::matrix_engine_policy()).
  void set_up_engine();
  int64_t last_tokens_ = 0, last_local_pairs_ = 0, last_skipped_ = 0, last_active_ = 0;
  PhaseTimes last_phase_;
};

}  // namespace ep_moe

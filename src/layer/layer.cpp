#include "layer/layer.hpp"
#include "layer/stages.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace ep_moe {

namespace {
constexpr int32_t kMaxHidden = 1 << 16;
constexpr int32_t kMaxInter = 1 << 18;
constexpr int32_t kMaxTokens = 1 << 20;
constexpr int32_t kMaxThreads = 1024;
constexpr int64_t kMaxChunkPairs = 2048;

size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

// Row conversions with the CPU's vector converters (the dtype chosen once
// per row, bit-identical to the scalar ones).
void convert_row(const cpu::Kernels& k, float* dst, const void* src, ep_moe_dtype_t dt, int64_t n) {
  if (dt == EP_MOE_DTYPE_F32) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  else if (dt == EP_MOE_DTYPE_BF16) k.from_bf16(static_cast<const uint16_t*>(src), dst, n);
  else k.from_f16(static_cast<const uint16_t*>(src), dst, n);
}

void store_row(const cpu::Kernels& k, void* dst, ep_moe_dtype_t dt, const float* src, int64_t n) {
  if (dt == EP_MOE_DTYPE_F32) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  else if (dt == EP_MOE_DTYPE_BF16) k.to_bf16(src, static_cast<uint16_t*>(dst), n);
  else k.to_f16(src, static_cast<uint16_t*>(dst), n);
}

// Whether p may be read and written as floats.
bool float_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(float) == 0; }

// Whether two regions of `bytes` bytes share any byte.
// Tensors of one routed expert (addressed by global expert id).
bool routed_weight(ep_moe_weight_t w) {
  return w <= EP_MOE_WEIGHT_EXPERT_GATE_UP ||
         (w >= EP_MOE_WEIGHT_EXPERT_GATE_BIAS && w <= EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS);
}

bool overlap(const void* a, const void* b, size_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}

}  // namespace

const char* weight_name(ep_moe_weight_t w) {
  switch (w) {
    case EP_MOE_WEIGHT_EXPERT_GATE: return "expert gate_proj";
    case EP_MOE_WEIGHT_EXPERT_UP: return "expert up_proj";
    case EP_MOE_WEIGHT_EXPERT_DOWN: return "expert down_proj";
    case EP_MOE_WEIGHT_EXPERT_GATE_UP: return "expert gate_up_proj";
    case EP_MOE_WEIGHT_SHARED_GATE: return "shared gate_proj";
    case EP_MOE_WEIGHT_SHARED_UP: return "shared up_proj";
    case EP_MOE_WEIGHT_SHARED_DOWN: return "shared down_proj";
    case EP_MOE_WEIGHT_SHARED_GATE_UP: return "shared gate_up_proj";
    case EP_MOE_WEIGHT_SHARED_EXPERT_GATE: return "shared_expert_gate";
    case EP_MOE_WEIGHT_SCORE_BIAS: return "score-correction bias";
    case EP_MOE_WEIGHT_ROUTER: return "router (gate) weight";
    case EP_MOE_WEIGHT_EXPERT_GATE_BIAS: return "expert gate_proj bias";
    case EP_MOE_WEIGHT_EXPERT_UP_BIAS: return "expert up_proj bias";
    case EP_MOE_WEIGHT_EXPERT_DOWN_BIAS: return "expert down_proj bias";
    case EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS: return "expert gate_up_proj bias";
    case EP_MOE_WEIGHT_ROUTER_BIAS: return "router bias";
    default: break;
  }
  return "unknown weight";
}

namespace {
// Every check of a layer's configuration, against its map and communicators
// too (throws INVALID_ARGUMENT naming the field); nothing is set up before.
void validate(const ep_moe_layer_config_t& c, const ExpertMap& map, const Comm* ep, const Comm* dp) {
  EP_MOE_CHECK_ARG(c.hidden_size >= 1 && c.hidden_size <= kMaxHidden, "hidden_size must be in [1, %d], got %d",
                   kMaxHidden, c.hidden_size);
  EP_MOE_CHECK_ARG(c.intermediate_size >= 1 && c.intermediate_size <= kMaxInter,
                   "intermediate_size must be in [1, %d], got %d", kMaxInter, c.intermediate_size);
  EP_MOE_CHECK_ARG(c.num_experts == map.num_experts(),
                   "num_experts %d differs from the expert map's global_num_experts %d", c.num_experts,
                   map.num_experts());
  EP_MOE_CHECK_ARG(c.top_k >= 1 && c.top_k <= c.num_experts, "top_k must be in [1, num_experts=%d], got %d",
                   c.num_experts, c.top_k);
  EP_MOE_CHECK_ARG(c.activation >= EP_MOE_ACT_SILU && c.activation <= EP_MOE_ACT_SWIGLU_OAI,
                   "activation %d is not an ep_moe_activation_t value", c.activation);
  EP_MOE_CHECK_ARG(dtype_is_float(static_cast<ep_moe_dtype_t>(c.weight_dtype)),
                   "weight_dtype %d is not f32, bf16 or f16", c.weight_dtype);
  EP_MOE_CHECK_ARG(dtype_is_float(static_cast<ep_moe_dtype_t>(c.act_dtype)), "act_dtype %d is not f32, bf16 or f16",
                   c.act_dtype);
  EP_MOE_CHECK_ARG(dtype_is_float(static_cast<ep_moe_dtype_t>(c.router_dtype)),
                   "router_dtype %d is not f32, bf16 or f16", c.router_dtype);
  EP_MOE_CHECK_ARG(c.scoring == EP_MOE_SCORING_SOFTMAX || c.scoring == EP_MOE_SCORING_SIGMOID,
                   "scoring %d is not an ep_moe_scoring_t value", c.scoring);
  EP_MOE_CHECK_ARG(c.num_expert_group >= 0, "num_expert_group must be >= 0, got %d", c.num_expert_group);
  if (c.num_expert_group > 0) {
    EP_MOE_CHECK_ARG(c.num_experts % c.num_expert_group == 0, "num_expert_group %d does not divide num_experts %d",
                     c.num_expert_group, c.num_experts);
    EP_MOE_CHECK_ARG(c.topk_group >= 1 && c.topk_group <= c.num_expert_group,
                     "topk_group must be in [1, num_expert_group=%d], got %d", c.num_expert_group, c.topk_group);
    EP_MOE_CHECK_ARG(c.top_k <= c.topk_group * (c.num_experts / c.num_expert_group),
                     "top_k %d exceeds the experts of topk_group=%d groups", c.top_k, c.topk_group);
  }
  EP_MOE_CHECK_ARG(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor != 0.0f,
                   "routed_scaling_factor must be finite and nonzero, got %g",
                   static_cast<double>(c.routed_scaling_factor));
  EP_MOE_CHECK_ARG(c.shared_intermediate_size >= 0 && c.shared_intermediate_size <= kMaxInter,
                   "shared_intermediate_size must be in [0, %d], got %d", kMaxInter, c.shared_intermediate_size);
  EP_MOE_CHECK_ARG(!c.shared_expert_gate || c.shared_intermediate_size > 0,
                   "shared_expert_gate needs a shared expert (shared_intermediate_size > 0)");
  EP_MOE_CHECK_ARG(c.max_tokens >= 1 && c.max_tokens <= kMaxTokens, "max_tokens must be in [1, %d], got %d", kMaxTokens,
                   c.max_tokens);
  EP_MOE_CHECK_ARG(c.num_threads >= 0 && c.num_threads <= kMaxThreads, "num_threads must be in [0, %d], got %d",
                   kMaxThreads, c.num_threads);
  EP_MOE_CHECK_ARG(c.skip_mode == EP_MOE_SKIP_TOKENS || c.skip_mode == EP_MOE_SKIP_WEIGHT_ZERO,
                   "skip_mode %d is not an ep_moe_skip_mode_t value", c.skip_mode);
  EP_MOE_CHECK_ARG(map.num_fused_shared() == 0,
                   "the expert map has %d fused shared experts; the layer runs its shared expert itself "
                   "(shared_intermediate_size), so pass a map without them",
                   map.num_fused_shared());
  if (ep) {
    EP_MOE_CHECK_ARG(ep->size() == map.ep_size() && ep->rank() == map.ep_rank(),
                     "ep_comm is rank %d of %d but the expert map is rank %d of %d", ep->rank(), ep->size(),
                     map.ep_rank(), map.ep_size());
  }
  if (dp) {
    EP_MOE_CHECK_ARG(ep != nullptr, "dp_comm needs an ep_comm: DP attention reduces over the EP group");
    EP_MOE_CHECK_ARG(ep->size() % dp->size() == 0, "dp_comm size %d does not divide the EP size %d", dp->size(),
                     ep->size());
  }
  EP_MOE_CHECK_ARG(c.dispatch_mode >= EP_MOE_DISPATCH_ALLGATHER && c.dispatch_mode <= EP_MOE_DISPATCH_AUTO,
                   "dispatch_mode %d is not an ep_moe_dispatch_mode_t value", c.dispatch_mode);
  if (c.dispatch_mode != EP_MOE_DISPATCH_ALLGATHER) {
    EP_MOE_CHECK_ARG(ep != nullptr, "dispatch_mode all-to-all/auto needs an ep_comm");
    EP_MOE_CHECK_ARG(dp == nullptr || dp == ep,
                     "dispatch_mode all-to-all/auto needs dp_comm NULL or the ep_comm handle itself (every rank its "
                     "own DP replica); use all-gather for other DP layouts");
    EP_MOE_CHECK_ARG(c.skip_mode == EP_MOE_SKIP_TOKENS, "skip_mode weight-0 exists only for the all-gather dispatch");
  }
  EP_MOE_CHECK_ARG(c.device >= -1, "device must be -1 (CPU) or a CUDA device ordinal, got %d", c.device);
  EP_MOE_CHECK_ARG(c.sync_free_tokens >= 0, "sync_free_tokens must be >= 0, got %d", c.sync_free_tokens);
}
}  // namespace

Layer::Layer(const ep_moe_layer_config_t& c, const ExpertMap& map, Comm* ep_comm, Comm* dp_comm)
    : cfg_(c), map_(map), ep_(ep_comm), dp_(dp_comm), kern_(cpu::layer_kernels()) {
  validate(c, map, ep_, dp_);
  if (dp_) {
    dp_size_ = dp_->size();
    dp_rank_ = dp_->rank();
    dp_is_ep_ = dp_ == ep_;
  }
  dispatch_ = c.dispatch_mode;
  shared_replicated_ = dispatch_ != EP_MOE_DISPATCH_ALLGATHER;  // all-to-all modes keep the whole shared expert
  routing_.num_experts = c.num_experts;
  routing_.top_k = c.top_k;
  routing_.sigmoid = c.scoring == EP_MOE_SCORING_SIGMOID;
  routing_.renormalize = c.renormalize != 0;
  routing_.num_group = c.num_expert_group;
  routing_.topk_group = c.topk_group;
  routing_.scale = c.routed_scaling_factor;
  act_ = static_cast<cpu::Act>(c.activation);

  experts_.resize(static_cast<size_t>(map.num_local_routed()));
  if (c.shared_intermediate_size > 0) {
    // All-gather: TP-sharded over the EP group (seed 000); all-to-all: whole.
    shared_begin_ = shared_replicated_ ? 0 : split_start(c.shared_intermediate_size, map.ep_size(), map.ep_rank());
    shared_count_ = shared_replicated_ ? c.shared_intermediate_size
                                       : split_count(c.shared_intermediate_size, map.ep_size(), map.ep_rank());
    if (c.shared_expert_gate) shared_gate_.assign(static_cast<size_t>(c.hidden_size), 0.0f);
  }
  if (c.use_score_bias) bias_.assign(static_cast<size_t>(c.num_experts), 0.0f);
  load_.assign(static_cast<size_t>(c.num_experts), 0);
  build_replica_tables();
  build_a2a_choice();

  int64_t max_rows = 0, send_rows = 0, fanout = 0;
  size_plans(&max_rows, &send_rows, &fanout);
  if (c.device >= 0) {  // routes on the device: no route_scratch_
    setup_device(max_rows, send_rows, fanout);
    return;
  }
  setup_cpu(max_rows, send_rows, fanout);
}

void Layer::build_replica_tables() {
  // Replica slots of each expert (one slot unless the map has replicas).
  const auto& p2g = map_.physical_to_global();
  replica_begin_.assign(static_cast<size_t>(cfg_.num_experts) + 1, 0);
  for (int32_t e : p2g) ++replica_begin_[static_cast<size_t>(e) + 1];
  for (size_t e = 0; e < static_cast<size_t>(cfg_.num_experts); ++e) replica_begin_[e + 1] += replica_begin_[e];
  replica_slots_.resize(p2g.size());
  std::vector<int32_t> fill(replica_begin_.begin(), replica_begin_.end() - 1);
  for (size_t s = 0; s < p2g.size(); ++s)
    replica_slots_[static_cast<size_t>(fill[static_cast<size_t>(p2g[s])]++)] = static_cast<int32_t>(s);
}

void Layer::size_plans(int64_t* max_rows_out, int64_t* send_rows_out, int64_t* fanout_out) {
  // Sizes of the flows and the host plan arrays, for either backend.
  const ep_moe_layer_config_t& c = cfg_;
  const int64_t H = c.hidden_size, K = c.top_k, T = c.max_tokens;
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(c.act_dtype));
  const int64_t ep = map_.ep_size();
  const bool a2a = dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  const int64_t fanout = std::min<int64_t>(ep, K);  // rows a token sends (all-to-all)
  max_all_ = T * dp_size_;
  const int64_t max_rows = std::max<int64_t>(max_all_, a2a ? ep * T : 0);  // rows experts may see
  // [hidden | K ids | K weights], the ids on a 4-byte boundary (bf16 or f16
  // with an odd hidden size would misalign them; a GPU faults on that).
  ids_off_ = round_up(static_cast<size_t>(H) * es, 4);
  row_bytes_ = ids_off_ + static_cast<size_t>(K) * 8;
  const int64_t send_rows = std::max<int64_t>(dp_size_ > 1 ? T : 0, a2a ? T * fanout : 0);
  if (a2a) {
    send_tok_.resize(static_cast<size_t>(T * fanout));
    back_off_.resize(static_cast<size_t>(T) + 1);
    back_idx_.resize(static_cast<size_t>(T * fanout));
    back_ptr_.resize(static_cast<size_t>(T * fanout));
    dest_.resize(static_cast<size_t>(T * K));
    send_count_.resize(static_cast<size_t>(ep));
    send_off_.resize(static_cast<size_t>(ep) + 1);
    stamp_.resize(static_cast<size_t>(ep));
    cursor64_.resize(static_cast<size_t>(ep));
    count_row_.resize(static_cast<size_t>(ep) + 1);
    count_matrix_.resize(static_cast<size_t>(ep * (ep + 1)));
    recv_words_.resize(static_cast<size_t>(ep));
    recv_count_.resize(static_cast<size_t>(ep));
  }
  counts_.resize(static_cast<size_t>(std::max<int64_t>(ep, dp_size_)));
  ids_.resize(static_cast<size_t>(max_rows * K));
  weights_.resize(static_cast<size_t>(max_rows * K));
  *max_rows_out = max_rows;
  *send_rows_out = send_rows;
  *fanout_out = fanout;
}

void Layer::setup_cpu(int64_t max_rows, int64_t send_rows, int64_t fanout) {
  // CPU threads and workspace, sized for max_tokens: forward allocates nothing.
  const ep_moe_layer_config_t& c = cfg_;
  const int64_t H = c.hidden_size, K = c.top_k, T = c.max_tokens, ep = map_.ep_size();
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(c.act_dtype));
  const bool a2a = dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  pool_ = std::make_unique<cpu::ThreadPool>(cpu::default_threads(c.num_threads, ep_ ? ep_->ranks_in_process() : 1));
  if (send_rows > 0) send_rows_.resize(static_cast<size_t>(send_rows) * row_bytes_);
  if (dp_size_ > 1 || a2a) recv_rows_.resize(static_cast<size_t>(max_rows) * row_bytes_);
  const int64_t chunk = std::min<int64_t>(kMaxChunkPairs, max_rows * (K + 1));
  ffn_ = std::make_unique<cpu::FfnRunner>(kern_, c.hidden_size, std::max(c.intermediate_size, shared_count_), chunk,
                                          c.act_dtype == EP_MOE_DTYPE_BF16);
  // bf16 rows straight into the bf16 tiles: no f32 copy of the rows at all.
  direct_bf16_ = ffn_->reads_bf16_rows(static_cast<ep_moe_dtype_t>(c.weight_dtype));
  if (!direct_bf16_) x_f32_.resize(static_cast<size_t>(max_rows * H) * 4);
  acc_.resize(static_cast<size_t>(max_rows * H) * 4);
  own_x_.resize(static_cast<size_t>(T * H) * 4);
  if (c.act_dtype != EP_MOE_DTYPE_F32) partial_.resize(static_cast<size_t>(max_all_ * H) * es);
  if (dp_is_ep_) scatter_out_.resize(static_cast<size_t>(T * H) * es);
  if (a2a) {
    own_acc_.resize(static_cast<size_t>(T * H) * 4);
    ret_send_.resize(static_cast<size_t>(ep * T * H) * es);
    ret_recv_.resize(static_cast<size_t>(T * fanout * H) * es);
    row_ids_.resize(static_cast<size_t>(K) * static_cast<size_t>(pool_->size()));  // K per pool thread
  }
  logits_.resize(static_cast<size_t>(T) * static_cast<size_t>(c.num_experts));
  pair_rows_.resize(static_cast<size_t>(max_rows * K));
  pair_weights_.resize(static_cast<size_t>(max_rows * K));
  pair_count_.resize(experts_.size() + 1);
  cursor_.resize(experts_.size());
  shared_rows_.resize(static_cast<size_t>(max_rows));
  shared_weights_.resize(static_cast<size_t>(max_rows));
  jobs_.reserve(experts_.size() + 1);
  ffn_->reserve_jobs(jobs_.capacity());
  route_scratch_.resize(static_cast<size_t>(pool_->size()));
  for (RouteScratch& rs : route_scratch_) rs.fit(routing_);

  log(EP_MOE_LOG_INFO,
      "[EP rank %d/%d] MoE layer: H=%d I=%d E=%d top-%d, %d local experts, shared shard %d/%d, dp %d, %d threads, "
      "%s kernels",
      map_.ep_rank(), map_.ep_size(), c.hidden_size, c.intermediate_size, c.num_experts, c.top_k,
      map_.num_local_routed(), shared_count_, c.shared_intermediate_size, dp_size_, pool_->size(),
      cpu::isa_name(kern_.isa));
}

void Layer::set_gate_up_part(Expert& x, int half, const Source& src, int32_t inter, int32_t k) {
  if (x.gate_up.empty())
    cpu::init_gate_up(x.gate_up, inter, k, kern_.nr, static_cast<ep_moe_dtype_t>(cfg_.weight_dtype));
  cpu::pack_gate_up_half(x.gate_up, src, half, inter);
  (half == 0 ? x.has_gate : x.has_up) = true;
}

void Layer::expected_shape(ep_moe_weight_t which, int64_t* rows, int64_t* cols) const {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size, Is = cfg_.shared_intermediate_size;
  switch (which) {
    case EP_MOE_WEIGHT_EXPERT_GATE:
    case EP_MOE_WEIGHT_EXPERT_UP:
      *rows = I;
      *cols = H;
      return;
    case EP_MOE_WEIGHT_EXPERT_DOWN:
      *rows = H;
      *cols = I;
      return;
    case EP_MOE_WEIGHT_EXPERT_GATE_UP:
      *rows = 2 * static_cast<int64_t>(I);
      *cols = H;
      return;
    case EP_MOE_WEIGHT_SHARED_GATE:
    case EP_MOE_WEIGHT_SHARED_UP:
      *rows = Is;
      *cols = H;
      return;
    case EP_MOE_WEIGHT_SHARED_DOWN:
      *rows = H;
      *cols = Is;
      return;
    case EP_MOE_WEIGHT_SHARED_GATE_UP:
      *rows = 2 * static_cast<int64_t>(Is);
      *cols = H;
      return;
    case EP_MOE_WEIGHT_SHARED_EXPERT_GATE:
      *rows = 1;
      *cols = H;
      return;
    case EP_MOE_WEIGHT_SCORE_BIAS:
      *rows = 1;
      *cols = cfg_.num_experts;
      return;
    case EP_MOE_WEIGHT_ROUTER:
      *rows = cfg_.num_experts;
      *cols = H;
      return;
    case EP_MOE_WEIGHT_EXPERT_GATE_BIAS:
    case EP_MOE_WEIGHT_EXPERT_UP_BIAS:
      *rows = 1;
      *cols = I;
      return;
    case EP_MOE_WEIGHT_EXPERT_DOWN_BIAS:
      *rows = 1;
      *cols = H;
      return;
    case EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS:
      *rows = 1;
      *cols = 2 * static_cast<int64_t>(I);
      return;
    case EP_MOE_WEIGHT_ROUTER_BIAS:
      *rows = 1;
      *cols = cfg_.num_experts;
      return;
    default: break;
  }
  fail(EP_MOE_ERR_INVALID_ARGUMENT, "which %d is not an ep_moe_weight_t value", static_cast<int>(which));
}

void Layer::check_weight(ep_moe_weight_t which, int32_t expert) const {
  int64_t r, c;
  expected_shape(which, &r, &c);  // rejects unknown values
  if (routed_weight(which))
    EP_MOE_CHECK_ARG(expert >= 0 && expert < cfg_.num_experts, "expert %d is outside [0, %d)", expert,
                     cfg_.num_experts);
  if (which >= EP_MOE_WEIGHT_SHARED_GATE && which <= EP_MOE_WEIGHT_SHARED_GATE_UP)
    EP_MOE_CHECK_ARG(cfg_.shared_intermediate_size > 0, "%s given, but the layer has no shared expert",
                     weight_name(which));
  if (which == EP_MOE_WEIGHT_SHARED_EXPERT_GATE)
    EP_MOE_CHECK_ARG(cfg_.shared_expert_gate, "shared_expert_gate given, but the config has shared_expert_gate = 0");
  if (which == EP_MOE_WEIGHT_SCORE_BIAS)
    EP_MOE_CHECK_ARG(cfg_.use_score_bias, "score-correction bias given, but the config has use_score_bias = 0");
}

bool Layer::set_weight(ep_moe_weight_t which, int32_t expert, const void* data, ep_moe_dtype_t dtype, int64_t rows,
                       int64_t cols) {
  EP_MOE_CHECK_ARG(dtype_is_float(dtype), "dtype %d is not f32, bf16 or f16", static_cast<int>(dtype));
  check_weight(which, expert);
  int64_t r, c;
  expected_shape(which, &r, &c);
  EP_MOE_CHECK_ARG(rows == r && cols == c, "%s must be [%lld, %lld], got [%lld, %lld]", weight_name(which),
                   static_cast<long long>(r), static_cast<long long>(c), static_cast<long long>(rows),
                   static_cast<long long>(cols));
  EP_MOE_CHECK_ARG(data != nullptr, "data is NULL");
  const int on = dev_ && wants(which, expert) ? dev_->pointer_device(data) : -1;
  EP_MOE_CHECK_ARG(on < 0 || on == cfg_.device, "data is memory of CUDA device %d, but the layer is on device %d", on,
                   cfg_.device);
  if (on >= 0) {
    if (which == EP_MOE_WEIGHT_SCORE_BIAS || which == EP_MOE_WEIGHT_SHARED_EXPERT_GATE) {
      // Small vectors the layer checks on the host: read them back first.
      std::vector<char> host(static_cast<size_t>(rows * cols) * dtype_size(dtype));
      dev_->download(host.data(), data, host.size());
      return store(which, expert, Source{host.data(), dtype, cols}, false);
    }
    return store(which, expert, Source{data, dtype, cols}, false, true);
  }
  return store(which, expert, Source{data, dtype, cols}, false);
}

bool Layer::wants(ep_moe_weight_t which, int32_t expert) const {
  if (routed_weight(which)) return map_.is_local(expert);
  if (which >= EP_MOE_WEIGHT_SHARED_GATE && which <= EP_MOE_WEIGHT_SHARED_GATE_UP) return shared_count_ > 0;
  return true;
}

bool Layer::store(ep_moe_weight_t which, int32_t expert, Source src, bool shard_relative, bool src_on_device) {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size, Is = cfg_.shared_intermediate_size;
  const auto wdt = static_cast<ep_moe_dtype_t>(cfg_.weight_dtype);
  if (!wants(which, expert)) return false;  // another rank's expert, or no shared shard here
  const bool bias = (which >= EP_MOE_WEIGHT_EXPERT_GATE_BIAS && which <= EP_MOE_WEIGHT_ROUTER_BIAS);
  if (dev_ && bias)
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: the CUDA backend has no expert or router biases; use a CPU layer (device -1)",
         weight_name(which));
  if (dev_ && which != EP_MOE_WEIGHT_SCORE_BIAS && which != EP_MOE_WEIGHT_SHARED_EXPERT_GATE) {
    store_device(which, expert, src, shard_relative, src_on_device);
    return true;
  }
  if (bias && which != EP_MOE_WEIGHT_ROUTER_BIAS) {
    store_expert_bias(which, expert, src);
    return true;
  }
  if (routed_weight(which)) {
    const auto& l2g = map_.local_to_global();
    for (size_t l = 0; l < experts_.size(); ++l) {
      if (l2g[l] != expert) continue;
      Expert& x = experts_[l];
      switch (which) {
        case EP_MOE_WEIGHT_EXPERT_GATE: set_gate_up_part(x, 0, src, I, H); break;
        case EP_MOE_WEIGHT_EXPERT_UP: set_gate_up_part(x, 1, src, I, H); break;
        case EP_MOE_WEIGHT_EXPERT_GATE_UP: {
          Source up = src;
          up.row0 += I;  // logical rows, whatever the storage order
          set_gate_up_part(x, 0, src, I, H);
          set_gate_up_part(x, 1, up, I, H);
          break;
        }
        default:
          cpu::pack(x.down, src, H, I, kern_.nr, wdt);
          x.has_down = true;
          break;
      }
    }
    return true;
  }
  if (which >= EP_MOE_WEIGHT_SHARED_GATE && which <= EP_MOE_WEIGHT_SHARED_GATE_UP) {
    // Full-size sources are narrowed to this rank's shard here; a loader that
    // already read only the shard passes shard-relative coordinates.
    const int64_t first = shard_relative ? 0 : shared_begin_;
    const int64_t up_rows = shard_relative ? shared_count_ : Is;
    switch (which) {
      case EP_MOE_WEIGHT_SHARED_GATE:
      case EP_MOE_WEIGHT_SHARED_UP:
        src.row0 += first;
        set_gate_up_part(shared_, which == EP_MOE_WEIGHT_SHARED_GATE ? 0 : 1, src, shared_count_, H);
        break;
      case EP_MOE_WEIGHT_SHARED_GATE_UP: {
        Source up = src;
        src.row0 += first;
        up.row0 += up_rows + first;
        set_gate_up_part(shared_, 0, src, shared_count_, H);
        set_gate_up_part(shared_, 1, up, shared_count_, H);
        break;
      }
      default:  // down [H, Is]: this rank's columns
        src.col0 += first;
        cpu::pack(shared_.down, src, H, shared_count_, kern_.nr, wdt);
        shared_.has_down = true;
        break;
    }
    return true;
  }
  if (which == EP_MOE_WEIGHT_ROUTER) {
    // Routing is sensitive: the router is kept in f32 whatever weight_dtype says.
    cpu::pack(router_, src, cfg_.num_experts, H, kern_.nr, EP_MOE_DTYPE_F32);
    has_router_ = true;
    return true;
  }
  if (which == EP_MOE_WEIGHT_ROUTER_BIAS) {
    set_bias(router_bias_, src, 0, cfg_.num_experts, cfg_.num_experts, which);
    return true;
  }
  std::vector<float>& dst = which == EP_MOE_WEIGHT_SCORE_BIAS ? bias_ : shared_gate_;
  std::vector<float> v;
  const auto n = static_cast<int64_t>(dst.size());
  set_bias(v, src, 0, n, n, which);
  if (dev_)
    dev_->upload(which == EP_MOE_WEIGHT_SCORE_BIAS ? cuda::Part::Bias : cuda::Part::SharedGate, 0, 0,
                 Source{v.data(), EP_MOE_DTYPE_F32, static_cast<int64_t>(v.size())}, 1, static_cast<int64_t>(v.size()),
                 false);
  dst = std::move(v);
  (which == EP_MOE_WEIGHT_SCORE_BIAS ? has_bias_ : has_shared_gate_) = true;
  if (which == EP_MOE_WEIGHT_SCORE_BIAS) routing_.bias = bias_.data();
  return true;
}

void Layer::store_expert_bias(ep_moe_weight_t which, int32_t expert, const Source& src) {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size, h = kern_.nr / 2;
  const int64_t ipad = (I + h - 1) / h * h, hpad = (H + kern_.nr - 1) / kern_.nr * kern_.nr;
  // Checked for every local slot before any is changed: a bad value stores nothing.
  std::vector<float> g, u, d;
  if (which == EP_MOE_WEIGHT_EXPERT_GATE_BIAS || which == EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS)
    set_bias(g, src, 0, I, ipad, which);
  if (which == EP_MOE_WEIGHT_EXPERT_UP_BIAS) set_bias(u, src, 0, I, ipad, which);
  if (which == EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS) set_bias(u, src, I, I, ipad, which);
  if (which == EP_MOE_WEIGHT_EXPERT_DOWN_BIAS) set_bias(d, src, 0, H, hpad, which);
  const auto& l2g = map_.local_to_global();
  for (size_t l = 0; l < experts_.size(); ++l) {
    if (l2g[l] != expert) continue;
    Expert& x = experts_[l];
    if (!g.empty()) x.gate_bias = g;
    if (!u.empty()) x.up_bias = u;
    if (!d.empty()) x.down_bias = d;
  }
  expert_bias_ = true;
}

void Layer::set_bias(std::vector<float>& dst, const Source& src, int64_t c0, int64_t n, int64_t padded,
                     ep_moe_weight_t which) const {
  std::vector<float> v(static_cast<size_t>(padded), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = source_at(src, 0, c0 + i);
    EP_MOE_CHECK_ARG(std::isfinite(v[static_cast<size_t>(i)]), "%s[%lld] is not finite", weight_name(which),
                     static_cast<long long>(c0 + i));
  }
  dst = std::move(v);
}

std::string Layer::missing_weight() const {
  const auto& l2g = map_.local_to_global();
  for (size_t l = 0; l < experts_.size(); ++l) {
    const Expert& x = experts_[l];
    const char* what = !x.has_gate ? "gate_proj" : !x.has_up ? "up_proj" : !x.has_down ? "down_proj" : nullptr;
    if (!what && expert_bias_)
      what = x.gate_bias.empty()   ? "gate_proj bias (other experts have biases)"
             : x.up_bias.empty()   ? "up_proj bias (other experts have biases)"
             : x.down_bias.empty() ? "down_proj bias (other experts have biases)"
                                   : nullptr;
    if (what) return format("expert %d (local %zu) has no %s", l2g[l], l, what);
  }
  if (shared_count_ > 0) {
    const char* what = !shared_.has_gate   ? "gate_proj"
                       : !shared_.has_up   ? "up_proj"
                       : !shared_.has_down ? "down_proj"
                                           : nullptr;
    if (what) return format("the shared expert has no %s", what);
  }
  if (cfg_.shared_expert_gate && !has_shared_gate_) return "the shared expert gate weight is not set";
  if (cfg_.use_score_bias && !has_bias_) return "the score-correction bias is not set";
  return "";
}

void Layer::compute_logits(const float* x, int64_t T, float* logits) {
  const int nr = kern_.nr, mr = kern_.mr;
  const int64_t H = cfg_.hidden_size, E = cfg_.num_experts;
  const size_t blocks = static_cast<size_t>((T + mr - 1) / mr);
  pool_->parallel_for(blocks, [&](size_t b, int) {
    const float* a[16];
    float c[16 * 32];
    const int64_t t0 = static_cast<int64_t>(b) * mr;
    const int m = static_cast<int>(std::min<int64_t>(mr, T - t0));
    for (int i = 0; i < m; ++i) a[i] = x + (t0 + i) * H;
    for (int32_t p = 0; p < router_.panels(); ++p) {
      kern_.gemm[EP_MOE_DTYPE_F32](m, a, static_cast<int>(H), router_.panel(p), c, nr,
                                   p + 1 < router_.panels() ? router_.panel(p + 1) : nullptr);
      const int64_t col0 = static_cast<int64_t>(p) * nr;
      const int64_t n = std::min<int64_t>(nr, E - col0);
      const float* rb = router_bias_.empty() ? nullptr : router_bias_.data() + col0;
      for (int i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) logits[(t0 + i) * E + col0 + j] = c[i * nr + j] + (rb ? rb[j] : 0.0f);
    }
  });
}

cpu::ExpertJob Layer::job(const Expert& x, int32_t inter, const int32_t* rows, const float* weights, int64_t n) {
  cpu::ExpertJob j;
  j.gate_up = &x.gate_up;
  j.down = &x.down;
  j.inter = inter;
  j.rows = rows;
  j.weights = weights;
  j.n = n;
  if (!x.gate_bias.empty()) {  // all three, or missing_weight() stopped the forward
    j.gate_bias = x.gate_bias.data();
    j.up_bias = x.up_bias.data();
    j.down_bias = x.down_bias.data();
  }
  return j;
}

int32_t Layer::pick_slot(int32_t expert, int64_t token, int32_t k) const {
  const int32_t b = replica_begin_[static_cast<size_t>(expert)];
  const int32_t n = replica_begin_[static_cast<size_t>(expert) + 1] - b;
  if (n == 1) return replica_slots_[static_cast<size_t>(b)];
  // Several replicas: spread the pairs over them by token, the same way on
  // every rank (all ranks see the same gathered batch). Not (t*K + k) % n:
  // when n divides K that depends on k alone, and routers emit the top-k
  // sorted by score, so a hot expert's pairs would all go to one replica.
  const int64_t idx = (token + k) % n;
  return replica_slots_[static_cast<size_t>(b + idx)];
}

void Layer::validate_forward(const ep_moe_forward_args_t& a, int64_t* dp_offset, int64_t* dp_padded,
                             Gather* gather) const {
  const int64_t T = a.num_tokens;
  EP_MOE_CHECK_ARG(T >= 0 && T <= cfg_.max_tokens, "num_tokens must be in [0, max_tokens=%d], got %lld",
                   cfg_.max_tokens, static_cast<long long>(T));
  if (T > 0) {
    EP_MOE_CHECK_ARG(a.hidden != nullptr, "hidden is NULL");
    EP_MOE_CHECK_ARG(a.out != nullptr, "out is NULL");
    if (a.router_logits) {
      EP_MOE_CHECK_ARG(a.topk_ids == nullptr && a.topk_weights == nullptr,
                       "give router_logits or topk_ids/topk_weights, not both");
    } else if (a.topk_ids != nullptr || a.topk_weights != nullptr || !has_router_) {
      EP_MOE_CHECK_ARG(a.topk_ids != nullptr && a.topk_weights != nullptr,
                       "router_logits is NULL, so topk_ids and topk_weights are needed (or a router weight, "
                       "EP_MOE_WEIGHT_ROUTER)");
    }
  }
  *gather = Gather::None;
  *dp_offset = 0;
  *dp_padded = 0;
  if (dp_size_ > 1) {
    EP_MOE_CHECK_ARG(a.dp_token_counts != nullptr, "dp_token_counts is NULL under DP attention (dp_size %d)", dp_size_);
    int64_t mx = 0;
    for (int i = 0; i < dp_size_; ++i) {
      const int32_t n = a.dp_token_counts[i];
      EP_MOE_CHECK_ARG(n >= 0 && n <= cfg_.max_tokens, "dp_token_counts[%d] = %d is outside [0, max_tokens=%d]", i, n,
                       cfg_.max_tokens);
      mx = std::max<int64_t>(mx, n);
      if (i < dp_rank_) *dp_offset += n;
    }
    EP_MOE_CHECK_ARG(a.dp_token_counts[dp_rank_] == T, "dp_token_counts[dp_rank=%d] = %d but num_tokens is %lld",
                     dp_rank_, a.dp_token_counts[dp_rank_], static_cast<long long>(T));
    bool all_decode = a.dp_is_decode != nullptr;
    for (int i = 0; all_decode && i < dp_size_; ++i) all_decode = a.dp_is_decode[i] != 0;
    // Seed 001: padded for graph capture, prefill and mixed batches.
    if (a.is_graph || a.is_prefill || !all_decode) {
      *gather = Gather::Padded;
      *dp_padded = mx;
      *dp_offset = static_cast<int64_t>(dp_rank_) * mx;
    } else {
      *gather = Gather::Compact;
    }
  } else if (a.dp_token_counts) {
    EP_MOE_CHECK_ARG(a.dp_token_counts[0] == T, "dp_token_counts[0] = %d but num_tokens is %lld", a.dp_token_counts[0],
                     static_cast<long long>(T));
  }
  const std::string missing = missing_weight();
  if (!missing.empty()) fail(EP_MOE_ERR_STATE, "weights incomplete: %s", missing.c_str());
}

// Tokens are routed independently, in blocks spread over the pool: routing
// is ~1 µs per token at qwen3's 128 experts (~2 µs at DeepSeek-V3's 256,
// grouped), 4 % of a T=512 forward when one thread did it all. A block's
// error (NaN logits) is caught in the job (jobs must not throw) and the
// earliest failing block's rethrown after, so the message names the first
// bad token, as when one thread routed them all.
void Layer::route_all(const void* logits, ep_moe_dtype_t dtype, int64_t T) {
  int32_t* ids = ids_.data();
  float* w = weights_.data();
  const int64_t E = cfg_.num_experts, K = cfg_.top_k;
  constexpr int64_t kBlock = 16;
  if (!pool_ || pool_->size() == 1 || T <= kBlock) {
    route(logits, dtype, T, routing_, ids, w, 0, route_scratch_.data());
    return;
  }
  const size_t es = dtype_size(dtype);
  std::mutex mu;
  int64_t failed_at = T;
  std::exception_ptr error;
  pool_->parallel_ranges(static_cast<size_t>(T), kBlock, [&](size_t b, size_t e, int tid) {
    const auto t0 = static_cast<int64_t>(b), n = static_cast<int64_t>(e - b);
    try {
      route(static_cast<const char*>(logits) + static_cast<size_t>(t0 * E) * es, dtype, n, routing_, ids + t0 * K,
            w + t0 * K, t0, &route_scratch_[static_cast<size_t>(tid)]);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (t0 < failed_at) {
        failed_at = t0;
        error = std::current_exception();
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

void Layer::route_tokens(const ep_moe_forward_args_t& a) {
  const int64_t T = a.num_tokens, K = cfg_.top_k;
  if (T == 0) return;
  int32_t* ids = ids_.data();
  float* w = weights_.data();
  if (a.router_logits) {
    route_all(a.router_logits, static_cast<ep_moe_dtype_t>(cfg_.router_dtype), T);
  } else if (!a.topk_ids) {  // the layer's own router: logits = x Wr^T in f32
    compute_logits(f32_rows(a.hidden, T, own_x_.data<float>(), nullptr), T, logits_.data());
    route_all(logits_.data(), EP_MOE_DTYPE_F32, T);
  } else {
    check_topk(a.topk_ids, a.topk_weights, T, cfg_.top_k, cfg_.num_experts);
    std::memcpy(ids, a.topk_ids, static_cast<size_t>(T * K) * 4);
    std::memcpy(w, a.topk_weights, static_cast<size_t>(T * K) * 4);
  }
}

void Layer::forward(const ep_moe_forward_args_t& a) {
  Stages st;
  const bool decide = dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  if (decide) {
    st.add(ep_);  // the exchange of send counts comes first
  } else {
    if (dp_size_ > 1) st.add(dp_);
    if (ep_) st.add(ep_);
  }
  try {
    int64_t dp_offset = 0, padded = 0;
    Gather gather = Gather::None;
    // The pool's threads, if they went to sleep since the last forward,
    // wake up during validation and routing rather than at the first loop
    // (a kernel wake-up costs ~50 us on a VM: 1-15 % of a decode step).
    if (pool_) pool_->wake();
    validate_forward(a, &dp_offset, &padded, &gather);
    // CUDA layers route on the device (layer_device.cpp); `capturing`: their
    // stream is being captured into a CUDA graph.
    bool capturing = false;
    if (dev_) {
      capturing = route_device(a);
    } else {
      route_tokens(a);
    }
    int32_t mode = EP_MOE_DISPATCH_ALLGATHER;
    if (decide) {
      if (dev_) choice_to_host(a, capturing);
      plan_sends(a.num_tokens);
      exchange_counts(st.enter(), a);
      mode = dispatch_ == EP_MOE_DISPATCH_AUTO ? cheaper_mode(a, gather, padded) : EP_MOE_DISPATCH_ALLTOALL;
      if (mode == EP_MOE_DISPATCH_ALLGATHER) {
        if (dp_size_ > 1) st.add(dp_);
        st.add(ep_);
      } else {
        st.add(ep_);
        st.add(ep_);
      }
    }
    if (mode == EP_MOE_DISPATCH_ALLGATHER) {
      if (dev_) {
        device_allgather(a, &st, dp_offset, padded, gather, capturing);
      } else {
        forward_allgather(a, &st, dp_offset, padded, gather);
      }
    } else if (dev_) {
      device_alltoall(a, &st);
    } else {
      forward_alltoall(a, &st);
    }
    last_gather_ = mode == EP_MOE_DISPATCH_ALLGATHER ? gather : Gather::None;
    last_dispatch_ = mode;
    ++load_steps_;
  } catch (const Error& e) {
    st.fail_rest(e.status(), e.what());
    throw;
  } catch (const std::exception& e) {
    st.fail_rest(EP_MOE_ERR_INTERNAL, e.what());
    throw;
  }
}

int64_t Layer::plan_pairs(int64_t rows, const int32_t* ids, const float* w, bool assigned, int64_t* skipped) {
  const int64_t K = cfg_.top_k;
  const int32_t n_local = static_cast<int32_t>(experts_.size());
  const int32_t my_begin = map_.rank_slot_begin()[static_cast<size_t>(map_.ep_rank())];
  const bool weight_zero = cfg_.skip_mode == EP_MOE_SKIP_WEIGHT_ZERO;
  const auto& slot_rank = map_.slot_rank();
  // Local slot of pair (t, k), or -1 when another rank computes it. `assigned`
  // rows (all-to-all) carry -1 for pairs sent elsewhere.
  auto local_of = [&](int64_t t, int64_t k, float* weight, bool* real) -> int32_t {
    const int32_t e = ids[t * K + k];
    *weight = w[t * K + k];
    *real = true;
    if (assigned) return e < 0 ? -1 : map_.global_to_local(e);
    const int32_t slot = pick_slot(e, t, static_cast<int32_t>(k));
    if (slot_rank[static_cast<size_t>(slot)] == map_.ep_rank()) return slot - my_begin;
    if (weight_zero && n_local > 0) {  // the seed: computed anyway, weight 0
      *weight = 0.0f;
      *real = false;
      return e % n_local;
    }
    return -1;
  };
  std::fill(pair_count_.begin(), pair_count_.end(), 0);
  *skipped = 0;
  for (int64_t t = 0; t < rows; ++t) {
    if (!assigned && ids[t * K] < 0) continue;  // DP padding
    for (int64_t k = 0; k < K; ++k) {
      float wt;
      bool real;
      const int32_t l = local_of(t, k, &wt, &real);
      if (l >= 0) ++pair_count_[static_cast<size_t>(l) + 1];
      else if (!assigned) ++*skipped;
      if (l >= 0 && real) ++load_[static_cast<size_t>(ids[t * K + k])];  // the load window
    }
  }
  for (int32_t l = 0; l < n_local; ++l) pair_count_[static_cast<size_t>(l) + 1] += pair_count_[static_cast<size_t>(l)];
  for (int32_t l = 0; l < n_local; ++l) cursor_[static_cast<size_t>(l)] = pair_count_[static_cast<size_t>(l)];
  for (int64_t t = 0; t < rows; ++t) {
    if (!assigned && ids[t * K] < 0) continue;
    for (int64_t k = 0; k < K; ++k) {
      float wt;
      bool real;
      const int32_t l = local_of(t, k, &wt, &real);
      if (l < 0) continue;
      const int32_t at = cursor_[static_cast<size_t>(l)]++;
      pair_rows_[static_cast<size_t>(at)] = static_cast<int32_t>(t);
      pair_weights_[static_cast<size_t>(at)] = wt;
    }
  }
  return pair_count_[static_cast<size_t>(n_local)];
}

void Layer::add_expert_jobs() {
  jobs_.clear();
  for (size_t l = 0; l < experts_.size(); ++l) {
    const int64_t b = pair_count_[l], n = pair_count_[l + 1] - b;
    if (n > 0)
      jobs_.push_back(job(experts_[l], cfg_.intermediate_size, pair_rows_.data() + b, pair_weights_.data() + b, n));
  }
}

void Layer::add_shared_job(const float* x, int64_t row0, int64_t n_rows, const int32_t* ids, const uint16_t* x16,
                           int64_t ld16) {
  if (shared_count_ == 0) return;
  const int64_t H = cfg_.hidden_size, K = cfg_.top_k;
  int64_t n = 0;
  for (int64_t t = row0; t < row0 + n_rows; ++t) {
    if (ids && ids[t * K] < 0) continue;  // DP padding
    float g = 1.0f;
    if (cfg_.shared_expert_gate) {
      float dot = 0.0f;
      if (x) {
        const float* xr = x + t * H;
        for (int64_t i = 0; i < H; ++i) dot += xr[i] * shared_gate_[static_cast<size_t>(i)];
      } else {  // the same values, widened here
        const uint16_t* xr = x16 + t * ld16;
        for (int64_t i = 0; i < H; ++i) dot += bf16_to_f32(xr[i]) * shared_gate_[static_cast<size_t>(i)];
      }
      g = 1.0f / (1.0f + std::exp(-dot));
    }
    shared_rows_[static_cast<size_t>(n)] = static_cast<int32_t>(t);
    shared_weights_[static_cast<size_t>(n)] = g;
    ++n;
  }
  if (n > 0) jobs_.push_back(job(shared_, shared_count_, shared_rows_.data(), shared_weights_.data(), n));
}

void Layer::forward_allgather(const ep_moe_forward_args_t& a, void* stages, int64_t dp_offset, int64_t padded,
                              Gather gather) {
  Stages& st = *static_cast<Stages*>(stages);
  const int64_t T = a.num_tokens, H = cfg_.hidden_size, K = cfg_.top_k;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  float* xw = x_f32_.data<float>();
  const float* x = xw;  // the experts' f32 rows
  int32_t* ids = ids_.data();
  float* w = weights_.data();

  // Phase times of this rank (collectives excluded), kept for the attrs.
  PhaseTimes ph;
  int64_t t0 = now_ns();

  // DP gather: one collective moving [hidden | ids | weights] rows.
  int64_t T_all = T;
  if (dp_size_ > 1) {
    const int64_t send_n = gather == Gather::Padded ? padded : T;
    char* send = send_rows_.data<char>();
    for (int64_t t = 0; t < send_n; ++t) {
      if (t < T) {
        pack_row(send + static_cast<size_t>(t) * row_bytes_,
                 static_cast<const char*>(a.hidden) + t * H * static_cast<int64_t>(es), ids + t * K, w + t * K);
      } else {  // padding row: never computed
        char* row = send + static_cast<size_t>(t) * row_bytes_;
        std::memset(row, 0, row_bytes_);
        int32_t* rid = reinterpret_cast<int32_t*>(row + ids_off_);
        for (int64_t k = 0; k < K; ++k) rid[k] = -1;
      }
    }
    ph.permute_bytes += send_n * static_cast<int64_t>(row_bytes_);
    ph.permute_ns += now_ns() - t0;
    const size_t words = row_bytes_ / 4;
    Comm* dp = st.enter();
    if (gather == Gather::Padded) {
      dp->all_gather(recv_rows_.data(), send, static_cast<size_t>(padded) * words, EP_MOE_DTYPE_I32, a.stream);
      T_all = padded * dp_size_;
    } else {
      T_all = 0;
      for (int i = 0; i < dp_size_; ++i) {
        counts_[static_cast<size_t>(i)] = static_cast<size_t>(a.dp_token_counts[i]) * words;
        T_all += a.dp_token_counts[i];
      }
      dp->all_gather_v(recv_rows_.data(), send, counts_.data(), EP_MOE_DTYPE_I32, a.stream);
    }
    t0 = now_ns();
    ph.permute_bytes += unpack_rows(T_all, xw);
    ph.permute_ns += now_ns() - t0;
  } else if (!direct_bf16_) {
    x = f32_rows(a.hidden, T, xw, &ph.permute_bytes);
    ph.permute_ns += now_ns() - t0;
  }
  // With direct_bf16_ the experts read the bf16 rows where they are.
  const uint16_t* x16 = nullptr;
  int64_t ld16 = 0;
  if (direct_bf16_) {
    x16 = dp_size_ > 1 ? recv_rows_.data<uint16_t>() : static_cast<const uint16_t*>(a.hidden);
    ld16 = dp_size_ > 1 ? static_cast<int64_t>(row_bytes_ / 2) : H;
  }

  // Plan the pairs this rank computes, then experts + shared into acc.
  int64_t skipped = 0;
  const int64_t local_pairs = plan_pairs(T_all, ids, w, false, &skipped);
  // One rank without DP, f32 activations, out apart from hidden: the
  // experts accumulate in out itself, and no T x H copy ends the forward
  // (a few per cent of a prefill). A failed call must
  // leave out as it was, and nothing from the zeroing on can fail: the
  // expert path allocates nothing (fault_tests [forward]) and throws
  // nothing.
  const bool acc_in_out = !ep_ && dp_size_ == 1 && adt == EP_MOE_DTYPE_F32 && T > 0 && float_aligned(a.out) &&
                          !overlap(a.out, a.hidden, static_cast<size_t>(T * H) * es);
  float* acc = acc_in_out ? static_cast<float*>(a.out) : acc_.data<float>();
  zero_rows(acc, T_all);
  add_expert_jobs();
  if (!shared_replicated_) {
    add_shared_job(x, 0, T_all, ids, x16, ld16);  // this rank's shard, every token
  } else if (dp_size_ > 1) {
    add_shared_job(x, dp_offset, T, ids, x16, ld16);  // the whole expert, this replica's tokens
  } else {
    const int32_t ep = map_.ep_size(), r = map_.ep_rank();  // the whole expert, a share of the tokens
    add_shared_job(x, split_start(static_cast<int32_t>(T), ep, r), split_count(static_cast<int32_t>(T), ep, r), ids,
                   x16, ld16);
  }
  t0 = now_ns();
  ffn_->run(*pool_, jobs_, x, H, acc, H, act_, x16, ld16);
  ph.expert_ns += now_ns() - t0;

  // ONE reduction of (routed + shared) partials, then this rank's rows.
  // Without a collective or DP the narrowed sums are the output: they go
  // straight into out (hidden, which out may alias, has been read by now);
  // in f32 they are already there (acc_in_out) unless out overlaps hidden.
  const bool into_out = !ep_ && dp_size_ == 1;
  void* partial = acc;
  if (adt != EP_MOE_DTYPE_F32) {
    t0 = now_ns();
    partial = into_out ? a.out : partial_.data();
    narrow_rows(acc, T_all, partial);
    ph.combine_bytes += T_all * H * 4;
    ph.combine_ns += now_ns() - t0;
  }
  const void* result = partial;
  int64_t row0 = 0;
  if (ep_) {
    Comm* ep = st.enter();
    if (dp_size_ > 1 && gather == Gather::Padded && dp_is_ep_) {
      ep->reduce_scatter(scatter_out_.data(), partial, static_cast<size_t>(padded * H), adt, a.stream);
      result = scatter_out_.data();
    } else {
      ep->all_reduce(partial, partial, static_cast<size_t>(T_all * H), adt, a.stream);
      row0 = dp_offset;
    }
  }
  t0 = now_ns();
  if (T > 0 && result != a.out) {  // result is the layer's own buffer: never overlaps out
    const char* src = static_cast<const char*>(result) + row0 * H * static_cast<int64_t>(es);
    const size_t row = static_cast<size_t>(H) * es;
    pool_->parallel_ranges(static_cast<size_t>(T), 16, [&](size_t t0r, size_t t1r, int) {
      std::memcpy(static_cast<char*>(a.out) + t0r * row, src + t0r * row, (t1r - t0r) * row);
    });
  }
  if (result != a.out) ph.combine_bytes += T * H * static_cast<int64_t>(es);
  ph.combine_ns += now_ns() - t0;
  last_phase_ = ph;

  int64_t tokens = 0;
  for (int64_t t = 0; t < T_all; ++t) tokens += ids[t * K] >= 0;
  record(tokens, local_pairs, skipped);
}

void Layer::record(int64_t tokens, int64_t local_pairs, int64_t skipped) {
  last_tokens_ = tokens;
  last_local_pairs_ = local_pairs;
  last_skipped_ = skipped;
  last_active_ = 0;
  for (const auto& j : jobs_) last_active_ += j.gate_up != &shared_.gate_up;
}

void Layer::pack_row(char* row, const char* hidden, const int32_t* ids, const float* w) const {
  const int64_t H = cfg_.hidden_size, K = cfg_.top_k;
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(cfg_.act_dtype));
  std::memcpy(row, hidden, static_cast<size_t>(H) * es);
  std::memcpy(row + ids_off_, ids, static_cast<size_t>(K) * 4);
  std::memcpy(row + ids_off_ + K * 4, w, static_cast<size_t>(K) * 4);
}

int64_t Layer::unpack_rows(int64_t n, float* x) {
  unpack_ids(n);
  if (direct_bf16_) return n * cfg_.top_k * 8;  // the experts read the bf16 rows where they arrived
  widen_rows(recv_rows_.data<char>(), n, x, row_bytes_);
  return n * cfg_.hidden_size * 4;
}

void Layer::widen_rows(const void* src, int64_t n, float* dst, size_t src_stride) {
  const int64_t H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t row = src_stride ? src_stride : static_cast<size_t>(H) * dtype_size(adt);
  pool_->parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    for (size_t t = t0; t < t1; ++t)
      convert_row(kern_, dst + static_cast<int64_t>(t) * H, static_cast<const char*>(src) + t * row, adt, H);
  });
}

const float* Layer::f32_rows(const void* hidden, int64_t n, float* scratch, int64_t* bytes) {
  // f32 activations need no widening: a copy of T x H floats (14.7 MB for
  // deepseek-v3's T=512, written, then read again by the experts) is not
  // made. The rows' values, and so the bits of every sum, are the same.
  if (cfg_.act_dtype == EP_MOE_DTYPE_F32 && float_aligned(hidden)) return static_cast<const float*>(hidden);
  widen_rows(hidden, n, scratch);
  if (bytes) *bytes += n * cfg_.hidden_size * 4;
  return scratch;
}

void Layer::zero_rows(float* dst, int64_t n) {
  const int64_t H = cfg_.hidden_size;
  pool_->parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    std::memset(dst + static_cast<int64_t>(t0) * H, 0, (t1 - t0) * static_cast<size_t>(H) * 4);
  });
}

void Layer::narrow_rows(const float* src, int64_t n, void* dst) {
  const int64_t H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t row = static_cast<size_t>(H) * dtype_size(adt);
  pool_->parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    for (size_t t = t0; t < t1; ++t)
      store_row(kern_, static_cast<char*>(dst) + t * row, adt, src + static_cast<int64_t>(t) * H, H);
  });
}

void Layer::unpack_ids(int64_t n) {
  const int64_t K = cfg_.top_k;
  for (int64_t t = 0; t < n; ++t) {
    const char* rid = recv_rows_.data<char>() + static_cast<size_t>(t) * row_bytes_ + ids_off_;
    std::memcpy(ids_.data() + t * K, rid, static_cast<size_t>(K) * 4);
    std::memcpy(weights_.data() + t * K, rid + K * 4, static_cast<size_t>(K) * 4);
  }
}

void Layer::expert_load(int64_t* out, bool across_ranks, bool reset) {
  const size_t E = load_.size();
  if (dev_) dev_->read_load(load_.data());  // a CUDA layer counts on the device
  if (across_ranks && ep_) {
    std::vector<int64_t> sum(load_);
    Comm* c = ep_staged_ ? ep_staged_.get() : ep_;  // host data over NCCL goes through device memory
    c->all_reduce(sum.data(), sum.data(), E, EP_MOE_DTYPE_I64, nullptr);
    std::copy(sum.begin(), sum.end(), out);
  } else {
    std::copy(load_.begin(), load_.end(), out);
  }
  if (reset) {
    if (dev_) dev_->reset_load();
    std::fill(load_.begin(), load_.end(), 0);
    load_steps_ = 0;
  }
}

int64_t Layer::attr(ep_moe_layer_attr_t a) const {
  if (dev_) {
    switch (a) {
      case EP_MOE_LAYER_ATTR_WEIGHT_BYTES:
        return dev_->weight_bytes() + (has_router_ ? int64_t{cfg_.num_experts} * cfg_.hidden_size * 4 : 0);
      case EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS: return dev_->stats().local_pairs;
      case EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS: return dev_->stats().skipped;
      case EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS: return dev_->stats().active;
      case EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS: return dev_->stats().permute_ns;
      case EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES: return dev_->stats().permute_bytes;
      case EP_MOE_LAYER_ATTR_LAST_EXPERT_NS: return dev_->stats().expert_ns;
      case EP_MOE_LAYER_ATTR_LAST_COMBINE_NS: return dev_->stats().combine_ns;
      case EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES: return dev_->stats().combine_bytes;
      case EP_MOE_LAYER_ATTR_LAST_SYNC_FREE: return dev_->stats().sync_free;
      default: break;
    }
  }
  switch (a) {
    case EP_MOE_LAYER_ATTR_DEVICE: return cfg_.device;
    case EP_MOE_LAYER_ATTR_LAST_SYNC_FREE: return -1;
    case EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS: return static_cast<int64_t>(experts_.size());
    case EP_MOE_LAYER_ATTR_NUM_THREADS: return pool_->size();
    case EP_MOE_LAYER_ATTR_WEIGHT_BYTES: {
      int64_t b = 0;
      for (const Expert& x : experts_) b += static_cast<int64_t>(x.gate_up.bytes() + x.down.bytes());
      b += static_cast<int64_t>(shared_.gate_up.bytes() + shared_.down.bytes());
      for (const Expert& x : experts_)
        b += static_cast<int64_t>((x.gate_bias.size() + x.up_bias.size() + x.down_bias.size()) * sizeof(float));
      b += static_cast<int64_t>((shared_gate_.size() + bias_.size() + router_bias_.size()) * sizeof(float));
      b += static_cast<int64_t>(router_.bytes());
      return b;
    }
    case EP_MOE_LAYER_ATTR_READY: return missing_weight().empty() ? 1 : 0;
    case EP_MOE_LAYER_ATTR_LAST_TOKENS: return last_tokens_;
    case EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS: return last_local_pairs_;
    case EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS: return last_skipped_;
    case EP_MOE_LAYER_ATTR_LAST_GATHER: return static_cast<int64_t>(last_gather_);
    case EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE: return shared_count_;
    case EP_MOE_LAYER_ATTR_CPU_ISA: return static_cast<int64_t>(kern_.isa);
    case EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS: return last_active_;
    case EP_MOE_LAYER_ATTR_BYTES_LOADED: return static_cast<int64_t>(bytes_loaded_);
    case EP_MOE_LAYER_ATTR_LAST_DISPATCH: return last_dispatch_;
    case EP_MOE_LAYER_ATTR_LAST_ALLTOALL_BYTES: return static_cast<int64_t>(last_bytes_alltoall_);
    case EP_MOE_LAYER_ATTR_LAST_ALLGATHER_BYTES: return static_cast<int64_t>(last_bytes_allgather_);
    case EP_MOE_LAYER_ATTR_LOAD_STEPS: return load_steps_;
    case EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS: return last_phase_.permute_ns;
    case EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES: return last_phase_.permute_bytes;
    case EP_MOE_LAYER_ATTR_LAST_EXPERT_NS: return last_phase_.expert_ns;
    case EP_MOE_LAYER_ATTR_LAST_COMBINE_NS: return last_phase_.combine_ns;
    case EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES: return last_phase_.combine_bytes;
    case EP_MOE_LAYER_ATTR_REPLACE_BYTES_SENT: return replace_sent_;
    case EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED: return replace_received_;
    case EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ: return replace_read_;
    case EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT: return replace_kept_;
    case EP_MOE_LAYER_ATTR_NUM_EXPERTS: return cfg_.num_experts;
    case EP_MOE_LAYER_ATTR_HAS_ROUTER: return has_router_ ? 1 : 0;
    default: break;
  }
  fail(EP_MOE_ERR_INVALID_ARGUMENT, "attr %d is not an ep_moe_layer_attr_t value", static_cast<int>(a));
}

}  // namespace ep_moe

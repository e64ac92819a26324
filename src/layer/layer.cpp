// The layer's shared half: configuration checks, the weights' placement
// (one step feeding either backend), the forward's order of steps and
// collectives, load statistics and attributes (backend.hpp says what the
// backends do).
#include "layer/layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "common/quant.hpp"
#include "layer/stages.hpp"

namespace ep_moe {

namespace {
constexpr int32_t kMaxHidden = 1 << 16;
constexpr int32_t kMaxInter = 1 << 18;
constexpr int32_t kMaxTokens = 1 << 20;
constexpr int32_t kMaxThreads = 1024;

size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

// Tensors of one routed expert (addressed by global expert id).
bool routed_weight(ep_moe_weight_t w) {
  return w <= EP_MOE_WEIGHT_EXPERT_GATE_UP ||
         (w >= EP_MOE_WEIGHT_EXPERT_GATE_BIAS && w <= EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS);
}

bool shared_weight(ep_moe_weight_t w) { return w >= EP_MOE_WEIGHT_SHARED_GATE && w <= EP_MOE_WEIGHT_SHARED_GATE_UP; }

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
  const auto wdt = static_cast<ep_moe_dtype_t>(c.weight_dtype);
  EP_MOE_CHECK_ARG(dtype_is_float(wdt) || dtype_is_quant(wdt),
                   "weight_dtype %d is not f32, bf16, f16 or a block format (EP_MOE_DTYPE_Q8_0 ...)", c.weight_dtype);
  if (dtype_is_quant(wdt)) {
    const int qk = quant_block_elems(wdt);
    EP_MOE_CHECK_ARG(c.hidden_size % qk == 0 && c.intermediate_size % qk == 0,
                     "weight_dtype %s stores rows in blocks of %d elements: hidden_size %d and intermediate_size %d "
                     "must be multiples of it",
                     dtype_name(wdt), qk, c.hidden_size, c.intermediate_size);
  }
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
    : cfg_(c), map_(map), ep_(ep_comm), dp_(dp_comm) {
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

  held_.resize(static_cast<size_t>(map.num_local_routed()));
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
  backend_ = c.device >= 0 ? make_cuda_backend(*this, max_rows, send_rows, fanout)
                           : make_cpu_backend(*this, max_rows, send_rows, fanout);
  // Host data over a device communicator (the count exchange, the load's
  // all-reduce) is staged through the backend's device.
  if (ep_ && ep_->device_memory()) ep_host_ = backend_->host_view(ep_);
}

Layer::~Layer() = default;

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
  // Sizes of the flows and of the host plan arrays, for either backend.
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
  agree_all_.resize(kAgreeFields * static_cast<size_t>(ep));  // check_agreement: the first forward allocates nothing
  ids_.resize(static_cast<size_t>(max_rows * K));
  weights_.resize(static_cast<size_t>(max_rows * K));
  *max_rows_out = max_rows;
  *send_rows_out = send_rows;
  *fanout_out = fanout;
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
  EP_MOE_CHECK_ARG(dtype_is_float(dtype) || dtype_is_quant(dtype),
                   "dtype %d is not f32, bf16, f16 or a block format (EP_MOE_DTYPE_Q8_0 ...)", static_cast<int>(dtype));
  check_weight(which, expert);
  int64_t r, c;
  expected_shape(which, &r, &c);
  EP_MOE_CHECK_ARG(rows == r && cols == c, "%s must be [%lld, %lld], got [%lld, %lld]", weight_name(which),
                   static_cast<long long>(r), static_cast<long long>(c), static_cast<long long>(rows),
                   static_cast<long long>(cols));
  EP_MOE_CHECK_ARG(data != nullptr, "data is NULL");
  if (dtype_is_quant(dtype)) {
    EP_MOE_CHECK_ARG(cols % quant_block_elems(dtype) == 0,
                     "%s in %s: its rows are whole blocks of %d elements, and %lld columns are not", weight_name(which),
                     dtype_name(dtype), quant_block_elems(dtype), static_cast<long long>(cols));
  }
  if (dtype == EP_MOE_DTYPE_FP8_E4M3 && data && wants(which, expert) && backend_->pointer_device(data) < 0) {
    // No NaN reaches the kernels: the scales and codes are checked as stored.
    const std::string fault = fp8_fault(data, rows, cols);
    EP_MOE_CHECK_ARG(fault.empty(), "%s: %s", weight_name(which), fault.c_str());
  }
  const int on = wants(which, expert) ? backend_->pointer_device(data) : -1;
  EP_MOE_CHECK_ARG(on < 0 || on == cfg_.device, "data is memory of CUDA device %d, but the layer is on device %d", on,
                   cfg_.device);
  if (on >= 0 && (which == EP_MOE_WEIGHT_SCORE_BIAS || which == EP_MOE_WEIGHT_SHARED_EXPERT_GATE)) {
    // Small vectors the layer checks on the host: read them back first.
    std::vector<char> host(static_cast<size_t>(rows * cols) * dtype_size(dtype));
    backend_->download(host.data(), data, host.size());
    return store(which, expert, Source{host.data(), dtype, cols}, false);
  }
  return store(which, expert, Source{data, dtype, cols}, false, on >= 0);
}

bool Layer::store(ep_moe_weight_t which, int32_t expert, Source src, bool shard_relative, bool src_on_device) {
  if (!wants(which, expert)) return false;  // another rank's expert, or no shared shard here
  const bool bias = which >= EP_MOE_WEIGHT_EXPERT_GATE_BIAS && which <= EP_MOE_WEIGHT_ROUTER_BIAS;
  if (bias && !backend_->takes_biases())
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: the CUDA backend has no expert or router biases; use a CPU layer (device -1)",
         weight_name(which));
  if (bias && which != EP_MOE_WEIGHT_ROUTER_BIAS) {
    store_expert_bias(which, expert, src);
  } else if (routed_weight(which)) {
    store_routed(which, expert, src, src_on_device);
  } else if (shared_weight(which)) {
    store_shared(which, src, shard_relative, src_on_device);
  } else if (which == EP_MOE_WEIGHT_ROUTER) {
    // Routing is sensitive: the router is kept in f32 whatever weight_dtype
    // says, and refused here if not finite (forward would otherwise fail on
    // logits the caller never passed).
    if (!src_on_device)
      for (int64_t r = 0; r < cfg_.num_experts; ++r)
        for (int64_t c = 0; c < cfg_.hidden_size; ++c)
          EP_MOE_CHECK_ARG(std::isfinite(source_at(src, r, c)), "router weight [%lld, %lld] is not finite",
                           static_cast<long long>(r), static_cast<long long>(c));
    backend_->put(WeightPart::Router, -1, 0, src, cfg_.num_experts, cfg_.hidden_size, src_on_device);
    has_router_ = true;
  } else {
    store_vector(which, src);
  }
  return true;
}

void Layer::store_routed(ep_moe_weight_t which, int32_t expert, const Source& src, bool on_device) {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size;
  Source up = src;
  up.row0 += I;  // gate_up's up half: logical rows, whatever the storage order
  const auto& l2g = map_.local_to_global();
  for (size_t l = 0; l < held_.size(); ++l) {
    if (l2g[l] != expert) continue;
    const auto slot = static_cast<int32_t>(l);
    Held& x = held_[l];
    switch (which) {
      case EP_MOE_WEIGHT_EXPERT_GATE:
        backend_->put(WeightPart::ExpertGateUp, slot, 0, src, I, H, on_device);
        x.gate = true;
        break;
      case EP_MOE_WEIGHT_EXPERT_UP:
        backend_->put(WeightPart::ExpertGateUp, slot, I, src, I, H, on_device);
        x.up = true;
        break;
      case EP_MOE_WEIGHT_EXPERT_GATE_UP:
        backend_->put(WeightPart::ExpertGateUp, slot, 0, src, I, H, on_device);
        backend_->put(WeightPart::ExpertGateUp, slot, I, up, I, H, on_device);
        x.gate = x.up = true;
        break;
      default:
        backend_->put(WeightPart::ExpertDown, slot, 0, src, H, I, on_device);
        x.down = true;
        break;
    }
  }
}

void Layer::store_shared(ep_moe_weight_t which, Source src, bool shard_relative, bool on_device) {
  // Full-size sources are narrowed to this rank's shard here; a loader that
  // already read only the shard passes shard-relative coordinates.
  const int32_t H = cfg_.hidden_size, S = shared_count_;
  const int64_t first = shard_relative ? 0 : shared_begin_;
  const int64_t up_rows = shard_relative ? S : cfg_.shared_intermediate_size;
  switch (which) {
    case EP_MOE_WEIGHT_SHARED_GATE:
    case EP_MOE_WEIGHT_SHARED_UP: {
      const bool gate = which == EP_MOE_WEIGHT_SHARED_GATE;
      src.row0 += first;
      backend_->put(WeightPart::SharedGateUp, -1, gate ? 0 : S, src, S, H, on_device);
      (gate ? shared_held_.gate : shared_held_.up) = true;
      break;
    }
    case EP_MOE_WEIGHT_SHARED_GATE_UP: {
      Source up = src;
      src.row0 += first;
      up.row0 += up_rows + first;
      backend_->put(WeightPart::SharedGateUp, -1, 0, src, S, H, on_device);
      backend_->put(WeightPart::SharedGateUp, -1, S, up, S, H, on_device);
      shared_held_.gate = shared_held_.up = true;
      break;
    }
    default:  // down [H, Is]: this rank's columns
      src.col0 += first;
      backend_->put(WeightPart::SharedDown, -1, 0, src, H, S, on_device);
      shared_held_.down = true;
      break;
  }
}

void Layer::store_expert_bias(ep_moe_weight_t which, int32_t expert, const Source& src) {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size;
  // Checked before any slot is changed: a bad value stores nothing.
  std::vector<float> g, u, d;
  if (which == EP_MOE_WEIGHT_EXPERT_GATE_BIAS || which == EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS)
    set_bias(g, src, 0, I, which);
  if (which == EP_MOE_WEIGHT_EXPERT_UP_BIAS) set_bias(u, src, 0, I, which);
  if (which == EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS) set_bias(u, src, I, I, which);
  if (which == EP_MOE_WEIGHT_EXPERT_DOWN_BIAS) set_bias(d, src, 0, H, which);
  auto vec = [](const std::vector<float>& v) {
    return Source{v.data(), EP_MOE_DTYPE_F32, static_cast<int64_t>(v.size())};
  };
  const auto& l2g = map_.local_to_global();
  for (size_t l = 0; l < held_.size(); ++l) {
    if (l2g[l] != expert) continue;
    const auto slot = static_cast<int32_t>(l);
    Held& x = held_[l];
    if (!g.empty()) backend_->put(WeightPart::ExpertGateBias, slot, 0, vec(g), 1, I, false);
    if (!u.empty()) backend_->put(WeightPart::ExpertUpBias, slot, 0, vec(u), 1, I, false);
    if (!d.empty()) backend_->put(WeightPart::ExpertDownBias, slot, 0, vec(d), 1, H, false);
    x.gate_bias = x.gate_bias || !g.empty();
    x.up_bias = x.up_bias || !u.empty();
    x.down_bias = x.down_bias || !d.empty();
  }
  expert_bias_ = true;
}

void Layer::store_vector(ep_moe_weight_t which, const Source& src) {
  std::vector<float> v;
  const int64_t n = which == EP_MOE_WEIGHT_SHARED_EXPERT_GATE ? cfg_.hidden_size : cfg_.num_experts;
  set_bias(v, src, 0, n, which);
  const Source vs{v.data(), EP_MOE_DTYPE_F32, n};
  switch (which) {
    case EP_MOE_WEIGHT_SCORE_BIAS:
      backend_->put(WeightPart::Bias, -1, 0, vs, 1, n, false);
      bias_ = std::move(v);
      has_bias_ = true;
      routing_.bias = bias_.data();
      break;
    case EP_MOE_WEIGHT_SHARED_EXPERT_GATE:
      backend_->put(WeightPart::SharedGate, -1, 0, vs, 1, n, false);
      shared_gate_ = std::move(v);
      has_shared_gate_ = true;
      break;
    default:  // the router bias
      backend_->put(WeightPart::RouterBias, -1, 0, vs, 1, n, false);
      router_bias_ = std::move(v);
      break;
  }
}

void Layer::set_bias(std::vector<float>& dst, const Source& src, int64_t c0, int64_t n, ep_moe_weight_t which) const {
  std::vector<float> v(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = source_at(src, 0, c0 + i);
    EP_MOE_CHECK_ARG(std::isfinite(v[static_cast<size_t>(i)]), "%s[%lld] is not finite", weight_name(which),
                     static_cast<long long>(c0 + i));
  }
  dst = std::move(v);
}

std::string Layer::missing_weight() const {
  const auto& l2g = map_.local_to_global();
  for (size_t l = 0; l < held_.size(); ++l) {
    const Held& x = held_[l];
    const char* what = !x.gate ? "gate_proj" : !x.up ? "up_proj" : !x.down ? "down_proj" : nullptr;
    if (!what && expert_bias_)
      what = !x.gate_bias   ? "gate_proj bias (other experts have biases)"
             : !x.up_bias   ? "up_proj bias (other experts have biases)"
             : !x.down_bias ? "down_proj bias (other experts have biases)"
                            : nullptr;
    if (what) return format("expert %d (local %zu) has no %s", l2g[l], l, what);
  }
  if (shared_count_ > 0) {
    const char* what = !shared_held_.gate   ? "gate_proj"
                       : !shared_held_.up   ? "up_proj"
                       : !shared_held_.down ? "down_proj"
                                            : nullptr;
    if (what) return format("the shared expert has no %s", what);
  }
  if (cfg_.shared_expert_gate && !has_shared_gate_) return "the shared expert gate weight is not set";
  if (cfg_.use_score_bias && !has_bias_) return "the score-correction bias is not set";
  return "";
}

bool Layer::wants(ep_moe_weight_t which, int32_t expert) const {
  if (routed_weight(which)) return map_.is_local(expert);
  if (which >= EP_MOE_WEIGHT_SHARED_GATE && which <= EP_MOE_WEIGHT_SHARED_GATE_UP) return shared_count_ > 0;
  return true;
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

namespace {

// Whether a row of n values of dtype dt holds a NaN or an Inf (its
// exponent bits all set), by their bits so that it vectorises; rows need
// not be aligned (memcpy loads).
template <class U>
bool any_exponent_full(const void* row, int64_t n, U exp) {
  const auto* b = static_cast<const unsigned char*>(row);
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    U u;
    std::memcpy(&u, b + static_cast<size_t>(i) * sizeof(U), sizeof(U));
    any |= (u & exp) == exp;
  }
  return any != 0;
}
bool row_nonfinite(const void* row, ep_moe_dtype_t dt, int64_t n) {
  if (dt == EP_MOE_DTYPE_F32) return any_exponent_full<uint32_t>(row, n, 0x7f800000u);
  return any_exponent_full<uint16_t>(row, n, dt == EP_MOE_DTYPE_BF16 ? 0x7f80 : 0x7c00);  // bf16, f16
}

}  // namespace

void Layer::check_agreement(Comm* ep, const ep_moe_forward_args_t& a) {
  // What every rank of the EP group must have alike: the layer's shape and
  // semantics, and without DP attention the step's tokens (the same rows on
  // every rank; fingerprinted on this first forward only, host memory).
  struct Field {
    const char* name;
    int64_t value;
  };
  float scale = cfg_.routed_scaling_factor;
  int32_t scale_bits;
  std::memcpy(&scale_bits, &scale, 4);
  uint64_t rows = 0;
  if (dp_size_ == 1 && a.num_tokens > 0 && backend_->pointer_device(a.hidden) < 0)
    rows = fnv1a(kFnvBasis, a.hidden,
                 static_cast<size_t>(a.num_tokens) * static_cast<size_t>(cfg_.hidden_size) *
                     dtype_size(static_cast<ep_moe_dtype_t>(cfg_.act_dtype)));
  const Field fields[] = {
      {"hidden_size", cfg_.hidden_size},
      {"intermediate_size", cfg_.intermediate_size},
      {"num_experts", cfg_.num_experts},
      {"top_k", cfg_.top_k},
      {"activation", cfg_.activation},
      {"weight_dtype", cfg_.weight_dtype},
      {"act_dtype", cfg_.act_dtype},
      {"router_dtype", cfg_.router_dtype},
      {"scoring", cfg_.scoring},
      {"renormalize", cfg_.renormalize},
      {"num_expert_group", cfg_.num_expert_group},
      {"topk_group", cfg_.topk_group},
      {"use_score_bias", cfg_.use_score_bias},
      {"routed_scaling_factor (bits)", scale_bits},
      {"shared_intermediate_size", cfg_.shared_intermediate_size},
      {"shared_expert_gate", cfg_.shared_expert_gate},
      {"skip_mode", cfg_.skip_mode},
      {"dispatch_mode", cfg_.dispatch_mode},
      {"the DP size", dp_size_},
      {"a fingerprint of its expert map's placement", static_cast<int64_t>(map_.fingerprint())},
      {"num_tokens (without DP attention every EP rank passes the same tokens)", dp_size_ == 1 ? a.num_tokens : 0},
      {"a fingerprint of the hidden rows (without DP attention every EP rank passes the same rows)",
       static_cast<int64_t>(rows)},
  };
  constexpr size_t kFields = sizeof fields / sizeof fields[0];
  static_assert(kFields == kAgreeFields, "kAgreeFields counts the fields");
  const auto n = static_cast<size_t>(map_.ep_size());
  int64_t mine[kFields];
  for (size_t i = 0; i < kFields; ++i) mine[i] = fields[i].value;
  std::vector<int64_t>& all = agree_all_;
  Comm* c = ep_host_ ? ep_host_.get() : ep;  // device communicators: through device memory
  c->all_gather(all.data(), mine, kFields, EP_MOE_DTYPE_I64, a.stream);
  for (size_t f = 0; f < kFields; ++f)
    for (size_t r = 1; r < n; ++r)
      if (all[r * kFields + f] != all[f])
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "the EP ranks disagree on the layer: rank 0 has %s %lld, rank %zu has %lld",
             fields[f].name, static_cast<long long>(all[f]), r, static_cast<long long>(all[r * kFields + f]));
  agreed_ = true;
}

bool Layer::hide_nonfinite_rows(ep_moe_forward_args_t* a) {
  nonfinite_rows_.clear();
  if (a->num_tokens <= 0 || backend_->pointer_device(a->hidden) >= 0) return false;
  const auto dt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const int64_t H = cfg_.hidden_size;
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(dt);
  const auto* hidden = static_cast<const uint8_t*>(a->hidden);
  for (int64_t t = 0; t < a->num_tokens; ++t)
    if (row_nonfinite(hidden + static_cast<size_t>(t) * row_bytes, dt, H)) nonfinite_rows_.push_back(t);
  if (nonfinite_rows_.empty()) return false;
  clean_hidden_.assign(hidden, hidden + static_cast<size_t>(a->num_tokens) * row_bytes);
  for (int64_t t : nonfinite_rows_)
    std::memset(clean_hidden_.data() + static_cast<size_t>(t) * row_bytes, 0, row_bytes);
  a->hidden = clean_hidden_.data();
  return true;
}

void Layer::poison_rows(const ep_moe_forward_args_t& a) const {
  const auto dt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const int64_t H = cfg_.hidden_size;
  auto* out = static_cast<uint8_t*>(a.out);
  for (int64_t t : nonfinite_rows_) {
    uint8_t* row = out + static_cast<size_t>(t) * static_cast<size_t>(H) * dtype_size(dt);
    if (dt == EP_MOE_DTYPE_F32) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = 0; i < H; ++i) std::memcpy(row + 4 * i, &nan, 4);
    } else {
      const uint16_t nan = dt == EP_MOE_DTYPE_BF16 ? 0x7fc0 : 0x7e00;
      for (int64_t i = 0; i < H; ++i) std::memcpy(row + 2 * i, &nan, 2);
    }
  }
}

void Layer::forward(const ep_moe_forward_args_t& args) {
  ep_moe_forward_args_t a = args;
  Stages st;
  // The first forward of an EP group checks that its ranks agree on the
  // layer (check_agreement) before anything else is exchanged.
  const bool agree = !agreed_ && ep_ != nullptr && map_.ep_size() > 1;
  if (agree) st.add(ep_);
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
    // What the step uses wakes up during validation and routing rather
    // than at its first loop (a thread's wake-up costs ~50 us on a VM).
    backend_->wake();
    validate_forward(a, &dp_offset, &padded, &gather);
    if (agree) check_agreement(st.enter(), a);
    const bool nonfinite = hide_nonfinite_rows(&a);
    backend_->route(a);
    int32_t mode = EP_MOE_DISPATCH_ALLGATHER;
    if (decide) {
      backend_->choice_to_host(a);
      plan_sends(a.num_tokens);
      exchange_counts(st.enter(), a);
      mode = dispatch_ == EP_MOE_DISPATCH_AUTO ? cheaper_mode(gather, padded) : EP_MOE_DISPATCH_ALLTOALL;
      if (mode == EP_MOE_DISPATCH_ALLGATHER) {
        if (dp_size_ > 1) st.add(dp_);
        st.add(ep_);
      } else {
        st.add(ep_);
        st.add(ep_);
      }
    }
    if (mode == EP_MOE_DISPATCH_ALLGATHER) {
      backend_->allgather(a, st, dp_offset, padded, gather);
    } else {
      backend_->alltoall(a, st);
    }
    if (nonfinite) poison_rows(a);
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

int64_t Layer::gathered_rows(const ep_moe_forward_args_t& a, Gather gather, int64_t padded, size_t words) {
  if (gather == Gather::Padded) return padded * dp_size_;
  int64_t T_all = 0;
  for (int i = 0; i < dp_size_; ++i) {
    counts_[static_cast<size_t>(i)] = static_cast<size_t>(a.dp_token_counts[i]) * words;
    T_all += a.dp_token_counts[i];
  }
  return T_all;
}

void Layer::shared_rows(int64_t T, int64_t T_all, int64_t dp_offset, int64_t* begin, int64_t* end) const {
  if (!shared_replicated_) {  // this rank's shard, every row
    *begin = 0;
    *end = T_all;
  } else if (dp_size_ > 1) {  // the whole expert, this replica's tokens
    *begin = dp_offset;
    *end = dp_offset + T;
  } else {  // the whole expert, a share of the tokens (all-to-all layers deciding per step)
    const int32_t ep = map_.ep_size(), r = map_.ep_rank();
    *begin = split_start(static_cast<int32_t>(T), ep, r);
    *end = *begin + split_count(static_cast<int32_t>(T), ep, r);
  }
}

void Layer::expert_load(int64_t* out, bool across_ranks, bool reset) {
  const size_t E = load_.size();
  backend_->read_load(load_.data());
  if (across_ranks && ep_) {
    std::vector<int64_t> sum(load_);
    Comm* c = ep_host_ ? ep_host_.get() : ep_;  // host data over NCCL goes through device memory
    c->all_reduce(sum.data(), sum.data(), E, EP_MOE_DTYPE_I64, nullptr);
    std::copy(sum.begin(), sum.end(), out);
  } else {
    std::copy(load_.begin(), load_.end(), out);
  }
  if (reset) {
    backend_->reset_load();
    std::fill(load_.begin(), load_.end(), 0);
    load_steps_ = 0;
  }
}

int64_t Layer::attr(ep_moe_layer_attr_t a) const {
  int64_t v = 0;
  if (backend_->attr(a, &v)) return v;
  switch (a) {
    case EP_MOE_LAYER_ATTR_DEVICE: return cfg_.device;
    case EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS: return static_cast<int64_t>(held_.size());
    case EP_MOE_LAYER_ATTR_READY: return missing_weight().empty() ? 1 : 0;
    case EP_MOE_LAYER_ATTR_LAST_GATHER: return static_cast<int64_t>(last_gather_);
    case EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE: return shared_count_;
    case EP_MOE_LAYER_ATTR_BYTES_LOADED: return static_cast<int64_t>(bytes_loaded_);
    case EP_MOE_LAYER_ATTR_LAST_DISPATCH: return last_dispatch_;
    case EP_MOE_LAYER_ATTR_LAST_ALLTOALL_BYTES: return static_cast<int64_t>(last_bytes_alltoall_);
    case EP_MOE_LAYER_ATTR_LAST_ALLGATHER_BYTES: return static_cast<int64_t>(last_bytes_allgather_);
    case EP_MOE_LAYER_ATTR_LOAD_STEPS: return load_steps_;
    case EP_MOE_LAYER_ATTR_REPLACE_BYTES_SENT: return replace_sent_;
    case EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED: return replace_received_;
    case EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ: return replace_read_;
    case EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT: return replace_kept_;
    case EP_MOE_LAYER_ATTR_NUM_EXPERTS: return cfg_.num_experts;
    case EP_MOE_LAYER_ATTR_HAS_ROUTER: return has_router_ ? 1 : 0;
    case EP_MOE_LAYER_ATTR_MATRIX_ENGINE: return 0;  // a backend without one (CUDA)
    case EP_MOE_LAYER_ATTR_LAST_ENGINE_PAIRS: return 0;
    default: break;
  }
  fail(EP_MOE_ERR_INVALID_ARGUMENT, "attr %d is not an ep_moe_layer_attr_t value", static_cast<int>(a));
}

}  // namespace ep_moe

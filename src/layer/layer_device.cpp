// The CUDA side of Layer (cfg.device >= 0): set-up, weight uploads and the
// forward, which hands the data flow to cuda::DeviceLayer and keeps the
// collective (and its failure protocol) here, like the CPU forward.
#include <algorithm>
#include <cstring>

#include "core/expert_map.hpp"
#include "core/routing.hpp"
#include "common/dtype.hpp"

#include "common/error.hpp"
#include "common/log.hpp"
#include "layer/layer.hpp"
#include "comm/staged_comm.hpp"
#include "layer/stages.hpp"

namespace ep_moe {

namespace {
constexpr int32_t kMaxDeviceTopK = 64;       // per-token scratch of the routing and combine kernels
constexpr int32_t kMaxDeviceExperts = 4096;  // the routing kernel keeps 2 E scores in shared memory
}  // namespace

void Layer::setup_device(int64_t max_rows, int64_t send_rows, int64_t fanout) {
  const ep_moe_layer_config_t& c = cfg_;
  if (c.top_k > kMaxDeviceTopK)
    fail(EP_MOE_ERR_UNSUPPORTED, "CUDA layers support top_k up to %d, got %d", kMaxDeviceTopK, c.top_k);
  if (c.num_experts > kMaxDeviceExperts)
    fail(EP_MOE_ERR_UNSUPPORTED, "CUDA layers support up to %d experts, got %d", kMaxDeviceExperts, c.num_experts);
  if (c.activation == EP_MOE_ACT_SWIGLU_OAI)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "CUDA layers have no clamped SwiGLU (EP_MOE_ACT_SWIGLU_OAI, GPT-OSS); use a CPU layer");
  pool_ = std::make_unique<cpu::ThreadPool>(1);

  // The all-to-all plan's upload (device_alltoall) reuses these.
  if (dispatch_ != EP_MOE_DISPATCH_ALLGATHER) {
    const int64_t T = c.max_tokens, K = c.top_k;
    row_ids_.reserve(static_cast<size_t>(T * fanout));
    pair_rows_.reserve(static_cast<size_t>(T * K + 3 * T * fanout + T + 1));
  }
  const bool host_comm = (ep_ && !ep_->device_memory()) || (dp_ && !dp_->device_memory());

  cuda::DeviceLayerDesc d;
  d.device = c.device;
  d.hidden = c.hidden_size;
  d.inter = c.intermediate_size;
  d.num_experts = c.num_experts;
  d.top_k = c.top_k;
  d.activation = c.activation;
  d.weight_dtype = static_cast<ep_moe_dtype_t>(c.weight_dtype);
  d.act_dtype = static_cast<ep_moe_dtype_t>(c.act_dtype);
  d.router_dtype = static_cast<ep_moe_dtype_t>(c.router_dtype);
  d.sigmoid = routing_.sigmoid;
  d.renormalize = routing_.renormalize;
  d.use_bias = c.use_score_bias != 0;
  d.weight_zero = c.skip_mode == EP_MOE_SKIP_WEIGHT_ZERO;
  d.num_group = c.num_expert_group;
  d.topk_group = c.topk_group;
  d.scale = c.routed_scaling_factor;
  d.shared_count = shared_count_;
  d.shared_gate = c.shared_expert_gate != 0;
  d.max_tokens = c.max_tokens;
  d.sync_free_tokens = std::min(c.sync_free_tokens, c.max_tokens);
  d.num_local = static_cast<int32_t>(experts_.size());
  d.ep_rank = map_.ep_rank();
  d.ep_size = map_.ep_size();
  d.my_slot_begin = map_.rank_slot_begin()[static_cast<size_t>(map_.ep_rank())];
  d.replica_begin = replica_begin_;
  d.replica_slots = replica_slots_;
  d.slot_rank = map_.slot_rank();
  d.global_to_local = map_.expert_map();
  const int64_t T = c.max_tokens, K = c.top_k, ep = map_.ep_size();
  const bool a2a = dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  const bool flows = dp_size_ > 1 || a2a;
  d.row_bytes = row_bytes_;
  d.ids_off = ids_off_;
  d.max_rows = flows ? max_rows : 0;
  d.max_send_rows = send_rows;
  d.max_ret_rows = a2a ? T * fanout : 0;
  d.max_index = a2a ? T * K + 2 * send_rows + (T + 1) + T * fanout : 0;
  if (host_comm)  // the largest staged transfer: rows of the gather/all-to-all, or a partial output
    d.staging_bytes = static_cast<size_t>(std::max<int64_t>(max_rows, T)) * row_bytes_;
  dev_ = cuda::create_device_layer(d);
  if (ep_ && ep_->device_memory()) {  // host data over NCCL: load statistics, the all-to-all's counts
    ep_staged_ = host_view(ep_);
    const size_t row = (static_cast<size_t>(ep) + 1) * 8;  // sized here: forward allocates nothing
    if (a2a) dev_->scratch(staged_scratch_bytes(row, static_cast<size_t>(ep) * row));
  }
  log(EP_MOE_LOG_INFO,
      "[EP rank %d/%d] MoE layer on CUDA device %d: H=%d I=%d E=%d top-%d, %d local experts, shared shard %d/%d, "
      "dp %d, collectives %s",
      map_.ep_rank(), map_.ep_size(), c.device, c.hidden_size, c.intermediate_size, c.num_experts, c.top_k,
      map_.num_local_routed(), shared_count_, c.shared_intermediate_size, dp_size_,
      host_comm ? "staged through pinned host memory"
      : ep_     ? "on device buffers"
                : "none");
}

void Layer::store_device(ep_moe_weight_t which, int32_t expert, Source src, bool shard_relative, bool on_device) {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size, Is = cfg_.shared_intermediate_size;
  const int32_t S = shared_count_;
  using cuda::Part;
  if (which <= EP_MOE_WEIGHT_EXPERT_GATE_UP) {
    const auto& l2g = map_.local_to_global();
    for (size_t l = 0; l < experts_.size(); ++l) {
      if (l2g[l] != expert) continue;
      Expert& x = experts_[l];
      const auto slot = static_cast<int32_t>(l);
      switch (which) {
        case EP_MOE_WEIGHT_EXPERT_GATE:
          dev_->upload(Part::ExpertGateUp, slot, 0, src, I, H, on_device);
          x.has_gate = true;
          break;
        case EP_MOE_WEIGHT_EXPERT_UP:
          dev_->upload(Part::ExpertGateUp, slot, I, src, I, H, on_device);
          x.has_up = true;
          break;
        case EP_MOE_WEIGHT_EXPERT_GATE_UP:
          dev_->upload(Part::ExpertGateUp, slot, 0, src, 2 * static_cast<int64_t>(I), H, on_device);
          x.has_gate = x.has_up = true;
          break;
        default:
          dev_->upload(Part::ExpertDown, slot, 0, src, H, I, on_device);
          x.has_down = true;
          break;
      }
    }
    return;
  }
  if (which >= EP_MOE_WEIGHT_SHARED_GATE && which <= EP_MOE_WEIGHT_SHARED_GATE_UP) {
    const int64_t first = shard_relative ? 0 : shared_begin_;
    const int64_t up_rows = shard_relative ? S : Is;
    switch (which) {
      case EP_MOE_WEIGHT_SHARED_GATE:
      case EP_MOE_WEIGHT_SHARED_UP: {
        const bool gate = which == EP_MOE_WEIGHT_SHARED_GATE;
        src.row0 += first;
        dev_->upload(Part::SharedGateUp, 0, gate ? 0 : S, src, S, H, on_device);
        (gate ? shared_.has_gate : shared_.has_up) = true;
        break;
      }
      case EP_MOE_WEIGHT_SHARED_GATE_UP: {
        Source up = src;
        src.row0 += first;
        up.row0 += up_rows + first;
        dev_->upload(Part::SharedGateUp, 0, 0, src, S, H, on_device);
        dev_->upload(Part::SharedGateUp, 0, S, up, S, H, on_device);
        shared_.has_gate = shared_.has_up = true;
        break;
      }
      default:
        src.col0 += first;
        dev_->upload(Part::SharedDown, 0, 0, src, H, S, on_device);
        shared_.has_down = true;
        break;
    }
    return;
  }
  // The router (f32 on the device, as on the CPU).
  dev_->upload(Part::Router, 0, 0, src, cfg_.num_experts, H, on_device);
  has_router_ = true;
}

// --- collectives on device buffers ---------------------------------------
// A device communicator (NCCL) takes the device pointers and the stream; a
// host one (local, MPI, callbacks) gets the bytes through the layer's pinned
// staging buffers, which synchronises the stream (and cannot be captured).

// --- collectives on device buffers ---------------------------------------
// A device communicator (NCCL) takes the device pointers and the stream; a
// host one (local, MPI, callbacks) gets the bytes through the layer's pinned
// staging buffers, which synchronises the stream (and cannot be captured).
void Layer::dev_collective(Comm* c, CollectiveOp op, void* out, const void* in, size_t count, const size_t* counts,
                           const size_t* out_counts, ep_moe_dtype_t dt, void* stream, bool capturing) {
  const Collective x{op, count, counts, out_counts, dt};
  if (c->device_memory()) {
    run_collective(c, x, out, in, stream);
    return;
  }
  if (capturing)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "a CUDA graph cannot capture a collective of the '%s' communicator (host memory): use NCCL to capture",
         c->backend());
  size_t in_bytes = 0, out_bytes = 0;
  collective_bytes(x, *c, &in_bytes, &out_bytes);
  const size_t cap = dev_->buffer_bytes(cuda::Buf::StageIn);
  if (in_bytes > cap || out_bytes > cap)
    fail(EP_MOE_ERR_INTERNAL, "staging buffer of %zu bytes is too small for %zu/%zu bytes", cap, in_bytes, out_bytes);
  void* hin = dev_->buffer(cuda::Buf::StageIn);
  void* hout = dev_->buffer(cuda::Buf::StageOut);
  dev_->copy(hin, in, in_bytes, stream);
  dev_->sync(stream);
  run_collective(c, x, hout, hin, nullptr);
  dev_->copy(out, hout, out_bytes, stream);
  dev_->sync(stream);  // the staging buffers are reused by the next collective
}

std::unique_ptr<Comm> Layer::host_view(Comm* c) { return make_staged_comm(c, dev_.get()); }

// --- the forward -----------------------------------------------------------

// forward()'s routing on a CUDA layer: the pointers must be this device's;
// the top-k choice lands in the device Ids/Weights buffers. Returns whether
// the stream is being captured into a CUDA graph.
bool Layer::route_device(const ep_moe_forward_args_t& a) {
  if (a.num_tokens > 0) {
    auto on_device = [&](const void* p, const char* what) {
      if (p != nullptr && !dev_->is_device_pointer(p))
        fail(EP_MOE_ERR_INVALID_ARGUMENT,
             "%s is not memory of CUDA device %d: a CUDA layer takes pointers to its own device's memory", what,
             cfg_.device);
    };
    on_device(a.hidden, "hidden");
    on_device(a.out, "out");
    on_device(a.router_logits, "router_logits");
    on_device(a.topk_ids, "topk_ids");
    on_device(a.topk_weights, "topk_weights");
  }
  const bool capturing = dev_->begin(a.stream);
  cuda::DeviceForward f;
  f.tokens = a.num_tokens;
  f.hidden = a.hidden;
  f.router_logits = a.router_logits;
  f.topk_ids = a.topk_ids;
  f.topk_weights = a.topk_weights;
  f.own_router = a.router_logits == nullptr && a.topk_ids == nullptr && has_router_;
  f.stream = a.stream;
  dev_->route(f, static_cast<int32_t*>(dev_->buffer(cuda::Buf::Ids)),
              static_cast<float*>(dev_->buffer(cuda::Buf::Weights)));
  return capturing;
}

// The all-to-all plan (plan_sends) reads the choice on the host: copy it
// back, checked as the CPU path checks it (synchronises).
void Layer::choice_to_host(const ep_moe_forward_args_t& a, bool capturing) {
  if (capturing)
    fail(EP_MOE_ERR_UNSUPPORTED, "the all-to-all dispatch plans on the host: it cannot be captured in a CUDA graph");
  const int64_t T = a.num_tokens, K = cfg_.top_k;
  if (T == 0) return;
  if (!a.topk_ids) dev_->check_route(a.stream);  // bad logits, before their ids are used
  dev_->copy(ids_.data(), dev_->buffer(cuda::Buf::Ids), static_cast<size_t>(T * K) * 4, a.stream);
  if (a.topk_ids)
    dev_->copy(weights_.data(), dev_->buffer(cuda::Buf::Weights), static_cast<size_t>(T * K) * 4, a.stream);
  dev_->sync(a.stream);
  if (a.topk_ids) check_topk(ids_.data(), weights_.data(), T, cfg_.top_k, cfg_.num_experts);
}

void Layer::device_allgather(const ep_moe_forward_args_t& a, void* stages, int64_t dp_offset, int64_t padded,
                             Gather gather, bool capturing) {
  Stages& st = *static_cast<Stages*>(stages);
  const int64_t T = a.num_tokens, H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  auto* ids_d = static_cast<int32_t*>(dev_->buffer(cuda::Buf::Ids));
  auto* w_d = static_cast<float*>(dev_->buffer(cuda::Buf::Weights));

  cuda::DeviceRows rows;
  rows.n = T;
  rows.x = a.hidden;
  rows.ids = ids_d;
  rows.w = w_d;
  rows.out = a.out;
  if (dp_size_ > 1) {
    // DP gather: one collective of [hidden | ids | weights] rows (padding
    // rows: zeros and ids -1, never computed).
    const int64_t send_n = gather == Gather::Padded ? padded : T;
    void* send = dev_->buffer(cuda::Buf::SendRows);
    void* recv = dev_->buffer(cuda::Buf::RecvRows);
    dev_->pack_rows(send, send_n, T, a.hidden, ids_d, w_d, nullptr, nullptr, nullptr, a.stream);
    const size_t words = row_bytes_ / 4;
    Comm* dp = st.enter();
    int64_t T_all = 0;
    if (gather == Gather::Padded) {
      dev_collective(dp, CollectiveOp::AllGather, recv, send, static_cast<size_t>(padded) * words, nullptr, nullptr,
                     EP_MOE_DTYPE_I32, a.stream, capturing);
      T_all = padded * dp_size_;
    } else {
      for (int i = 0; i < dp_size_; ++i) {
        counts_[static_cast<size_t>(i)] = static_cast<size_t>(a.dp_token_counts[i]) * words;
        T_all += a.dp_token_counts[i];
      }
      dev_collective(dp, CollectiveOp::AllGatherV, recv, send, 0, counts_.data(), nullptr, EP_MOE_DTYPE_I32, a.stream,
                     capturing);
    }
    rows.n = T_all;
    rows.x = dev_->buffer(cuda::Buf::AllX);
    rows.ids = static_cast<int32_t*>(dev_->buffer(cuda::Buf::AllIds));
    rows.w = static_cast<float*>(dev_->buffer(cuda::Buf::AllW));
    rows.out = dev_->buffer(cuda::Buf::Partial);
    dev_->unpack_rows(recv, T_all, const_cast<void*>(rows.x), const_cast<int32_t*>(rows.ids),
                      const_cast<float*>(rows.w), a.stream);
  }
  // The shared expert: this rank's shard on every row, or (all-to-all
  // layers deciding per step) the whole expert on a share of the rows.
  if (!shared_replicated_) {
    rows.shared_begin = 0;
    rows.shared_end = rows.n;
  } else if (dp_size_ > 1) {
    rows.shared_begin = dp_offset;
    rows.shared_end = dp_offset + T;
  } else {
    const int32_t ep = map_.ep_size(), r = map_.ep_rank();
    rows.shared_begin = split_start(static_cast<int32_t>(T), ep, r);
    rows.shared_end = rows.shared_begin + split_count(static_cast<int32_t>(T), ep, r);
  }
  dev_->compute(rows, a.stream);
  if (dp_size_ > 1) {  // tokens of the gathered batch (padding rows excluded)
    last_tokens_ = 0;
    for (int i = 0; i < dp_size_; ++i) last_tokens_ += a.dp_token_counts[i];
  } else {
    last_tokens_ = T;
  }

  // ONE reduction of (routed + shared) partials, then this rank's rows.
  if (!ep_) {
    if (dp_size_ > 1)
      dev_->copy(a.out, static_cast<const char*>(rows.out) + dp_offset * H * static_cast<int64_t>(es),
                 static_cast<size_t>(T * H) * es, a.stream);
    return;
  }
  Comm* ep = st.enter();
  if (dp_size_ > 1 && gather == Gather::Padded && dp_is_ep_) {
    void* own = dev_->buffer(cuda::Buf::Own);
    dev_collective(ep, CollectiveOp::ReduceScatter, own, rows.out, static_cast<size_t>(padded * H), nullptr, nullptr,
                   adt, a.stream, capturing);
    dev_->copy(a.out, own, static_cast<size_t>(T * H) * es, a.stream);
  } else {
    dev_collective(ep, CollectiveOp::AllReduce, rows.out, rows.out, static_cast<size_t>(rows.n * H), nullptr, nullptr,
                   adt, a.stream, capturing);
    if (dp_size_ > 1)
      dev_->copy(a.out, static_cast<const char*>(rows.out) + dp_offset * H * static_cast<int64_t>(es),
                 static_cast<size_t>(T * H) * es, a.stream);
  }
}

void Layer::device_alltoall(const ep_moe_forward_args_t& a, void* stages) {
  Stages& st = *static_cast<Stages*>(stages);
  const int64_t T = a.num_tokens, H = cfg_.hidden_size, K = cfg_.top_k;
  const int32_t n = map_.ep_size();
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t words = row_bytes_ / 4;
  auto* ids_d = static_cast<int32_t*>(dev_->buffer(cuda::Buf::Ids));
  auto* w_d = static_cast<float*>(dev_->buffer(cuda::Buf::Weights));

  // The plan (plan_sends, on the host) goes up to the device: dest per pair,
  // token and destination per row, and each own token's returned rows.
  const int64_t rows_out = send_off_[static_cast<size_t>(n)];
  std::vector<int32_t>& row_dest = row_ids_;
  row_dest.resize(static_cast<size_t>(rows_out));
  for (int32_t d = 0; d < n; ++d)
    for (int64_t j = send_off_[static_cast<size_t>(d)]; j < send_off_[static_cast<size_t>(d) + 1]; ++j)
      row_dest[static_cast<size_t>(j)] = d;
  build_back_csr(T);
  std::vector<int32_t>& index = pair_rows_;  // host image of the index buffer
  index.clear();
  auto put = [&](const int32_t* p, size_t len) {
    const size_t at = index.size();
    index.insert(index.end(), p, p + len);
    return at;
  };
  const size_t at_dest = put(dest_.data(), static_cast<size_t>(T * K));
  const size_t at_tok = put(send_tok_.data(), static_cast<size_t>(rows_out));
  const size_t at_rd = put(row_dest.data(), static_cast<size_t>(rows_out));
  const size_t at_off = index.size();  // the return CSR, as int32
  for (int64_t t = 0; t <= T; ++t) index.push_back(static_cast<int32_t>(back_off_[static_cast<size_t>(t)]));
  const size_t at_idx = index.size();
  for (int64_t j = 0; j < rows_out; ++j) index.push_back(static_cast<int32_t>(back_idx_[static_cast<size_t>(j)]));
  auto* idx_d = static_cast<int32_t*>(dev_->buffer(cuda::Buf::Index));
  if (index.size() * 4 > dev_->buffer_bytes(cuda::Buf::Index)) fail(EP_MOE_ERR_INTERNAL, "index buffer too small");
  dev_->copy(idx_d, index.data(), index.size() * 4, a.stream);

  // 1. One row per (token, destination); pairs computed elsewhere are -1.
  void* send = dev_->buffer(cuda::Buf::SendRows);
  void* recv = dev_->buffer(cuda::Buf::RecvRows);
  dev_->pack_rows(send, rows_out, rows_out, a.hidden, ids_d, w_d, idx_d + at_tok, idx_d + at_dest, idx_d + at_rd,
                  a.stream);
  const int64_t R = a2a_counts(words, true);
  dev_collective(st.enter(), CollectiveOp::AllToAllV, recv, send, 0, counts_.data(), recv_words_.data(),
                 EP_MOE_DTYPE_I32, a.stream, false);

  // 2. Experts on the rows received; partial sums back in the same order.
  cuda::DeviceRows rows;
  rows.n = R;
  rows.x = dev_->buffer(cuda::Buf::AllX);
  rows.ids = static_cast<int32_t*>(dev_->buffer(cuda::Buf::AllIds));
  rows.w = static_cast<float*>(dev_->buffer(cuda::Buf::AllW));
  rows.assigned = true;
  rows.out = dev_->buffer(cuda::Buf::Partial);
  dev_->unpack_rows(recv, R, const_cast<void*>(rows.x), const_cast<int32_t*>(rows.ids), const_cast<float*>(rows.w),
                    a.stream);
  dev_->compute(rows, a.stream);
  last_tokens_ = R;
  void* ret = dev_->buffer(cuda::Buf::RetRecv);
  a2a_counts(static_cast<size_t>(H), false);
  dev_collective(st.enter(), CollectiveOp::AllToAllV, ret, rows.out, 0, counts_.data(), recv_words_.data(), adt,
                 a.stream, false);

  // 3. Own tokens: the shared expert (whole, replicated) plus the returned
  //    rows, in the order they were sent.
  const void* own = nullptr;
  if (shared_count_ > 0 && T > 0) {
    cuda::DeviceRows sh;
    sh.n = T;
    sh.x = a.hidden;
    sh.shared_begin = 0;
    sh.shared_end = T;
    sh.out = dev_->buffer(cuda::Buf::Own);
    dev_->compute(sh, a.stream);
    own = sh.out;
  }
  dev_->sum_returned(a.out, own, ret, idx_d + at_off, idx_d + at_idx, T, a.stream);
  dev_->sync(a.stream);  // the host plan arrays are reused by the next forward
}

}  // namespace ep_moe

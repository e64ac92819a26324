// The CUDA backend of a layer (backend.hpp; a layer whose config names a
// device): the weights and the flows on cuda::DeviceLayer, which lives in
// the run-time module libep_moe_cuda.so. The host plans here (the layer's
// all-to-all plan, the DP gather's counts) and runs the collectives on
// device buffers: a device communicator (NCCL) takes the device pointers
// and the stream; a host one (local, MPI, callbacks) gets the bytes through
// pinned staging buffers, which synchronises the stream (and cannot be
// captured in a CUDA graph).
#include <algorithm>
#include <cstring>

#include "comm/staged_comm.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cuda/device_layer.hpp"
#include "layer/layer.hpp"
#include "layer/stages.hpp"

namespace ep_moe {

namespace {
constexpr int32_t kMaxDeviceTopK = 64;       // per-token scratch of the routing and combine kernels
constexpr int32_t kMaxDeviceExperts = 4096;  // the routing kernel keeps 2 E scores in shared memory
}  // namespace

class CudaBackend final : public LayerBackend {
 public:
  CudaBackend(Layer& layer, int64_t max_rows, int64_t send_rows, int64_t fanout);

  void put(WeightPart part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
           bool src_on_device) override;
  bool takes_biases() const override { return false; }
  void routed_types(int32_t* gate_up, int32_t* down) const override { *gate_up = *down = cfg_.weight_dtype; }
  int pointer_device(const void* p) const override { return dev_->pointer_device(p); }
  void download(void* dst, const void* src, size_t bytes) const override { dev_->download(dst, src, bytes); }
  void extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) const override {
    dev_->extract_units(slot, j0, n, out);
  }
  void extract_rows(int32_t, uint8_t*) const override {
    fail(EP_MOE_ERR_INTERNAL, "a CUDA layer holds no block-format experts");
  }
  void extract_biases(int32_t, uint8_t*) const override {
    fail(EP_MOE_ERR_INTERNAL, "a CUDA layer holds no expert biases");
  }
  // The old layer's device memory goes with it: every kept slot is copied
  // before the vote, and nothing is left for the commit.
  void keep_before_vote(const LayerBackend& old, const std::vector<KeptSlot>& kept, bool router) override;
  void keep_at_commit(LayerBackend&, const std::vector<KeptSlot>&, bool) noexcept override {}
  bool keep_shared(const LayerBackend&) override { return false; }  // units, on the device

  void route(const ep_moe_forward_args_t& a) override;
  void choice_to_host(const ep_moe_forward_args_t& a) override;
  void allgather(const ep_moe_forward_args_t& a, Stages& st, int64_t dp_offset, int64_t padded, Gather gather) override;
  void alltoall(const ep_moe_forward_args_t& a, Stages& st) override;

  void read_load(int64_t* load) override { dev_->read_load(load); }
  void reset_load() override { dev_->reset_load(); }
  bool attr(ep_moe_layer_attr_t a, int64_t* value) const override;
  std::unique_ptr<Comm> host_view(Comm* c) override { return make_staged_comm(c, dev_.get()); }

 private:
  static cuda::DeviceLayerDesc describe(const Layer& L, int64_t max_rows, int64_t send_rows, int64_t fanout,
                                        bool host_comm);
  // A collective on device buffers (staged through pinned host memory for
  // host communicators; `counts`: per-rank counts of the v variants).
  void collective(Comm* c, CollectiveOp op, void* out, const void* in, size_t count, const size_t* counts,
                  const size_t* out_counts, ep_moe_dtype_t dt, void* stream);
  // The all-gather flow's DP gather into the device's gathered rows.
  void dp_gather(const ep_moe_forward_args_t& a, Stages& st, int64_t padded, Gather gather, cuda::DeviceRows* rows);
  // The all-to-all plan (made on the host) up to the device's index buffer.
  struct Index {
    int32_t* base;
    size_t dest, tok, row_dest, off, idx;
  };
  Index upload_plan(const ep_moe_forward_args_t& a);

  Layer& L_;
  const ep_moe_layer_config_t& cfg_;
  std::unique_ptr<cuda::DeviceLayer> dev_;
  bool capturing_ = false;                 // this step's stream is being captured into a CUDA graph
  std::vector<int32_t> row_dest_, index_;  // host images of the all-to-all plan, reserved at create
  int64_t last_tokens_ = 0;
};

std::unique_ptr<LayerBackend> make_cuda_backend(Layer& layer, int64_t max_rows, int64_t send_rows, int64_t fanout) {
  return std::make_unique<CudaBackend>(layer, max_rows, send_rows, fanout);
}

CudaBackend::CudaBackend(Layer& L, int64_t max_rows, int64_t send_rows, int64_t fanout) : L_(L), cfg_(L.cfg_) {
  const ep_moe_layer_config_t& c = cfg_;
  if (c.top_k > kMaxDeviceTopK)
    fail(EP_MOE_ERR_UNSUPPORTED, "CUDA layers support top_k up to %d, got %d", kMaxDeviceTopK, c.top_k);
  if (c.num_experts > kMaxDeviceExperts)
    fail(EP_MOE_ERR_UNSUPPORTED, "CUDA layers support up to %d experts, got %d", kMaxDeviceExperts, c.num_experts);
  if (dtype_is_quant(static_cast<ep_moe_dtype_t>(c.weight_dtype)))
    fail(EP_MOE_ERR_UNSUPPORTED,
         "CUDA layers hold no block-format (GGUF-quantized) weights (weight_dtype %s); use f32, bf16 or f16 (block-"
         "format files and buffers are widened to it as they are stored), or a CPU layer (device -1)",
         dtype_name(static_cast<ep_moe_dtype_t>(c.weight_dtype)));
  if (c.activation == EP_MOE_ACT_SWIGLU_OAI)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "CUDA layers have no clamped SwiGLU (EP_MOE_ACT_SWIGLU_OAI, GPT-OSS); use a CPU layer");
  const bool a2a = L.dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  if (a2a) {  // the all-to-all plan's upload
    const int64_t T = c.max_tokens, K = c.top_k;
    row_dest_.reserve(static_cast<size_t>(T * fanout));
    index_.reserve(static_cast<size_t>(T * K + 3 * T * fanout + T + 1));
  }
  const bool host_comm = (L.ep_ && !L.ep_->device_memory()) || (L.dp_ && !L.dp_->device_memory());
  dev_ = cuda::create_device_layer(describe(L, max_rows, send_rows, fanout, host_comm));
  if (a2a && L.ep_ && L.ep_->device_memory()) {  // the count exchange's host data, sized here
    const size_t row = (static_cast<size_t>(L.map_.ep_size()) + 1) * 8;
    dev_->scratch(staged_scratch_bytes(row, static_cast<size_t>(L.map_.ep_size()) * row));
  }
  log(EP_MOE_LOG_INFO,
      "[EP rank %d/%d] MoE layer on CUDA device %d: H=%d I=%d E=%d top-%d, %d local experts, shared shard %d/%d, "
      "dp %d, collectives %s",
      L.map_.ep_rank(), L.map_.ep_size(), c.device, c.hidden_size, c.intermediate_size, c.num_experts, c.top_k,
      L.map_.num_local_routed(), L.shared_count_, c.shared_intermediate_size, L.dp_size_,
      host_comm ? "staged through pinned host memory"
      : L.ep_   ? "on device buffers"
                : "none");
}

cuda::DeviceLayerDesc CudaBackend::describe(const Layer& L, int64_t max_rows, int64_t send_rows, int64_t fanout,
                                            bool host_comm) {
  const ep_moe_layer_config_t& c = L.cfg_;
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
  d.sigmoid = L.routing_.sigmoid;
  d.renormalize = L.routing_.renormalize;
  d.use_bias = c.use_score_bias != 0;
  d.weight_zero = c.skip_mode == EP_MOE_SKIP_WEIGHT_ZERO;
  d.num_group = c.num_expert_group;
  d.topk_group = c.topk_group;
  d.scale = c.routed_scaling_factor;
  d.shared_count = L.shared_count_;
  d.shared_gate = c.shared_expert_gate != 0;
  d.max_tokens = c.max_tokens;
  d.sync_free_tokens = std::min(c.sync_free_tokens, c.max_tokens);
  d.num_local = static_cast<int32_t>(L.held_.size());
  d.ep_rank = L.map_.ep_rank();
  d.ep_size = L.map_.ep_size();
  d.my_slot_begin = L.map_.rank_slot_begin()[static_cast<size_t>(L.map_.ep_rank())];
  d.replica_begin = L.replica_begin_;
  d.replica_slots = L.replica_slots_;
  d.slot_rank = L.map_.slot_rank();
  d.global_to_local = L.map_.expert_map();
  const int64_t T = c.max_tokens, K = c.top_k;
  const bool a2a = L.dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  const bool flows = L.dp_size_ > 1 || a2a;
  d.row_bytes = L.row_bytes_;
  d.ids_off = L.ids_off_;
  d.max_rows = flows ? max_rows : 0;
  d.max_send_rows = send_rows;
  d.max_ret_rows = a2a ? T * fanout : 0;
  d.max_index = a2a ? T * K + 2 * send_rows + (T + 1) + T * fanout : 0;
  if (host_comm)  // the largest staged transfer: rows of the gather/all-to-all, or a partial output
    d.staging_bytes = static_cast<size_t>(std::max<int64_t>(max_rows, T)) * L.row_bytes_;
  return d;
}

void CudaBackend::put(WeightPart part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
                      bool src_on_device) {
  if (part == WeightPart::RouterBias || part == WeightPart::ExpertGateBias || part == WeightPart::ExpertUpBias ||
      part == WeightPart::ExpertDownBias)
    fail(EP_MOE_ERR_INTERNAL, "a CUDA layer was given a bias (takes_biases() is false)");
  // CUDA layers hold weight_dtype (f32, bf16 or f16): the upload widens
  // block formats on the host, from host memory only.
  if (dtype_is_quant(src.dtype) && src_on_device)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s weights in device memory: a CUDA layer widens block formats on the host; give them in host memory",
         dtype_name(src.dtype));
  dev_->upload(part, slot < 0 ? 0 : slot, row0, src, rows, cols, src_on_device);
}

void CudaBackend::keep_before_vote(const LayerBackend& old_backend, const std::vector<KeptSlot>& kept, bool router) {
  const auto& old = static_cast<const CudaBackend&>(old_backend);
  for (const KeptSlot& k : kept) dev_->copy_expert_from(*old.dev_, k.old_slot, k.new_slot);
  if (router) dev_->copy_router_from(*old.dev_);
}

bool CudaBackend::attr(ep_moe_layer_attr_t a, int64_t* v) const {
  switch (a) {
    case EP_MOE_LAYER_ATTR_WEIGHT_BYTES:
      *v = dev_->weight_bytes() + (L_.has_router_ ? int64_t{cfg_.num_experts} * cfg_.hidden_size * 4 : 0);
      return true;
    case EP_MOE_LAYER_ATTR_NUM_THREADS: *v = 1; return true;
    case EP_MOE_LAYER_ATTR_CPU_ISA: *v = static_cast<int64_t>(cpu::layer_kernels().isa); return true;
    case EP_MOE_LAYER_ATTR_LAST_TOKENS: *v = last_tokens_; return true;
    case EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS: *v = dev_->stats().local_pairs; return true;
    case EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS: *v = dev_->stats().skipped; return true;
    case EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS: *v = dev_->stats().active; return true;
    case EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS: *v = dev_->stats().permute_ns; return true;
    case EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES: *v = dev_->stats().permute_bytes; return true;
    case EP_MOE_LAYER_ATTR_LAST_EXPERT_NS: *v = dev_->stats().expert_ns; return true;
    case EP_MOE_LAYER_ATTR_LAST_COMBINE_NS: *v = dev_->stats().combine_ns; return true;
    case EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES: *v = dev_->stats().combine_bytes; return true;
    case EP_MOE_LAYER_ATTR_LAST_SYNC_FREE: *v = dev_->stats().sync_free; return true;
    default: return false;
  }
}

void CudaBackend::collective(Comm* c, CollectiveOp op, void* out, const void* in, size_t count, const size_t* counts,
                             const size_t* out_counts, ep_moe_dtype_t dt, void* stream) {
  const Collective x{op, count, counts, out_counts, dt};
  if (c->device_memory()) {
    run_collective(c, x, out, in, stream);
    return;
  }
  if (capturing_)
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

// --- the forward -------------------------------------------------------------

// Routing: the pointers must be this device's; the top-k choice lands in
// the device Ids/Weights buffers.
void CudaBackend::route(const ep_moe_forward_args_t& a) {
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
  capturing_ = dev_->begin(a.stream);
  cuda::DeviceForward f;
  f.tokens = a.num_tokens;
  f.hidden = a.hidden;
  f.router_logits = a.router_logits;
  f.topk_ids = a.topk_ids;
  f.topk_weights = a.topk_weights;
  f.own_router = a.router_logits == nullptr && a.topk_ids == nullptr && L_.has_router_;
  f.stream = a.stream;
  dev_->route(f, static_cast<int32_t*>(dev_->buffer(cuda::Buf::Ids)),
              static_cast<float*>(dev_->buffer(cuda::Buf::Weights)));
}

// The all-to-all plan reads the choice on the host: copied back, checked
// as the CPU checks it (synchronises).
void CudaBackend::choice_to_host(const ep_moe_forward_args_t& a) {
  if (capturing_)
    fail(EP_MOE_ERR_UNSUPPORTED, "the all-to-all dispatch plans on the host: it cannot be captured in a CUDA graph");
  const int64_t T = a.num_tokens, K = cfg_.top_k;
  if (T == 0) return;
  if (!a.topk_ids) dev_->check_route(a.stream);  // bad logits, before their ids are used
  dev_->copy(L_.ids_.data(), dev_->buffer(cuda::Buf::Ids), static_cast<size_t>(T * K) * 4, a.stream);
  if (a.topk_ids)
    dev_->copy(L_.weights_.data(), dev_->buffer(cuda::Buf::Weights), static_cast<size_t>(T * K) * 4, a.stream);
  dev_->sync(a.stream);
  if (a.topk_ids) check_topk(L_.ids_.data(), L_.weights_.data(), T, cfg_.top_k, cfg_.num_experts);
}

void CudaBackend::allgather(const ep_moe_forward_args_t& a, Stages& st, int64_t dp_offset, int64_t padded,
                            Gather gather) {
  const int64_t T = a.num_tokens, H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  cuda::DeviceRows rows;
  rows.n = T;
  rows.x = a.hidden;
  rows.ids = static_cast<int32_t*>(dev_->buffer(cuda::Buf::Ids));
  rows.w = static_cast<float*>(dev_->buffer(cuda::Buf::Weights));
  rows.out = a.out;
  if (L_.dp_size_ > 1) dp_gather(a, st, padded, gather, &rows);
  L_.shared_rows(T, rows.n, dp_offset, &rows.shared_begin, &rows.shared_end);
  dev_->compute(rows, a.stream);
  if (L_.dp_size_ > 1) {  // tokens of the gathered batch (padding rows excluded)
    last_tokens_ = 0;
    for (int i = 0; i < L_.dp_size_; ++i) last_tokens_ += a.dp_token_counts[i];
  } else {
    last_tokens_ = T;
  }

  // ONE reduction of (routed + shared) partials, then this rank's rows.
  const char* mine = static_cast<const char*>(rows.out) + dp_offset * H * static_cast<int64_t>(es);
  if (!L_.ep_) {
    if (L_.dp_size_ > 1) dev_->copy(a.out, mine, static_cast<size_t>(T * H) * es, a.stream);
    return;
  }
  Comm* ep = st.enter();
  if (L_.dp_size_ > 1 && gather == Gather::Padded && L_.dp_is_ep_) {
    void* own = dev_->buffer(cuda::Buf::Own);
    collective(ep, CollectiveOp::ReduceScatter, own, rows.out, static_cast<size_t>(padded * H), nullptr, nullptr, adt,
               a.stream);
    dev_->copy(a.out, own, static_cast<size_t>(T * H) * es, a.stream);
  } else {
    collective(ep, CollectiveOp::AllReduce, rows.out, rows.out, static_cast<size_t>(rows.n * H), nullptr, nullptr, adt,
               a.stream);
    if (L_.dp_size_ > 1) dev_->copy(a.out, mine, static_cast<size_t>(T * H) * es, a.stream);
  }
}

// One collective of [hidden | ids | weights] rows (padding rows: zeros and
// ids -1, never computed), unpacked into the gathered rows.
void CudaBackend::dp_gather(const ep_moe_forward_args_t& a, Stages& st, int64_t padded, Gather gather,
                            cuda::DeviceRows* rows) {
  const int64_t T = a.num_tokens;
  const int64_t send_n = gather == Gather::Padded ? padded : T;
  void* send = dev_->buffer(cuda::Buf::SendRows);
  void* recv = dev_->buffer(cuda::Buf::RecvRows);
  dev_->pack_rows(send, send_n, T, a.hidden, rows->ids, rows->w, nullptr, nullptr, nullptr, a.stream);
  const size_t words = L_.row_bytes_ / 4;
  const int64_t T_all = L_.gathered_rows(a, gather, padded, words);
  Comm* dp = st.enter();
  if (gather == Gather::Padded) {
    collective(dp, CollectiveOp::AllGather, recv, send, static_cast<size_t>(padded) * words, nullptr, nullptr,
               EP_MOE_DTYPE_I32, a.stream);
  } else {
    collective(dp, CollectiveOp::AllGatherV, recv, send, 0, L_.counts_.data(), nullptr, EP_MOE_DTYPE_I32, a.stream);
  }
  rows->n = T_all;
  rows->x = dev_->buffer(cuda::Buf::AllX);
  rows->ids = static_cast<int32_t*>(dev_->buffer(cuda::Buf::AllIds));
  rows->w = static_cast<float*>(dev_->buffer(cuda::Buf::AllW));
  rows->out = dev_->buffer(cuda::Buf::Partial);
  dev_->unpack_rows(recv, T_all, const_cast<void*>(rows->x), const_cast<int32_t*>(rows->ids),
                    const_cast<float*>(rows->w), a.stream);
}

// The plan goes up to the device: dest per pair, token and destination per
// row, and each own token's returned rows (the CSR, as int32).
CudaBackend::Index CudaBackend::upload_plan(const ep_moe_forward_args_t& a) {
  const int64_t T = a.num_tokens, K = cfg_.top_k;
  const int32_t n = L_.map_.ep_size();
  const std::vector<int64_t>& off = L_.send_off_;
  const int64_t rows_out = off[static_cast<size_t>(n)];
  row_dest_.resize(static_cast<size_t>(rows_out));
  for (int32_t d = 0; d < n; ++d)
    for (int64_t j = off[static_cast<size_t>(d)]; j < off[static_cast<size_t>(d) + 1]; ++j)
      row_dest_[static_cast<size_t>(j)] = d;
  L_.build_back_csr(T);
  index_.clear();
  auto put = [&](const int32_t* p, size_t len) {
    const size_t at = index_.size();
    index_.insert(index_.end(), p, p + len);
    return at;
  };
  Index ix;
  ix.dest = put(L_.dest_.data(), static_cast<size_t>(T * K));
  ix.tok = put(L_.send_tok_.data(), static_cast<size_t>(rows_out));
  ix.row_dest = put(row_dest_.data(), static_cast<size_t>(rows_out));
  ix.off = index_.size();
  for (int64_t t = 0; t <= T; ++t) index_.push_back(static_cast<int32_t>(L_.back_off_[static_cast<size_t>(t)]));
  ix.idx = index_.size();
  for (int64_t j = 0; j < rows_out; ++j) index_.push_back(static_cast<int32_t>(L_.back_idx_[static_cast<size_t>(j)]));
  ix.base = static_cast<int32_t*>(dev_->buffer(cuda::Buf::Index));
  if (index_.size() * 4 > dev_->buffer_bytes(cuda::Buf::Index)) fail(EP_MOE_ERR_INTERNAL, "index buffer too small");
  dev_->copy(ix.base, index_.data(), index_.size() * 4, a.stream);
  return ix;
}

void CudaBackend::alltoall(const ep_moe_forward_args_t& a, Stages& st) {
  const int64_t T = a.num_tokens, H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t words = L_.row_bytes_ / 4;
  const Index ix = upload_plan(a);
  const int64_t rows_out = L_.send_off_[static_cast<size_t>(L_.map_.ep_size())];

  // 1. One row per (token, destination); pairs computed elsewhere are -1.
  void* send = dev_->buffer(cuda::Buf::SendRows);
  void* recv = dev_->buffer(cuda::Buf::RecvRows);
  dev_->pack_rows(send, rows_out, rows_out, a.hidden, static_cast<int32_t*>(dev_->buffer(cuda::Buf::Ids)),
                  static_cast<float*>(dev_->buffer(cuda::Buf::Weights)), ix.base + ix.tok, ix.base + ix.dest,
                  ix.base + ix.row_dest, a.stream);
  const int64_t R = L_.a2a_counts(words, true);
  collective(st.enter(), CollectiveOp::AllToAllV, recv, send, 0, L_.counts_.data(), L_.recv_words_.data(),
             EP_MOE_DTYPE_I32, a.stream);

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
  L_.a2a_counts(static_cast<size_t>(H), false);
  collective(st.enter(), CollectiveOp::AllToAllV, ret, rows.out, 0, L_.counts_.data(), L_.recv_words_.data(), adt,
             a.stream);

  // 3. Own tokens: the shared expert (whole, replicated) plus the returned
  //    rows, in the order they were sent.
  const void* own = nullptr;
  if (L_.shared_count_ > 0 && T > 0) {
    cuda::DeviceRows sh;
    sh.n = T;
    sh.x = a.hidden;
    sh.shared_begin = 0;
    sh.shared_end = T;
    sh.out = dev_->buffer(cuda::Buf::Own);
    dev_->compute(sh, a.stream);
    own = sh.out;
  }
  dev_->sum_returned(a.out, own, ret, ix.base + ix.off, ix.base + ix.idx, T, a.stream);
  dev_->sync(a.stream);  // the host plan arrays are reused by the next forward
}

}  // namespace ep_moe

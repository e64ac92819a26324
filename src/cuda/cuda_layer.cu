// The CUDA layer (cuda_layer.cuh): set-up, weight uploads, routing, the
// plan, permutation and combine of compute(), the distributed flows' row
// kernels, re-placement copies and statistics. The expert GEMMs are in
// expert_gemm.cu.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cuda/cuda_layer.cuh"
#include "cuda/permute_kernels.cuh"
#include "cuda/plan_kernels.cuh"
#include "cuda/routing_kernels.cuh"

namespace ep_moe {
namespace cuda {

CudaLayer::CudaLayer(const DeviceLayerDesc& d) : d_(d), gdt_(d.weight_dtype), ges_(dtype_size(d.weight_dtype)) {
  DeviceGuard g(d.device);
  check_lt(cublasLtCreate(&lt_), "cublasLtCreate");
  check_lt(cublasLtMatmulDescCreate(&mm_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(mm_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "set TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(mm_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "set TRANSB");
  lt_ws_.alloc(32u << 20, "cuBLASLt workspace");

  const int64_t H = d.hidden, I = d.inter, S = d.shared_count, L = d.num_local, E = d.num_experts, K = d.top_k;
  const int64_t T = d.max_tokens, R = std::max(d.max_rows, T), P = R * K;
  const size_t aes = dtype_size(d.act_dtype);
  row_bytes_ = d.row_bytes;
  w_gu_.alloc(static_cast<size_t>(L * 2 * I * H) * ges_, "expert gate/up weights");
  w_down_.alloc(static_cast<size_t>(L * H * I) * ges_, "expert down weights");
  s_gu_.alloc(static_cast<size_t>(2 * S * H) * ges_, "shared gate/up weights");
  s_down_.alloc(static_cast<size_t>(H * S) * ges_, "shared down weights");
  router_.alloc(static_cast<size_t>(E * H) * 4, "router weight");
  if (d.use_bias) bias_.alloc(static_cast<size_t>(E) * 4, "score bias");
  if (d.shared_gate) s_gate_.alloc(static_cast<size_t>(H) * 4, "shared expert gate");
  weight_bytes_ =
      static_cast<int64_t>(w_gu_.bytes + w_down_.bytes + s_gu_.bytes + s_down_.bytes + bias_.bytes + s_gate_.bytes);

  auto upload_table = [](DevBuf& b, const std::vector<int32_t>& v) {
    b.alloc(std::max<size_t>(v.size(), 1) * 4, "placement table");
    if (!v.empty()) check(cudaMemcpy(b.p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload tables");
  };
  upload_table(rep_begin_, d.replica_begin);
  upload_table(rep_slots_, d.replica_slots);
  upload_table(slot_rank_, d.slot_rank);
  upload_table(g2l_, d.global_to_local);
  load_.alloc(static_cast<size_t>(E) * 8, "load counts");
  check(cudaMemset(load_.p, 0, load_.bytes), "clear load counts");

  const auto sz = [](int64_t n) { return static_cast<size_t>(std::max<int64_t>(n, 1)); };
  pair_local_.alloc(sz(P) * 4, "workspace");
  pair_w_.alloc(sz(P) * 4, "workspace");
  pair_pos_.alloc(sz(P) * 4, "workspace");
  offsets_.alloc(sz(L + 1) * 4, "workspace");
  cursor_.alloc(sz(L) * 4, "workspace");
  meta_ints_ = static_cast<size_t>(L + 4);
  meta_.alloc(meta_ints_ * 4, "workspace");
  // The expert rows: room for the pairs plus half again, so that the padded
  // (one call per GEMM) layout fits when the experts' counts are uneven, and
  // for slots of sync_free_tokens rows per local expert (decode), the latter
  // capped at 256 MiB of rows (beyond it decode uses the grouped kernel).
  const int64_t row_cost = H * static_cast<int64_t>(ges_) + 2 * I * 4 + I * static_cast<int64_t>(ges_) + H * 4;
  const int64_t slot_rows =
      std::min<int64_t>(L * std::min<int64_t>(d.sync_free_tokens, R), (int64_t{256} << 20) / row_cost);
  cap_rows_ = std::max<int64_t>(P + P / 2, slot_rows);
  xperm_.alloc(sz(cap_rows_ * H) * ges_, "workspace");
  h_.alloc(sz(cap_rows_ * 2 * I) * 4, "workspace");
  a_.alloc(sz(cap_rows_ * I) * ges_, "workspace");
  y_.alloc(sz(cap_rows_ * H) * 4, "workspace");
  if (S > 0) {
    xs_.alloc(sz(R * H) * ges_, "workspace");
    hs_.alloc(sz(R * 2 * S) * 4, "workspace");
    as_.alloc(sz(R * S) * ges_, "workspace");
    ys_.alloc(sz(R * H) * 4, "workspace");
    if (d.shared_gate) gs_.alloc(sz(R) * 4, "workspace");
  }
  xf_.alloc(sz(T * H) * 4, "workspace");
  logits_.alloc(sz(T * E) * 4, "workspace");

  // The distributed flows' buffers.
  const std::pair<Buf, size_t> sizes[] = {
      {Buf::Ids, sz(T * K) * 4},
      {Buf::Weights, sz(T * K) * 4},
      {Buf::SendRows, d.max_send_rows > 0 ? sz(d.max_send_rows) * row_bytes_ : 0},
      {Buf::RecvRows, d.max_rows > 0 ? sz(d.max_rows) * row_bytes_ : 0},
      {Buf::AllX, d.max_rows > 0 ? sz(d.max_rows * H) * aes : 0},
      {Buf::AllIds, d.max_rows > 0 ? sz(d.max_rows * K) * 4 : 0},
      {Buf::AllW, d.max_rows > 0 ? sz(d.max_rows * K) * 4 : 0},
      {Buf::Partial, d.max_rows > 0 ? sz(d.max_rows * H) * aes : 0},
      {Buf::Own, d.max_rows > 0 ? sz(T * H) * aes : 0},
      {Buf::RetRecv, d.max_ret_rows > 0 ? sz(d.max_ret_rows * H) * aes : 0},
      {Buf::Index, d.max_index > 0 ? sz(d.max_index) * 4 : 0},
  };
  int i = 0;
  for (const auto& p : sizes) {
    flow_[i].alloc(p.second, "workspace");
    buf(p.first) = Buffer{flow_[i].p, flow_[i].bytes};
    ++i;
  }
  if (d.staging_bytes > 0) {
    for (int k = 0; k < 2; ++k) check(cudaMallocHost(&staging_[k], d.staging_bytes), "pinned staging buffer");
    buf(Buf::StageIn) = Buffer{staging_[0], d.staging_bytes};
    buf(Buf::StageOut) = Buffer{staging_[1], d.staging_bytes};
  }
  check(cudaMallocHost(reinterpret_cast<void**>(&host_meta_), (meta_ints_ + 2 * static_cast<size_t>(L) + 1) * 4),
        "pinned host buffer");
  for (auto& e : ev_) check(cudaEventCreate(&e), "cudaEventCreate");
  check(cudaEventCreateWithFlags(&ev_meta_, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaDeviceSynchronize(), "layer setup");
}

CudaLayer::~CudaLayer() {
  DeviceGuard g(d_.device);
  for (auto& e : ev_)
    if (e) (void)cudaEventDestroy(e);
  if (ev_meta_) (void)cudaEventDestroy(ev_meta_);
  if (host_meta_) (void)cudaFreeHost(host_meta_);
  for (void* p : staging_)
    if (p) (void)cudaFreeHost(p);
  if (mm_) (void)cublasLtMatmulDescDestroy(mm_);
  if (lt_) (void)cublasLtDestroy(lt_);
}

int CudaLayer::pointer_device(const void* p) const {
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  if (at.type == cudaMemoryTypeManaged) return d_.device;
  return at.type == cudaMemoryTypeDevice ? at.device : -1;
}

void CudaLayer::upload(Part part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
                       bool src_on_device) {
  DeviceGuard g(d_.device);
  const int64_t H = d_.hidden, I = d_.inter;
  char* dst = nullptr;
  ep_moe_dtype_t ddt = gdt_;
  switch (part) {
    case Part::ExpertGateUp: dst = w_gu_.as<char>() + (slot * 2 * I + row0) * H * static_cast<int64_t>(ges_); break;
    case Part::ExpertDown: dst = w_down_.as<char>() + slot * H * I * static_cast<int64_t>(ges_); break;
    case Part::SharedGateUp: dst = s_gu_.as<char>() + row0 * H * static_cast<int64_t>(ges_); break;
    case Part::SharedDown: dst = s_down_.as<char>(); break;
    case Part::Router:
      dst = router_.as<char>();
      ddt = EP_MOE_DTYPE_F32;
      break;
    case Part::Bias:
      dst = bias_.as<char>();
      ddt = EP_MOE_DTYPE_F32;
      break;
    case Part::SharedGate:
      dst = s_gate_.as<char>();
      ddt = EP_MOE_DTYPE_F32;
      break;
    default:  // expert and router biases: the layer refuses them for CUDA layers
      fail(EP_MOE_ERR_UNSUPPORTED, "CUDA layers hold no expert or router biases");
  }
  if (dst == nullptr || rows <= 0 || cols <= 0) return;
  const size_t des = dtype_size(ddt), ses = dtype_size(src.dtype);
  const size_t row_bytes = static_cast<size_t>(cols) * des;
  if (!src.transposed && src.dtype == ddt) {  // straight copy, host or device
    const char* s0 = static_cast<const char*>(src.data) + (src.row0 * src.ld + src.col0) * static_cast<int64_t>(ses);
    check(cudaMemcpy2D(dst, row_bytes, s0, static_cast<size_t>(src.ld) * ses, row_bytes, static_cast<size_t>(rows),
                       src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice),
          "weight upload");
    // A device-to-device cudaMemcpy may return before the copy is done; the
    // caller may reuse its buffer once set_weight returns.
    if (src_on_device) check(cudaDeviceSynchronize(), "weight upload");
    return;
  }
  // Other layouts: the source span to the host (when on the device), then
  // converted on the host, row by row, and copied up.
  Source hs = src;
  std::vector<char> span;
  if (src_on_device) {
    const int64_t first = src.transposed ? src.col0 * src.ld + src.row0 : src.row0 * src.ld + src.col0;
    const int64_t last = src.transposed ? (src.col0 + cols - 1) * src.ld + src.row0 + rows - 1
                                        : (src.row0 + rows - 1) * src.ld + src.col0 + cols - 1;
    span.resize(static_cast<size_t>(last - first + 1) * ses);
    check(cudaMemcpy(span.data(), static_cast<const char*>(src.data) + first * static_cast<int64_t>(ses), span.size(),
                     cudaMemcpyDeviceToHost),
          "weight download");
    // Rebase so that (row0, col0) lands on span[0].
    hs.data = span.data() - first * static_cast<int64_t>(ses);
  }
  std::vector<char> stage(static_cast<size_t>(rows) * row_bytes);
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    source_row_f32(hs, r, cols, row.data());  // a block format's row decoded once
    for (int64_t c = 0; c < cols; ++c) store_elem(stage.data(), ddt, r * cols + c, row[static_cast<size_t>(c)]);
  }
  check(cudaMemcpy(dst, stage.data(), stage.size(), cudaMemcpyHostToDevice), "weight upload");
}

bool CudaLayer::begin(void* stream) {
  DeviceGuard g(d_.device);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &cs), "cudaStreamIsCapturing");
  capturing_ = cs != cudaStreamCaptureStatusNone;
  have_stats_ = have_times_ = false;
  last_ = DeviceStats{};
  last_rows_ = 0;
  // The meta block (counts, errors) starts each forward cleared: routing
  // writes its errors there, the plan its counts.
  check(cudaMemsetAsync(meta_.p, 0, meta_ints_ * 4, static_cast<cudaStream_t>(stream)), "clear counts");
  return capturing_;
}

void CudaLayer::route(const DeviceForward& f, int32_t* ids, float* w) {
  DeviceGuard guard(d_.device);
  const auto s = static_cast<cudaStream_t>(f.stream);
  const int64_t T = f.tokens, H = d_.hidden, K = d_.top_k, E = d_.num_experts;
  if (T == 0) return;
  const int L = d_.num_local;
  int* meta = meta_.as<int>();  // routing errors land there (cleared by begin())
  if (f.own_router || f.router_logits) {
    RouteArgs ra{static_cast<int>(E),
                 static_cast<int>(K),
                 d_.num_group,
                 d_.topk_group,
                 d_.sigmoid,
                 d_.renormalize,
                 d_.use_bias ? bias_.as<float>() : nullptr,
                 d_.scale};
    const size_t route_smem = static_cast<size_t>(2 * E + std::max(d_.num_group, 1)) * 4;
    const void* logits = f.router_logits;
    ep_moe_dtype_t ldt = d_.router_dtype;
    if (f.own_router) {
      with_type(d_.act_dtype, [&](auto* tag) {
        using A = std::remove_pointer_t<decltype(tag)>;
        convert_kernel<A, float>
            <<<grid_for(T * H, 256), 256, 0, s>>>(static_cast<const A*>(f.hidden), xf_.as<float>(), T * H);
      });
      check_launch("convert kernel");
      if (!lt_gemm(Gemm::Router, EP_MOE_DTYPE_F32, router_.p, xf_.p, logits_.as<float>(), T, static_cast<int>(E),
                   static_cast<int>(H), s, 1))
        grouped_gemm(EP_MOE_DTYPE_F32, xf_.p, router_.p, 0, logits_.as<float>(), nullptr, nullptr, 0, 1, T,
                     static_cast<int>(E), static_cast<int>(H), s, T);
      logits = logits_.p;
      ldt = EP_MOE_DTYPE_F32;
    }
    with_type(ldt, [&](auto* tag) {
      using Lg = std::remove_pointer_t<decltype(tag)>;
      route_kernel<Lg>
          <<<static_cast<unsigned>(T), 128, route_smem, s>>>(static_cast<const Lg*>(logits), ra, ids, w, meta + L + 1);
    });
    check_launch("routing kernel");
  } else {
    check(cudaMemcpyAsync(ids, f.topk_ids, static_cast<size_t>(T * K) * 4, cudaMemcpyDeviceToDevice, s),
          "copy topk_ids");
    check(cudaMemcpyAsync(w, f.topk_weights, static_cast<size_t>(T * K) * 4, cudaMemcpyDeviceToDevice, s),
          "copy topk_weights");
  }
}

void CudaLayer::check_route(void* stream) {
  DeviceGuard g(d_.device);
  const auto s = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(host_meta_, meta_.p, meta_ints_ * 4, cudaMemcpyDeviceToHost, s), "read routing errors");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  check_errors(host_meta_);
}

void CudaLayer::check_errors(const int* hm) {
  const int L = d_.num_local;
  const int64_t K = d_.top_k;
  const int err = hm[L + 1];
  if (err == kErrNone) return;
  const long long where = hm[L + 2];
  switch (err) {
    case kErrNanLogit: fail(EP_MOE_ERR_INVALID_ARGUMENT, "router_logits of token %lld hold a NaN", where);
    case kErrInfLogits:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "router_logits of token %lld are infinite: softmax is undefined", where);
    case kErrBadId:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_ids[token %lld, slot %lld] is outside [0, %d)", where / K, where % K,
           d_.num_experts);
    default:
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "topk_weights[token %lld, slot %lld] is not finite", where / K, where % K);
  }
}

void CudaLayer::compute(const DeviceRows& r, void* stream) {
  DeviceGuard guard(d_.device);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = r.n, S = d_.shared_count, K = d_.top_k;
  const int64_t P = r.ids ? n * K : 0;
  const bool sync_free = capturing_ || n <= d_.sync_free_tokens;
  if (r.ids) {
    last_.sync_free = sync_free ? 1 : 0;
    last_rows_ = n;
  }
  if (n == 0) {
    if (r.ids) have_stats_ = true;
    return;
  }
  const bool timed = !capturing_ && r.ids != nullptr;
  if (timed) check(cudaEventRecord(ev_[0], s), "cudaEventRecord");
  // The shared expert's rows [s0, s1) of the n.
  const int64_t s0 = S > 0 ? std::max<int64_t>(0, r.shared_begin) : 0;
  const int64_t s1 = S > 0 ? std::min<int64_t>(n, r.shared_end) : 0;
  const int64_t sn = std::max<int64_t>(0, s1 - s0);

  const int32_t* hoff = nullptr;
  const int64_t pad = P > 0 ? plan(r, s, P, sync_free, &hoff) : 0;
  permute(r, s, P, s0, sn);
  if (timed) check(cudaEventRecord(ev_[1], s), "cudaEventRecord");
  routed_experts(s, P, pad, sync_free, hoff);
  shared_expert(s, sn);
  if (timed) check(cudaEventRecord(ev_[2], s), "cudaEventRecord");
  combine(r, s, P, s0, s1, sn);
  if (timed) {
    check(cudaEventRecord(ev_[3], s), "cudaEventRecord");
    check(cudaMemcpyAsync(host_meta_, meta_.p, meta_ints_ * 4, cudaMemcpyDeviceToHost, s), "read counts");
    check(cudaEventRecord(ev_meta_, s), "cudaEventRecord");
    have_stats_ = have_times_ = true;
    last_shared_rows_ = sn;
  }
}

// Plan: counts per local slot and their offsets. On the synchronising path
// the counts come to the host here (*hoff: the offsets there); when the
// experts' row counts are even enough, each expert gets a slot of `pad`
// rows (returned; 0: none) and each GEMM is one strided-batched cuBLASLt
// call instead of one call per expert.
int64_t CudaLayer::plan(const DeviceRows& r, cudaStream_t s, int64_t P, bool sync_free, const int32_t** hoff) {
  const int64_t n = r.n, K = d_.top_k;
  const int L = d_.num_local;
  int* meta = meta_.as<int>();
  int32_t* offsets = offsets_.as<int32_t>();
  int64_t pad = 0;
  PlanArgs pa{P,
              static_cast<int>(K),
              d_.num_experts,
              d_.ep_rank,
              d_.my_slot_begin,
              L,
              d_.weight_zero,
              r.assigned,
              rep_begin_.as<int32_t>(),
              rep_slots_.as<int32_t>(),
              slot_rank_.as<int32_t>(),
              g2l_.as<int32_t>(),
              load_.as<unsigned long long>()};
  if (sync_free && !d_.weight_zero && L > 0 && L * n <= cap_rows_) {
    // No counts on the host, but no expert gets more than n rows (a token
    // picks an expert once): when most experts are likely active (uniform
    // routing: 1 - (1 - K/E)^n of them), a slot of n rows each and one
    // strided-batched cuBLASLt call per GEMM read each expert's weights
    // once at full speed; with few active experts the grouped kernel,
    // which skips the idle ones, reads less.
    const double active = 1.0 - std::pow(1.0 - static_cast<double>(K) / d_.num_experts, static_cast<double>(n));
    if (active >= 0.5) pad = n;
  }
  if (sync_free && P <= kSmallPlanPairs && L > 0) {
    // The whole plan in one block (one launch instead of four).
    plan_small_kernel<<<1, 512, static_cast<size_t>(2 * L) * 4, s>>>(
        pa, r.ids, r.w, pair_local_.as<int32_t>(), pair_w_.as<float>(), pair_pos_.as<int32_t>(), meta, offsets, pad);
    check_launch("plan kernel");
    return pad;
  }
  plan_count_kernel<<<grid_for(P, 256), 256, 0, s>>>(pa, r.ids, r.w, pair_local_.as<int32_t>(), pair_w_.as<float>(),
                                                     meta);
  check_launch("plan kernel");
  if (L > 0) {
    // A warp per 32 slots, up to 1024 threads (then several slots each).
    const int threads = std::min(1024, (L + 31) / 32 * 32);
    plan_scan_kernel<<<1, threads, 0, s>>>(L, meta, offsets, cursor_.as<int32_t>());
    check_launch("plan scan kernel");
  } else {
    check(cudaMemsetAsync(offsets, 0, 4, s), "clear offsets");
  }
  if (!sync_free) {
    pad = read_counts(s, hoff);
  } else if (pad > 0) {
    padded_cursor_kernel<<<grid_for(L, 256), 256, 0, s>>>(L, pad, cursor_.as<int32_t>());
    check_launch("padded slots");
  }
  plan_fill_kernel<<<grid_for(P, 256), 256, 0, s>>>(P, pair_local_.as<int32_t>(), cursor_.as<int32_t>(),
                                                    pair_pos_.as<int32_t>());
  check_launch("plan fill kernel");
  return pad;
}

// The one synchronisation of the synchronising path: the per-expert counts
// (and any input error) to the host; padded slots when they fit. Returns
// the pad (0: none).
int64_t CudaLayer::read_counts(cudaStream_t s, const int32_t** hoff_out) {
  const int L = d_.num_local;
  int* hm = host_meta_;
  int32_t* ho = host_meta_ + meta_ints_;
  check(cudaMemcpyAsync(hm, meta_.p, meta_ints_ * 4, cudaMemcpyDeviceToHost, s), "read counts");
  check(cudaMemcpyAsync(ho, offsets_.p, static_cast<size_t>(L + 1) * 4, cudaMemcpyDeviceToHost, s), "read offsets");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  check_errors(hm);
  *hoff_out = ho;
  int64_t most = 0;
  for (int l = 0; l < L; ++l) most = std::max<int64_t>(most, ho[l + 1] - ho[l]);
  const int64_t used = ho[L];
  if (!(L > 1 && most > 0 && L * most <= cap_rows_ && L * most <= 2 * used)) return 0;
  const int64_t pad = most;
  int32_t* starts = ho + L + 1;
  for (int l = 0; l < L; ++l) starts[l] = static_cast<int32_t>(l * pad);
  check(cudaMemcpyAsync(cursor_.p, starts, static_cast<size_t>(L) * 4, cudaMemcpyHostToDevice, s), "padded slots");
  return pad;
}

// The routed pairs' rows into expert order, the shared expert's rows and
// its gate, all in the GEMM type.
void CudaLayer::permute(const DeviceRows& r, cudaStream_t s, int64_t P, int64_t s0, int64_t sn) {
  const int64_t H = d_.hidden, K = d_.top_k;
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    const A* x = static_cast<const A*>(r.x);
    with_type(gdt_, [&](auto* tg) {
      using G = std::remove_pointer_t<decltype(tg)>;
      if (P > 0)
        permute_kernel<A, G><<<static_cast<unsigned>(P), 128, 0, s>>>(x, pair_pos_.as<int32_t>(), static_cast<int>(K),
                                                                      H, xperm_.as<G>());
      if (sn > 0) convert_kernel<A, G><<<grid_for(sn * H, 256), 256, 0, s>>>(x + s0 * H, xs_.as<G>(), sn * H);
      if (d_.shared_gate && sn > 0)
        shared_gate_kernel<A>
            <<<static_cast<unsigned>(sn), 128, 0, s>>>(x + s0 * H, s_gate_.as<float>(), H, gs_.as<float>());
    });
  });
  check_launch("permute kernels");
}

// The weighted combine into the output rows (act dtype), with the shared
// expert's rows [s0, s1).
void CudaLayer::combine(const DeviceRows& r, cudaStream_t s, int64_t P, int64_t s0, int64_t s1, int64_t sn) {
  const int64_t n = r.n, H = d_.hidden, K = d_.top_k;
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    const float* ysp = sn > 0 ? ys_.as<float>() : nullptr;
    const float* gsp = d_.shared_gate && sn > 0 ? gs_.as<float>() : nullptr;
    const int32_t* pp = P > 0 ? pair_pos_.as<int32_t>() : nullptr;
    if (H % 4 == 0)  // rows of y are then 16-byte aligned
      combine_kernel<A, 4><<<static_cast<unsigned>(n), 128, 0, s>>>(
          y_.as<float>(), pp, pair_w_.as<float>(), static_cast<int>(K), ysp, gsp, s0, s1, H, static_cast<A*>(r.out));
    else
      combine_kernel<A, 1><<<static_cast<unsigned>(n), 128, 0, s>>>(
          y_.as<float>(), pp, pair_w_.as<float>(), static_cast<int>(K), ysp, gsp, s0, s1, H, static_cast<A*>(r.out));
  });
  check_launch("combine kernel");
}

void CudaLayer::pack_rows(void* out, int64_t rows, int64_t valid, const void* hidden, const int32_t* ids,
                          const float* w, const int32_t* tok, const int32_t* dest, const int32_t* row_dest,
                          void* stream) {
  if (rows <= 0) return;
  DeviceGuard g(d_.device);
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    pack_rows_kernel<A><<<static_cast<unsigned>(rows), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<char*>(out), rows, valid, row_bytes_, d_.ids_off, static_cast<const A*>(hidden), ids, w, tok, dest,
        row_dest, d_.hidden, d_.top_k);
  });
  check_launch("pack kernel");
}

void CudaLayer::unpack_rows(const void* in, int64_t rows, void* x, int32_t* ids, float* w, void* stream) {
  if (rows <= 0) return;
  DeviceGuard g(d_.device);
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    unpack_rows_kernel<A><<<static_cast<unsigned>(rows), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const char*>(in), rows, row_bytes_, d_.ids_off, static_cast<A*>(x), ids, w, d_.hidden, d_.top_k);
  });
  check_launch("unpack kernel");
}

void CudaLayer::sum_returned(void* out, const void* own, const void* ret, const int32_t* off, const int32_t* idx,
                             int64_t tokens, void* stream) {
  if (tokens <= 0) return;
  DeviceGuard g(d_.device);
  with_type(d_.act_dtype, [&](auto* ta) {
    using A = std::remove_pointer_t<decltype(ta)>;
    sum_returned_kernel<A><<<static_cast<unsigned>(tokens), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<A*>(out), static_cast<const A*>(own), static_cast<const A*>(ret), off, idx, d_.hidden);
  });
  check_launch("return-sum kernel");
}

void CudaLayer::extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) {
  if (n <= 0) return;
  DeviceGuard g(d_.device);
  const int64_t H = d_.hidden;
  const int64_t rows = slot >= 0 ? d_.inter : d_.shared_count;  // gate rows (up follows)
  const char* gu = slot >= 0 ? w_gu_.as<char>() + slot * 2 * rows * H * static_cast<int64_t>(ges_) : s_gu_.as<char>();
  const char* dn = slot >= 0 ? w_down_.as<char>() + slot * H * rows * static_cast<int64_t>(ges_) : s_down_.as<char>();
  const size_t row = static_cast<size_t>(H) * ges_, nn = static_cast<size_t>(n);
  std::vector<char> gate(nn * row), up(nn * row), down(static_cast<size_t>(H) * nn * ges_);
  check(cudaMemcpy(gate.data(), gu + j0 * static_cast<int64_t>(row), gate.size(), cudaMemcpyDeviceToHost),
        "read units");
  check(cudaMemcpy(up.data(), gu + (rows + j0) * static_cast<int64_t>(row), up.size(), cudaMemcpyDeviceToHost),
        "read units");
  // Columns j0 .. j0+n of down [H, rows]: one strided copy.
  check(cudaMemcpy2D(down.data(), nn * ges_, dn + j0 * static_cast<int64_t>(ges_), static_cast<size_t>(rows) * ges_,
                     nn * ges_, static_cast<size_t>(H), cudaMemcpyDeviceToHost),
        "read units");
  for (size_t j = 0; j < nn; ++j) {
    uint8_t* u = out + j * 3 * row;
    std::memcpy(u, gate.data() + j * row, row);
    std::memcpy(u + row, up.data() + j * row, row);
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(u + 2 * row + static_cast<size_t>(h) * ges_, down.data() + (static_cast<size_t>(h) * nn + j) * ges_,
                  ges_);
  }
}

void CudaLayer::copy_expert_from(const DeviceLayer& src, int32_t src_slot, int32_t dst_slot) {
  DeviceGuard g(d_.device);
  const auto& o = static_cast<const CudaLayer&>(src);
  const size_t gu = static_cast<size_t>(2) * d_.inter * d_.hidden * ges_,
               dn = static_cast<size_t>(d_.hidden) * d_.inter * ges_;
  check(cudaMemcpy(w_gu_.as<char>() + dst_slot * gu, o.w_gu_.as<char>() + src_slot * gu, gu, cudaMemcpyDeviceToDevice),
        "copy expert");
  check(cudaMemcpy(w_down_.as<char>() + dst_slot * dn, o.w_down_.as<char>() + src_slot * dn, dn,
                   cudaMemcpyDeviceToDevice),
        "copy expert");
  check(cudaDeviceSynchronize(), "copy expert");  // done before the old layer can be freed
}

void CudaLayer::copy_router_from(const DeviceLayer& src) {
  DeviceGuard g(d_.device);
  const auto& o = static_cast<const CudaLayer&>(src);
  check(cudaMemcpy(router_.p, o.router_.p, router_.bytes, cudaMemcpyDeviceToDevice), "copy router");
  check(cudaDeviceSynchronize(), "copy router");
}

DeviceStats CudaLayer::stats() {
  if (!have_stats_ || last_rows_ == 0) return last_;
  DeviceGuard g(d_.device);
  check(cudaEventSynchronize(ev_meta_), "cudaEventSynchronize");
  const int L = d_.num_local;
  DeviceStats st = last_;
  st.local_pairs = 0;
  for (int l = 0; l < L; ++l) st.local_pairs += host_meta_[l];
  st.skipped = host_meta_[L];
  st.active = host_meta_[L + 3];
  if (have_times_) {
    float ms[3] = {0, 0, 0};
    for (int i = 0; i < 3; ++i) check(cudaEventElapsedTime(&ms[i], ev_[i], ev_[i + 1]), "cudaEventElapsedTime");
    st.permute_ns = static_cast<int64_t>(ms[0] * 1e6);
    st.expert_ns = static_cast<int64_t>(ms[1] * 1e6);
    st.combine_ns = static_cast<int64_t>(ms[2] * 1e6);
    const int64_t H = d_.hidden;
    // As on the CPU: rows the permutation wrote, rows the combine read.
    st.permute_bytes = (st.local_pairs + last_shared_rows_) * H * static_cast<int64_t>(ges_);
    st.combine_bytes = (st.local_pairs + last_shared_rows_) * H * 4;
  }
  last_ = st;
  have_stats_ = false;
  return st;
}

std::unique_ptr<DeviceLayer> create_device_layer(const DeviceLayerDesc& d) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    fail(EP_MOE_ERR_UNSUPPORTED, "no CUDA device is available (%s)",
         e != cudaSuccess ? cudaGetErrorString(e) : "the device count is 0");
  }
  if (d.device < 0 || d.device >= n)
    fail(EP_MOE_ERR_INVALID_ARGUMENT, "device %d does not exist: %d CUDA device(s) visible", d.device, n);
  return std::make_unique<CudaLayer>(d);
}

}  // namespace cuda
}  // namespace ep_moe

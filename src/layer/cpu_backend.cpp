// The CPU backend's set-up, weights, routing and attributes (the flows are
// in cpu_flows.cpp).
#include "layer/cpu_backend.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/quant.hpp"

namespace ep_moe {

namespace {
constexpr int64_t kMaxChunkPairs = 2048;
}  // namespace

std::unique_ptr<LayerBackend> make_cpu_backend(Layer& layer, int64_t max_rows, int64_t send_rows, int64_t fanout) {
  return std::make_unique<CpuBackend>(layer, max_rows, send_rows, fanout);
}

CpuBackend::CpuBackend(Layer& L, int64_t max_rows, int64_t send_rows, int64_t fanout)
    : L_(L), cfg_(L.cfg_), kern_(cpu::layer_kernels()), act_(static_cast<cpu::Act>(L.cfg_.activation)) {
  // Threads and workspace, sized for max_tokens: forward allocates nothing.
  const ep_moe_layer_config_t& c = cfg_;
  const int64_t H = c.hidden_size, K = c.top_k, T = c.max_tokens, ep = L.map_.ep_size();
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(c.act_dtype));
  const bool a2a = L.dispatch_ != EP_MOE_DISPATCH_ALLGATHER;
  pool_ = std::make_unique<cpu::ThreadPool>(cpu::default_threads(c.num_threads, L.ep_ ? L.ep_->ranks_in_process() : 1));
  rows_ = std::make_unique<cpu::RowOps>(*pool_, kern_, static_cast<ep_moe_dtype_t>(c.act_dtype), H);
  slots_.resize(L.held_.size());
  if (send_rows > 0) send_rows_.resize(static_cast<size_t>(send_rows) * L.row_bytes_);
  if (L.dp_size_ > 1 || a2a) recv_rows_.resize(static_cast<size_t>(max_rows) * L.row_bytes_);
  const int64_t chunk = std::min<int64_t>(kMaxChunkPairs, max_rows * (K + 1));
  ffn_ = std::make_unique<cpu::FfnRunner>(kern_, c.hidden_size, std::max(c.intermediate_size, L.shared_count_), chunk,
                                          c.act_dtype == EP_MOE_DTYPE_BF16);
  // bf16 rows straight into the bf16 tiles: no f32 copy of the rows at all.
  const auto wdt = static_cast<ep_moe_dtype_t>(c.weight_dtype);
  float_type_ = dtype_is_quant(wdt) ? EP_MOE_DTYPE_F32 : wdt;
  max_rows_ = max_rows;
  direct_bf16_ = !dtype_is_quant(wdt) && ffn_->reads_bf16_rows(wdt);
  if (dtype_is_quant(wdt)) ffn_->reserve_quant(pool_->size(), wdt);
  set_up_engine();
  if (!direct_bf16_) x_f32_.resize(static_cast<size_t>(max_rows * H) * 4);
  acc_.resize(static_cast<size_t>(max_rows * H) * 4);
  own_x_.resize(static_cast<size_t>(T * H) * 4);
  if (c.act_dtype != EP_MOE_DTYPE_F32) partial_.resize(static_cast<size_t>(L.max_all_ * H) * es);
  if (L.dp_is_ep_) scatter_out_.resize(static_cast<size_t>(T * H) * es);
  if (a2a) {
    own_acc_.resize(static_cast<size_t>(T * H) * 4);
    ret_send_.resize(static_cast<size_t>(ep * T * H) * es);
    ret_recv_.resize(static_cast<size_t>(T * fanout * H) * es);
    row_ids_.resize(static_cast<size_t>(K) * static_cast<size_t>(pool_->size()));  // K per pool thread
    back_ptr_.resize(static_cast<size_t>(T * fanout));
  }
  logits_.resize(static_cast<size_t>(T) * static_cast<size_t>(c.num_experts));
  pair_rows_.resize(static_cast<size_t>(max_rows * K));
  pair_weights_.resize(static_cast<size_t>(max_rows * K));
  pair_count_.resize(slots_.size() + 1);
  cursor_.resize(slots_.size());
  shared_rows_.resize(static_cast<size_t>(max_rows));
  shared_weights_.resize(static_cast<size_t>(max_rows));
  jobs_.reserve(slots_.size() + 1);
  ffn_->reserve_jobs(jobs_.capacity());
  route_scratch_.resize(static_cast<size_t>(pool_->size()));
  for (RouteScratch& rs : route_scratch_) rs.fit(L.routing_);

  log(EP_MOE_LOG_INFO,
      "[EP rank %d/%d] MoE layer: H=%d I=%d E=%d top-%d, %d local experts, shared shard %d/%d, dp %d, %d threads, "
      "%s kernels (block formats: %s)",
      L.map_.ep_rank(), L.map_.ep_size(), c.hidden_size, c.intermediate_size, c.num_experts, c.top_k,
      L.map_.num_local_routed(), L.shared_count_, c.shared_intermediate_size, L.dp_size_, pool_->size(),
      cpu::isa_name(kern_.isa), kern_.qname);
}

void CpuBackend::set_up_engine() {
  const cpu::EnginePolicy policy = cpu::matrix_engine_policy();
  const ep_moe_layer_config_t& c = cfg_;
  if (policy == cpu::EnginePolicy::Off || c.act_dtype != EP_MOE_DTYPE_BF16 || c.weight_dtype != EP_MOE_DTYPE_BF16)
    return;
  cpu::MatrixEngineDesc d;
  d.threads = pool_->size();
  d.nr = kern_.nr;
  d.tile_panels = std::max(1, 256 / kern_.nr);
  d.need_amx = policy == cpu::EnginePolicy::Amx;
  // The depths of the GEMMs it may take: gate/up (hidden), the routed
  // down (intermediate), the shared shard's down; those the panels' layout
  // serves (multiples of 32), the others stay on the tiles.
  for (const int32_t k : {c.hidden_size, c.intermediate_size, static_cast<int32_t>(L_.shared_count_)})
    if (k > 0 && k % 32 == 0 && std::find(d.depths.begin(), d.depths.end(), k) == d.depths.end()) d.depths.push_back(k);
  std::string why;
  if (!d.depths.empty()) engine_ = cpu::make_matrix_engine(d, &why);
  else why = "no depth of the layer is a multiple of 32";
  if (!engine_) {
    log(EP_MOE_LOG_INFO, "[EP rank %d/%d] no matrix engine: %s", L_.map_.ep_rank(), L_.map_.ep_size(), why.c_str());
    return;
  }
  // From how many rows: EP_MOE_MATRIX_MIN_ROWS, else measured against the
  // tiles (once per process and shape).
  const char* env = std::getenv("EP_MOE_MATRIX_MIN_ROWS");
  char* end = nullptr;
  const long long forced = env ? std::strtoll(env, &end, 10) : 0;
  const bool dot = ffn_->reads_bf16_rows(EP_MOE_DTYPE_BF16);
  engine_min_rows_ =
      env && end != env && *end == 0 && forced > 0
          ? forced
          : cpu::engine_min_rows(*engine_, kern_, dot, c.hidden_size % 32 == 0 ? c.hidden_size : d.depths[0]);
  if (engine_min_rows_ == std::numeric_limits<int64_t>::max()) {
    // Slower than the tiles at every row count measured: no engine, unless
    // it was asked for by name (tests, benchmarks): then from the most
    // rows measured.
    if (policy == cpu::EnginePolicy::Force) {
      engine_min_rows_ = cpu::kEngineMeasuredRows;
    } else {
      log(EP_MOE_LOG_INFO, "[EP rank %d/%d] no matrix engine: %s was slower than the tiles at every row count measured",
          L_.map_.ep_rank(), L_.map_.ep_size(), engine_->name().c_str());
      engine_.reset();
      return;
    }
  }
  ffn_->set_engine(engine_.get(), engine_min_rows_, pool_->size());
  log(EP_MOE_LOG_INFO, "[EP rank %d/%d] matrix engine: %s, from %lld rows an expert", L_.map_.ep_rank(),
      L_.map_.ep_size(), engine_->name().c_str(), static_cast<long long>(engine_min_rows_));
}

// --- weights ---------------------------------------------------------------------

void CpuBackend::put(WeightPart part, int32_t s, int64_t row0, const Source& src, int64_t rows, int64_t cols,
                     bool /*src_on_device: never, pointer_device() is -1*/) {
  const int32_t H = cfg_.hidden_size, I = cfg_.intermediate_size, h = kern_.nr / 2;
  const int64_t ipad = (I + h - 1) / h * h, hpad = (H + kern_.nr - 1) / kern_.nr * kern_.nr;
  const auto n = static_cast<int32_t>(rows), k = static_cast<int32_t>(cols);
  switch (part) {
    case WeightPart::ExpertGateUp: {
      const ep_moe_dtype_t t = routed_type(src.dtype, &gu_type_, "gate/up");
      if (dtype_is_quant(t)) enable_quant(t);
      put_gate_up_half(slot(s), row0 == 0 ? 0 : 1, src, n, t);
      gu_type_ = t;
      break;
    }
    case WeightPart::ExpertDown: {
      const ep_moe_dtype_t t = routed_type(src.dtype, &down_type_, "down");
      if (dtype_is_quant(t)) enable_quant(t);
      cpu::pack(slot(s).down, src, n, k, kern_.nr, t, kern_.il_of(t));
      down_type_ = t;
      break;
    }
    case WeightPart::SharedGateUp: put_shared_gate_up(row0 == 0 ? 0 : 1, src, n); break;
    case WeightPart::SharedDown: {
      const ep_moe_dtype_t t = shared_type(src, k);
      if (dtype_is_quant(t)) enable_quant(t);
      cpu::pack(shared_.down, src, n, k, kern_.nr, t, kern_.il_of(t));
      break;
    }
    case WeightPart::Router: cpu::pack(router_, src, n, k, kern_.nr, EP_MOE_DTYPE_F32); break;
    case WeightPart::ExpertGateBias: put_bias(slot(s).gate_bias, src, cols, ipad); break;
    case WeightPart::ExpertUpBias: put_bias(slot(s).up_bias, src, cols, ipad); break;
    case WeightPart::ExpertDownBias: put_bias(slot(s).down_bias, src, cols, hpad); break;
    default: break;  // the score bias, shared gate and router bias: read from the layer's copies
  }
}

void CpuBackend::put_gate_up_half(Slot& x, int half, const Source& src, int32_t inter, ep_moe_dtype_t dtype) {
  if (x.gate_up.empty() || x.gate_up.dtype != dtype)
    cpu::init_gate_up(x.gate_up, inter, cfg_.hidden_size, kern_.nr, dtype, kern_.il_of(dtype));
  cpu::pack_gate_up_half(x.gate_up, src, half, inter);
}

// The shared gate and up are held in one format: blocks (given, or floats
// quantized to a block weight_dtype) when both come in it, else both in
// the float type.
ep_moe_dtype_t CpuBackend::shared_type(const Source& src, int64_t k) const {
  const auto wdt = static_cast<ep_moe_dtype_t>(cfg_.weight_dtype);
  const ep_moe_dtype_t t = dtype_is_quant(src.dtype) ? src.dtype : src.dequantized ? float_type_ : wdt;
  if (!dtype_is_quant(t)) return float_type_;
  const int qk = quant_block_elems(t);
  return src.col0 % qk == 0 && k % qk == 0 ? t : float_type_;
}

void CpuBackend::put_shared_gate_up(int half, const Source& src, int32_t inter) {
  cpu::PackedWeight& gu = shared_.gate_up;
  ep_moe_dtype_t t = shared_type(src, cfg_.hidden_size);
  if (!gu.empty() && gu.dtype != t) {
    // gate_up holds the other half (or an earlier copy of this one), in
    // blocks or in the float type: both end in the float type.
    t = float_type_;
    if (gu.quant()) dequantize_gate_up(gu, inter);
  }
  if (dtype_is_quant(t)) enable_quant(t);
  put_gate_up_half(shared_, half, src, inter, t);
}

void CpuBackend::dequantize_gate_up(cpu::PackedWeight& gu, int32_t inter) const {
  const int32_t H = cfg_.hidden_size;
  cpu::PackedWeight wide;
  cpu::init_gate_up(wide, inter, H, kern_.nr, float_type_);
  std::vector<uint8_t> raw(gu.row_bytes());
  std::vector<float> rows(static_cast<size_t>(inter) * static_cast<size_t>(H));
  for (int half = 0; half < 2; ++half) {
    for (int32_t r = 0; r < inter; ++r) {
      cpu::unpack_gate_up_row(gu, half, r, raw.data());
      dequantize_row(gu.dtype, raw.data(), rows.data() + static_cast<size_t>(r) * static_cast<size_t>(H), H);
    }
    cpu::pack_gate_up_half(wide, Source{rows.data(), EP_MOE_DTYPE_F32, H}, half, inter);
  }
  gu = std::move(wide);
}

ep_moe_dtype_t CpuBackend::routed_type(ep_moe_dtype_t src, int32_t* fixed, const char* part) const {
  const ep_moe_dtype_t t = dtype_is_quant(src) ? src : static_cast<ep_moe_dtype_t>(cfg_.weight_dtype);
  if (*fixed >= 0 && *fixed != t)
    fail(EP_MOE_ERR_INVALID_ARGUMENT,
         "routed expert %s weights would be stored as %s, but this layer's other experts hold theirs as %s: every "
         "expert of a layer keeps one type per part (gate and up included)",
         part, dtype_name(t), dtype_name(static_cast<ep_moe_dtype_t>(*fixed)));
  return t;
}

void CpuBackend::enable_quant(ep_moe_dtype_t t) {
  ffn_->reserve_quant(pool_->size(), t);
  if (!direct_bf16_) return;
  // Rows are quantized from f32: the flows widen them again.
  direct_bf16_ = false;
  x_f32_.resize(static_cast<size_t>(max_rows_ * cfg_.hidden_size) * 4);
}

void CpuBackend::put_bias(std::vector<float>& dst, const Source& src, int64_t n, int64_t padded) {
  std::vector<float> v(static_cast<size_t>(padded), 0.0f);
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = source_at(src, 0, i);
  dst = std::move(v);
}

void CpuBackend::download(void* dst, const void* src, size_t bytes) const { std::memcpy(dst, src, bytes); }

void CpuBackend::extract_units(int32_t s, int32_t j0, int32_t n, uint8_t* out) const {
  const Slot& x = slot(s);
  const ep_moe_dtype_t ut = L_.unit_dtype();
  const size_t es = dtype_size(ut);
  const int32_t H = cfg_.hidden_size;
  const size_t ub = 3 * static_cast<size_t>(H) * es;
  // Parts held as blocks (a shared expert's) are dequantized into the units.
  std::vector<uint8_t> raw;
  std::vector<float> f;
  auto row = [&](const cpu::PackedWeight& w, int half, int32_t r, uint8_t* dst) {
    if (!w.quant()) return cpu::unpack_gate_up_row(w, half, r, dst);
    raw.resize(w.row_bytes());
    f.resize(static_cast<size_t>(w.k));
    cpu::unpack_gate_up_row(w, half, r, raw.data());
    dequantize_row(w.dtype, raw.data(), f.data(), w.k);
    for (int32_t c = 0; c < w.k; ++c) store_elem(dst, ut, c, f[static_cast<size_t>(c)]);
  };
  std::vector<float> down;  // the down rows' columns [j0, j0 + n), when in blocks
  if (x.down.quant()) {
    down.resize(static_cast<size_t>(H) * static_cast<size_t>(n));
    raw.resize(x.down.row_bytes());
    f.resize(static_cast<size_t>(x.down.k));
    for (int32_t h = 0; h < H; ++h) {
      cpu::unpack_row(x.down, h, raw.data());
      dequantize_row(x.down.dtype, raw.data(), f.data(), x.down.k);
      for (int32_t j = 0; j < n; ++j) down[static_cast<size_t>(j) * H + h] = f[static_cast<size_t>(j0 + j)];
    }
  }
  for (int32_t j = 0; j < n; ++j) {
    uint8_t* u = out + static_cast<size_t>(j) * ub;
    row(x.gate_up, 0, j0 + j, u);
    row(x.gate_up, 1, j0 + j, u + H * es);
    if (down.empty()) {
      cpu::unpack_col(x.down, j0 + j, u + 2 * H * es);
    } else {
      for (int32_t h = 0; h < H; ++h)
        store_elem(u + 2 * H * es, ut, h, down[static_cast<size_t>(j) * H + static_cast<size_t>(h)]);
    }
  }
}

void CpuBackend::extract_rows(int32_t s, uint8_t* out) const {
  const Slot& x = slot(s);
  const int32_t I = cfg_.intermediate_size, H = cfg_.hidden_size;
  const size_t gb = Layer::row_bytes_of(x.gate_up.dtype, H), db = Layer::row_bytes_of(x.down.dtype, I);
  for (int32_t r = 0; r < I; ++r) {
    cpu::unpack_gate_up_row(x.gate_up, 0, r, out + static_cast<size_t>(r) * gb);
    cpu::unpack_gate_up_row(x.gate_up, 1, r, out + static_cast<size_t>(I + r) * gb);
  }
  uint8_t* d = out + 2 * static_cast<size_t>(I) * gb;
  for (int32_t r = 0; r < H; ++r) cpu::unpack_row(x.down, r, d + static_cast<size_t>(r) * db);
}

void CpuBackend::extract_biases(int32_t s, uint8_t* out) const {
  const Slot& x = slot(s);
  const size_t I = static_cast<size_t>(cfg_.intermediate_size), H = static_cast<size_t>(cfg_.hidden_size);
  std::memcpy(out, x.gate_bias.data(), I * 4);
  std::memcpy(out + I * 4, x.up_bias.data(), I * 4);
  std::memcpy(out + 2 * I * 4, x.down_bias.data(), H * 4);
}

// A kept expert's first new slot takes the old storage at commit (no copy);
// its replicas are copies, made before the vote.
void CpuBackend::keep_before_vote(const LayerBackend& old_backend, const std::vector<KeptSlot>& kept, bool) {
  const auto& old = static_cast<const CpuBackend&>(old_backend);
  // Kept experts keep their storage formats: a rank that receives nothing
  // must still know them (and have the block kernels' scratch).
  if (!kept.empty()) {
    gu_type_ = old.gu_type_;
    down_type_ = old.down_type_;
    for (const int32_t t : {gu_type_, down_type_})
      if (dtype_is_quant(static_cast<ep_moe_dtype_t>(t))) enable_quant(static_cast<ep_moe_dtype_t>(t));
  }
  for (const KeptSlot& k : kept) {
    if (k.first) continue;
    const Slot& src = old.slot(k.old_slot);
    Slot& dst = slot(k.new_slot);
    cpu::copy_packed(dst.gate_up, src.gate_up);
    cpu::copy_packed(dst.down, src.down);
    dst.gate_bias = src.gate_bias;
    dst.up_bias = src.up_bias;
    dst.down_bias = src.down_bias;
  }
}

bool CpuBackend::keep_shared(const LayerBackend& old_backend) {
  const auto& old = static_cast<const CpuBackend&>(old_backend);
  cpu::copy_packed(shared_.gate_up, old.shared_.gate_up);
  cpu::copy_packed(shared_.down, old.shared_.down);
  for (const cpu::PackedWeight* w : {&shared_.gate_up, &shared_.down})
    if (w->quant()) enable_quant(w->dtype);
  return true;
}

void CpuBackend::keep_at_commit(LayerBackend& old_backend, const std::vector<KeptSlot>& kept, bool router) noexcept {
  auto& old = static_cast<CpuBackend&>(old_backend);
  for (const KeptSlot& k : kept)
    if (k.first) slot(k.new_slot) = std::move(old.slot(k.old_slot));
  if (router) router_ = std::move(old.router_);
}

// --- routing -----------------------------------------------------------------------

void CpuBackend::route(const ep_moe_forward_args_t& a) {
  engine_mark_ = ffn_->engine_rows();
  const int64_t T = a.num_tokens, K = cfg_.top_k;
  if (T == 0) return;
  if (a.router_logits) {
    route_all(a.router_logits, static_cast<ep_moe_dtype_t>(cfg_.router_dtype), T);
  } else if (!a.topk_ids) {  // the layer's own router: logits = x Wr^T in f32
    compute_logits(f32_rows(a.hidden, T, own_x_.data<float>(), nullptr), T, logits_.data());
    route_all(logits_.data(), EP_MOE_DTYPE_F32, T);
  } else {
    check_topk(a.topk_ids, a.topk_weights, T, cfg_.top_k, cfg_.num_experts);
    std::memcpy(L_.ids_.data(), a.topk_ids, static_cast<size_t>(T * K) * 4);
    std::memcpy(L_.weights_.data(), a.topk_weights, static_cast<size_t>(T * K) * 4);
  }
}

void CpuBackend::compute_logits(const float* x, int64_t T, float* logits) {
  const int nr = kern_.nr, mr = kern_.mr;
  const int64_t H = cfg_.hidden_size, E = cfg_.num_experts;
  const float* bias = L_.router_bias_.empty() ? nullptr : L_.router_bias_.data();
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
      const float* rb = bias ? bias + col0 : nullptr;
      for (int i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) logits[(t0 + i) * E + col0 + j] = c[i * nr + j] + (rb ? rb[j] : 0.0f);
    }
  });
}

// Tokens are routed independently, in blocks spread over the pool: routing
// is ~1 us per token at 128 experts, a few per cent of a prefill when one
// thread does it all. A block's error (NaN logits) is caught in the job
// (jobs must not throw) and the earliest failing block's rethrown after, so
// the message names the first bad token, as when one thread routed them all.
void CpuBackend::route_all(const void* logits, ep_moe_dtype_t dtype, int64_t T) {
  int32_t* ids = L_.ids_.data();
  float* w = L_.weights_.data();
  const int64_t E = cfg_.num_experts, K = cfg_.top_k;
  constexpr int64_t kBlock = 16;
  if (pool_->size() == 1 || T <= kBlock) {
    ep_moe::route(logits, dtype, T, L_.routing_, ids, w, 0, route_scratch_.data());
    return;
  }
  const size_t es = dtype_size(dtype);
  std::mutex mu;
  int64_t failed_at = T;
  std::exception_ptr error;
  pool_->parallel_ranges(static_cast<size_t>(T), kBlock, [&](size_t b, size_t e, int tid) {
    const auto t0 = static_cast<int64_t>(b), n = static_cast<int64_t>(e - b);
    try {
      ep_moe::route(static_cast<const char*>(logits) + static_cast<size_t>(t0 * E) * es, dtype, n, L_.routing_,
                    ids + t0 * K, w + t0 * K, t0, &route_scratch_[static_cast<size_t>(tid)]);
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

// --- attributes ----------------------------------------------------------------------

bool CpuBackend::attr(ep_moe_layer_attr_t a, int64_t* v) const {
  switch (a) {
    case EP_MOE_LAYER_ATTR_LAST_SYNC_FREE: *v = -1; return true;
    case EP_MOE_LAYER_ATTR_NUM_THREADS: *v = pool_->size(); return true;
    case EP_MOE_LAYER_ATTR_CPU_ISA: *v = static_cast<int64_t>(kern_.isa); return true;
    case EP_MOE_LAYER_ATTR_MATRIX_ENGINE: *v = !engine_ ? 0 : engine_->amx() ? 2 : 1; return true;
    case EP_MOE_LAYER_ATTR_LAST_ENGINE_PAIRS: *v = ffn_->engine_rows() - engine_mark_; return true;
    case EP_MOE_LAYER_ATTR_WEIGHT_BYTES: {
      int64_t b = 0;
      for (const Slot& x : slots_)
        b += static_cast<int64_t>(x.gate_up.bytes() + x.down.bytes() +
                                  (x.gate_bias.size() + x.up_bias.size() + x.down_bias.size()) * sizeof(float));
      b += static_cast<int64_t>(shared_.gate_up.bytes() + shared_.down.bytes());
      b += static_cast<int64_t>((L_.shared_gate_.size() + L_.bias_.size() + L_.router_bias_.size()) * sizeof(float));
      *v = b + static_cast<int64_t>(router_.bytes());
      return true;
    }
    case EP_MOE_LAYER_ATTR_LAST_TOKENS: *v = last_tokens_; return true;
    case EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS: *v = last_local_pairs_; return true;
    case EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS: *v = last_skipped_; return true;
    case EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS: *v = last_active_; return true;
    case EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS: *v = last_phase_.permute_ns; return true;
    case EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES: *v = last_phase_.permute_bytes; return true;
    case EP_MOE_LAYER_ATTR_LAST_EXPERT_NS: *v = last_phase_.expert_ns; return true;
    case EP_MOE_LAYER_ATTR_LAST_COMBINE_NS: *v = last_phase_.combine_ns; return true;
    case EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES: *v = last_phase_.combine_bytes; return true;
    default: return false;
  }
}

}  // namespace ep_moe

// The CPU backend's forward flows (backend.hpp): the all-gather flow (DP
// gather -> experts + shared -> ONE reduction) and the all-to-all flow
// (rows out -> experts -> partial sums back -> combine), on the layer's
// pool, in workspace sized at create.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "layer/cpu_backend.hpp"
#include "layer/stages.hpp"

namespace ep_moe {

namespace {
// Whether p may be read and written as floats.
bool float_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(float) == 0; }

// Whether two regions of `bytes` bytes share any byte.
bool overlap(const void* a, const void* b, size_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}
}  // namespace

// --- the all-gather flow ----------------------------------------------------------

void CpuBackend::allgather(const ep_moe_forward_args_t& a, Stages& st, int64_t dp_offset, int64_t padded,
                           Gather gather) {
  const int64_t T = a.num_tokens, H = cfg_.hidden_size, K = cfg_.top_k;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  const int32_t* ids = L_.ids_.data();
  PhaseTimes ph;  // this rank's phase times (collectives excluded), kept for the attrs
  Rows x;
  const int64_t T_all = dp_gather(a, st, padded, gather, &x, &ph);

  // Plan the pairs this rank computes, then experts + shared into acc.
  int64_t skipped = 0;
  const int64_t local_pairs = plan_pairs(T_all, ids, L_.weights_.data(), false, &skipped);
  // One rank without DP, f32 activations, out apart from hidden: the
  // experts accumulate in out itself, and no T x H copy ends the forward.
  // A failed call must leave out as it was, and nothing from the zeroing
  // on can fail: the expert path allocates nothing (fault_tests [forward])
  // and throws nothing.
  const bool acc_in_out = !L_.ep_ && L_.dp_size_ == 1 && adt == EP_MOE_DTYPE_F32 && T > 0 && float_aligned(a.out) &&
                          !overlap(a.out, a.hidden, static_cast<size_t>(T * H) * es);
  float* acc = acc_in_out ? static_cast<float*>(a.out) : acc_.data<float>();
  rows_->zero(acc, T_all);
  add_expert_jobs();
  int64_t sb = 0, se = 0;
  L_.shared_rows(T, T_all, dp_offset, &sb, &se);
  add_shared_job(x, sb, se - sb, ids);
  const int64_t t0 = now_ns();
  ffn_->run(*pool_, jobs_, x.x, H, acc, H, act_, x.x16, x.ld16);
  ph.expert_ns += now_ns() - t0;

  reduce(a, st, acc, T_all, dp_offset, padded, gather, &ph);
  last_phase_ = ph;
  int64_t tokens = 0;
  for (int64_t t = 0; t < T_all; ++t) tokens += ids[t * K] >= 0;
  record(tokens, local_pairs, skipped);
}

int64_t CpuBackend::dp_gather(const ep_moe_forward_args_t& a, Stages& st, int64_t padded, Gather gather, Rows* rows,
                              PhaseTimes* ph) {
  const int64_t T = a.num_tokens, H = cfg_.hidden_size, K = cfg_.top_k;
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(cfg_.act_dtype));
  const size_t row_bytes = L_.row_bytes_;
  float* xw = x_f32_.data<float>();
  rows->x = xw;
  int64_t t0 = now_ns();
  int64_t T_all = T;
  if (L_.dp_size_ > 1) {
    // One collective moving [hidden | ids | weights] rows.
    const int64_t send_n = gather == Gather::Padded ? padded : T;
    char* send = send_rows_.data<char>();
    for (int64_t t = 0; t < send_n; ++t) {
      char* row = send + static_cast<size_t>(t) * row_bytes;
      if (t < T) {
        pack_row(row, static_cast<const char*>(a.hidden) + t * H * static_cast<int64_t>(es), L_.ids_.data() + t * K,
                 L_.weights_.data() + t * K);
      } else {  // padding row: never computed
        std::memset(row, 0, row_bytes);
        int32_t* rid = reinterpret_cast<int32_t*>(row + L_.ids_off_);
        for (int64_t k = 0; k < K; ++k) rid[k] = -1;
      }
    }
    ph->permute_bytes += send_n * static_cast<int64_t>(row_bytes);
    ph->permute_ns += now_ns() - t0;
    const size_t words = row_bytes / 4;
    T_all = L_.gathered_rows(a, gather, padded, words);
    Comm* dp = st.enter();
    if (gather == Gather::Padded) {
      dp->all_gather(recv_rows_.data(), send, static_cast<size_t>(padded) * words, EP_MOE_DTYPE_I32, a.stream);
    } else {
      dp->all_gather_v(recv_rows_.data(), send, L_.counts_.data(), EP_MOE_DTYPE_I32, a.stream);
    }
    t0 = now_ns();
    ph->permute_bytes += unpack_rows(T_all, xw);
    ph->permute_ns += now_ns() - t0;
  } else if (!direct_bf16_) {
    rows->x = f32_rows(a.hidden, T, xw, &ph->permute_bytes);
    ph->permute_ns += now_ns() - t0;
  }
  // With direct_bf16_ the experts read the bf16 rows where they are.
  if (direct_bf16_) {
    rows->x16 = L_.dp_size_ > 1 ? recv_rows_.data<uint16_t>() : static_cast<const uint16_t*>(a.hidden);
    rows->ld16 = L_.dp_size_ > 1 ? static_cast<int64_t>(row_bytes / 2) : H;
  }
  return T_all;
}

// ONE reduction of the (routed + shared) partials in acc, then this rank's
// rows into out. Without a collective or DP the narrowed sums are the
// output: they go straight into out (hidden, which out may alias, has been
// read by now); in f32 they are already there when acc is out.
void CpuBackend::reduce(const ep_moe_forward_args_t& a, Stages& st, float* acc, int64_t T_all, int64_t dp_offset,
                        int64_t padded, Gather gather, PhaseTimes* ph) {
  const int64_t T = a.num_tokens, H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  const bool into_out = !L_.ep_ && L_.dp_size_ == 1;
  void* partial = acc;
  int64_t t0 = 0;
  if (adt != EP_MOE_DTYPE_F32) {
    t0 = now_ns();
    partial = into_out ? a.out : partial_.data();
    rows_->narrow(acc, T_all, partial);
    ph->combine_bytes += T_all * H * 4;
    ph->combine_ns += now_ns() - t0;
  }
  const void* result = partial;
  int64_t row0 = 0;
  if (L_.ep_) {
    Comm* ep = st.enter();
    if (L_.dp_size_ > 1 && gather == Gather::Padded && L_.dp_is_ep_) {
      ep->reduce_scatter(scatter_out_.data(), partial, static_cast<size_t>(padded * H), adt, a.stream);
      result = scatter_out_.data();
    } else {
      ep->all_reduce(partial, partial, static_cast<size_t>(T_all * H), adt, a.stream);
      row0 = dp_offset;
    }
  }
  t0 = now_ns();
  if (T > 0 && result != a.out)  // result is the layer's own buffer: never overlaps out
    rows_->copy(a.out, static_cast<const char*>(result) + row0 * H * static_cast<int64_t>(es), T);
  if (result != a.out) ph->combine_bytes += T * H * static_cast<int64_t>(es);
  ph->combine_ns += now_ns() - t0;
}

// --- the all-to-all flow ----------------------------------------------------------

void CpuBackend::alltoall(const ep_moe_forward_args_t& a, Stages& st) {
  PhaseTimes ph;
  const int64_t R = send_rows(a, st, &ph);
  experts_and_return(a, st, R, &ph);
  combine_own(a, &ph);
  last_phase_ = ph;
  last_skipped_ = L_.sent_pairs(a.num_tokens);
}

// 1. One row per (token, destination): pairs computed elsewhere are -1.
// Blocks of rows in parallel; row_ids_ holds K ids per pool thread. Returns
// the rows received.
int64_t CpuBackend::send_rows(const ep_moe_forward_args_t& a, Stages& st, PhaseTimes* ph) {
  const int64_t H = cfg_.hidden_size, K = cfg_.top_k;
  const int32_t n = L_.map_.ep_size();
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(cfg_.act_dtype));
  const size_t row_bytes = L_.row_bytes_;
  const int32_t* ids = L_.ids_.data();
  const float* w = L_.weights_.data();
  const std::vector<int64_t>& off = L_.send_off_;
  const int64_t t0 = now_ns();
  char* send = send_rows_.data<char>();
  const int64_t rows_out = off[static_cast<size_t>(n)];
  pool_->parallel_ranges(static_cast<size_t>(rows_out), 16, [&](size_t b0, size_t b1, int tid) {
    int32_t* row_ids = row_ids_.data() + static_cast<size_t>(tid) * static_cast<size_t>(K);
    const auto j0 = static_cast<int64_t>(b0), j1 = static_cast<int64_t>(b1);
    auto d = static_cast<int32_t>(std::upper_bound(off.begin(), off.begin() + n + 1, j0) - off.begin()) - 1;
    for (int64_t j = j0; j < j1; ++j) {
      while (j >= off[static_cast<size_t>(d) + 1]) ++d;
      const int64_t t = L_.send_tok_[static_cast<size_t>(j)];
      for (int64_t k = 0; k < K; ++k) row_ids[k] = L_.dest_[static_cast<size_t>(t * K + k)] == d ? ids[t * K + k] : -1;
      pack_row(send + static_cast<size_t>(j) * row_bytes,
               static_cast<const char*>(a.hidden) + t * H * static_cast<int64_t>(es), row_ids, w + t * K);
    }
  });
  ph->permute_bytes += rows_out * static_cast<int64_t>(row_bytes);
  ph->permute_ns += now_ns() - t0;
  const int64_t R = L_.a2a_counts(row_bytes / 4, true);
  st.enter()->all_to_all_v(recv_rows_.data(), L_.recv_words_.data(), send, L_.counts_.data(), EP_MOE_DTYPE_I32,
                           a.stream);
  return R;
}

// 2. Experts on the R rows received; their partial sums back in the same order.
void CpuBackend::experts_and_return(const ep_moe_forward_args_t& a, Stages& st, int64_t R, PhaseTimes* ph) {
  const int64_t H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  float* x = x_f32_.data<float>();
  int64_t t0 = now_ns();
  ph->permute_bytes += unpack_rows(R, x);
  ph->permute_ns += now_ns() - t0;
  int64_t skipped = 0;
  const int64_t local_pairs = plan_pairs(R, L_.ids_.data(), L_.weights_.data(), true, &skipped);
  float* acc = acc_.data<float>();
  rows_->zero(acc, R);
  add_expert_jobs();
  t0 = now_ns();
  // With direct_bf16_ the experts read the bf16 rows where they arrived.
  const uint16_t* x16 = direct_bf16_ ? recv_rows_.data<uint16_t>() : nullptr;
  ffn_->run(*pool_, jobs_, x, H, acc, H, act_, x16, static_cast<int64_t>(L_.row_bytes_ / 2));
  ph->expert_ns += now_ns() - t0;
  record(R, local_pairs, 0);
  char* back = ret_send_.data<char>();
  t0 = now_ns();
  rows_->narrow(acc, R, back);
  ph->combine_bytes += R * H * 4;
  ph->combine_ns += now_ns() - t0;
  L_.a2a_counts(static_cast<size_t>(H), false);
  st.enter()->all_to_all_v(ret_recv_.data(), L_.recv_words_.data(), back, L_.counts_.data(), adt, a.stream);
}

// 3. Own tokens: the shared expert (whole, replicated), then per token its
// shared result (if any) plus the rows that came back for it (in
// destination-rank order, as sent), summed in f32 a few columns at a time
// in registers (Kernels::sum_rows) and written once in the activation
// dtype: no f32 row is written and read back. Without a shared expert the
// sum starts from the first returned row. Token blocks in parallel.
void CpuBackend::combine_own(const ep_moe_forward_args_t& a, PhaseTimes* ph) {
  const int64_t T = a.num_tokens, H = cfg_.hidden_size;
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  Rows own;
  own.x = own_x_.data<float>();
  float* oacc = own_acc_.data<float>();
  int64_t t0 = 0;
  if (L_.shared_count_ > 0) {  // the shared expert (and its gate) read own rows in f32
    t0 = now_ns();
    own.x = f32_rows(a.hidden, T, own_x_.data<float>(), &ph->permute_bytes);
    ph->permute_ns += now_ns() - t0;
  }
  jobs_.clear();
  add_shared_job(own, 0, T, nullptr);
  const bool any_shared = !jobs_.empty();
  if (any_shared) {
    rows_->zero(oacc, T);
    t0 = now_ns();
    ffn_->run(*pool_, jobs_, own.x, H, oacc, H, act_);
    ph->expert_ns += now_ns() - t0;
  }
  t0 = now_ns();
  const char* ret = ret_recv_.data<char>();
  const int64_t back_rows = L_.send_off_[static_cast<size_t>(L_.map_.ep_size())];
  L_.build_back_csr(T);
  for (int64_t q = 0; q < back_rows; ++q)
    back_ptr_[static_cast<size_t>(q)] = ret + static_cast<size_t>(L_.back_idx_[static_cast<size_t>(q)] * H) * es;
  pool_->parallel_ranges(static_cast<size_t>(T), 8, [&](size_t b0, size_t b1, int) {
    for (auto t = static_cast<int64_t>(b0); t < static_cast<int64_t>(b1); ++t) {
      const int64_t q = L_.back_off_[static_cast<size_t>(t)];
      const auto nq = static_cast<int>(L_.back_off_[static_cast<size_t>(t) + 1] - q);
      kern_.sum_rows(static_cast<char*>(a.out) + t * H * static_cast<int64_t>(es), adt,
                     any_shared ? oacc + t * H : nullptr, back_ptr_.data() + q, nq, adt, 0, H);
    }
  });
  ph->combine_bytes += (back_rows + T) * H * static_cast<int64_t>(es);
  ph->combine_ns += now_ns() - t0;
}

// --- plans, jobs and rows ----------------------------------------------------------

int64_t CpuBackend::plan_pairs(int64_t rows, const int32_t* ids, const float* w, bool assigned, int64_t* skipped) {
  const int64_t K = cfg_.top_k;
  const ExpertMap& map = L_.map_;
  const auto n_local = static_cast<int32_t>(slots_.size());
  const int32_t my_begin = map.rank_slot_begin()[static_cast<size_t>(map.ep_rank())];
  const bool weight_zero = cfg_.skip_mode == EP_MOE_SKIP_WEIGHT_ZERO;
  const auto& slot_rank = map.slot_rank();
  // Local slot of pair (t, k), or -1 when another rank computes it. `assigned`
  // rows (all-to-all) carry -1 for pairs sent elsewhere.
  auto local_of = [&](int64_t t, int64_t k, float* weight, bool* real) -> int32_t {
    const int32_t e = ids[t * K + k];
    *weight = w[t * K + k];
    *real = true;
    if (assigned) return e < 0 ? -1 : map.global_to_local(e);
    const int32_t s = L_.pick_slot(e, t, static_cast<int32_t>(k));
    if (slot_rank[static_cast<size_t>(s)] == map.ep_rank()) return s - my_begin;
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
      if (l >= 0 && real) ++L_.load_[static_cast<size_t>(ids[t * K + k])];  // the load window
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

cpu::ExpertJob CpuBackend::job(const Slot& x, int32_t inter, const int32_t* rows, const float* weights,
                               int64_t n) const {
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

void CpuBackend::add_expert_jobs() {
  jobs_.clear();
  for (size_t l = 0; l < slots_.size(); ++l) {
    const int64_t b = pair_count_[l], n = pair_count_[l + 1] - b;
    if (n > 0)
      jobs_.push_back(job(slots_[l], cfg_.intermediate_size, pair_rows_.data() + b, pair_weights_.data() + b, n));
  }
}

void CpuBackend::add_shared_job(const Rows& x, int64_t row0, int64_t n_rows, const int32_t* ids) {
  if (L_.shared_count_ == 0) return;
  const int64_t H = cfg_.hidden_size, K = cfg_.top_k;
  const float* gate = L_.shared_gate_.data();
  int64_t n = 0;
  for (int64_t t = row0; t < row0 + n_rows; ++t) {
    if (ids && ids[t * K] < 0) continue;  // DP padding
    float g = 1.0f;
    if (cfg_.shared_expert_gate) {
      float dot = 0.0f;
      if (x.x16 == nullptr) {
        const float* xr = x.x + t * H;
        for (int64_t i = 0; i < H; ++i) dot += xr[i] * gate[i];
      } else {  // the same values, widened here
        const uint16_t* xr = x.x16 + t * x.ld16;
        for (int64_t i = 0; i < H; ++i) dot += bf16_to_f32(xr[i]) * gate[i];
      }
      g = 1.0f / (1.0f + std::exp(-dot));
    }
    shared_rows_[static_cast<size_t>(n)] = static_cast<int32_t>(t);
    shared_weights_[static_cast<size_t>(n)] = g;
    ++n;
  }
  if (n > 0) jobs_.push_back(job(shared_, L_.shared_count_, shared_rows_.data(), shared_weights_.data(), n));
}

void CpuBackend::record(int64_t tokens, int64_t local_pairs, int64_t skipped) {
  last_tokens_ = tokens;
  last_local_pairs_ = local_pairs;
  last_skipped_ = skipped;
  last_active_ = 0;
  for (const auto& j : jobs_) last_active_ += j.gate_up != &shared_.gate_up;
}

void CpuBackend::pack_row(char* row, const char* hidden, const int32_t* ids, const float* w) const {
  const int64_t H = cfg_.hidden_size, K = cfg_.top_k;
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(cfg_.act_dtype));
  std::memcpy(row, hidden, static_cast<size_t>(H) * es);
  std::memcpy(row + L_.ids_off_, ids, static_cast<size_t>(K) * 4);
  std::memcpy(row + L_.ids_off_ + K * 4, w, static_cast<size_t>(K) * 4);
}

void CpuBackend::unpack_ids(int64_t n) {
  const int64_t K = cfg_.top_k;
  for (int64_t t = 0; t < n; ++t) {
    const char* rid = recv_rows_.data<char>() + static_cast<size_t>(t) * L_.row_bytes_ + L_.ids_off_;
    std::memcpy(L_.ids_.data() + t * K, rid, static_cast<size_t>(K) * 4);
    std::memcpy(L_.weights_.data() + t * K, rid + K * 4, static_cast<size_t>(K) * 4);
  }
}

int64_t CpuBackend::unpack_rows(int64_t n, float* x) {
  unpack_ids(n);
  if (direct_bf16_) return n * cfg_.top_k * 8;  // the experts read the bf16 rows where they arrived
  rows_->widen(recv_rows_.data<char>(), n, x, L_.row_bytes_);
  return n * cfg_.hidden_size * 4;
}

const float* CpuBackend::f32_rows(const void* hidden, int64_t n, float* scratch, int64_t* bytes) {
  // f32 activations need no widening: a copy of T x H floats (written, then
  // read again by the experts) is not made. The rows' values, and so the
  // bits of every sum, are the same.
  if (cfg_.act_dtype == EP_MOE_DTYPE_F32 && float_aligned(hidden)) return static_cast<const float*>(hidden);
  rows_->widen(hidden, n, scratch);
  if (bytes) *bytes += n * cfg_.hidden_size * 4;
  return scratch;
}

}  // namespace ep_moe

// The all-to-all dispatch (EP_MOE_DISPATCH_ALLTOALL and AUTO's choice): which
// replica a pair goes to, the send plan of a step, the count exchange, the
// row exchange there and back, and the combine of the returned rows
// (docs/architecture.md, "All-to-all dispatch").
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "layer/layer.hpp"
#include "layer/stages.hpp"

namespace ep_moe {

void Layer::build_a2a_choice() {
  // All-to-all: a rank holding a replica keeps its own tokens' pairs; tokens
  // of ranks without one go to the holders in proportion to what each still
  // lacks of an even share. With an expert's pairs spread evenly over the
  // R ranks' tokens, a holder with m of the n replicas keeps L/R and needs
  // m*L/n, so it takes (m*R - n) parts of the others' pairs. Where some
  // holder's own share already exceeds its even share (m*R < n), keeping
  // pairs local cannot balance: no rank keeps them and the all-gather rule
  // applies to every token.
  const int32_t E = cfg_.num_experts, R = map_.ep_size(), me = map_.ep_rank();
  const auto& slot_rank = map_.slot_rank();
  a2a_local_.assign(static_cast<size_t>(E), -1);
  a2a_begin_.assign(static_cast<size_t>(E) + 1, 0);
  a2a_table_.clear();
  std::vector<int32_t> per_rank(static_cast<size_t>(R)), first(static_cast<size_t>(R));
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = replica_begin_[static_cast<size_t>(e)], n = replica_begin_[static_cast<size_t>(e) + 1] - b;
    std::fill(per_rank.begin(), per_rank.end(), 0);
    for (int32_t i = n - 1; i >= 0; --i) {
      const int32_t s = replica_slots_[static_cast<size_t>(b + i)];
      ++per_rank[static_cast<size_t>(slot_rank[static_cast<size_t>(s)])];
      first[static_cast<size_t>(slot_rank[static_cast<size_t>(s)])] = s;
    }
    bool local_ok = true;
    for (int32_t r = 0; r < R; ++r)
      if (per_rank[static_cast<size_t>(r)] > 0 && static_cast<int64_t>(per_rank[static_cast<size_t>(r)]) * R < n)
        local_ok = false;
    if (local_ok) {
      if (per_rank[static_cast<size_t>(me)] > 0) a2a_local_[static_cast<size_t>(e)] = first[static_cast<size_t>(me)];
      for (int32_t r = 0; r < R; ++r)
        for (int64_t j = 0;
             per_rank[static_cast<size_t>(r)] > 0 && j < static_cast<int64_t>(per_rank[static_cast<size_t>(r)]) * R - n;
             ++j)
          a2a_table_.push_back(first[static_cast<size_t>(r)]);
    }
    a2a_begin_[static_cast<size_t>(e) + 1] = static_cast<int32_t>(a2a_table_.size());
  }
}

int32_t Layer::pick_slot_a2a(int32_t expert, int64_t token, int32_t k) const {
  // The pair never leaves a rank that keeps it (see build_a2a_choice).
  const int32_t local = a2a_local_[static_cast<size_t>(expert)];
  if (local >= 0) return local;
  const int32_t b = a2a_begin_[static_cast<size_t>(expert)], w = a2a_begin_[static_cast<size_t>(expert) + 1] - b;
  if (w == 0) return pick_slot(expert, token, k);
  return a2a_table_[static_cast<size_t>(b + (token + k) % w)];
}

void Layer::plan_sends(int64_t T) {
  const int64_t K = cfg_.top_k;
  const int32_t ep = map_.ep_size();
  const auto& slot_rank = map_.slot_rank();
  const int32_t* ids = ids_.data();
  std::fill(send_count_.begin(), send_count_.end(), 0);
  std::fill(stamp_.begin(), stamp_.end(), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t d = slot_rank[static_cast<size_t>(pick_slot_a2a(ids[t * K + k], t, static_cast<int32_t>(k)))];
      dest_[static_cast<size_t>(t * K + k)] = d;
      if (stamp_[static_cast<size_t>(d)] != t) {  // one row per (token, destination rank)
        stamp_[static_cast<size_t>(d)] = t;
        ++send_count_[static_cast<size_t>(d)];
      }
    }
  send_off_[0] = 0;
  for (int32_t d = 0; d < ep; ++d)
    send_off_[static_cast<size_t>(d) + 1] = send_off_[static_cast<size_t>(d)] + send_count_[static_cast<size_t>(d)];
  std::vector<int64_t>& cur = cursor64_;
  for (int32_t d = 0; d < ep; ++d) cur[static_cast<size_t>(d)] = send_off_[static_cast<size_t>(d)];
  std::fill(stamp_.begin(), stamp_.end(), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t d = dest_[static_cast<size_t>(t * K + k)];
      if (stamp_[static_cast<size_t>(d)] == t) continue;
      stamp_[static_cast<size_t>(d)] = t;
      send_tok_[static_cast<size_t>(cur[static_cast<size_t>(d)]++)] = static_cast<int32_t>(t);
    }
}

int64_t Layer::a2a_counts(size_t per_row, bool outbound) {
  const int32_t n = map_.ep_size(), me = map_.ep_rank();
  int64_t R = 0;
  for (int32_t p = 0; p < n; ++p) {
    const int64_t c =
        count_matrix_[static_cast<size_t>(p) * (static_cast<size_t>(n) + 1) + 1 + static_cast<size_t>(me)];
    recv_count_[static_cast<size_t>(p)] = static_cast<size_t>(c);
    R += c;
  }
  for (int32_t d = 0; d < n; ++d) {
    const size_t sent = static_cast<size_t>(send_count_[static_cast<size_t>(d)]) * per_row;
    const size_t got = recv_count_[static_cast<size_t>(d)] * per_row;
    counts_[static_cast<size_t>(d)] = outbound ? sent : got;
    recv_words_[static_cast<size_t>(d)] = outbound ? got : sent;
  }
  return R;
}

void Layer::build_back_csr(int64_t T) {
  const int64_t back_rows = send_off_[static_cast<size_t>(map_.ep_size())];
  std::fill(back_off_.begin(), back_off_.begin() + T + 1, 0);
  for (int64_t j = 0; j < back_rows; ++j) ++back_off_[static_cast<size_t>(send_tok_[static_cast<size_t>(j)]) + 1];
  for (int64_t t = 0; t < T; ++t) back_off_[static_cast<size_t>(t) + 1] += back_off_[static_cast<size_t>(t)];
  for (int64_t j = 0; j < back_rows; ++j)  // fills each token's range in j order (shifts back_off_ by one token)
    back_idx_[static_cast<size_t>(back_off_[static_cast<size_t>(send_tok_[static_cast<size_t>(j)])]++)] = j;
  for (int64_t t = T; t > 0; --t) back_off_[static_cast<size_t>(t)] = back_off_[static_cast<size_t>(t) - 1];
  back_off_[0] = 0;
}

void Layer::exchange_counts(Comm* ep, const ep_moe_forward_args_t& a) {
  const int32_t n = map_.ep_size();
  std::vector<int64_t>& mine = count_row_;
  mine[0] = a.num_tokens;
  for (int32_t d = 0; d < n; ++d) mine[static_cast<size_t>(d) + 1] = send_count_[static_cast<size_t>(d)];
  // A CUDA layer over NCCL: these host counts go through device memory.
  Comm* c = ep_staged_ ? ep_staged_.get() : ep;
  c->all_gather(count_matrix_.data(), mine.data(), static_cast<size_t>(n) + 1, EP_MOE_DTYPE_I64, a.stream);
}

int32_t Layer::cheaper_mode(const ep_moe_forward_args_t& a, Gather gather, int64_t padded) {
  // Bytes that cross between ranks in this step, summed over the ranks; the
  // same numbers on every rank, so every rank makes the same choice.
  const int32_t n = map_.ep_size();
  const double es = static_cast<double>(dtype_size(static_cast<ep_moe_dtype_t>(cfg_.act_dtype)));
  const double H = cfg_.hidden_size, row = static_cast<double>(row_bytes_);
  auto M = [&](int32_t p, int32_t c) {
    return static_cast<double>(
        count_matrix_[static_cast<size_t>(p) * (static_cast<size_t>(n) + 1) + static_cast<size_t>(c)]);
  };
  double a2a = 0, tokens = 0;
  for (int32_t p = 0; p < n; ++p) {
    tokens += M(p, 0);
    for (int32_t q = 0; q < n; ++q)
      if (q != p) a2a += M(p, q + 1) * (row + H * es);  // rows out, partial sums back
  }
  double ag = 0;
  const double frac = n > 1 ? static_cast<double>(n - 1) / n : 0.0;
  if (dp_size_ > 1) {  // every rank is a replica: gather, then reduce(-scatter)
    const double t_all = gather == Gather::Padded ? static_cast<double>(padded) * n : tokens;
    ag += n * (t_all - (gather == Gather::Padded ? static_cast<double>(padded) : tokens / n)) * row;
    ag += n * t_all * H * es * frac * (gather == Gather::Padded && dp_is_ep_ ? 1.0 : 2.0);
  } else {  // the same tokens everywhere: one all-reduce
    ag += n * M(map_.ep_rank(), 0) * H * es * frac * 2.0;
  }
  const int32_t mode = a2a < ag ? EP_MOE_DISPATCH_ALLTOALL : EP_MOE_DISPATCH_ALLGATHER;
  last_bytes_alltoall_ = a2a;
  last_bytes_allgather_ = ag;
  if (mode != last_auto_choice_)
    log(EP_MOE_LOG_INFO, "[EP rank %d/%d] dispatch %s: all-to-all moves %.0f bytes, all-gather %.0f", map_.ep_rank(), n,
        mode == EP_MOE_DISPATCH_ALLTOALL ? "all-to-all" : "all-gather", a2a, ag);
  last_auto_choice_ = mode;
  (void)a;
  return mode;
}

void Layer::forward_alltoall(const ep_moe_forward_args_t& a, void* stages) {
  Stages& st = *static_cast<Stages*>(stages);
  const int64_t T = a.num_tokens, H = cfg_.hidden_size, K = cfg_.top_k;
  const int32_t n = map_.ep_size(), me = map_.ep_rank();
  const auto adt = static_cast<ep_moe_dtype_t>(cfg_.act_dtype);
  const size_t es = dtype_size(adt);
  const size_t words = row_bytes_ / 4;
  const int32_t* ids = ids_.data();
  const float* w = weights_.data();

  PhaseTimes ph;
  int64_t t0 = now_ns();

  // 1. Pack one row per (token, destination): pairs computed elsewhere are
  //    -1. Blocks of rows in parallel; row_ids_ holds K ids per pool thread.
  char* send = send_rows_.data<char>();
  const int64_t rows_out = send_off_[static_cast<size_t>(n)];
  pool_->parallel_ranges(static_cast<size_t>(rows_out), 16, [&](size_t b0, size_t b1, int tid) {
    int32_t* row_ids = row_ids_.data() + static_cast<size_t>(tid) * static_cast<size_t>(K);
    const auto j0 = static_cast<int64_t>(b0), j1 = static_cast<int64_t>(b1);
    int32_t d =
        static_cast<int32_t>(std::upper_bound(send_off_.begin(), send_off_.begin() + n + 1, j0) - send_off_.begin()) -
        1;
    for (int64_t j = j0; j < j1; ++j) {
      while (j >= send_off_[static_cast<size_t>(d) + 1]) ++d;
      const int64_t t = send_tok_[static_cast<size_t>(j)];
      for (int64_t k = 0; k < K; ++k) row_ids[k] = dest_[static_cast<size_t>(t * K + k)] == d ? ids[t * K + k] : -1;
      pack_row(send + static_cast<size_t>(j) * row_bytes_,
               static_cast<const char*>(a.hidden) + t * H * static_cast<int64_t>(es), row_ids, w + t * K);
    }
  });
  ph.permute_bytes += rows_out * static_cast<int64_t>(row_bytes_);
  ph.permute_ns += now_ns() - t0;
  const int64_t R = a2a_counts(words, true);
  st.enter()->all_to_all_v(recv_rows_.data(), recv_words_.data(), send, counts_.data(), EP_MOE_DTYPE_I32, a.stream);

  // 2. Experts on the rows received; partial sums back in the same order.
  float* x = x_f32_.data<float>();
  t0 = now_ns();
  ph.permute_bytes += unpack_rows(R, x);
  ph.permute_ns += now_ns() - t0;
  int64_t skipped = 0;
  const int64_t local_pairs = plan_pairs(R, ids_.data(), weights_.data(), true, &skipped);
  float* acc = acc_.data<float>();
  zero_rows(acc, R);
  add_expert_jobs();
  t0 = now_ns();
  // With direct_bf16_ the experts read the bf16 rows where they arrived.
  const uint16_t* x16 = direct_bf16_ ? recv_rows_.data<uint16_t>() : nullptr;
  ffn_->run(*pool_, jobs_, x, H, acc, H, act_, x16, static_cast<int64_t>(row_bytes_ / 2));
  ph.expert_ns += now_ns() - t0;
  record(R, local_pairs, 0);
  char* back = ret_send_.data<char>();
  t0 = now_ns();
  narrow_rows(acc, R, back);
  ph.combine_bytes += R * H * 4;
  ph.combine_ns += now_ns() - t0;
  a2a_counts(static_cast<size_t>(H), false);
  st.enter()->all_to_all_v(ret_recv_.data(), recv_words_.data(), back, counts_.data(), adt, a.stream);

  // 3. Own tokens: the shared expert (whole, replicated), then the partial
  //    sums in destination-rank order.
  const float* ox = own_x_.data<float>();
  float* oacc = own_acc_.data<float>();
  if (shared_count_ > 0) {  // the shared expert (and its gate) read own rows in f32
    t0 = now_ns();
    ox = f32_rows(a.hidden, T, own_x_.data<float>(), &ph.permute_bytes);
    ph.permute_ns += now_ns() - t0;
  }
  jobs_.clear();
  add_shared_job(ox, 0, T, nullptr);
  const bool any_shared = !jobs_.empty();
  if (any_shared) {
    zero_rows(oacc, T);
    t0 = now_ns();
    ffn_->run(*pool_, jobs_, ox, H, oacc, H, act_);
    ph.expert_ns += now_ns() - t0;
  }
  t0 = now_ns();
  // Per token: its shared-expert result (if any) plus the rows that came
  // back for it (in destination-rank order, as sent), summed in f32 a few
  // columns at a time in registers (Kernels::sum_rows) and written out
  // once, in the activation dtype: no f32 row is written and read back,
  // per returned row or per token. Without a shared expert the sum starts
  // from the first returned row. Token blocks in parallel.
  const char* ret = ret_recv_.data<char>();
  const int64_t back_rows = send_off_[static_cast<size_t>(n)];
  build_back_csr(T);
  for (int64_t q = 0; q < back_rows; ++q)
    back_ptr_[static_cast<size_t>(q)] = ret + static_cast<size_t>(back_idx_[static_cast<size_t>(q)] * H) * es;
  pool_->parallel_ranges(static_cast<size_t>(T), 8, [&](size_t b0, size_t b1, int) {
    for (auto t = static_cast<int64_t>(b0); t < static_cast<int64_t>(b1); ++t) {
      const int64_t q = back_off_[static_cast<size_t>(t)];
      const auto nq = static_cast<int>(back_off_[static_cast<size_t>(t) + 1] - q);
      kern_.sum_rows(static_cast<char*>(a.out) + t * H * static_cast<int64_t>(es), adt,
                     any_shared ? oacc + t * H : nullptr, back_ptr_.data() + q, nq, adt, 0, H);
    }
  });
  ph.combine_bytes += (back_rows + T) * H * static_cast<int64_t>(es);
  ph.combine_ns += now_ns() - t0;
  last_phase_ = ph;
  int64_t sent_pairs = 0;
  for (int64_t i = 0; i < T * K; ++i) sent_pairs += dest_[static_cast<size_t>(i)] != me;
  last_skipped_ = sent_pairs;
}

}  // namespace ep_moe

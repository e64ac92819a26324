// The all-to-all dispatch's host plan (EP_MOE_DISPATCH_ALLTOALL and AUTO's
// choice), the same for every backend: which replica a pair goes to, the
// send plan of a step, the count exchange, the per-rank counts of the row
// exchange there and back, and the returned rows of each own token
// (docs/architecture.md, "All-to-all dispatch"). The backends move the rows
// (CpuBackend::alltoall, CudaBackend::alltoall).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "layer/layer.hpp"

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
  Comm* c = ep_host_ ? ep_host_.get() : ep;
  c->all_gather(count_matrix_.data(), mine.data(), static_cast<size_t>(n) + 1, EP_MOE_DTYPE_I64, a.stream);
  // Without DP attention every EP rank passes the same tokens: the counts
  // every rank now holds say whether they did (each rank fails alike).
  if (dp_size_ == 1)
    for (int32_t r = 1; r < n; ++r)
      if (count_matrix_[static_cast<size_t>(r) * (static_cast<size_t>(n) + 1)] != count_matrix_[0])
        fail(EP_MOE_ERR_INVALID_ARGUMENT,
             "the EP ranks disagree on the step: rank 0 passes %lld tokens, rank %d %lld (without DP attention every "
             "EP rank passes the same tokens)",
             static_cast<long long>(count_matrix_[0]), r,
             static_cast<long long>(count_matrix_[static_cast<size_t>(r) * (static_cast<size_t>(n) + 1)]));
}

int32_t Layer::cheaper_mode(Gather gather, int64_t padded) {
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
  return mode;
}

int64_t Layer::sent_pairs(int64_t T) const {
  const int32_t me = map_.ep_rank();
  int64_t n = 0;
  for (int64_t i = 0; i < T * cfg_.top_k; ++i) n += dest_[static_cast<size_t>(i)] != me;
  return n;
}

}  // namespace ep_moe

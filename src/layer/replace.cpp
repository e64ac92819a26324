// Live re-placement: moving a running layer to a new expert placement (and
// possibly a new EP group) between forward calls.
//
// Protocol, over the new group's communicator:
//  1. One all-gather of what every rank holds (complete routed experts, its
//     range of the shared expert's intermediate units), whether it has a
//     checkpoint, its status, and a hash of its new map and config.
//  2. Every rank computes the same plan from that: each rank keeps what it
//     holds; what it lacks comes from a holder (the least busy, ties to the
//     lower rank) or, when no rank holds it, from its checkpoint.
//  3. The transfers, in rounds of at most kRoundBytes, one all-to-all each.
//  4. Checkpoint reads, then one all-gather of every rank's status (the vote).
//  5. Only when every rank succeeded: the kept experts move into the new
//     layer, which the caller then swaps in. Nothing is changed before.
// Weights travel as "units", one per intermediate row: [gate row | up row |
// down column], H elements each, in the float dtype they are stored in
// (packing is not portable between ranks with different CPU kernels; this
// format is). Routed experts kept in GGUF block formats travel as their
// blocks instead: [gate rows (I) | up rows (I) | down rows (H)], each row
// its blocks as stored (a column of blocks is no unit); every rank must
// hold its experts in the same formats. A routed expert's weights are
// followed, when the layer has expert biases, by [gate bias (I) | up bias
// (I) | down bias (H)] in f32.
#include <algorithm>
#include <cstring>
#include <map>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "common/quant.hpp"
#include "layer/layer.hpp"

namespace ep_moe {

namespace {

constexpr size_t kRoundBytes = size_t{256} << 20;

// Words of the status record before the holdings bitmap.
enum Rec : size_t { kStatus, kCkpt, kSharedLo, kSharedHi, kMapHash, kCfgHash, kBias, kGuType, kDownType, kHeader };

uint64_t hash_config(const ep_moe_layer_config_t& c) {
  const int32_t v[8] = {c.hidden_size,  c.intermediate_size, c.num_experts, c.shared_intermediate_size,
                        c.weight_dtype, c.dispatch_mode,     c.top_k,       c.shared_expert_gate};
  return fnv1a(kFnvBasis, v, sizeof v);
}

// The status a rank reports for a peer's failure: the peer's, except that
// a bad handle there is not a bad handle here.
ep_moe_status_t peer_status(ep_moe_status_t s) {
  return s == EP_MOE_ERR_INVALID_HANDLE ? EP_MOE_ERR_INVALID_ARGUMENT : s;
}

// Runs fn and turns what it throws into a status and a message, so that the
// rank can still take part in the collectives that follow.
template <class F>
void capture(ep_moe_status_t* status, std::string* message, const char* what, F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    *status = e.status();
    *message = e.what();
  } catch (const std::bad_alloc&) {
    *status = EP_MOE_ERR_OUT_OF_MEMORY;
    *message = std::string("out of memory ") + what;
  } catch (const std::exception& e) {
    *status = EP_MOE_ERR_INTERNAL;
    *message = e.what();
  }
}

struct Transfer {
  int32_t src, dst;  // participants (ranks of the communicator)
  int32_t expert;    // -1: units of the shared expert
  int32_t u0, u1;    // units [u0, u1) (shared: global intermediate index)
};

}  // namespace

void Layer::store_biases(int32_t expert, const uint8_t* in) {
  const int64_t I = cfg_.intermediate_size, H = cfg_.hidden_size;
  store(EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, expert, Source{in, EP_MOE_DTYPE_F32, 2 * I}, false);
  store(EP_MOE_WEIGHT_EXPERT_DOWN_BIAS, expert, Source{in + 2 * I * 4, EP_MOE_DTYPE_F32, H}, false);
}

ep_moe_dtype_t Layer::unit_dtype() const {
  const auto wdt = static_cast<ep_moe_dtype_t>(cfg_.weight_dtype);
  return dtype_is_quant(wdt) ? EP_MOE_DTYPE_F32 : wdt;  // the float parts' storage then
}

void Layer::store_units(int32_t expert, const uint8_t* units) {
  const int64_t H = cfg_.hidden_size;
  Source gate{units, unit_dtype(), 3 * H};
  gate.dequantized = true;
  Source up = gate;
  up.col0 = H;
  Source down = gate;  // element (h, j) = units[j * 3H + 2H + h]
  down.transposed = true;
  down.row0 = 2 * H;
  const bool shared = expert < 0;
  store(shared ? EP_MOE_WEIGHT_SHARED_GATE : EP_MOE_WEIGHT_EXPERT_GATE, expert, gate, shared);
  store(shared ? EP_MOE_WEIGHT_SHARED_UP : EP_MOE_WEIGHT_EXPERT_UP, expert, up, shared);
  store(shared ? EP_MOE_WEIGHT_SHARED_DOWN : EP_MOE_WEIGHT_EXPERT_DOWN, expert, down, shared);
}

void Layer::store_rows(int32_t expert, const uint8_t* in, ep_moe_dtype_t gu, ep_moe_dtype_t down) {
  const int64_t H = cfg_.hidden_size, I = cfg_.intermediate_size;
  const size_t gb = row_bytes_of(gu, H) * static_cast<size_t>(I);
  store(EP_MOE_WEIGHT_EXPERT_GATE, expert, Source{in, gu, H}, false);
  store(EP_MOE_WEIGHT_EXPERT_UP, expert, Source{in + gb, gu, H}, false);
  store(EP_MOE_WEIGHT_EXPERT_DOWN, expert, Source{in + 2 * gb, down, I}, false);
}

size_t Layer::row_bytes_of(ep_moe_dtype_t t, int64_t n) {
  return dtype_is_quant(t) ? quant_row_bytes(t, n) : static_cast<size_t>(n) * dtype_size(t);
}

// One re-placement, step by step (the protocol above). Every rank runs the
// same steps; from the transfers on, a rank that failed joins the remaining
// collectives as a failure, so no peer waits.
class Replacement {
 public:
  Replacement(Layer& old, const ExpertMap* nmap, Comm* comm, const io::Checkpoint* ck, int32_t L)
      : o_(old), nmap_(nmap), comm_(comm), ck_(ck), L_(L) {
    // A CUDA layer's host-side records and units cross a device
    // communicator through device memory.
    if (comm && comm->device_memory()) staged_ = o_.backend_->host_view(comm);
    xc_ = staged_ ? staged_.get() : comm;
    E_ = o_.cfg_.num_experts;
    I_ = o_.cfg_.intermediate_size;
    Is_ = o_.cfg_.shared_intermediate_size;
    unit_bytes_ = 3 * static_cast<size_t>(o_.cfg_.hidden_size) * dtype_size(o_.unit_dtype());
    expert_bytes_ = static_cast<size_t>(I_) * unit_bytes_;
    n_ = comm ? comm->size() : 1;
    me_ = comm ? comm->rank() : 0;
    words_ = (static_cast<size_t>(E_) + 63) / 64;
    rec_len_ = kHeader + words_;
  }

  std::unique_ptr<Layer> run(ep_moe_status_t pre_status, const std::string& pre_error) {
    status_ = pre_status;
    message_ = pre_error;
    prepare();
    exchange_holdings();
    plan();
    transfer();
    complete_locally();
    vote();
    commit();
    return std::move(nl_);
  }

 private:
  const int64_t* rec(int i) const { return all_.data() + static_cast<size_t>(i) * rec_len_; }
  bool holds(int i, int32_t e) const { return (rec(i)[kHeader + static_cast<size_t>(e) / 64] >> (e % 64)) & 1; }
  int map_rank(int i) const { return comm_ ? i : nmap_->ep_rank(); }
  // Rank i's range of the shared expert's intermediate units in the new placement.
  void shared_range(int i, int32_t* lo, int32_t* hi) const {
    const bool whole = o_.shared_replicated_;
    const int32_t new_ep = nmap_->ep_size();
    *lo = Is_ == 0 ? 0 : whole ? 0 : split_start(Is_, new_ep, map_rank(i));
    *hi = Is_ == 0 ? 0 : whole ? Is_ : *lo + split_count(Is_, new_ep, map_rank(i));
  }
  // Bytes of a transfer: its units, and an expert's biases.
  size_t xfer_bytes(const Transfer& t) const {
    return t.expert >= 0 ? expert_bytes_ + bias_bytes_ : static_cast<size_t>(t.u1 - t.u0) * unit_bytes_;
  }

  // 1. Locally: the new layer (without weights), and what this rank holds.
  void prepare() {
    if (status_ == EP_MOE_OK) {
      capture(&status_, &message_, "creating the re-placed layer", [&] {
        EP_MOE_CHECK_ARG(nmap_->num_experts() == E_, "the new map has %d experts, the layer %d", nmap_->num_experts(),
                         E_);
        Comm* dp = o_.dp_ == nullptr ? nullptr : o_.dp_ == o_.ep_ ? comm_ : o_.dp_;
        nl_ = std::make_unique<Layer>(o_.cfg_, *nmap_, comm_, dp);
      });
    }
    // A complete local slot of each expert (with its biases, when the layer has them).
    const auto& l2g = o_.map_.local_to_global();
    old_slot_.assign(static_cast<size_t>(E_), -1);
    for (size_t l = 0; l < o_.held_.size(); ++l) {
      const Layer::Held& x = o_.held_[l];
      if (x.complete() && (!o_.expert_bias_ || x.biases()) && old_slot_[static_cast<size_t>(l2g[l])] < 0)
        old_slot_[static_cast<size_t>(l2g[l])] = static_cast<int32_t>(l);
    }
  }

  // 1. The holdings record of every rank (one all-gather), checked: every
  // rank took part, with the same configuration and placement.
  void exchange_holdings() {
    const bool have_shared = Is_ > 0 && o_.shared_count_ > 0 && o_.shared_held_.complete();
    std::vector<int64_t> mine(rec_len_, 0);
    mine[kStatus] = status_;
    mine[kCkpt] = ck_ != nullptr;
    mine[kSharedLo] = have_shared ? o_.shared_begin_ : 0;
    mine[kSharedHi] = have_shared ? o_.shared_begin_ + o_.shared_count_ : 0;
    mine[kMapHash] = nl_ ? static_cast<int64_t>(nmap_->fingerprint()) : 0;
    mine[kCfgHash] = static_cast<int64_t>(hash_config(o_.cfg_));
    mine[kBias] = o_.expert_bias_ ? 1 : 0;
    int32_t gu = -1, down = -1;
    o_.backend_->routed_types(&gu, &down);
    mine[kGuType] = gu;
    mine[kDownType] = down;
    for (int32_t e = 0; e < E_; ++e)
      if (old_slot_[static_cast<size_t>(e)] >= 0) mine[kHeader + static_cast<size_t>(e) / 64] |= int64_t{1} << (e % 64);
    all_.assign(rec_len_ * static_cast<size_t>(n_), 0);
    if (comm_) xc_->all_gather(all_.data(), mine.data(), rec_len_, EP_MOE_DTYPE_I64, nullptr);
    else all_ = mine;
    for (int i = 0; i < n_; ++i) {
      const auto s = static_cast<ep_moe_status_t>(rec(i)[kStatus]);
      if (s == EP_MOE_OK) continue;
      if (i == me_) fail(s, "%s", message_.c_str());
      fail(peer_status(s), "the re-placement was abandoned: rank %d could not take part (%s)", i,
           ep_moe_status_string(s));
    }
    for (int i = 1; i < n_; ++i) {
      if (rec(i)[kCfgHash] != rec(0)[kCfgHash])
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "the layer configuration of rank %d differs from rank 0's", i);
      if (rec(i)[kMapHash] != rec(0)[kMapHash])
        fail(EP_MOE_ERR_INVALID_ARGUMENT,
             "the new expert map of rank %d describes another placement than rank 0's (every rank must pass its own "
             "map of the same placement)",
             i);
    }
    // Expert biases: every rank that holds experts must agree; they travel
    // after an expert's units when any rank has them.
    int bias_holder = -1, plain_holder = -1;
    for (int i = 0; i < n_; ++i) {
      bool any = false;
      for (size_t w = 0; w < words_; ++w) any = any || rec(i)[kHeader + w] != 0;
      with_bias_ = with_bias_ || rec(i)[kBias] != 0;
      if (any) (rec(i)[kBias] ? bias_holder : plain_holder) = i;
    }
    if (bias_holder >= 0 && plain_holder >= 0)
      fail(EP_MOE_ERR_INVALID_ARGUMENT,
           "rank %d's experts have biases and rank %d's do not: give every rank the same weights", bias_holder,
           plain_holder);
    bias_bytes_ = with_bias_ ? (2 * static_cast<size_t>(I_) + static_cast<size_t>(o_.cfg_.hidden_size)) * 4 : 0;
    agree_on_formats();
  }

  // The storage formats of the experts that travel: every rank holding
  // experts must keep them in the same ones. Block formats travel as their
  // blocks (expert_bytes_ per expert), float ones as units.
  void agree_on_formats() {
    int holder = -1;
    for (int i = 0; i < n_; ++i) {
      bool any = false;
      for (size_t w = 0; w < words_; ++w) any = any || rec(i)[kHeader + w] != 0;
      if (!any) continue;
      if (holder >= 0 && (rec(i)[kGuType] != rec(holder)[kGuType] || rec(i)[kDownType] != rec(holder)[kDownType]))
        fail(EP_MOE_ERR_INVALID_ARGUMENT,
             "rank %d holds its experts as %s/%s and rank %d as %s/%s (gate_up/down): give every rank the same "
             "weights",
             holder, dtype_name(static_cast<ep_moe_dtype_t>(rec(holder)[kGuType])),
             dtype_name(static_cast<ep_moe_dtype_t>(rec(holder)[kDownType])), i,
             dtype_name(static_cast<ep_moe_dtype_t>(rec(i)[kGuType])),
             dtype_name(static_cast<ep_moe_dtype_t>(rec(i)[kDownType])));
      holder = i;
    }
    if (holder < 0) return;
    gu_ = static_cast<ep_moe_dtype_t>(rec(holder)[kGuType]);
    down_ = static_cast<ep_moe_dtype_t>(rec(holder)[kDownType]);
    blocks_ = dtype_is_quant(gu_) || dtype_is_quant(down_);
    if (blocks_) {
      const int64_t H = o_.cfg_.hidden_size;
      expert_bytes_ = 2 * static_cast<size_t>(I_) * Layer::row_bytes_of(gu_, H) +
                      static_cast<size_t>(H) * Layer::row_bytes_of(down_, I_);
    }
  }

  // 2. The plan, the same on every rank: what each rank lacks comes from the
  // least busy holder, or from its checkpoint; then the destinations are
  // interleaved and cut into rounds.
  void plan() {
    busy_.assign(static_cast<size_t>(n_), 0);
    ck_experts_.assign(static_cast<size_t>(E_), 0);
    for (int i = 0; i < n_; ++i) {
      plan_experts(i);
      plan_shared(i);
    }
    if (!missing_.empty()) fail(EP_MOE_ERR_NOT_FOUND, "cannot re-place the layer: %s", missing_.c_str());
    interleave();
    size_t bytes = 0;
    for (size_t t = 0; t < plan_.size(); ++t) {
      const size_t b = xfer_bytes(plan_[t]);
      if (bytes > 0 && bytes + b > kRoundBytes) {
        round_end_.push_back(t);
        bytes = 0;
      }
      bytes += b;
    }
    if (!plan_.empty()) round_end_.push_back(plan_.size());
  }

  // The routed experts rank i needs in the new placement.
  void plan_experts(int i) {
    const auto& slots = nmap_->physical_to_global();
    const auto& begin = nmap_->rank_slot_begin();
    const int32_t r = map_rank(i);
    std::vector<int32_t> need(slots.begin() + begin[static_cast<size_t>(r)],
                              slots.begin() + begin[static_cast<size_t>(r) + 1]);
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    for (int32_t e : need) {
      if (holds(i, e)) {
        if (i == me_) ++kept_;
        continue;
      }
      int best = -1;
      for (int j = 0; j < n_; ++j)
        if (j != i && holds(j, e) && (best < 0 || busy_[static_cast<size_t>(j)] < busy_[static_cast<size_t>(best)]))
          best = j;
      if (best >= 0) {
        plan_.push_back({best, i, e, 0, I_});
        busy_[static_cast<size_t>(best)] += xfer_bytes(plan_.back());
      } else if (rec(i)[kCkpt]) {
        if (i == me_) ck_experts_[static_cast<size_t>(e)] = ck_any_expert_ = true;
      } else if (missing_.empty()) {
        missing_ = format("expert %d is held by no rank of the group and rank %d was given no checkpoint", e, i);
      }
    }
  }

  // Rank i's range of the shared expert: segments it keeps, segments from
  // a holder (the one holding the longest run), or, at any gap, all of it
  // from its checkpoint.
  void plan_shared(int i) {
    int32_t lo, hi;
    shared_range(i, &lo, &hi);
    std::vector<Transfer> segs;
    bool gap = false;
    for (int32_t u = lo; u < hi;) {
      auto held = [&](int j) { return u >= rec(j)[kSharedLo] && u < rec(j)[kSharedHi]; };
      if (held(i)) {
        const int32_t end = std::min<int32_t>(hi, static_cast<int32_t>(rec(i)[kSharedHi]));
        segs.push_back({i, i, -1, u, end});
        u = end;
        continue;
      }
      int best = -1;
      for (int j = 0; j < n_; ++j)
        if (held(j) && (best < 0 || rec(j)[kSharedHi] > rec(best)[kSharedHi])) best = j;
      if (best >= 0) {
        const int32_t end = std::min<int32_t>(hi, static_cast<int32_t>(rec(best)[kSharedHi]));
        segs.push_back({best, i, -1, u, end});
        u = end;
        continue;
      }
      gap = true;
      int32_t next = hi;
      for (int j = 0; j < n_; ++j)
        if (rec(j)[kSharedLo] > u && rec(j)[kSharedLo] < rec(j)[kSharedHi])
          next = std::min<int32_t>(next, static_cast<int32_t>(rec(j)[kSharedLo]));
      if (!rec(i)[kCkpt] && missing_.empty())
        missing_ = format(
            "units [%d, %d) of the shared expert's intermediate are held by no rank of the group and rank %d was "
            "given no checkpoint",
            u, next, i);
      u = next;
    }
    if (gap) {
      if (i == me_) ck_shared_ = true;
      return;
    }
    for (const Transfer& t : segs) {
      if (t.src == t.dst) {
        if (i == me_) shared_keep_.emplace_back(t.u0, t.u1);
      } else {
        plan_.push_back(t);
      }
    }
  }

  // The plan lists the destinations one after another: interleave them, so
  // that every round keeps every rank receiving and storing.
  void interleave() {
    std::vector<int32_t> seq(plan_.size()), next(static_cast<size_t>(n_), 0);
    for (size_t t = 0; t < plan_.size(); ++t) seq[t] = next[static_cast<size_t>(plan_[t].dst)]++;
    std::vector<size_t> order(plan_.size());
    for (size_t t = 0; t < order.size(); ++t) order[t] = t;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return seq[a] != seq[b] ? seq[a] < seq[b] : plan_[a].dst < plan_[b].dst;
    });
    std::vector<Transfer> sorted;
    sorted.reserve(plan_.size());
    for (size_t t : order) sorted.push_back(plan_[t]);
    plan_.swap(sorted);
  }

  // 3. The transfers, one all-to-all a round; a failure joins the rounds
  // left (and the vote) as a failure on every peer.
  void transfer() {
    stages_ = comm_ ? round_end_.size() + 1 : 0;
    shared_range(me_, &my_lo_, &my_hi_);
    shared_units_.assign(ck_shared_ ? 0 : static_cast<size_t>(my_hi_ - my_lo_) * unit_bytes_, 0);
    status_ = EP_MOE_OK;
    message_.clear();
    capture(&status_, &message_, "moving expert weights", [&] {
      size_t t0 = 0;
      for (size_t round = 0; round < round_end_.size(); ++round) {
        run_round(t0, round_end_[round]);
        t0 = round_end_[round];
      }
    });
    if (status_ != EP_MOE_OK) {
      for (size_t st = entered_; st < stages_; ++st) comm_->fail_collective(status_, message_);
      fail(status_, "%s", message_.c_str());
    }
  }

  // The transfers [t0, t1) of the plan: this rank's sends packed by
  // destination, one all-to-all, its receipts stored.
  void run_round(size_t t0, size_t t1) {
    std::vector<size_t> out_n(static_cast<size_t>(n_), 0), in_n(static_cast<size_t>(n_), 0);
    for (size_t t = t0; t < t1; ++t) {
      const size_t b = xfer_bytes(plan_[t]);
      if (plan_[t].src == me_) out_n[static_cast<size_t>(plan_[t].dst)] += b;
      if (plan_[t].dst == me_) in_n[static_cast<size_t>(plan_[t].src)] += b;
    }
    size_t out_total = 0, in_total = 0;
    for (int j = 0; j < n_; ++j) {
      out_total += out_n[static_cast<size_t>(j)];
      in_total += in_n[static_cast<size_t>(j)];
    }
    // Left uninitialised: every byte is written before it is read.
    std::unique_ptr<uint8_t[]> sendbuf(new uint8_t[std::max<size_t>(out_total, 1)]);
    std::unique_ptr<uint8_t[]> recvbuf(new uint8_t[std::max<size_t>(in_total, 1)]);
    size_t at = 0;
    for (int j = 0; j < n_; ++j)
      for (size_t t = t0; t < t1; ++t) {
        const Transfer& x = plan_[t];
        if (x.src != me_ || x.dst != j) continue;
        if (x.expert >= 0) {
          const int32_t held = old_slot_[static_cast<size_t>(x.expert)];
          if (blocks_) o_.backend_->extract_rows(held, sendbuf.get() + at);
          else o_.backend_->extract_units(held, 0, I_, sendbuf.get() + at);
          if (with_bias_) o_.backend_->extract_biases(held, sendbuf.get() + at + expert_bytes_);
        } else {
          o_.backend_->extract_units(-1, x.u0 - o_.shared_begin_, x.u1 - x.u0, sendbuf.get() + at);
        }
        at += xfer_bytes(x);
      }
    ++entered_;
    xc_->all_to_all_v(recvbuf.get(), in_n.data(), sendbuf.get(), out_n.data(), EP_MOE_DTYPE_U8, nullptr);
    sent_ += static_cast<int64_t>(out_total);
    received_ += static_cast<int64_t>(in_total);
    at = 0;
    for (int j = 0; j < n_; ++j)
      for (size_t t = t0; t < t1; ++t) {
        const Transfer& x = plan_[t];
        if (x.dst != me_ || x.src != j) continue;
        const size_t b = xfer_bytes(x);
        if (x.expert >= 0) {
          if (blocks_) nl_->store_rows(x.expert, recvbuf.get() + at, gu_, down_);
          else nl_->store_units(x.expert, recvbuf.get() + at);
          if (with_bias_) nl_->store_biases(x.expert, recvbuf.get() + at + expert_bytes_);
        } else {
          std::memcpy(shared_units_.data() + static_cast<size_t>(x.u0 - my_lo_) * unit_bytes_, recvbuf.get() + at, b);
        }
        at += b;
      }
  }

  // 4. Locally: the kept shared units, the checkpoint reads, the kept
  // experts (keep_experts).
  void complete_locally() {
    capture(&status_, &message_, "completing the re-placement", [&] {
      if (Is_ > 0 && my_hi_ > my_lo_) {
        if (ck_shared_) {
          Layer::LoadParts parts;
          parts.experts.assign(static_cast<size_t>(E_), 0);
          parts.others = false;
          read_ += static_cast<int64_t>(nl_->load_parts(*ck_, L_, parts));
        } else if (keeps_whole_shard() && nl_->backend_->keep_shared(*o_.backend_)) {
          nl_->shared_held_ = o_.shared_held_;  // as it is held: a shard in blocks stays in blocks
        } else {
          for (const auto& seg : shared_keep_)
            o_.backend_->extract_units(-1, seg.first - o_.shared_begin_, seg.second - seg.first,
                                       shared_units_.data() + static_cast<size_t>(seg.first - my_lo_) * unit_bytes_);
          nl_->store_units(-1, shared_units_.data());
        }
      }
      if (ck_any_expert_) {
        Layer::LoadParts parts;
        parts.experts = ck_experts_;
        parts.shared = parts.others = false;
        read_ += static_cast<int64_t>(nl_->load_parts(*ck_, L_, parts));
      }
      keep_experts();
    });
  }

  // Whether this rank's new shard of the shared expert is its old one.
  bool keeps_whole_shard() const {
    const int32_t lo = o_.shared_begin_, hi = o_.shared_begin_ + o_.shared_count_;
    return my_lo_ == lo && my_hi_ == hi && shared_keep_.size() == 1 && shared_keep_[0].first == lo &&
           shared_keep_[0].second == hi;
  }

  // The kept experts (every slot of the new layer whose expert this rank
  // held), the router, and the small vectors the backend holds too: all
  // that can fail happens here, before the vote; the commit completes it.
  void keep_experts() {
    const auto& nl2g = nl_->map_.local_to_global();
    std::vector<char> first(static_cast<size_t>(E_), 1);
    kept_slots_.clear();
    for (size_t l = 0; l < nl_->held_.size(); ++l) {
      const int32_t e = nl2g[l];
      const int32_t o = old_slot_[static_cast<size_t>(e)];
      if (o < 0) continue;
      kept_slots_.push_back({o, static_cast<int32_t>(l), first[static_cast<size_t>(e)] != 0});
      first[static_cast<size_t>(e)] = 0;
      nl_->held_[l] = o_.held_[static_cast<size_t>(o)];
    }
    nl_->backend_->keep_before_vote(*o_.backend_, kept_slots_, o_.has_router_);
    const int64_t H = o_.cfg_.hidden_size;
    if (o_.has_bias_)
      nl_->backend_->put(WeightPart::Bias, -1, 0, Source{o_.bias_.data(), EP_MOE_DTYPE_F32, E_}, 1, E_, false);
    if (o_.has_shared_gate_)
      nl_->backend_->put(WeightPart::SharedGate, -1, 0, Source{o_.shared_gate_.data(), EP_MOE_DTYPE_F32, H}, 1, H,
                         false);
  }

  // 4. The vote: one all-gather of every rank's status; any failure fails
  // every rank, and nothing has changed yet.
  void vote() {
    if (!comm_) {
      if (status_ != EP_MOE_OK) fail(status_, "%s", message_.c_str());
      return;
    }
    std::vector<int32_t> votes(static_cast<size_t>(n_));
    const int32_t v = status_;
    xc_->all_gather(votes.data(), &v, 1, EP_MOE_DTYPE_I32, nullptr);
    for (int i = 0; i < n_; ++i) {
      const auto s = static_cast<ep_moe_status_t>(votes[static_cast<size_t>(i)]);
      if (s == EP_MOE_OK) continue;
      if (i == me_) fail(s, "%s", message_.c_str());
      fail(peer_status(s), "the re-placement was abandoned: rank %d failed (%s)", i, ep_moe_status_string(s));
    }
  }

  // 5. Commit: the kept experts and the small weights move into the new
  // layer. Nothing here throws.
  void commit() {
    nl_->backend_->keep_at_commit(*o_.backend_, kept_slots_, o_.has_router_);
    nl_->router_bias_ = std::move(o_.router_bias_);
    nl_->expert_bias_ = with_bias_;
    nl_->has_router_ = o_.has_router_;
    nl_->bias_ = std::move(o_.bias_);
    nl_->has_bias_ = o_.has_bias_;
    if (o_.has_bias_) nl_->routing_.bias = nl_->bias_.data();
    nl_->shared_gate_ = std::move(o_.shared_gate_);
    nl_->has_shared_gate_ = o_.has_shared_gate_;
    nl_->bytes_loaded_ += o_.bytes_loaded_;  // load_parts counted `read_`
    nl_->replace_sent_ = sent_;
    nl_->replace_received_ = received_;
    nl_->replace_read_ = read_;
    nl_->replace_kept_ = kept_;
    log(EP_MOE_LOG_INFO,
        "[EP rank %d/%d] re-placed: %d experts kept, %lld bytes received and %lld sent over %zu rounds, %lld read "
        "from the checkpoint; now %s",
        nmap_->ep_rank(), nmap_->ep_size(), kept_, static_cast<long long>(received_), static_cast<long long>(sent_),
        round_end_.size(), static_cast<long long>(read_), nmap_->describe().c_str());
  }

  Layer& o_;  // the layer being re-placed (unchanged until commit)
  const ExpertMap* nmap_;
  Comm* comm_;
  const io::Checkpoint* ck_;
  int32_t L_;
  std::unique_ptr<Comm> staged_;
  Comm* xc_ = nullptr;  // comm_, or its host view
  int32_t E_ = 0, I_ = 0, Is_ = 0;
  size_t unit_bytes_ = 0, bias_bytes_ = 0, words_ = 0, rec_len_ = 0;
  size_t expert_bytes_ = 0;  // a routed expert's weights in transfer (units, or its blocks' rows)
  ep_moe_dtype_t gu_ = EP_MOE_DTYPE_F32, down_ = EP_MOE_DTYPE_F32;
  bool blocks_ = false;  // routed experts travel as their rows of blocks
  int n_ = 1, me_ = 0;
  ep_moe_status_t status_ = EP_MOE_OK;
  std::string message_;
  std::unique_ptr<Layer> nl_;
  std::vector<int32_t> old_slot_;  // a complete local slot of each expert, -1: none
  std::vector<KeptSlot> kept_slots_;
  std::vector<int64_t> all_;  // every rank's holdings record
  bool with_bias_ = false;
  // The plan.
  std::vector<Transfer> plan_;
  std::vector<size_t> busy_, round_end_;
  std::vector<char> ck_experts_;
  bool ck_any_expert_ = false, ck_shared_ = false;
  int32_t kept_ = 0;
  std::vector<std::pair<int32_t, int32_t>> shared_keep_;  // this rank's kept shared segments
  std::string missing_;
  // The transfers.
  size_t stages_ = 0, entered_ = 0;
  int32_t my_lo_ = 0, my_hi_ = 0;
  std::vector<uint8_t> shared_units_;
  int64_t sent_ = 0, received_ = 0, read_ = 0;
};

std::unique_ptr<Layer> Layer::replace(const ExpertMap* nmap, Comm* comm, const io::Checkpoint* ck, int32_t L,
                                      ep_moe_status_t pre_status, const std::string& pre_error) {
  return Replacement(*this, nmap, comm, ck, L).run(pre_status, pre_error);
}

}  // namespace ep_moe

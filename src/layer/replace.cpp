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
// down column], H elements each, in the weight dtype (packing is not
// portable between ranks with different CPU kernels; this format is). A
// routed expert's I units are followed, when the layer has expert biases,
// by [gate bias (I) | up bias (I) | down bias (H)] in f32.
#include <algorithm>
#include <cstring>
#include <map>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "layer/layer.hpp"

namespace ep_moe {

namespace {

constexpr size_t kRoundBytes = size_t{256} << 20;

// Words of the status record before the holdings bitmap.
enum Rec : size_t { kStatus, kCkpt, kSharedLo, kSharedHi, kMapHash, kCfgHash, kBias, kHeader };

uint64_t hash_map(const ExpertMap& m) {
  const int32_t head[3] = {m.ep_size(), m.num_experts(), m.num_physical()};
  uint64_t h = fnv1a(kFnvBasis, head, sizeof head);
  h = fnv1a(h, m.physical_to_global().data(), m.physical_to_global().size() * 4);
  return fnv1a(h, m.slots_per_rank().data(), m.slots_per_rank().size() * 4);
}

uint64_t hash_config(const ep_moe_layer_config_t& c) {
  const int32_t v[8] = {c.hidden_size,     c.intermediate_size, c.num_experts, c.shared_intermediate_size,
                        c.weight_dtype,    c.dispatch_mode,     c.top_k,       c.shared_expert_gate};
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

void Layer::extract_units(const Expert& x, int32_t j0, int32_t n, uint8_t* out) const {
  if (dev_) {  // the slot of `x` in this layer's device weights (-1: the shared shard)
    const int32_t slot = &x == &shared_ ? -1 : static_cast<int32_t>(&x - experts_.data());
    dev_->extract_units(slot, j0, n, out);
    return;
  }
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(cfg_.weight_dtype));
  const size_t H = static_cast<size_t>(cfg_.hidden_size), ub = 3 * H * es;
  for (int32_t j = 0; j < n; ++j) {
    uint8_t* u = out + static_cast<size_t>(j) * ub;
    cpu::unpack_gate_up_row(x.gate_up, 0, j0 + j, u);
    cpu::unpack_gate_up_row(x.gate_up, 1, j0 + j, u + H * es);
    cpu::unpack_col(x.down, j0 + j, u + 2 * H * es);
  }
}

void Layer::extract_biases(const Expert& x, uint8_t* out) const {
  const size_t I = static_cast<size_t>(cfg_.intermediate_size), H = static_cast<size_t>(cfg_.hidden_size);
  std::memcpy(out, x.gate_bias.data(), I * 4);
  std::memcpy(out + I * 4, x.up_bias.data(), I * 4);
  std::memcpy(out + 2 * I * 4, x.down_bias.data(), H * 4);
}

void Layer::store_biases(int32_t expert, const uint8_t* in) {
  const int64_t I = cfg_.intermediate_size, H = cfg_.hidden_size;
  store(EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS, expert, Source{in, EP_MOE_DTYPE_F32, 2 * I}, false);
  store(EP_MOE_WEIGHT_EXPERT_DOWN_BIAS, expert, Source{in + 2 * I * 4, EP_MOE_DTYPE_F32, H}, false);
}

void Layer::store_units(int32_t expert, const uint8_t* units) {
  const auto wdt = static_cast<ep_moe_dtype_t>(cfg_.weight_dtype);
  const int64_t H = cfg_.hidden_size;
  Source gate{units, wdt, 3 * H};
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

void Layer::copy_expert(Expert& dst, const Expert& src) {
  auto copy = [](cpu::PackedWeight& d, const cpu::PackedWeight& s) {
    d.n = s.n;
    d.k = s.k;
    d.nr = s.nr;
    d.dtype = s.dtype;
    d.data.resize(s.data.size());
    if (s.data.size()) std::memcpy(d.data.data(), s.data.data(), s.data.size());
  };
  copy(dst.gate_up, src.gate_up);
  copy(dst.down, src.down);
  dst.has_gate = src.has_gate;
  dst.has_up = src.has_up;
  dst.has_down = src.has_down;
  dst.gate_bias = src.gate_bias;
  dst.up_bias = src.up_bias;
  dst.down_bias = src.down_bias;
}

std::unique_ptr<Layer> Layer::replace(const ExpertMap* nmap, Comm* comm, const io::Checkpoint* ck, int32_t L,
                                      ep_moe_status_t pre_status, const std::string& pre_error) {
  // A CUDA layer's host-side records and units cross a device communicator
  // through device memory.
  std::unique_ptr<Comm> staged = dev_ && comm && comm->device_memory() ? host_view(comm) : nullptr;
  Comm* xc = staged ? staged.get() : comm;
  const int32_t E = cfg_.num_experts, I = cfg_.intermediate_size, Is = cfg_.shared_intermediate_size;
  const size_t es = dtype_size(static_cast<ep_moe_dtype_t>(cfg_.weight_dtype));
  const size_t unit_bytes = 3 * static_cast<size_t>(cfg_.hidden_size) * es;
  const int n = comm ? comm->size() : 1;
  const int me = comm ? comm->rank() : 0;

  // 1. Prepare locally: the new layer, without weights.
  ep_moe_status_t status = pre_status;
  std::string message = pre_error;
  std::unique_ptr<Layer> nl;
  if (status == EP_MOE_OK) {
    capture(&status, &message, "creating the re-placed layer", [&] {
      EP_MOE_CHECK_ARG(nmap->num_experts() == E, "the new map has %d experts, the layer %d", nmap->num_experts(), E);
      Comm* dp = dp_ == nullptr ? nullptr : dp_ == ep_ ? comm : dp_;
      nl = std::make_unique<Layer>(cfg_, *nmap, comm, dp);
    });
  }

  // What this rank holds now.
  const auto& l2g = map_.local_to_global();
  std::vector<int32_t> old_slot(static_cast<size_t>(E), -1);  // a complete local slot of each expert
  for (size_t l = 0; l < experts_.size(); ++l) {
    const Expert& x = experts_[l];
    const bool biases = !x.gate_bias.empty() && !x.up_bias.empty() && !x.down_bias.empty();
    if (x.complete() && (!expert_bias_ || biases) && old_slot[static_cast<size_t>(l2g[l])] < 0)
      old_slot[static_cast<size_t>(l2g[l])] = static_cast<int32_t>(l);
  }
  const bool have_shared = Is > 0 && shared_count_ > 0 && shared_.complete();

  const size_t words = (static_cast<size_t>(E) + 63) / 64;
  const size_t rec_len = kHeader + words;
  std::vector<int64_t> mine(rec_len, 0), all(rec_len * static_cast<size_t>(n));
  mine[kStatus] = status;
  mine[kCkpt] = ck != nullptr;
  mine[kSharedLo] = have_shared ? shared_begin_ : 0;
  mine[kSharedHi] = have_shared ? shared_begin_ + shared_count_ : 0;
  mine[kMapHash] = nl ? static_cast<int64_t>(hash_map(*nmap)) : 0;
  mine[kCfgHash] = static_cast<int64_t>(hash_config(cfg_));
  mine[kBias] = expert_bias_ ? 1 : 0;
  for (int32_t e = 0; e < E; ++e)
    if (old_slot[static_cast<size_t>(e)] >= 0) mine[kHeader + static_cast<size_t>(e) / 64] |= int64_t{1} << (e % 64);
  if (comm) {
    xc->all_gather(all.data(), mine.data(), rec_len, EP_MOE_DTYPE_I64, nullptr);
  } else {
    all = mine;
  }
  auto rec = [&](int i) { return all.data() + static_cast<size_t>(i) * rec_len; };
  for (int i = 0; i < n; ++i) {
    const auto s = static_cast<ep_moe_status_t>(rec(i)[kStatus]);
    if (s == EP_MOE_OK) continue;
    if (i == me) fail(s, "%s", message.c_str());
    fail(peer_status(s), "the re-placement was abandoned: rank %d could not take part (%s)", i,
         ep_moe_status_string(s));
  }
  for (int i = 1; i < n; ++i) {
    if (rec(i)[kCfgHash] != rec(0)[kCfgHash])
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "the layer configuration of rank %d differs from rank 0's", i);
    if (rec(i)[kMapHash] != rec(0)[kMapHash])
      fail(EP_MOE_ERR_INVALID_ARGUMENT,
           "the new expert map of rank %d describes another placement than rank 0's (every rank must pass its own "
           "map of the same placement)",
           i);
  }

  // 2. The plan, the same on every rank.
  auto holds = [&](int i, int32_t e) { return (rec(i)[kHeader + static_cast<size_t>(e) / 64] >> (e % 64)) & 1; };
  // Expert biases: every rank that holds experts must agree; they travel
  // after an expert's units when any rank has them.
  bool with_bias = false;
  int bias_holder = -1, plain_holder = -1;
  for (int i = 0; i < n; ++i) {
    bool any = false;
    for (size_t w = 0; w < words; ++w) any = any || rec(i)[kHeader + w] != 0;
    with_bias = with_bias || rec(i)[kBias] != 0;
    if (any) (rec(i)[kBias] ? bias_holder : plain_holder) = i;
  }
  if (bias_holder >= 0 && plain_holder >= 0)
    fail(EP_MOE_ERR_INVALID_ARGUMENT, "rank %d's experts have biases and rank %d's do not: give every rank the same "
         "weights", bias_holder, plain_holder);
  const size_t bias_bytes = with_bias ? (2 * static_cast<size_t>(I) + static_cast<size_t>(cfg_.hidden_size)) * 4 : 0;
  // Bytes of a transfer: its units, and an expert's biases.
  const auto xfer_bytes = [&](const Transfer& t) {
    return static_cast<size_t>(t.u1 - t.u0) * unit_bytes + (t.expert >= 0 ? bias_bytes : 0);
  };
  const int32_t new_ep = nmap->ep_size();
  auto map_rank = [&](int i) { return comm ? i : nmap->ep_rank(); };
  auto shared_range = [&](int i, int32_t* lo, int32_t* hi) {
    const bool whole = shared_replicated_;
    *lo = Is == 0 ? 0 : whole ? 0 : split_start(Is, new_ep, map_rank(i));
    *hi = Is == 0 ? 0 : whole ? Is : *lo + split_count(Is, new_ep, map_rank(i));
  };
  const auto& slots = nmap->physical_to_global();
  const auto& begin = nmap->rank_slot_begin();
  std::vector<Transfer> plan;
  std::vector<size_t> busy(static_cast<size_t>(n), 0);  // bytes each rank sends
  std::vector<char> ck_experts(static_cast<size_t>(E), 0);
  bool ck_any_expert = false, ck_shared = false;
  int32_t kept = 0;
  std::vector<std::pair<int32_t, int32_t>> shared_keep;  // my kept shared segments
  std::string missing;
  for (int i = 0; i < n; ++i) {
    const int32_t r = map_rank(i);
    std::vector<int32_t> need(slots.begin() + begin[static_cast<size_t>(r)], slots.begin() + begin[static_cast<size_t>(r) + 1]);
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    for (int32_t e : need) {
      if (holds(i, e)) {
        if (i == me) ++kept;
        continue;
      }
      int best = -1;
      for (int j = 0; j < n; ++j)
        if (j != i && holds(j, e) && (best < 0 || busy[static_cast<size_t>(j)] < busy[static_cast<size_t>(best)])) best = j;
      if (best >= 0) {
        plan.push_back({best, i, e, 0, I});
        busy[static_cast<size_t>(best)] += xfer_bytes(plan.back());
      } else if (rec(i)[kCkpt]) {
        if (i == me) ck_experts[static_cast<size_t>(e)] = ck_any_expert = true;
      } else if (missing.empty()) {
        missing = format("expert %d is held by no rank of the group and rank %d was given no checkpoint", e, i);
      }
    }
    int32_t lo, hi;
    shared_range(i, &lo, &hi);
    // Segments of [lo, hi): kept, from a holder, or (any gap) all from the checkpoint.
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
      for (int j = 0; j < n; ++j)
        if (held(j) && (best < 0 || rec(j)[kSharedHi] > rec(best)[kSharedHi])) best = j;
      if (best >= 0) {
        const int32_t end = std::min<int32_t>(hi, static_cast<int32_t>(rec(best)[kSharedHi]));
        segs.push_back({best, i, -1, u, end});
        u = end;
        continue;
      }
      gap = true;
      int32_t next = hi;
      for (int j = 0; j < n; ++j)
        if (rec(j)[kSharedLo] > u && rec(j)[kSharedLo] < rec(j)[kSharedHi])
          next = std::min<int32_t>(next, static_cast<int32_t>(rec(j)[kSharedLo]));
      if (!rec(i)[kCkpt] && missing.empty())
        missing = format(
            "units [%d, %d) of the shared expert's intermediate are held by no rank of the group and rank %d was "
            "given no checkpoint",
            u, next, i);
      u = next;
    }
    if (gap) {
      if (i == me) ck_shared = true;
      continue;
    }
    for (const Transfer& t : segs) {
      if (t.src == t.dst) {
        if (i == me) shared_keep.emplace_back(t.u0, t.u1);
      } else {
        plan.push_back(t);
      }
    }
  }
  if (!missing.empty()) fail(EP_MOE_ERR_NOT_FOUND, "cannot re-place the layer: %s", missing.c_str());

  // Interleave the destinations (the plan lists them one after another), so
  // that every round keeps every rank receiving and storing.
  {
    std::vector<int32_t> seq(plan.size()), next(static_cast<size_t>(n), 0);
    for (size_t t = 0; t < plan.size(); ++t) seq[t] = next[static_cast<size_t>(plan[t].dst)]++;
    std::vector<size_t> order(plan.size());
    for (size_t t = 0; t < order.size(); ++t) order[t] = t;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return seq[a] != seq[b] ? seq[a] < seq[b] : plan[a].dst < plan[b].dst;
    });
    std::vector<Transfer> sorted;
    sorted.reserve(plan.size());
    for (size_t t : order) sorted.push_back(plan[t]);
    plan.swap(sorted);
  }

  // 3.-4. Transfers, checkpoint reads, then the vote. From here on every
  // rank enters the same collectives: after a failure the rest are joined
  // as failures, so no peer waits.
  std::vector<size_t> round_end;
  {
    size_t bytes = 0;
    for (size_t t = 0; t < plan.size(); ++t) {
      const size_t b = xfer_bytes(plan[t]);
      if (bytes > 0 && bytes + b > kRoundBytes) {
        round_end.push_back(t);
        bytes = 0;
      }
      bytes += b;
    }
    if (!plan.empty()) round_end.push_back(plan.size());
  }
  const size_t stages = comm ? round_end.size() + 1 : 0;
  size_t entered = 0;
  int32_t my_lo = 0, my_hi = 0;
  shared_range(me, &my_lo, &my_hi);
  std::vector<uint8_t> shared_units(ck_shared ? 0 : static_cast<size_t>(my_hi - my_lo) * unit_bytes);
  int64_t sent = 0, received = 0, read = 0;
  status = EP_MOE_OK;
  message.clear();
  capture(&status, &message, "moving expert weights", [&] {
    size_t t0 = 0;
    for (size_t round = 0; round < round_end.size(); ++round) {
      const size_t t1 = round_end[round];
      std::vector<size_t> out_n(static_cast<size_t>(n), 0), in_n(static_cast<size_t>(n), 0);
      for (size_t t = t0; t < t1; ++t) {
        const size_t b = xfer_bytes(plan[t]);
        if (plan[t].src == me) out_n[static_cast<size_t>(plan[t].dst)] += b;
        if (plan[t].dst == me) in_n[static_cast<size_t>(plan[t].src)] += b;
      }
      size_t out_total = 0, in_total = 0;
      for (int j = 0; j < n; ++j) {
        out_total += out_n[static_cast<size_t>(j)];
        in_total += in_n[static_cast<size_t>(j)];
      }
      // Left uninitialised: every byte is written before it is read.
      std::unique_ptr<uint8_t[]> sendbuf(new uint8_t[std::max<size_t>(out_total, 1)]);
      std::unique_ptr<uint8_t[]> recvbuf(new uint8_t[std::max<size_t>(in_total, 1)]);
      size_t at = 0;
      for (int j = 0; j < n; ++j)
        for (size_t t = t0; t < t1; ++t) {
          const Transfer& x = plan[t];
          if (x.src != me || x.dst != j) continue;
          if (x.expert >= 0) {
            const Expert& held = experts_[static_cast<size_t>(old_slot[static_cast<size_t>(x.expert)])];
            extract_units(held, 0, I, sendbuf.get() + at);
            if (with_bias) extract_biases(held, sendbuf.get() + at + static_cast<size_t>(I) * unit_bytes);
          } else {
            extract_units(shared_, x.u0 - shared_begin_, x.u1 - x.u0, sendbuf.get() + at);
          }
          at += xfer_bytes(x);
        }
      ++entered;
      xc->all_to_all_v(recvbuf.get(), in_n.data(), sendbuf.get(), out_n.data(), EP_MOE_DTYPE_U8, nullptr);
      sent += static_cast<int64_t>(out_total);
      received += static_cast<int64_t>(in_total);
      at = 0;
      for (int j = 0; j < n; ++j)
        for (size_t t = t0; t < t1; ++t) {
          const Transfer& x = plan[t];
          if (x.dst != me || x.src != j) continue;
          const size_t b = xfer_bytes(x);
          if (x.expert >= 0) {
            nl->store_units(x.expert, recvbuf.get() + at);
            if (with_bias) nl->store_biases(x.expert, recvbuf.get() + at + static_cast<size_t>(I) * unit_bytes);
          } else {
            std::memcpy(shared_units.data() + static_cast<size_t>(x.u0 - my_lo) * unit_bytes, recvbuf.get() + at, b);
          }
          at += b;
        }
      t0 = t1;
    }
  });
  if (status != EP_MOE_OK) {
    for (size_t s = entered; s < stages; ++s) comm->fail_collective(status, message);
    fail(status, "%s", message.c_str());
  }

  // Local completion: kept shared units, checkpoint reads, duplicate slots.
  capture(&status, &message, "completing the re-placement", [&] {
    if (Is > 0 && my_hi > my_lo) {
      if (ck_shared) {
        LoadParts parts;
        parts.experts.assign(static_cast<size_t>(E), 0);
        parts.others = false;
        read += static_cast<int64_t>(nl->load_parts(*ck, L, parts));
      } else {
        for (const auto& seg : shared_keep)
          extract_units(shared_, seg.first - shared_begin_, seg.second - seg.first,
                        shared_units.data() + static_cast<size_t>(seg.first - my_lo) * unit_bytes);
        nl->store_units(-1, shared_units.data());
      }
    }
    if (ck_any_expert) {
      LoadParts parts;
      parts.experts = ck_experts;
      parts.shared = parts.others = false;
      read += static_cast<int64_t>(nl->load_parts(*ck, L, parts));
    }
    // Kept experts move at commit; a second local slot of one gets a copy now.
    const auto& nl2g = nl->map_.local_to_global();
    std::vector<char> first(static_cast<size_t>(E), 1);
    for (size_t l = 0; l < nl->experts_.size(); ++l) {
      const int32_t e = nl2g[l];
      if (old_slot[static_cast<size_t>(e)] < 0) continue;
      const int32_t o = old_slot[static_cast<size_t>(e)];
      if (dev_) {  // CUDA: every kept expert is copied now (the old layer's memory is freed with it)
        nl->dev_->copy_expert_from(*dev_, o, static_cast<int32_t>(l));
        Expert& x = nl->experts_[l];
        x.has_gate = x.has_up = x.has_down = true;
      } else if (!first[static_cast<size_t>(e)]) {
        copy_expert(nl->experts_[l], experts_[static_cast<size_t>(o)]);
      }
      first[static_cast<size_t>(e)] = 0;
    }
    if (dev_) {  // router, bias and shared gate live on the device too
      if (has_router_) nl->dev_->copy_router_from(*dev_);
      if (has_bias_)
        nl->dev_->upload(cuda::Part::Bias, 0, 0, Source{bias_.data(), EP_MOE_DTYPE_F32, E}, 1, E, false);
      if (has_shared_gate_)
        nl->dev_->upload(cuda::Part::SharedGate, 0, 0,
                         Source{shared_gate_.data(), EP_MOE_DTYPE_F32, cfg_.hidden_size}, 1, cfg_.hidden_size,
                         false);
    }
  });

  // The vote.
  if (comm) {
    std::vector<int32_t> votes(static_cast<size_t>(n));
    const int32_t v = status;
    xc->all_gather(votes.data(), &v, 1, EP_MOE_DTYPE_I32, nullptr);
    for (int i = 0; i < n; ++i) {
      const auto s = static_cast<ep_moe_status_t>(votes[static_cast<size_t>(i)]);
      if (s == EP_MOE_OK) continue;
      if (i == me) fail(s, "%s", message.c_str());
      fail(peer_status(s), "the re-placement was abandoned: rank %d failed (%s)", i, ep_moe_status_string(s));
    }
  } else if (status != EP_MOE_OK) {
    fail(status, "%s", message.c_str());
  }

  // 5. Commit: nothing below throws.
  {
    const auto& nl2g = nl->map_.local_to_global();
    std::vector<char> first(static_cast<size_t>(E), 1);
    for (size_t l = 0; l < nl->experts_.size(); ++l) {
      const int32_t e = nl2g[l];
      const int32_t o = old_slot[static_cast<size_t>(e)];
      if (o < 0 || !first[static_cast<size_t>(e)] || dev_) continue;  // CUDA: copied before the vote
      first[static_cast<size_t>(e)] = 0;
      nl->experts_[l] = std::move(experts_[static_cast<size_t>(o)]);
    }
  }
  nl->router_ = std::move(router_);
  nl->router_bias_ = std::move(router_bias_);
  nl->expert_bias_ = with_bias;
  nl->has_router_ = has_router_;
  nl->bias_ = std::move(bias_);
  nl->has_bias_ = has_bias_;
  if (has_bias_) nl->routing_.bias = nl->bias_.data();
  nl->shared_gate_ = std::move(shared_gate_);
  nl->has_shared_gate_ = has_shared_gate_;
  nl->bytes_loaded_ += bytes_loaded_;  // load_parts counted `read`
  nl->replace_sent_ = sent;
  nl->replace_received_ = received;
  nl->replace_read_ = read;
  nl->replace_kept_ = kept;
  log(EP_MOE_LOG_INFO,
      "[EP rank %d/%d] re-placed: %d experts kept, %lld bytes received and %lld sent over %zu rounds, %lld read from "
      "the checkpoint; now %s",
      nmap->ep_rank(), new_ep, kept, static_cast<long long>(received), static_cast<long long>(sent), round_end.size(),
      static_cast<long long>(read), nmap->describe().c_str());
  return nl;
}

}  // namespace ep_moe

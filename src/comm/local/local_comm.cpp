// The `local` backend: N ranks in one process, one thread each.
//
// Every collective is a rendezvous in two phases on the group's shared state:
//   arrive  - each rank posts its arguments (buffer pointers, counts) and
//             waits until all ranks have posted;
//   work    - each rank checks the posted arguments for consistency (every
//             rank reaches the same verdict) and moves its share of the data
//             directly between the peers' buffers;
//   depart  - each rank waits until all ranks are done, so no buffer is
//             released while a peer may still read or write it.
// A waiting rank first spins (common/spin.hpp) on the phase counter
// (when the group has no more ranks than the machine has hardware threads),
// then sleeps on the group's condition variable: a futex wake-up costs tens
// of microseconds on a virtual machine, and a forward runs several
// collectives back to back. Each wait honours the caller's timeout and the
// group's abort flag. A timeout or abort breaks the group for good; a rank
// that posts a failure (fail_collective) makes the others return
// EP_MOE_ERR_REMOTE but leaves the group usable.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "comm/reduce.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/spin.hpp"

namespace ep_moe {

namespace {

enum class Op { None, AllReduce, ReduceScatter, AllGather, AllGatherV, AllToAllV, Barrier, Split, Failure };

const char* op_name(Op op) {
  switch (op) {
    case Op::None: return "none";
    case Op::AllReduce: return "all_reduce";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllGather: return "all_gather";
    case Op::AllGatherV: return "all_gather_v";
    case Op::AllToAllV: return "all_to_all_v";
    case Op::Barrier: return "barrier";
    case Op::Split: return "split";
    case Op::Failure: return "a failed call";
  }
  return "?";
}

struct Slot {
  Op op = Op::None;
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;
  ep_moe_dtype_t dtype = EP_MOE_DTYPE_F32;
  const size_t* counts = nullptr;
  const size_t* out_counts = nullptr;
  int color = 0, key = 0;
  ep_moe_status_t fail_status = EP_MOE_OK;
  std::string fail_message;
};

Slot data_slot(Op op, const void* in, void* out, size_t count, ep_moe_dtype_t dtype, const size_t* counts = nullptr,
               const size_t* out_counts = nullptr) {
  Slot s;
  s.op = op;
  s.in = in;
  s.out = out;
  s.count = count;
  s.dtype = dtype;
  s.counts = counts;
  s.out_counts = out_counts;
  return s;
}

struct Group;

// Shared by a world group and every group split from it: one abort breaks all.
struct Family {
  std::mutex mutex;
  std::vector<std::weak_ptr<Group>> groups;
  std::atomic<bool> aborted{false};
  void abort();
};

struct Group {
  Group(int n, std::shared_ptr<Family> fam)
      : size(n),
        spin(n <= static_cast<int>(std::thread::hardware_concurrency())),
        slots(static_cast<size_t>(n)),
        seq(static_cast<size_t>(n), 0),
        family(std::move(fam)) {}

  const int size;
  const bool spin;  // no more ranks than hardware threads: waiting ranks spin first
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<Slot> slots;
  std::vector<uint64_t> seq;  // collectives each rank has entered
  int arrived = 0, departed = 0;
  // Written under `mutex`; read without it while a rank spins.
  std::atomic<uint64_t> arrive_gen{0}, depart_gen{0};
  std::atomic<bool> broken{false};
  ep_moe_status_t broken_status = EP_MOE_OK;
  std::string broken_message;
  int broken_peer = -1;  // first rank that did not arrive, when known
  std::shared_ptr<Family> family;

  // Split bookkeeping: groups being formed, by (split number, color).
  std::map<std::pair<uint64_t, int>, std::pair<std::shared_ptr<Group>, int>> forming;
  uint64_t splits = 0;

  void break_locked(ep_moe_status_t st, std::string msg) {
    if (!broken) {
      broken = true;
      broken_status = st;
      broken_message = std::move(msg);
    }
    cv.notify_all();
  }
};

void Family::abort() {
  aborted.store(true);
  std::vector<std::shared_ptr<Group>> live;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (auto& g : live) {
    std::lock_guard<std::mutex> lock(g->mutex);
    g->break_locked(EP_MOE_ERR_ABORTED, "the communicator was aborted (ep_moe_comm_abort)");
  }
}

std::shared_ptr<Group> make_group(int n, const std::shared_ptr<Family>& fam) {
  auto g = std::make_shared<Group>(n, fam);
  std::lock_guard<std::mutex> lock(fam->mutex);
  fam->groups.erase(
      std::remove_if(fam->groups.begin(), fam->groups.end(), [](const std::weak_ptr<Group>& w) { return w.expired(); }),
      fam->groups.end());
  fam->groups.push_back(g);
  if (fam->aborted.load()) g->break_locked(EP_MOE_ERR_ABORTED, "the communicator was aborted (ep_moe_comm_abort)");
  return g;
}

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<Group> g, int rank, int timeout_ms)
      : group_(std::move(g)), rank_(rank), srcs_(static_cast<size_t>(group_->size)) {
    timeout_ms_ = timeout_ms;
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  int ranks_in_process() const override { return group_->size; }
  const char* backend() const override { return "local"; }

  void all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void*) override {
    run(data_slot(Op::AllReduce, in, out, count, dtype), [&](std::vector<Slot>& sl) {
      check_same_count(sl);
      // Rank r reduces its share of the elements and writes it to everyone.
      const size_t n = group_->size;
      const size_t lo = count * static_cast<size_t>(rank_) / n, hi = count * (static_cast<size_t>(rank_) + 1) / n;
      if (hi == lo) return;
      for (size_t p = 0; p < n; ++p) srcs_[p] = sl[p].in;
      const size_t es = dtype_size(dtype);
      char* first = static_cast<char*>(sl[0].out) + lo * es;
      sum_into(first, srcs_.data(), static_cast<int>(n), lo, hi - lo, dtype);
      for (size_t p = 1; p < n; ++p) std::memcpy(static_cast<char*>(sl[p].out) + lo * es, first, (hi - lo) * es);
    });
  }

  void reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void*) override {
    run(data_slot(Op::ReduceScatter, in, out, count, dtype), [&](std::vector<Slot>& sl) {
      check_same_count(sl);
      for (size_t p = 0; p < sl.size(); ++p) srcs_[p] = sl[p].in;
      sum_into(out, srcs_.data(), static_cast<int>(sl.size()), count * static_cast<size_t>(rank_), count, dtype);
    });
  }

  void all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void*) override {
    run(data_slot(Op::AllGather, in, out, count, dtype), [&](std::vector<Slot>& sl) {
      check_same_count(sl);
      const size_t bytes = count * dtype_size(dtype);
      for (size_t p = 0; p < sl.size(); ++p)
        if (bytes) std::memmove(static_cast<char*>(out) + p * bytes, sl[p].in, bytes);
    });
  }

  void all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dtype, void*) override {
    run(data_slot(Op::AllGatherV, in, out, 0, dtype, counts), [&](std::vector<Slot>& sl) {
      const size_t n = sl.size();
      for (size_t p = 0; p < n; ++p)
        for (size_t q = 0; q < n; ++q)
          if (sl[p].counts[q] != sl[0].counts[q])
            fail(EP_MOE_ERR_INVALID_ARGUMENT,
                 "all_gather_v: ranks disagree on counts: rank 0 says rank %zu sends %zu, rank %zu says %zu", q,
                 sl[0].counts[q], p, sl[p].counts[q]);
      const size_t es = dtype_size(dtype);
      size_t off = 0;
      for (size_t p = 0; p < n; ++p) {
        const size_t bytes = counts[p] * es;
        if (bytes) std::memmove(static_cast<char*>(out) + off, sl[p].in, bytes);
        off += bytes;
      }
    });
  }

  void all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts, ep_moe_dtype_t dtype,
                    void*) override {
    run(data_slot(Op::AllToAllV, in, out, 0, dtype, in_counts, out_counts), [&](std::vector<Slot>& sl) {
      const size_t n = sl.size();
      for (size_t p = 0; p < n; ++p)
        for (size_t q = 0; q < n; ++q)
          if (sl[p].counts[q] != sl[q].out_counts[p])
            fail(EP_MOE_ERR_INVALID_ARGUMENT,
                 "all_to_all_v: rank %zu sends %zu elements to rank %zu, which expects %zu", p, sl[p].counts[q], q,
                 sl[q].out_counts[p]);
      const size_t es = dtype_size(dtype);
      const size_t r = static_cast<size_t>(rank_);
      size_t dst_off = 0;
      for (size_t p = 0; p < n; ++p) {
        size_t src_off = 0;
        for (size_t q = 0; q < r; ++q) src_off += sl[p].counts[q];
        const size_t bytes = out_counts[p] * es;
        if (bytes)
          std::memcpy(static_cast<char*>(out) + dst_off, static_cast<const char*>(sl[p].in) + src_off * es, bytes);
        dst_off += bytes;
      }
    });
  }

  void barrier(void*) override {
    Slot s;
    s.op = Op::Barrier;
    run(std::move(s), [](std::vector<Slot>&) {});
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    Slot s;
    s.op = Op::Split;
    s.color = color;
    s.key = key;
    std::shared_ptr<Group> mine;
    int my_rank = -1;
    run(std::move(s), [&](std::vector<Slot>& sl) {
      if (color < 0) return;
      std::vector<std::pair<int, int>> members;  // (key, rank)
      for (int p = 0; p < static_cast<int>(sl.size()); ++p)
        if (sl[static_cast<size_t>(p)].color == color) members.emplace_back(sl[static_cast<size_t>(p)].key, p);
      std::sort(members.begin(), members.end());
      for (size_t i = 0; i < members.size(); ++i)
        if (members[i].second == rank_) my_rank = static_cast<int>(i);
      // The first member to get here creates the group; the last to take it
      // removes the entry.
      std::lock_guard<std::mutex> lock(group_->mutex);
      auto k = std::make_pair(group_->splits, color);
      auto it = group_->forming.find(k);
      if (it == group_->forming.end())
        it = group_->forming.emplace(k, std::make_pair(make_group(static_cast<int>(members.size()), group_->family), 0))
                 .first;
      mine = it->second.first;
      if (++it->second.second == static_cast<int>(members.size())) group_->forming.erase(it);
    });
    {
      std::lock_guard<std::mutex> lock(group_->mutex);
      // Every rank increments; the split number only needs to differ between
      // consecutive splits, and all ranks have left the work phase.
      if (rank_ == 0) ++group_->splits;
    }
    if (!mine) return nullptr;
    return std::unique_ptr<Comm>(new LocalComm(std::move(mine), my_rank, timeout_ms_));
  }

  void fail_collective(ep_moe_status_t status, const std::string& message) noexcept override {
    try {
      Slot s;
      s.op = Op::Failure;
      s.fail_status = status;
      s.fail_message = message;
      run(std::move(s), [](std::vector<Slot>&) {});
    } catch (...) {
      // The group may be broken already; the caller reports its own error.
    }
  }

  void abort() noexcept override { group_->family->abort(); }

  ep_moe_status_t async_error(int* peer, std::string* message) const override {
    std::lock_guard<std::mutex> lock(group_->mutex);
    *peer = group_->broken_peer;
    if (message) *message = group_->broken_message;
    return group_->broken ? group_->broken_status : EP_MOE_OK;
  }

 private:
  using Clock = std::chrono::steady_clock;

  void check_same_count(const std::vector<Slot>& sl) const {
    for (size_t p = 1; p < sl.size(); ++p)
      if (sl[p].count != sl[0].count)
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s: ranks disagree on count: rank 0 has %zu, rank %zu has %zu",
             op_name(sl[0].op), sl[0].count, p, sl[p].count);
  }

  // Waits in one phase. `count`/`gen` are the phase's counters.
  void phase(std::unique_lock<std::mutex>& lock, int& count, std::atomic<uint64_t>& gen, Clock::time_point deadline,
             const char* what, Op op) {
    Group& g = *group_;
    throw_if_broken_locked();
    const uint64_t my_gen = gen.load(std::memory_order_relaxed);
    if (++count == g.size) {
      count = 0;
      gen.fetch_add(1, std::memory_order_release);
      g.cv.notify_all();
      return;
    }
    if (g.spin) {  // the lock is taken again below, which orders the peers' writes before ours
      lock.unlock();
      spin_until(
          [&] { return gen.load(std::memory_order_acquire) != my_gen || g.broken.load(std::memory_order_acquire); });
      lock.lock();
    }
    while (gen == my_gen) {
      if (g.broken) {
        // Our own arrival stays counted, but the group is dead anyway.
        throw_if_broken_locked();
      }
      if (g.cv.wait_until(lock, deadline) == std::cv_status::timeout && gen == my_gen && !g.broken) {
        std::string missing;
        for (int p = 0; p < g.size; ++p)
          if (g.seq[static_cast<size_t>(p)] < g.seq[static_cast<size_t>(rank_)]) {
            if (!missing.empty()) missing += ", ";
            missing += std::to_string(p);
          }
        for (int p = 0; p < g.size && g.broken_peer < 0; ++p)
          if (g.seq[static_cast<size_t>(p)] < g.seq[static_cast<size_t>(rank_)]) g.broken_peer = p;
        if (missing.empty()) missing = "(all entered; a peer is stuck in its work phase)";
        std::string msg =
            format("rank %d timed out after %d ms in %s of %s #%llu waiting for rank(s) %s", rank_, timeout_ms_, what,
                   op_name(op), static_cast<unsigned long long>(g.seq[static_cast<size_t>(rank_)]), missing.c_str());
        g.break_locked(EP_MOE_ERR_REMOTE, "the group is broken: " + msg);
        throw Error(EP_MOE_ERR_TIMEOUT, msg);
      }
    }
  }

  void throw_if_broken_locked() const {
    const Group& g = *group_;
    if (g.broken) throw Error(g.broken_status, g.broken_message);
  }

  template <class Work>
  void run(Slot slot, Work&& work) {
    Group& g = *group_;
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
    const Op op = slot.op;
    std::unique_lock<std::mutex> lock(g.mutex);
    throw_if_broken_locked();
    ++g.seq[static_cast<size_t>(rank_)];
    g.slots[static_cast<size_t>(rank_)] = std::move(slot);
    phase(lock, g.arrived, g.arrive_gen, deadline, "arrive", op);
    lock.unlock();

    // Work phase: same verdict on every rank, then our share of the data.
    bool have_error = false;
    Error error(EP_MOE_OK, "");
    std::vector<Slot>& sl = g.slots;
    int failed = -1;
    for (int p = 0; p < g.size; ++p)
      if (sl[static_cast<size_t>(p)].op == Op::Failure) {
        failed = p;
        break;
      }
    if (failed >= 0) {
      if (op != Op::Failure) {
        have_error = true;
        error = Error(EP_MOE_ERR_REMOTE, format("rank %d failed in its matching call: %s", failed,
                                                sl[static_cast<size_t>(failed)].fail_message.c_str()));
      }
    } else {
      for (int p = 1; p < g.size; ++p)
        if (sl[static_cast<size_t>(p)].op != sl[0].op || sl[static_cast<size_t>(p)].dtype != sl[0].dtype) {
          have_error = true;
          error = Error(EP_MOE_ERR_INVALID_ARGUMENT,
                        format("collective mismatch: rank 0 called %s (%s), rank %d called %s (%s)", op_name(sl[0].op),
                               dtype_name(sl[0].dtype), p, op_name(sl[static_cast<size_t>(p)].op),
                               dtype_name(sl[static_cast<size_t>(p)].dtype)));
          break;
        }
      if (!have_error) {
        try {
          work(sl);
        } catch (const Error& e) {
          have_error = true;
          error = e;
        }
      }
    }

    lock.lock();
    phase(lock, g.departed, g.depart_gen, deadline, "depart", op);
    lock.unlock();
    if (have_error) throw error;
  }

  std::shared_ptr<Group> group_;
  int rank_;
  // The reductions' source rows, one per rank: kept so that a collective
  // allocates nothing (a handle runs one collective at a time).
  std::vector<const void*> srcs_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> create_local_group(int size, int timeout_ms) {
  auto family = std::make_shared<Family>();
  auto group = make_group(size, family);
  std::vector<std::unique_ptr<Comm>> out;
  out.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<LocalComm>(group, r, timeout_ms));
  return out;
}

}  // namespace ep_moe

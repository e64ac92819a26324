#include "comm/message_comm.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/reduce.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/hash.hpp"

namespace ep_moe {

namespace {

enum Op : int32_t { kAllReduce = 1, kReduceScatter, kAllGather, kAllGatherV, kAllToAllV, kBarrier, kSplit, kFailure };

const char* op_name(int32_t op) {
  switch (op) {
    case kAllReduce: return "all_reduce";
    case kReduceScatter: return "reduce_scatter";
    case kAllGather: return "all_gather";
    case kAllGatherV: return "all_gather_v";
    case kAllToAllV: return "all_to_all_v";
    case kBarrier: return "barrier";
    case kSplit: return "split";
    case kFailure: return "a failed call";
  }
  return "?";
}

constexpr uint32_t kMagic = 0x45504D31u;  // "EPM1"

}  // namespace

struct MessageComm::Header {
  uint32_t magic;
  int32_t op;
  int32_t dtype;
  int32_t fail_status;
  uint64_t count, aux1, aux2;
  char message[216];
};

namespace {
// v with at least n elements (grown, never shrunk or refilled).
template <class T>
T* at_least(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
}  // namespace

MessageComm::MessageComm(std::unique_ptr<Transport> t, int timeout_ms) : t_(std::move(t)) {
  timeout_ms_ = timeout_ms;
  const auto n = static_cast<size_t>(t_->size());
  headers_.resize(n);
  sizes_a_.resize(n);
  sizes_b_.resize(n);
  srcs_.resize(n);
}

MessageComm::~MessageComm() = default;

Transport::Clock::time_point MessageComm::deadline() const {
  return Transport::Clock::now() + std::chrono::milliseconds(timeout_ms_);
}

void MessageComm::throw_if_broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_) throw Error(EP_MOE_ERR_REMOTE, "the communicator is broken: " + broken_message_);
}

template <class F>
void MessageComm::guarded(F&& f) {
  throw_if_broken();
  try {
    f();
  } catch (const Error& e) {
    // A transport failure leaves the ranks out of step: nothing more can run.
    std::lock_guard<std::mutex> lock(mutex_);
    broken_ = true;
    broken_status_ = e.status();
    broken_message_ = e.what();
    throw;
  }
}

void MessageComm::agree(int op, ep_moe_dtype_t dtype, uint64_t count, uint64_t aux1, uint64_t aux2) {
  static_assert(sizeof(Header) == 256, "the header is 256 bytes on every rank");
  Header mine;
  std::memset(&mine, 0, sizeof mine);
  mine.magic = kMagic;
  mine.op = op;
  mine.dtype = static_cast<int32_t>(dtype);
  mine.count = count;
  mine.aux1 = aux1;
  mine.aux2 = aux2;
  std::vector<Header>& all = headers_;
  guarded([&] { t_->all_gather(all.data(), &mine, sizeof mine, deadline()); });
  // The same verdict on every rank, from the same headers.
  for (int p = 0; p < size(); ++p) {
    const Header& h = all[static_cast<size_t>(p)];
    if (h.magic != kMagic) {
      std::lock_guard<std::mutex> lock(mutex_);
      broken_ = true;
      broken_status_ = EP_MOE_ERR_REMOTE;
      broken_message_ = format("rank %d sent a header that is not ep_moe's (another library on this communicator?)", p);
      throw Error(EP_MOE_ERR_REMOTE, broken_message_);
    }
  }
  for (int p = 0; p < size(); ++p) {
    const Header& h = all[static_cast<size_t>(p)];
    if (h.op == kFailure) {
      if (op == kFailure) return;  // our own failure: the caller reports it
      char msg[sizeof h.message + 1];
      std::memcpy(msg, h.message, sizeof h.message);
      msg[sizeof h.message] = '\0';
      fail(EP_MOE_ERR_REMOTE, "rank %d failed in its matching call: %s", p, msg);
    }
  }
  const Header& h0 = all[0];
  for (int p = 1; p < size(); ++p) {
    const Header& h = all[static_cast<size_t>(p)];
    if (h.op != h0.op || h.dtype != h0.dtype)
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "collective mismatch: rank 0 called %s (%s), rank %d called %s (%s)",
           op_name(h0.op), dtype_name(static_cast<ep_moe_dtype_t>(h0.dtype)), p, op_name(h.op),
           dtype_name(static_cast<ep_moe_dtype_t>(h.dtype)));
    if ((op == kAllReduce || op == kReduceScatter || op == kAllGather) && h.count != h0.count)
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s: ranks disagree on count: rank 0 has %llu, rank %d has %llu", op_name(op),
           static_cast<unsigned long long>(h0.count), p, static_cast<unsigned long long>(h.count));
    if (op == kAllGatherV && h.aux1 != h0.aux1)
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "all_gather_v: ranks disagree on counts (rank 0 and rank %d)", p);
  }
  if (op == kAllToAllV) {
    uint64_t sent = 0, recv = 0;
    for (const Header& h : all) {
      sent += h.aux1;
      recv += h.aux2;
    }
    if (sent != recv)
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "all_to_all_v: the ranks send %llu elements in all but expect %llu",
           static_cast<unsigned long long>(sent), static_cast<unsigned long long>(recv));
  }
}

void MessageComm::all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) {
  agree(kAllReduce, dtype, count, 0, 0);
  bool native = false;
  guarded([&] { native = t_->all_reduce(out, in, count, dtype, stream, deadline()); });
  if (native) return;
  // Rank p reduces elements [count*p/n, count*(p+1)/n): an all-to-all brings
  // it every rank's slice, it sums them in rank order, an all-gather shares
  // the result.
  const size_t n = static_cast<size_t>(size()), me = static_cast<size_t>(rank()), es = dtype_size(dtype);
  size_t* send = sizes_a_.data();
  size_t* recv = sizes_b_.data();
  for (size_t p = 0; p < n; ++p) send[p] = (count * (p + 1) / n - count * p / n) * es;
  const size_t mine = send[me] / es;
  for (size_t p = 0; p < n; ++p) recv[p] = mine * es;
  uint8_t* slices = at_least(slices_, n * mine * es + 1);
  uint8_t* reduced = at_least(reduced_, mine * es + 1);
  guarded([&] { t_->all_to_all_v(slices, recv, in, send, deadline()); });
  for (size_t p = 0; p < n; ++p) srcs_[p] = slices + p * mine * es;
  sum_into(reduced, srcs_.data(), static_cast<int>(n), 0, mine, dtype);
  guarded([&] { t_->all_gather_v(out, reduced, send, deadline()); });
}

void MessageComm::reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) {
  agree(kReduceScatter, dtype, count, 0, 0);
  bool native = false;
  guarded([&] { native = t_->reduce_scatter(out, in, count, dtype, stream, deadline()); });
  if (native) return;
  const size_t n = static_cast<size_t>(size()), es = dtype_size(dtype);
  size_t* bytes = sizes_a_.data();
  for (size_t p = 0; p < n; ++p) bytes[p] = count * es;
  uint8_t* slices = at_least(slices_, n * count * es + 1);
  guarded([&] { t_->all_to_all_v(slices, bytes, in, bytes, deadline()); });
  for (size_t p = 0; p < n; ++p) srcs_[p] = slices + p * count * es;
  sum_into(out, srcs_.data(), static_cast<int>(n), 0, count, dtype);
}

void MessageComm::all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void*) {
  agree(kAllGather, dtype, count, 0, 0);
  guarded([&] { t_->all_gather(out, in, count * dtype_size(dtype), deadline()); });
}

void MessageComm::all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dtype, void*) {
  const size_t n = static_cast<size_t>(size());
  agree(kAllGatherV, dtype, counts[rank()], fnv1a(kFnvBasis, counts, n * sizeof(size_t)), 0);
  size_t* bytes = sizes_a_.data();
  for (size_t p = 0; p < n; ++p) bytes[p] = counts[p] * dtype_size(dtype);
  guarded([&] { t_->all_gather_v(out, in, bytes, deadline()); });
}

void MessageComm::all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts,
                               ep_moe_dtype_t dtype, void*) {
  const size_t n = static_cast<size_t>(size()), es = dtype_size(dtype);
  uint64_t sent = 0, recv = 0;
  size_t* ib = sizes_a_.data();
  size_t* ob = sizes_b_.data();
  for (size_t p = 0; p < n; ++p) {
    sent += in_counts[p];
    recv += out_counts[p];
    ib[p] = in_counts[p] * es;
    ob[p] = out_counts[p] * es;
  }
  agree(kAllToAllV, dtype, 0, sent, recv);
  guarded([&] { t_->all_to_all_v(out, ob, in, ib, deadline()); });
}

void MessageComm::barrier(void*) {
  agree(kBarrier, EP_MOE_DTYPE_F32, 0, 0, 0);  // the header exchange is itself a barrier
  guarded([&] { t_->barrier(deadline()); });
}

std::unique_ptr<Comm> MessageComm::split(int color, int key) {
  agree(kSplit, EP_MOE_DTYPE_F32, 0, 0, 0);
  std::unique_ptr<Transport> sub;
  guarded([&] { sub = t_->split(color, key, deadline()); });
  if (!sub) return nullptr;
  return std::unique_ptr<Comm>(new MessageComm(std::move(sub), timeout_ms_));
}

void MessageComm::fail_collective(ep_moe_status_t status, const std::string& message) noexcept {
  try {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_) return;
    }
    Header mine;
    std::memset(&mine, 0, sizeof mine);
    mine.magic = kMagic;
    mine.op = kFailure;
    mine.fail_status = static_cast<int32_t>(status);
    std::strncpy(mine.message, message.c_str(), sizeof mine.message - 1);
    std::vector<Header> all(static_cast<size_t>(size()));
    guarded([&] { t_->all_gather(all.data(), &mine, sizeof mine, deadline()); });
  } catch (...) {
  }
}

void MessageComm::abort() noexcept { t_->abort(); }

ep_moe_status_t MessageComm::async_error(int* peer, std::string* message) const {
  std::lock_guard<std::mutex> lock(mutex_);
  *peer = broken_peer_;
  if (message) *message = broken_message_;
  return broken_ ? broken_status_ : EP_MOE_OK;
}

}  // namespace ep_moe

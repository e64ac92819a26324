#include "comm/nccl/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

#include "comm/poll.hpp"
#include "common/error.hpp"

namespace ep_moe {

namespace {

using Clock = std::chrono::steady_clock;

void need_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    fail(EP_MOE_ERR_UNSUPPORTED, "no CUDA device: the NCCL backend needs a GPU");
  }
}

ncclDataType_t nccl_type(ep_moe_dtype_t t) {
  switch (t) {
    case EP_MOE_DTYPE_F32: return ncclFloat32;
    case EP_MOE_DTYPE_BF16: return ncclBfloat16;
    case EP_MOE_DTYPE_F16: return ncclFloat16;
    case EP_MOE_DTYPE_I32: return ncclInt32;
    case EP_MOE_DTYPE_I64: return ncclInt64;
    case EP_MOE_DTYPE_U8: return ncclUint8;
    default: break;
  }
  fail(EP_MOE_ERR_INVALID_ARGUMENT, "dtype %d has no NCCL type", static_cast<int>(t));
}

size_t type_size(ep_moe_dtype_t t) {
  return t == EP_MOE_DTYPE_I64                              ? 8
         : (t == EP_MOE_DTYPE_F32 || t == EP_MOE_DTYPE_I32) ? 4
         : t == EP_MOE_DTYPE_U8                             ? 1
                                                            : 2;
}

// Waits for a non-blocking communicator to leave ncclInProgress.
void settle(ncclComm_t c, Clock::time_point deadline, const std::atomic<bool>& aborted, const char* what) {
  ncclResult_t st = ncclInProgress;
  const PollResult r = poll_until(
      [&] {
        if (ncclCommGetAsyncError(c, &st) != ncclSuccess) return true;
        return st != ncclInProgress;
      },
      deadline, aborted);
  if (r != PollResult::Done) {
    ncclCommAbort(c);
    fail(r == PollResult::Aborted ? EP_MOE_ERR_ABORTED : EP_MOE_ERR_TIMEOUT, "NCCL %s did not complete", what);
  }
  if (st != ncclSuccess) fail(EP_MOE_ERR_REMOTE, "NCCL %s failed: %s", what, ncclGetErrorString(st));
}

class NcclComm final : public Comm {
 public:
  NcclComm(ncclComm_t c, bool owned, int timeout_ms) : comm_(c), owned_(owned) {
    timeout_ms_ = timeout_ms;
    ncclCommUserRank(comm_, &rank_);
    ncclCommCount(comm_, &size_);
  }
  ~NcclComm() override {
    if (owned_) {
      // abort() may have aborted it already: NCCL must not see it twice.
      if (abort_called_.load()) return;
      if (broken_) ncclCommAbort(comm_);
      else ncclCommDestroy(comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int ranks_in_process() const override { return 1; }
  const char* backend() const override { return "nccl"; }
  bool device_memory() const override { return true; }

  void all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) override {
    enqueue("ncclAllReduce", stream, [&] {
      return ncclAllReduce(in, out, count, nccl_type(dtype), ncclSum, comm_, static_cast<cudaStream_t>(stream));
    });
  }
  void reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) override {
    enqueue("ncclReduceScatter", stream, [&] {
      return ncclReduceScatter(in, out, count, nccl_type(dtype), ncclSum, comm_, static_cast<cudaStream_t>(stream));
    });
  }
  void all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) override {
    enqueue("ncclAllGather", stream,
            [&] { return ncclAllGather(in, out, count, nccl_type(dtype), comm_, static_cast<cudaStream_t>(stream)); });
  }
  void all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dtype, void* stream) override {
    // One broadcast per rank inside a group: rank p's block lands at its offset.
    enqueue("all_gather_v", stream, [&] {
      ncclResult_t r = ncclGroupStart();
      size_t off = 0;
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        char* dst = static_cast<char*>(out) + off * type_size(dtype);
        r = ncclBroadcast(p == rank_ ? in : dst, dst, counts[p], nccl_type(dtype), p, comm_,
                          static_cast<cudaStream_t>(stream));
        off += counts[p];
      }
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    });
  }
  void all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts, ep_moe_dtype_t dtype,
                    void* stream) override {
    enqueue("all_to_all_v", stream, [&] {
      const size_t es = type_size(dtype);
      ncclResult_t r = ncclGroupStart();
      size_t so = 0, ro = 0;
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        if (in_counts[p])
          r = ncclSend(static_cast<const char*>(in) + so * es, in_counts[p], nccl_type(dtype), p, comm_,
                       static_cast<cudaStream_t>(stream));
        if (r == ncclSuccess && out_counts[p])
          r = ncclRecv(static_cast<char*>(out) + ro * es, out_counts[p], nccl_type(dtype), p, comm_,
                       static_cast<cudaStream_t>(stream));
        so += in_counts[p];
        ro += out_counts[p];
      }
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    });
  }
  void barrier(void* stream) override {
    if (!scratch_ && cudaMalloc(&scratch_, sizeof(int)) != cudaSuccess)
      fail(EP_MOE_ERR_OUT_OF_MEMORY, "cudaMalloc for the NCCL barrier failed");
    all_reduce(scratch_, scratch_, 1, EP_MOE_DTYPE_I32, stream);
    wait(stream, "barrier");
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    throw_if_broken();
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t sub = nullptr;
    const ncclResult_t r = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
      fail(EP_MOE_ERR_REMOTE, "ncclCommSplit failed: %s", ncclGetErrorString(r));
    settle(comm_, deadline(), aborted_, "split");
    if (!sub) return nullptr;
    settle(sub, deadline(), aborted_, "split (new communicator)");
    return std::unique_ptr<Comm>(new NcclComm(sub, true, timeout_ms_));
  }

  // NCCL cannot tell its peers "I failed". A communicator ep_moe created is
  // aborted, so the peers' operations fail instead of waiting forever; the
  // caller's own communicator is left alone (the peers then wait until their
  // timeout, or until the caller aborts it).
  void fail_collective(ep_moe_status_t, const std::string& message) noexcept override {
    if (!owned_) return;
    try {
      mark_broken(EP_MOE_ERR_REMOTE, "aborted after a local failure: " + message);
    } catch (...) {
    }
    abort();
  }

  void abort() noexcept override {
    aborted_.store(true, std::memory_order_release);
    bool expected = false;
    if (abort_called_.compare_exchange_strong(expected, true)) ncclCommAbort(comm_);
  }

  ep_moe_status_t async_error(int* peer, std::string* message) const override {
    *peer = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_) {
        if (message) *message = broken_message_;
        return broken_status_;
      }
    }
    ncclResult_t st = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress) {
      if (message) *message = ncclGetErrorString(st);
      return EP_MOE_ERR_REMOTE;
    }
    return EP_MOE_OK;
  }

 private:
  Clock::time_point deadline() const { return Clock::now() + std::chrono::milliseconds(timeout_ms_); }

  void throw_if_broken() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) throw Error(EP_MOE_ERR_REMOTE, "the NCCL communicator is broken: " + broken_message_);
    if (aborted_.load()) throw Error(EP_MOE_ERR_ABORTED, "the communicator was aborted (ep_moe_comm_abort)");
  }
  void mark_broken(ep_moe_status_t s, const std::string& m) {
    std::lock_guard<std::mutex> lock(mutex_);
    broken_ = true;
    broken_status_ = s;
    broken_message_ = m;
  }

  template <class F>
  void enqueue(const char* what, void* stream, F&& f) {
    throw_if_broken();
    const ncclResult_t r = f();
    if (r != ncclSuccess && r != ncclInProgress) {
      mark_broken(EP_MOE_ERR_REMOTE, std::string(what) + ": " + ncclGetErrorString(r));
      fail(EP_MOE_ERR_REMOTE, "%s failed: %s", what, ncclGetErrorString(r));
    }
    wait(stream, what);
  }

  // Completion with a deadline. The communicator is non-blocking, so a call
  // may return ncclInProgress before its work is even on the stream: first
  // wait for NCCL to leave that state (no other NCCL call is allowed before),
  // then for the stream, unless it is being captured into a CUDA graph (then
  // the work runs when the graph is launched).
  void wait(void* stream, const char* what) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    const bool capturing = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &cap) == cudaSuccess &&
                           cap != cudaStreamCaptureStatusNone;
    cudaError_t ce = cudaSuccess;
    ncclResult_t ne = ncclSuccess;
    const PollResult res = poll_until(
        [&] {
          const ncclResult_t q = ncclCommGetAsyncError(comm_, &ne);
          if (q != ncclSuccess) {
            ne = q;
            return true;
          }
          if (ne == ncclInProgress) return false;
          if (ne != ncclSuccess || capturing) return true;
          ce = cudaStreamQuery(static_cast<cudaStream_t>(stream));
          return ce != cudaErrorNotReady;
        },
        deadline(), aborted_);
    if (res == PollResult::Done) {
      if (ne != ncclSuccess) {
        mark_broken(EP_MOE_ERR_REMOTE, std::string(what) + ": " + ncclGetErrorString(ne));
        fail(EP_MOE_ERR_REMOTE, "%s failed: %s", what, ncclGetErrorString(ne));
      }
      if (ce != cudaSuccess) {
        mark_broken(EP_MOE_ERR_REMOTE, std::string(what) + ": " + cudaGetErrorString(ce));
        fail(EP_MOE_ERR_REMOTE, "%s: CUDA error %s", what, cudaGetErrorString(ce));
      }
      return;
    }
    abort();
    mark_broken(res == PollResult::Aborted ? EP_MOE_ERR_ABORTED : EP_MOE_ERR_TIMEOUT, what);
    fail(res == PollResult::Aborted ? EP_MOE_ERR_ABORTED : EP_MOE_ERR_TIMEOUT,
         "%s %s after %d ms; the NCCL communicator was aborted", what,
         res == PollResult::Aborted ? "aborted" : "timed out", timeout_ms_);
  }

  ncclComm_t comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  void* scratch_ = nullptr;
  std::atomic<bool> aborted_{false}, abort_called_{false};
  mutable std::mutex mutex_;  // guards broken_* (async_error may run on another thread)
  bool broken_ = false;
  ep_moe_status_t broken_status_ = EP_MOE_OK;
  std::string broken_message_;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(void* nccl_comm, int timeout_ms) {
  EP_MOE_CHECK_ARG(nccl_comm != nullptr, "nccl_comm is NULL");
  need_device();
  return std::unique_ptr<Comm>(new NcclComm(static_cast<ncclComm_t>(nccl_comm), false, timeout_ms));
}

std::unique_ptr<Comm> make_nccl_comm_from_id(const void* id, size_t id_size, int rank, int size, int timeout_ms) {
  EP_MOE_CHECK_ARG(id != nullptr, "unique_id is NULL");
  EP_MOE_CHECK_ARG(id_size == sizeof(ncclUniqueId), "unique_id_size must be %zu, got %zu", sizeof(ncclUniqueId),
                   id_size);
  EP_MOE_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "rank %d / size %d are out of range", rank, size);
  need_device();
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // so a missing peer gives a timeout, not a hang
  ncclComm_t c = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&c, size, uid, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress)
    fail(EP_MOE_ERR_REMOTE, "ncclCommInitRankConfig failed: %s", ncclGetErrorString(r));
  std::atomic<bool> never{false};
  settle(c, Clock::now() + std::chrono::milliseconds(timeout_ms), never, "communicator init");
  return std::unique_ptr<Comm>(new NcclComm(c, true, timeout_ms));
}

void nccl_unique_id(void* out, size_t out_size) {
  EP_MOE_CHECK_ARG(out != nullptr, "out is NULL");
  EP_MOE_CHECK_ARG(out_size >= sizeof(ncclUniqueId), "out_size must be at least %zu, got %zu", sizeof(ncclUniqueId),
                   out_size);
  ncclUniqueId uid;
  const ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) fail(EP_MOE_ERR_REMOTE, "ncclGetUniqueId failed: %s", ncclGetErrorString(r));
  std::memcpy(out, &uid, sizeof uid);
}

}  // namespace ep_moe

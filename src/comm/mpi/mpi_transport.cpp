#include "comm/mpi/mpi_transport.hpp"

// The C bindings only (Open MPI and MPICH otherwise pull in their C++ API).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <vector>

#include "comm/poll.hpp"
#include "common/error.hpp"

namespace ep_moe {

namespace {

std::string mpi_error(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

int to_int(size_t v, const char* what) {
  if (v > static_cast<size_t>(INT_MAX))
    fail(EP_MOE_ERR_UNSUPPORTED, "%s of %zu bytes is above MPI's 2 GiB count limit", what, v);
  return static_cast<int>(v);
}

class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(MPI_Comm dup) : comm_(dup) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    for (auto* v : {&sc_, &sd_, &rc_, &rd_}) v->resize(static_cast<size_t>(size_));
  }
  ~MpiTransport() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A communicator with an abandoned request (timeout/abort) is leaked on
    // purpose: freeing it could block on the request.
    if (!finalized && !abandoned_) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

  void all_gather(void* out, const void* in, size_t bytes, Clock::time_point deadline) override {
    const int n = to_int(bytes, "all_gather");
    MPI_Request r;
    check(MPI_Iallgather(in, n, MPI_BYTE, out, n, MPI_BYTE, comm_, &r), "MPI_Iallgather");
    wait(r, deadline, "all_gather");
  }

  void all_gather_v(void* out, const void* in, const size_t* bytes, Clock::time_point deadline) override {
    std::vector<int>& counts = sc_;
    std::vector<int>& displs = sd_;
    size_t off = 0;
    for (int p = 0; p < size_; ++p) {
      counts[static_cast<size_t>(p)] = to_int(bytes[p], "all_gather_v block");
      displs[static_cast<size_t>(p)] = to_int(off, "all_gather_v offset");
      off += bytes[p];
    }
    MPI_Request r;
    check(MPI_Iallgatherv(in, counts[static_cast<size_t>(rank_)], MPI_BYTE, out, counts.data(), displs.data(), MPI_BYTE,
                          comm_, &r),
          "MPI_Iallgatherv");
    wait(r, deadline, "all_gather_v");
  }

  void all_to_all_v(void* out, const size_t* out_bytes, const void* in, const size_t* in_bytes,
                    Clock::time_point deadline) override {
    const size_t n = static_cast<size_t>(size_);
    std::vector<int>& sc = sc_;
    std::vector<int>& sd = sd_;
    std::vector<int>& rc = rc_;
    std::vector<int>& rd = rd_;
    size_t so = 0, ro = 0;
    for (size_t p = 0; p < n; ++p) {
      sc[p] = to_int(in_bytes[p], "all_to_all_v block");
      sd[p] = to_int(so, "all_to_all_v offset");
      rc[p] = to_int(out_bytes[p], "all_to_all_v block");
      rd[p] = to_int(ro, "all_to_all_v offset");
      so += in_bytes[p];
      ro += out_bytes[p];
    }
    MPI_Request r;
    check(MPI_Ialltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(), MPI_BYTE, comm_, &r),
          "MPI_Ialltoallv");
    wait(r, deadline, "all_to_all_v");
  }

  bool barrier(Clock::time_point deadline) override {
    MPI_Request r;
    check(MPI_Ibarrier(comm_, &r), "MPI_Ibarrier");
    wait(r, deadline, "barrier");
    return true;
  }

  std::unique_ptr<Transport> split(int color, int key, Clock::time_point) override {
    // Every rank has just passed the header exchange, so all are here; MPI
    // has no non-blocking split.
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split");
    if (sub == MPI_COMM_NULL) return nullptr;
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::unique_ptr<Transport>(new MpiTransport(sub));
  }

  void abort() noexcept override { aborted_.store(true, std::memory_order_release); }

 private:
  void check(int rc, const char* what) {
    if (aborted_.load(std::memory_order_acquire))
      fail(EP_MOE_ERR_ABORTED, "the communicator was aborted (ep_moe_comm_abort)");
    if (rc != MPI_SUCCESS) fail(EP_MOE_ERR_REMOTE, "%s failed: %s", what, mpi_error(rc).c_str());
  }

  void wait(MPI_Request& r, Clock::time_point deadline, const char* what) {
    int rc = MPI_SUCCESS;
    const PollResult res = poll_until(
        [&] {
          int done = 0;
          rc = MPI_Test(&r, &done, MPI_STATUS_IGNORE);
          return rc != MPI_SUCCESS || done != 0;
        },
        deadline, aborted_);
    if (res == PollResult::Done) {
      if (rc != MPI_SUCCESS) fail(EP_MOE_ERR_REMOTE, "MPI %s failed: %s", what, mpi_error(rc).c_str());
      return;
    }
    // Collective requests cannot be cancelled: leave it, and the communicator.
    abandoned_ = true;
    if (res == PollResult::Aborted) fail(EP_MOE_ERR_ABORTED, "the communicator was aborted during %s", what);
    fail(EP_MOE_ERR_TIMEOUT, "rank %d of %d timed out in MPI %s (a peer stopped responding?)", rank_, size_, what);
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::atomic<bool> aborted_{false};
  bool abandoned_ = false;
  // The v-collectives' counts and displacements: kept, so that a call
  // allocates nothing, and so that they outlive a request abandoned at a
  // timeout (MPI may read them until the request completes).
  std::vector<int> sc_, sd_, rc_, rd_;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(const void* mpi_comm, size_t comm_size) {
  EP_MOE_CHECK_ARG(mpi_comm != nullptr, "mpi_comm is NULL");
  EP_MOE_CHECK_ARG(comm_size == sizeof(MPI_Comm),
                   "mpi_comm_size is %zu but this library's MPI_Comm is %zu bytes: it was built with another MPI",
                   comm_size, sizeof(MPI_Comm));
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    fail(EP_MOE_ERR_STATE, "MPI is not initialised (call MPI_Init first) or already finalised");
  MPI_Comm user;
  std::memcpy(&user, mpi_comm, sizeof user);
  if (user == MPI_COMM_NULL) fail(EP_MOE_ERR_INVALID_ARGUMENT, "mpi_comm is MPI_COMM_NULL");
  MPI_Comm dup = MPI_COMM_NULL;
  const int rc = MPI_Comm_dup(user, &dup);
  if (rc != MPI_SUCCESS) fail(EP_MOE_ERR_REMOTE, "MPI_Comm_dup failed: %s", mpi_error(rc).c_str());
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return std::unique_ptr<Transport>(new MpiTransport(dup));
}

}  // namespace ep_moe

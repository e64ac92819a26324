// The communicator interface every backend implements. Collectives are
// blocking, called by every rank of the group in the same order, and throw
// ep_moe::Error on failure (TIMEOUT, ABORTED, REMOTE, INVALID_ARGUMENT).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace ep_moe {

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // How many ranks of this group run inside this process (for choosing
  // threads per rank without oversubscribing the cores).
  virtual int ranks_in_process() const = 0;
  // A backend name for messages ("local", "mpi", ...).
  virtual const char* backend() const = 0;

  // `stream` carries a cudaStream_t for device backends; host backends ignore it.
  virtual void all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) = 0;
  virtual void reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) = 0;
  virtual void all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) = 0;
  virtual void all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dtype, void* stream) = 0;
  virtual void all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts,
                            ep_moe_dtype_t dtype, void* stream) = 0;
  virtual void barrier(void* stream) = 0;
  // Whether buffers live in device memory (NCCL) or host memory.
  virtual bool device_memory() const { return false; }
  // The error that broke the group, if any, and the peer that caused it
  // (-1 when unknown). EP_MOE_OK while the group is healthy.
  virtual ep_moe_status_t async_error(int* peer, std::string* message) const = 0;
  // Collective: ranks with equal color >= 0 form a new group (ordered by key,
  // then rank); a negative color returns nullptr.
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;

  // Takes part in the next collective as a failure: the other ranks return
  // EP_MOE_ERR_REMOTE naming this rank and `message` instead of waiting for
  // it. Never throws.
  virtual void fail_collective(ep_moe_status_t status, const std::string& message) noexcept = 0;
  // Breaks the group (and groups split from it): blocked and later calls
  // return ABORTED. Safe from any thread.
  virtual void abort() noexcept = 0;

  int timeout_ms() const { return timeout_ms_; }
  void set_timeout_ms(int ms) { timeout_ms_ = ms; }

 protected:
  int timeout_ms_ = 60000;
};

constexpr int kMaxTimeoutMs = 86400000;

// Creates `size` in-process ranks sharing one group.
std::vector<std::unique_ptr<Comm>> create_local_group(int size, int timeout_ms);

}  // namespace ep_moe

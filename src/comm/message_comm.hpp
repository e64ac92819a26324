// Communicators over a message transport (MPI, the host's callbacks).
//
// A Transport moves bytes between processes and gives up at a deadline or
// on abort; MessageComm builds ep_moe's collectives on it with the same
// guarantees as the in-process backend:
//  - before every collective the ranks exchange a small header (operation,
//    dtype, counts, or "this rank failed: <message>"), so a rank with bad
//    arguments makes the others return EP_MOE_ERR_REMOTE at once and
//    mismatched calls fail everywhere with EP_MOE_ERR_INVALID_ARGUMENT;
//  - reductions are done by ep_moe (all-to-all of slices, a sum in f32 in
//    rank order, all-gather), so every backend gives bit-identical results;
//  - a timeout or abort breaks the communicator: later calls fail at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "common/error.hpp"

namespace ep_moe {

class Transport {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;
  virtual int ranks_in_process() const { return 1; }

  // Byte-level operations; each returns when complete or throws TIMEOUT at
  // the deadline, ABORTED after abort(), REMOTE when the transport reports a
  // failure.
  virtual void all_gather(void* out, const void* in, size_t bytes, Clock::time_point deadline) = 0;
  virtual void all_gather_v(void* out, const void* in, const size_t* bytes, Clock::time_point deadline) = 0;
  virtual void all_to_all_v(void* out, const size_t* out_bytes, const void* in, const size_t* in_bytes,
                            Clock::time_point deadline) = 0;
  // Optional native reductions: return false when the transport has none
  // (MessageComm then does them itself).
  virtual bool all_reduce(void*, const void*, size_t, ep_moe_dtype_t, void*, Clock::time_point) { return false; }
  virtual bool reduce_scatter(void*, const void*, size_t, ep_moe_dtype_t, void*, Clock::time_point) { return false; }
  virtual bool barrier(Clock::time_point) { return false; }
  // A sub-group (collective over this transport); nullptr for color < 0.
  // Inline, like every member here: Transport has no key function, so its
  // vtable is emitted wherever it is used (a transport built in a backend
  // module, backend/modules.hpp, needs nothing from the core).
  virtual std::unique_ptr<Transport> split(int, int, Clock::time_point) {
    fail(EP_MOE_ERR_UNSUPPORTED, "the %s transport cannot split; create one communicator per group", name());
  }

  virtual void abort() noexcept = 0;
};

class MessageComm final : public Comm {
 public:
  MessageComm(std::unique_ptr<Transport> t, int timeout_ms);
  ~MessageComm() override;

  int rank() const override { return t_->rank(); }
  int size() const override { return t_->size(); }
  int ranks_in_process() const override { return t_->ranks_in_process(); }
  const char* backend() const override { return t_->name(); }

  void all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) override;
  void reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) override;
  void all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream) override;
  void all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dtype, void* stream) override;
  void all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts, ep_moe_dtype_t dtype,
                    void* stream) override;
  void barrier(void* stream) override;
  std::unique_ptr<Comm> split(int color, int key) override;
  void fail_collective(ep_moe_status_t status, const std::string& message) noexcept override;
  void abort() noexcept override;
  ep_moe_status_t async_error(int* peer, std::string* message) const override;

 private:
  struct Header;
  // Exchanges headers and checks them; throws the common verdict.
  void agree(int op, ep_moe_dtype_t dtype, uint64_t count, uint64_t aux1, uint64_t aux2);
  Transport::Clock::time_point deadline() const;
  // Runs a transport call, turning its failure into a broken communicator.
  template <class F>
  void guarded(F&& f);
  void throw_if_broken() const;

  std::unique_ptr<Transport> t_;
  mutable std::mutex mutex_;  // guards the broken_* fields (async_error reads them from any thread)
  bool broken_ = false;
  ep_moe_status_t broken_status_ = EP_MOE_OK;
  std::string broken_message_;
  int broken_peer_ = -1;
  // Scratch of the collectives (one runs at a time on a communicator), kept
  // so that a collective allocates nothing once its sizes have been seen:
  // the headers, per-rank byte counts, the reductions' slices and sources.
  std::vector<Header> headers_;
  std::vector<size_t> sizes_a_, sizes_b_;
  std::vector<uint8_t> slices_, reduced_;
  std::vector<const void*> srcs_;
};

}  // namespace ep_moe

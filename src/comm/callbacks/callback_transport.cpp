#include "comm/callbacks/callback_transport.hpp"

#include <atomic>

#include "comm/poll.hpp"
#include "common/error.hpp"

namespace ep_moe {

namespace {

class CallbackTransport final : public Transport {
 public:
  explicit CallbackTransport(const ep_moe_comm_callbacks_t& cb) : cb_(cb) {}

  int rank() const override { return cb_.rank; }
  int size() const override { return cb_.size; }
  const char* name() const override { return "callbacks"; }
  int ranks_in_process() const override { return cb_.ranks_in_process > 0 ? cb_.ranks_in_process : 1; }

  void all_gather(void* out, const void* in, size_t bytes, Clock::time_point deadline) override {
    run("all_gather", deadline, [&](void** req) { return cb_.all_gather(req, out, in, bytes, cb_.user_data); });
  }
  void all_gather_v(void* out, const void* in, const size_t* bytes, Clock::time_point deadline) override {
    run("all_gather_v", deadline, [&](void** req) { return cb_.all_gather_v(req, out, in, bytes, cb_.user_data); });
  }
  void all_to_all_v(void* out, const size_t* out_bytes, const void* in, const size_t* in_bytes,
                    Clock::time_point deadline) override {
    run("all_to_all_v", deadline,
        [&](void** req) { return cb_.all_to_all_v(req, out, out_bytes, in, in_bytes, cb_.user_data); });
  }
  bool all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream,
                  Clock::time_point deadline) override {
    if (!cb_.all_reduce) return false;
    run("all_reduce", deadline,
        [&](void** req) { return cb_.all_reduce(req, out, in, count, dtype, stream, cb_.user_data); });
    return true;
  }
  bool reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype, void* stream,
                      Clock::time_point deadline) override {
    if (!cb_.reduce_scatter) return false;
    run("reduce_scatter", deadline,
        [&](void** req) { return cb_.reduce_scatter(req, out, in, count, dtype, stream, cb_.user_data); });
    return true;
  }
  bool barrier(Clock::time_point deadline) override {
    if (!cb_.barrier) return false;
    run("barrier", deadline, [&](void** req) { return cb_.barrier(req, cb_.user_data); });
    return true;
  }
  void abort() noexcept override { aborted_.store(true, std::memory_order_release); }

 private:
  template <class Start>
  void run(const char* what, Clock::time_point deadline, Start&& start) {
    if (aborted_.load(std::memory_order_acquire))
      fail(EP_MOE_ERR_ABORTED, "the communicator was aborted (ep_moe_comm_abort)");
    void* req = nullptr;
    const ep_moe_status_t s = start(&req);
    if (s != EP_MOE_OK)
      fail(EP_MOE_ERR_REMOTE, "the host's %s callback failed to start: %s", what, ep_moe_status_string(s));
    if (req == nullptr) return;  // completed synchronously
    ep_moe_status_t test_status = EP_MOE_OK;
    const PollResult r = poll_until(
        [&] {
          int32_t done = 0;
          test_status = cb_.test(&done, req, cb_.user_data);
          return test_status != EP_MOE_OK || done != 0;
        },
        deadline, aborted_);
    if (r == PollResult::Done) {
      if (test_status != EP_MOE_OK)
        fail(EP_MOE_ERR_REMOTE, "the host's %s failed: %s", what, ep_moe_status_string(test_status));
      return;
    }
    if (cb_.cancel) cb_.cancel(req, cb_.user_data);
    if (r == PollResult::Aborted) fail(EP_MOE_ERR_ABORTED, "the communicator was aborted during %s", what);
    fail(EP_MOE_ERR_TIMEOUT, "rank %d timed out in the host's %s", cb_.rank, what);
  }

  ep_moe_comm_callbacks_t cb_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Transport> make_callback_transport(const ep_moe_comm_callbacks_t& cb) {
  EP_MOE_CHECK_ARG(cb.size >= 1 && cb.size <= (1 << 20), "callbacks->size must be in [1, %d], got %d", 1 << 20,
                   cb.size);
  EP_MOE_CHECK_ARG(cb.rank >= 0 && cb.rank < cb.size, "callbacks->rank must be in [0, size=%d), got %d", cb.size,
                   cb.rank);
  EP_MOE_CHECK_ARG(cb.all_gather != nullptr, "callbacks->all_gather is NULL (required)");
  EP_MOE_CHECK_ARG(cb.all_gather_v != nullptr, "callbacks->all_gather_v is NULL (required)");
  EP_MOE_CHECK_ARG(cb.all_to_all_v != nullptr, "callbacks->all_to_all_v is NULL (required)");
  EP_MOE_CHECK_ARG(cb.test != nullptr, "callbacks->test is NULL (required)");
  return std::unique_ptr<Transport>(new CallbackTransport(cb));
}

}  // namespace ep_moe

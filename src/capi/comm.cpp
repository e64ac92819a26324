// C API shims of the communicators.
#include <memory>
#include <vector>

#include "capi/handle.hpp"
#include "capi/objects.hpp"
#include "comm/callbacks/callback_transport.hpp"
#include "comm/message_comm.hpp"
#include "comm/mpi/mpi_transport.hpp"
#include "comm/nccl/nccl_comm.hpp"
#include "common/dtype.hpp"

using namespace ep_moe;
using namespace ep_moe::capi;

namespace {

constexpr int32_t kMaxLocalRanks = 4096;

Comm& comm_of(ep_moe_comm_t* h) { return *checked(h, Kind::Comm, "comm")->comm; }

void check_dtype(ep_moe_dtype_t dtype) {
  EP_MOE_CHECK_ARG(dtype_valid(dtype), "dtype %d is not an ep_moe_dtype_t value", static_cast<int>(dtype));
}

// Runs a collective: argument checks first; when they fail, the rank still
// takes part (as a failure) so the other ranks return instead of waiting.
template <class Check, class Run>
ep_moe_status_t collective(const char* func, ep_moe_comm_t* h, Check&& check, Run&& run) {
  return guard(func, h, Kind::Comm, [&] {
    Comm& c = comm_of(h);
    try {
      check(c);
    } catch (const Error& e) {
      c.fail_collective(e.status(), std::string(func) + ": " + e.what());
      throw;
    }
    run(c);
  });
}

void need(const void* p, size_t count, const char* what) {
  if (count > 0 && p == nullptr) fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s is NULL with a nonzero count", what);
}

size_t checked_mul(size_t a, size_t b, const char* what) {
  if (b != 0 && a > SIZE_MAX / b) fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s overflows", what);
  return a * b;
}

}  // namespace

extern "C" {

ep_moe_status_t ep_moe_comm_config_init(ep_moe_comm_config_t* out) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    ep_moe_comm_config_t c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.timeout_ms = 60000;
    *out = c;
  });
}

ep_moe_status_t ep_moe_comm_create_local(ep_moe_comm_t** out, int32_t size, const ep_moe_comm_config_t* config) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    EP_MOE_CHECK_ARG(size >= 1 && size <= kMaxLocalRanks, "size must be in [1, %d], got %d", kMaxLocalRanks, size);
    int32_t timeout = 60000;
    if (config) {
      const auto& c = checked_config(config, "config");
      EP_MOE_CHECK_ARG(c.timeout_ms >= 1 && c.timeout_ms <= kMaxTimeoutMs,
                       "config->timeout_ms must be in [1, %d], got %d", kMaxTimeoutMs, c.timeout_ms);
      timeout = c.timeout_ms;
    }
    auto comms = create_local_group(size, timeout);
    std::vector<std::unique_ptr<ep_moe_comm>> handles;
    handles.reserve(comms.size());
    for (auto& c : comms) {
      handles.push_back(std::make_unique<ep_moe_comm>());
      handles.back()->comm = std::move(c);
    }
    try {
      for (auto& h : handles) register_handle(h.get());
    } catch (...) {
      for (auto& h : handles) unregister_handle(h.get());
      throw;
    }
    for (size_t i = 0; i < handles.size(); ++i) out[i] = handles[i].release();
  });
}

ep_moe_status_t ep_moe_comm_split(ep_moe_comm_t** out, ep_moe_comm_t* comm, int32_t color, int32_t key) {
  return collective(
      __func__, comm, [&](Comm&) { checked_out(out, "out"); },
      [&](Comm& c) {
        std::unique_ptr<Comm> sub = c.split(color, key);
        if (!sub) {
          *out = nullptr;
          return;
        }
        auto h = std::make_unique<ep_moe_comm>();
        h->comm = std::move(sub);
        register_handle(h.get());
        *out = h.release();
      });
}

void ep_moe_comm_destroy(ep_moe_comm_t* comm) {
  if (comm == nullptr || !retire_handle(comm, Kind::Comm)) return;
  comm->alive->store(false);  // layers still borrowing it refuse to use it
  delete comm;
}

ep_moe_status_t ep_moe_comm_abort(ep_moe_comm_t* comm) {
  return guard(__func__, comm, Kind::Comm, [&] { comm_of(comm).abort(); });
}

ep_moe_status_t ep_moe_comm_get_rank(int32_t* out, const ep_moe_comm_t* comm) {
  return guard(__func__, comm, Kind::Comm, [&] {
    checked(comm, Kind::Comm, "comm");
    checked_out(out, "out");
    *out = comm->comm->rank();
  });
}

ep_moe_status_t ep_moe_comm_get_size(int32_t* out, const ep_moe_comm_t* comm) {
  return guard(__func__, comm, Kind::Comm, [&] {
    checked(comm, Kind::Comm, "comm");
    checked_out(out, "out");
    *out = comm->comm->size();
  });
}

ep_moe_status_t ep_moe_comm_set_timeout(ep_moe_comm_t* comm, int32_t timeout_ms) {
  return guard(__func__, comm, Kind::Comm, [&] {
    Comm& c = comm_of(comm);
    EP_MOE_CHECK_ARG(timeout_ms >= 1 && timeout_ms <= kMaxTimeoutMs, "timeout_ms must be in [1, %d], got %d",
                     kMaxTimeoutMs, timeout_ms);
    c.set_timeout_ms(timeout_ms);
  });
}

const char* ep_moe_comm_last_error(const ep_moe_comm_t* comm) { return handle_last_error(comm, comm, Kind::Comm); }

ep_moe_status_t ep_moe_comm_all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                       ep_moe_comm_t* comm, void* stream) {
  return collective(
      __func__, comm,
      [&](Comm&) {
        check_dtype(dtype);
        need(out, count, "out");
        need(in, count, "in");
      },
      [&](Comm& c) { c.all_reduce(out, in, count, dtype, stream); });
}

ep_moe_status_t ep_moe_comm_reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                           ep_moe_comm_t* comm, void* stream) {
  return collective(
      __func__, comm,
      [&](Comm& c) {
        check_dtype(dtype);
        need(out, count, "out");
        need(in, checked_mul(count, static_cast<size_t>(c.size()), "count * size"), "in");
      },
      [&](Comm& c) { c.reduce_scatter(out, in, count, dtype, stream); });
}

ep_moe_status_t ep_moe_comm_all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                       ep_moe_comm_t* comm, void* stream) {
  return collective(
      __func__, comm,
      [&](Comm& c) {
        check_dtype(dtype);
        need(in, count, "in");
        need(out, checked_mul(count, static_cast<size_t>(c.size()), "count * size"), "out");
      },
      [&](Comm& c) { c.all_gather(out, in, count, dtype, stream); });
}

ep_moe_status_t ep_moe_comm_all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dtype,
                                         ep_moe_comm_t* comm, void* stream) {
  return collective(
      __func__, comm,
      [&](Comm& c) {
        check_dtype(dtype);
        checked_out(counts, "counts");
        size_t total = 0;
        for (int p = 0; p < c.size(); ++p) {
          if (counts[p] > SIZE_MAX - total) fail(EP_MOE_ERR_INVALID_ARGUMENT, "sum of counts overflows");
          total += counts[p];
        }
        need(in, counts[c.rank()], "in");
        need(out, total, "out");
      },
      [&](Comm& c) { c.all_gather_v(out, in, counts, dtype, stream); });
}

ep_moe_status_t ep_moe_comm_all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts,
                                         ep_moe_dtype_t dtype, ep_moe_comm_t* comm, void* stream) {
  return collective(
      __func__, comm,
      [&](Comm& c) {
        check_dtype(dtype);
        checked_out(out_counts, "out_counts");
        checked_out(in_counts, "in_counts");
        size_t tin = 0, tout = 0;
        for (int p = 0; p < c.size(); ++p) {
          if (in_counts[p] > SIZE_MAX - tin || out_counts[p] > SIZE_MAX - tout)
            fail(EP_MOE_ERR_INVALID_ARGUMENT, "sum of counts overflows");
          tin += in_counts[p];
          tout += out_counts[p];
        }
        need(in, tin, "in");
        need(out, tout, "out");
      },
      [&](Comm& c) { c.all_to_all_v(out, out_counts, in, in_counts, dtype, stream); });
}

ep_moe_status_t ep_moe_comm_barrier(ep_moe_comm_t* comm) {
  return collective(
      __func__, comm, [](Comm&) {}, [](Comm& c) { c.barrier(nullptr); });
}

namespace {
int timeout_of(const ep_moe_comm_config_t* config) {
  if (!config) return 60000;
  const auto& c = checked_config(config, "config");
  EP_MOE_CHECK_ARG(c.timeout_ms >= 1 && c.timeout_ms <= kMaxTimeoutMs, "config->timeout_ms must be in [1, %d], got %d",
                   kMaxTimeoutMs, c.timeout_ms);
  return c.timeout_ms;
}

void publish(ep_moe_comm_t** out, std::unique_ptr<Comm> c) {
  auto h = std::make_unique<ep_moe_comm>();
  h->comm = std::move(c);
  register_handle(h.get());
  *out = h.release();
}
}  // namespace

ep_moe_status_t ep_moe_comm_create_mpi(ep_moe_comm_t** out, const void* mpi_comm, size_t mpi_comm_size,
                                       const ep_moe_comm_config_t* config) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    const int timeout = timeout_of(config);
    publish(out, std::unique_ptr<Comm>(new MessageComm(make_mpi_transport(mpi_comm, mpi_comm_size), timeout)));
  });
}

ep_moe_status_t ep_moe_comm_create_nccl(ep_moe_comm_t** out, void* nccl_comm, const ep_moe_comm_config_t* config) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    const int timeout = timeout_of(config);
    publish(out, make_nccl_comm(nccl_comm, timeout));
  });
}

ep_moe_status_t ep_moe_nccl_get_unique_id(void* out, size_t out_size) {
  return guard(__func__, nullptr, Kind::Comm, [&] { nccl_unique_id(out, out_size); });
}

ep_moe_status_t ep_moe_comm_create_nccl_from_id(ep_moe_comm_t** out, const void* unique_id, size_t unique_id_size,
                                                int32_t rank, int32_t size, const ep_moe_comm_config_t* config) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    const int timeout = timeout_of(config);
    publish(out, make_nccl_comm_from_id(unique_id, unique_id_size, rank, size, timeout));
  });
}

ep_moe_status_t ep_moe_comm_callbacks_init(ep_moe_comm_callbacks_t* out) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    std::memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
  });
}

ep_moe_status_t ep_moe_comm_create_callbacks(ep_moe_comm_t** out, const ep_moe_comm_callbacks_t* callbacks,
                                             const ep_moe_comm_config_t* config) {
  return guard(__func__, nullptr, Kind::Comm, [&] {
    checked_out(out, "out");
    const auto& cb = checked_config(callbacks, "callbacks");
    const int timeout = timeout_of(config);
    publish(out, std::unique_ptr<Comm>(new MessageComm(make_callback_transport(cb), timeout)));
  });
}

ep_moe_status_t ep_moe_comm_get_async_error(ep_moe_status_t* out_status, int32_t* out_peer, const ep_moe_comm_t* comm) {
  return guard(__func__, comm, Kind::Comm, [&] {
    checked(comm, Kind::Comm, "comm");
    checked_out(out_status, "out_status");
    int peer = -1;
    const ep_moe_status_t s = comm->comm->async_error(&peer, nullptr);
    *out_status = s;
    if (out_peer) *out_peer = peer;
  });
}

const char* ep_moe_comm_backend(const ep_moe_comm_t* comm) {
  if (comm == nullptr || !is_live(comm, Kind::Comm)) return "invalid handle";
  return comm->comm->backend();
}

}  // extern "C"

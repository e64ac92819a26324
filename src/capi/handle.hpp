// Shared machinery of the C API shims: the handle registry (detects NULL,
// destroyed and wrong-type handles), last-error slots, config-struct checks,
// and `guard`, which turns every C++ exception into a status.
#pragma once

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <new>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/log.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace capi {

enum class Kind : unsigned { ExpertMap = 1, Comm = 2, Layer = 3, Checkpoint = 4 };

// Every public handle type derives from this.
struct HandleBase {
  explicit HandleBase(Kind k) : kind(k) {}
  virtual ~HandleBase() = default;
  HandleBase(const HandleBase&) = delete;
  HandleBase& operator=(const HandleBase&) = delete;

  void set_error(const std::string& msg) const {
    std::lock_guard<std::mutex> lock(error_mutex);
    last_error = msg;
  }
  std::string error() const {
    std::lock_guard<std::mutex> lock(error_mutex);
    return last_error;
  }

  const Kind kind;
  mutable std::mutex error_mutex;
  mutable std::string last_error;

  // The calls in flight on this handle (use_handle()): how many, and the
  // exclusive one's name and thread.
  mutable std::mutex use_mutex;
  mutable std::condition_variable use_cv;
  mutable int users = 0;
  mutable const char* exclusive_call = nullptr;
  mutable std::thread::id exclusive_thread;
};

void register_handle(const HandleBase* h);
void unregister_handle(const HandleBase* h);

// Calls that overlap on one handle, which the API says they must not, get
// a clear error instead of a crash: a call taking a layer non-const holds
// it alone (an overlapping call fails with EP_MOE_ERR_STATE naming the call
// in flight); other calls share their handles. use_handle() takes a
// use of a live handle (false, taking nothing, where h is NULL or not a
// live `kind`: the call's own checks say so), under the registry's lock so
// that a destroy cannot come between the check and the use.
bool use_handle(const HandleBase* h, Kind kind, const char* func, bool exclusive);
void end_use(const HandleBase* h, bool exclusive) noexcept;
// For the destroy functions: unregisters the live handle p of `kind` (later
// calls see a dead handle; of two racing destroys one gets true), then
// waits for the calls in flight on it to return; true: delete it. False
// where p is not live, or, leaving it allocated (and logged), where this
// thread has a call in flight on it (a destroy from the log callback inside
// that call), for which waiting would never end.
bool retire_handle(const void* p, Kind kind);

// A use for the length of a scope (a second handle a call reads).
class HandleUse {
 public:
  HandleUse(const HandleBase* h, Kind kind, const char* func, bool exclusive = false)
      : h_(h), exclusive_(exclusive), held_(use_handle(h, kind, func, exclusive)) {}
  ~HandleUse() {
    if (held_) end_use(h_, exclusive_);
  }
  HandleUse(const HandleUse&) = delete;
  HandleUse& operator=(const HandleUse&) = delete;

 private:
  const HandleBase* h_;
  bool exclusive_, held_;
};
bool is_live(const void* p, Kind kind);
const char* kind_name(Kind kind);

// Thread-local error slot (ep_moe_last_error).
void set_thread_error(const std::string& msg);
const char* thread_error();
// Copies `s` into a thread-local buffer and returns it (for *_last_error).
const char* thread_copy(std::string s);

// Body of every ep_moe_<x>_last_error(): a thread-local copy of the handle's
// message, or a fixed text for NULL and dead handles. Never throws.
const char* handle_last_error(const HandleBase* h, const void* raw, Kind kind);

// Validates a handle pointer; throws INVALID_HANDLE.
template <class H>
H* checked(H* h, Kind kind, const char* what) {
  if (h == nullptr) fail(EP_MOE_ERR_INVALID_HANDLE, "%s is NULL", what);
  if (!is_live(h, kind))
    fail(EP_MOE_ERR_INVALID_HANDLE, "%s is not a live %s (destroyed, or another type)", what, kind_name(kind));
  return h;
}

// Validates a config struct pointer and its struct_size.
template <class C>
const C& checked_config(const C* cfg, const char* what) {
  if (cfg == nullptr) fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s is NULL", what);
  if (cfg->struct_size != sizeof(C))
    fail(EP_MOE_ERR_STRUCT_SIZE,
         "%s->struct_size is %zu, this library knows only %zu: fill the struct with its "
         "*_config_init() function",
         what, cfg->struct_size, sizeof(C));
  return *cfg;
}

template <class T>
T* checked_out(T* p, const char* what) {
  if (p == nullptr) fail(EP_MOE_ERR_INVALID_ARGUMENT, "%s is NULL", what);
  return p;
}

// Runs `fn`, returning EP_MOE_OK or the status of the exception it threw.
template <class F>
ep_moe_status_t guard_use(const char* func, const HandleBase* handle, Kind kind, bool exclusive, F&& fn) noexcept;
// The message goes to the thread-local slot and, when `handle` is not NULL
// and live, to the handle's slot. Nothing escapes.
// A layer passed non-const is held alone for the call (HandleUse), as
// const and other handles are shared: ep_moe.h's rule that calls taking a
// non-const handle must not overlap, enforced where overlapping crashed.
template <class H, class F>
ep_moe_status_t guard(const char* func, H* handle, Kind kind, F&& fn) noexcept {
  return guard_use(func, handle, kind, !std::is_const<H>::value && kind == Kind::Layer, std::forward<F>(fn));
}
template <class F>
ep_moe_status_t guard(const char* func, std::nullptr_t, Kind kind, F&& fn) noexcept {
  return guard_use(func, static_cast<const HandleBase*>(nullptr), kind, false, std::forward<F>(fn));
}

template <class F>
ep_moe_status_t guard_use(const char* func, const HandleBase* handle, Kind kind, bool exclusive, F&& fn) noexcept {
  ep_moe_status_t status = EP_MOE_OK;
  std::string msg;
  try {
    const HandleUse use(handle, kind, func, exclusive);
    fn();
    return EP_MOE_OK;
  } catch (const Error& e) {
    status = e.status();
    msg = e.what();
  } catch (const std::bad_alloc&) {
    status = EP_MOE_ERR_OUT_OF_MEMORY;
    msg = "out of memory";
  } catch (const std::exception& e) {
    status = EP_MOE_ERR_INTERNAL;
    msg = std::string("internal error: ") + e.what();
  } catch (...) {
    status = EP_MOE_ERR_INTERNAL;
    msg = "internal error: unknown exception";
  }
  try {
    std::string full = std::string(func) + ": " + msg;
    set_thread_error(full);
    if (handle && is_live(handle, kind)) handle->set_error(full);  // (another argument was the bad handle)
    log(EP_MOE_LOG_ERROR, "%s", full.c_str());  // a runtime listening at ERROR or WARN sees every failure
  } catch (...) {
    // Recording the message itself ran out of memory: the status still says it.
  }
  return status;
}

}  // namespace capi
}  // namespace ep_moe

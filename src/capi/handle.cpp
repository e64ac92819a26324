#include "capi/handle.hpp"

#include <shared_mutex>
#include <unordered_map>

namespace ep_moe {
namespace capi {

namespace {
struct Registry {
  std::shared_mutex mutex;
  std::unordered_map<const void*, Kind> live;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handles may outlive static destructors
  return *r;
}
thread_local std::string t_error;
thread_local std::string t_copy;
}  // namespace

void register_handle(const HandleBase* h) {
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mutex);
  r.live[h] = h->kind;
}

void unregister_handle(const HandleBase* h) {
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mutex);
  r.live.erase(h);
}

bool is_live(const void* p, Kind kind) {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mutex);
  auto it = r.live.find(p);
  return it != r.live.end() && it->second == kind;
}

bool use_handle(const HandleBase* h, Kind kind, const char* func, bool exclusive) {
  if (h == nullptr) return false;
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mutex);
  auto it = r.live.find(h);
  if (it == r.live.end() || it->second != kind) return false;
  std::lock_guard<std::mutex> use(h->use_mutex);
  if (h->exclusive_call)
    fail(EP_MOE_ERR_STATE, "%s is running on this %s %s; calls on one handle must not overlap", h->exclusive_call,
         kind_name(kind),
         h->exclusive_thread == std::this_thread::get_id() ? "on this thread (a call from the log callback?)"
                                                           : "on another thread");
  if (exclusive && h->users > 0)
    fail(EP_MOE_ERR_STATE, "another call is running on this %s; calls on one handle must not overlap", kind_name(kind));
  ++h->users;
  if (exclusive) {
    h->exclusive_call = func;
    h->exclusive_thread = std::this_thread::get_id();
  }
  return true;
}

void end_use(const HandleBase* h, bool exclusive) noexcept {
  std::lock_guard<std::mutex> use(h->use_mutex);
  --h->users;
  if (exclusive) {
    h->exclusive_call = nullptr;
    h->exclusive_thread = std::thread::id();
  }
  h->use_cv.notify_all();
}

bool retire_handle(const void* p, Kind kind) {
  const HandleBase* h = nullptr;
  {
    auto& r = registry();
    std::unique_lock<std::shared_mutex> lock(r.mutex);
    auto it = r.live.find(p);
    if (it == r.live.end() || it->second != kind) return false;  // dead, another type, or a racing destroy won
    r.live.erase(it);
    h = static_cast<const HandleBase*>(p);
  }
  std::unique_lock<std::mutex> use(h->use_mutex);
  if (h->users > 0 && h->exclusive_thread == std::this_thread::get_id()) {
    log(EP_MOE_LOG_ERROR, "a %s was destroyed from inside %s on it (the log callback?): left allocated",
        kind_name(kind), h->exclusive_call);
    return false;
  }
  h->use_cv.wait(use, [h] { return h->users == 0; });
  return true;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::ExpertMap: return "ep_moe_expert_map_t";
    case Kind::Comm: return "ep_moe_comm_t";
    case Kind::Layer: return "ep_moe_layer_t";
    case Kind::Checkpoint: return "ep_moe_checkpoint_t";
  }
  return "handle";
}

const char* handle_last_error(const HandleBase* h, const void* raw, Kind kind) {
  if (raw == nullptr) return "the handle is NULL";
  if (!is_live(raw, kind)) return "the handle is not live (destroyed, or another type)";
  try {
    return thread_copy(h->error());
  } catch (...) {
    return "out of memory while copying the error message";
  }
}

void set_thread_error(const std::string& msg) { t_error = msg; }
const char* thread_error() { return t_error.c_str(); }
const char* thread_copy(std::string s) {
  t_copy = std::move(s);
  return t_copy.c_str();
}

}  // namespace capi
}  // namespace ep_moe

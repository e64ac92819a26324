#include "common/log.hpp"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <strings.h>
#include <mutex>
#include <string>
#include <vector>

namespace ep_moe {

namespace {
struct Sink {
  ep_moe_log_fn fn = nullptr;
  ep_moe_log_level_t max_level = EP_MOE_LOG_ERROR;
  void* user_data = nullptr;
};
// Recursive, and held while the callback runs: removing the callback then
// guarantees no call is in flight afterwards (user_data may be freed), and
// a callback that calls back into ep_moe on its thread (even to replace or
// remove itself) does not deadlock.
std::recursive_mutex g_mutex;
Sink g_sink;
// Set while this thread runs the callback: messages its nested calls into
// ep_moe log are dropped, so that a callback cannot recurse into itself.
thread_local bool t_in_callback = false;
// Fast path: callers check this before formatting anything.
std::atomic<int> g_max_level{-1};

void stderr_sink(ep_moe_log_level_t level, const char* message, void*) {
  static const char* const names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  std::fprintf(stderr, "[ep_moe %s] %s\n", names[static_cast<int>(level) & 3], message);
}

// EP_MOE_LOG_LEVEL (error, warn, info, debug, or 0-3), as runtimes know it
// from NCCL_DEBUG: when set, messages up to that level go to stderr until
// the caller installs a callback of its own (or removes logging). Unset,
// nothing is written anywhere. Read once, when the library is loaded.
struct EnvSink {
  EnvSink() {
    const char* v = std::getenv("EP_MOE_LOG_LEVEL");
    if (!v || !*v) return;
    static const char* const names[] = {"error", "warn", "info", "debug"};
    int level = -1;
    for (int i = 0; i < 4; ++i)
      if (strcasecmp(v, names[i]) == 0 || (v[0] == '0' + i && v[1] == '\0')) level = i;
    if (level < 0) {
      std::fprintf(stderr, "[ep_moe WARN] EP_MOE_LOG_LEVEL=%s is not error, warn, info, debug or 0-3: ignored\n", v);
      return;
    }
    set_log_callback(stderr_sink, static_cast<ep_moe_log_level_t>(level), nullptr);
  }
};
const EnvSink g_env_sink;
}  // namespace

void set_log_callback(ep_moe_log_fn fn, ep_moe_log_level_t max_level, void* user_data) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  g_sink.fn = fn;
  g_sink.max_level = max_level;
  g_sink.user_data = user_data;
  g_max_level.store(fn ? static_cast<int>(max_level) : -1, std::memory_order_release);
}

bool log_enabled(ep_moe_log_level_t level) {
  return static_cast<int>(level) <= g_max_level.load(std::memory_order_acquire);
}

void log(ep_moe_log_level_t level, const char* fmt, ...) {
  if (!log_enabled(level) || t_in_callback) return;
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string text;
  if (n > 0) {
    std::vector<char> buf(static_cast<size_t>(n) + 1);
    std::vsnprintf(buf.data(), buf.size(), fmt, ap2);
    text.assign(buf.data(), static_cast<size_t>(n));
  }
  va_end(ap2);
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (g_sink.fn && static_cast<int>(level) <= static_cast<int>(g_sink.max_level)) {
    struct InCallback {
      InCallback() { t_in_callback = true; }
      ~InCallback() { t_in_callback = false; }
    } in;
    g_sink.fn(level, text.c_str(), g_sink.user_data);
  }
}

}  // namespace ep_moe

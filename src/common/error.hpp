// Internal error type: the C++ core throws ep_moe::Error; the C API shims
// (src/capi) catch it and turn it into a status + message. Nothing throws
// across the C boundary.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "ep_moe/ep_moe.h"

namespace ep_moe {

class Error : public std::runtime_error {
 public:
  Error(ep_moe_status_t status, std::string message) : std::runtime_error(std::move(message)), status_(status) {}
  ep_moe_status_t status() const noexcept { return status_; }

 private:
  ep_moe_status_t status_;
};

// printf-style message formatting for error texts.
#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
std::string
format(const char* fmt, ...);

[[noreturn]]
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void fail(ep_moe_status_t status, const char* fmt, ...);

// Throws INVALID_ARGUMENT with the formatted message unless `cond` holds.
#define EP_MOE_CHECK_ARG(cond, ...)                                        \
  do {                                                                     \
    if (!(cond)) ::ep_moe::fail(EP_MOE_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

}  // namespace ep_moe

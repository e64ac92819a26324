// FNV-1a over bytes: cheap fingerprints that ranks compare to check that
// they agree (collective arguments, maps, configs). Not for security.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ep_moe {

constexpr uint64_t kFnvBasis = 1469598103934665603ull;

inline uint64_t fnv1a(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace ep_moe

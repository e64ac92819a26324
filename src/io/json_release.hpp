// Allocation-free destruction of parsed JSON documents.
//
// nlohmann::json's destructor moves the children of a container into a heap
// vector to destroy them without recursion, so destroying a parsed document
// allocates; an allocation failure there, inside a destructor, would end
// the process. Emptying the containers bottom-up first leaves nothing for
// that vector to hold, so the destruction allocates nothing. Documents
// deeper than kMaxDepth keep the library's own path (real headers and
// configs are a few levels deep).
#pragma once

#include <nlohmann/json.hpp>

namespace ep_moe {
namespace io {

inline void release_json(nlohmann::json& j, int depth = 0) noexcept {
  constexpr int kMaxDepth = 64;
  if (depth > kMaxDepth) return;
  if (j.is_array()) {
    for (auto& c : j) release_json(c, depth + 1);
    j.get_ref<nlohmann::json::array_t&>().clear();
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) release_json(*it, depth + 1);
    j.get_ref<nlohmann::json::object_t&>().clear();
  }
}

// Declared after the document it guards, so it runs first.
struct JsonRelease {
  nlohmann::json& j;
  ~JsonRelease() { release_json(j); }
};

}  // namespace io
}  // namespace ep_moe

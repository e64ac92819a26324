// A linear pass over a JSON text the loader reads (a safetensors header,
// model.safetensors.index.json, config.json) before it builds a document:
// the document costs tens of bytes per input byte for deep nesting and long
// arrays, which no checkpoint has, so the pass refuses them first, keeping
// the document a small multiple of the text. Also finds duplicate keys of
// the top-level object, which a document keeps only the last of.
#pragma once

#include <cstdint>
#include <string>

namespace ep_moe {
namespace io {

struct JsonLimits {
  int max_depth;         // containers inside containers (the top level is 1)
  uint64_t max_array;    // elements of one array
  bool unique_top_keys;  // refuse a top-level key that appears twice
};

// The limits of the files: an index is {"metadata": {...}, "weight_map":
// {tensor: file}}; a config.json nests a few objects (text_config,
// quantization_config, rope_scaling) and its longest arrays list layers or
// modules.
constexpr int kIndexMaxDepth = 4;
constexpr uint64_t kIndexMaxArray = 1u << 16;
constexpr int kConfigMaxDepth = 16;
constexpr uint64_t kConfigMaxArray = 1u << 20;

// EP_MOE_ERR_FORMAT naming `name` (and the key, depth or array) where the
// text is not JSON or goes past the limits.
void check_json(const std::string& text, const std::string& name, const JsonLimits& limits);

}  // namespace io
}  // namespace ep_moe

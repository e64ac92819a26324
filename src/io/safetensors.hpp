// safetensors: an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}), then
// the data. Everything is validated before any tensor is trusted.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "io/source.hpp"
#include "io/tensor.hpp"

namespace ep_moe {
namespace io {

constexpr uint64_t kSafetensorsMaxHeader = 100ull << 20;
// Elements of one array in a header (a shape or data_offsets): a tensor
// has a few dimensions; more is refused before a document is built.
constexpr uint64_t kMaxHeaderArray = 64;

struct SafetensorsFile {
  std::vector<TensorInfo> tensors;  // in file order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;
};

// Throws ep_moe::Error (FORMAT) naming the source and, where it applies,
// the tensor. `file_index` is stored in every TensorInfo.
SafetensorsFile parse_safetensors(const ByteSource& src, int file_index);

}  // namespace io
}  // namespace ep_moe

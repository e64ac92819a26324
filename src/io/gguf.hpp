// GGUF (v2 and v3): header, metadata key/values and tensor infos, parsed
// defensively — every count and length is checked against what the file
// can hold before anything is allocated.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/source.hpp"
#include "io/tensor.hpp"

namespace ep_moe {
namespace io {

// A metadata value. Scalars and strings are kept; arrays keep their element
// type and length, and their values only when numeric and short.
struct GgufValue {
  uint32_t type = 0;  // GGUF value type
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string s;
  uint32_t array_type = 0;
  uint64_t array_len = 0;
  std::vector<double> array;  // numeric arrays of up to 4096 entries
  bool is_int() const;
  bool is_float() const;
  int64_t as_int() const;
  double as_float() const;
  // The value as an integer in [lo, hi]; EP_MOE_ERR_FORMAT naming `key` and
  // `where` for any other type (a float, a string) or a value outside, as
  // read in its own type (a u64 of 2^32 + 2 is not 2).
  int64_t checked_int(const std::string& key, int64_t lo, int64_t hi, const std::string& where) const;
};

struct GgufFile {
  uint32_t version = 0;
  uint64_t alignment = 32;
  uint64_t data_start = 0;
  std::map<std::string, GgufValue> kv;
  std::vector<TensorInfo> tensors;

  const GgufValue* find(const std::string& key) const;
};

// Caps (beyond "fits in the file"): a string of at most 64 MiB, at most 2^24
// tensors and key/values, at most 4 dimensions, nested arrays 8 deep.
GgufFile parse_gguf(const ByteSource& src, int file_index);

// Block size (elements) and block bytes of a ggml type, false when unknown.
bool ggml_type_size(uint32_t type, uint64_t* block, uint64_t* bytes, const char** name);

}  // namespace io
}  // namespace ep_moe

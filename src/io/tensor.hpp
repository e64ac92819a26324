// What the parsers report for each tensor, format-independent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ep_moe {
namespace io {

// Element encodings the loader understands (others are listed with their
// own name and rejected when loaded).
enum class Elem : int { F32, F16, BF16, Q8_0, Other };

struct TensorInfo {
  std::string name;
  std::string type_name;      // "F32", "BF16", "Q8_0", "I64", ...
  Elem elem = Elem::Other;
  std::vector<int64_t> shape; // row-major, outermost first (GGUF dims reversed)
  uint64_t offset = 0;        // absolute byte offset in its file
  uint64_t bytes = 0;
  int file = 0;               // index into the checkpoint's files
};

// Bytes of `count` consecutive elements (count must be whole Q8_0 blocks).
uint64_t elem_bytes(Elem e, uint64_t count);
const char* elem_name(Elem e);

}  // namespace io
}  // namespace ep_moe

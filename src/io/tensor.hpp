// What the parsers report for each tensor, format-independent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace io {

// Element encodings the loader understands (others are listed with their
// own name and rejected when loaded): the float types, and GGUF's block
// formats that layers keep as they are (common/quant.hpp's traits), each as
// its ep_moe_dtype_t value.
enum class Elem : int {
  Other = -1,
  F32 = EP_MOE_DTYPE_F32,
  F16 = EP_MOE_DTYPE_F16,
  BF16 = EP_MOE_DTYPE_BF16,
  MXFP4 = EP_MOE_DTYPE_MXFP4,
  FP8 = EP_MOE_DTYPE_FP8_E4M3,  // an F8_E4M3 weight with its weight_scale_inv, read as FP8_E4M3 blocks
  F8_E4M3 = 1000,               // a safetensors F8_E4M3 tensor: raw codes, loadable only with its scales
};

// The ep_moe_dtype_t of a loadable encoding (-1: none, raw F8_E4M3 codes
// included, which are read only through their scales).
inline int elem_dtype(Elem e) { return e == Elem::F8_E4M3 ? -1 : static_cast<int>(e); }

struct TensorInfo {
  std::string name;
  std::string type_name;  // "F32", "BF16", "Q8_0", "I64", ...
  Elem elem = Elem::Other;
  std::vector<int64_t> shape;  // row-major, outermost first (GGUF dims reversed)
  uint64_t offset = 0;         // absolute byte offset in its file
  uint64_t bytes = 0;
  int file = 0;  // index into the checkpoint's files
  // Its encoding's blocks (1 element for plain types; 32 and 34 bytes for
  // Q8_0, ...), known for every type the parsers accept, loadable or not.
  uint64_t block = 1, block_bytes = 0;

  // Bytes of `count` consecutive elements (whole blocks).
  uint64_t bytes_of(uint64_t count) const { return count / block * block_bytes; }
};

}  // namespace io
}  // namespace ep_moe

#include "io/tensor.hpp"

namespace ep_moe {
namespace io {

uint64_t elem_bytes(Elem e, uint64_t count) {
  switch (e) {
    case Elem::F32: return count * 4;
    case Elem::F16:
    case Elem::BF16: return count * 2;
    case Elem::Q8_0: return count / 32 * 34;
    case Elem::Other: break;
  }
  return 0;
}

const char* elem_name(Elem e) {
  switch (e) {
    case Elem::F32: return "F32";
    case Elem::F16: return "F16";
    case Elem::BF16: return "BF16";
    case Elem::Q8_0: return "Q8_0";
    case Elem::Other: break;
  }
  return "other";
}

}  // namespace io
}  // namespace ep_moe

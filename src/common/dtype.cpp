#include "common/dtype.hpp"

#include "common/quant.hpp"

namespace ep_moe {
const char* dtype_name(ep_moe_dtype_t t) {
  switch (t) {
    case EP_MOE_DTYPE_F32: return "f32";
    case EP_MOE_DTYPE_BF16: return "bf16";
    case EP_MOE_DTYPE_F16: return "f16";
    case EP_MOE_DTYPE_I32: return "i32";
    case EP_MOE_DTYPE_I64: return "i64";
    case EP_MOE_DTYPE_U8: return "u8";
    default: break;
  }
  if (const QuantTraits* q = quant_traits(t)) return q->name;
  return "unknown";
}
}  // namespace ep_moe

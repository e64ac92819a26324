#include "common/dtype.hpp"

namespace ep_moe {
const char* dtype_name(ep_moe_dtype_t t) {
  switch (t) {
    case EP_MOE_DTYPE_F32: return "f32";
    case EP_MOE_DTYPE_BF16: return "bf16";
    case EP_MOE_DTYPE_F16: return "f16";
    case EP_MOE_DTYPE_I32: return "i32";
    case EP_MOE_DTYPE_I64: return "i64";
    case EP_MOE_DTYPE_U8: return "u8";
    case EP_MOE_DTYPE_Q8_0: return "q8_0";
    case EP_MOE_DTYPE_Q4_0: return "q4_0";
    case EP_MOE_DTYPE_Q4_K: return "q4_k";
    case EP_MOE_DTYPE_Q5_K: return "q5_k";
    case EP_MOE_DTYPE_Q6_K: return "q6_k";
    case EP_MOE_DTYPE_IQ4_XS: return "iq4_xs";
    case EP_MOE_DTYPE_MXFP4: return "mxfp4";
    default: break;
  }
  return "unknown";
}
}  // namespace ep_moe

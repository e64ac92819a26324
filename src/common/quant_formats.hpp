// The per-format functions behind quant.cpp's traits table: the decoders
// and quantizers of the formats computed through their decoded form
// (quant_lowbit.cpp).
#pragma once

#include <cstdint>

#include "common/quant.hpp"

namespace ep_moe {
namespace qf {

#define EP_MOE_DECODED_FORMAT(n)                        \
  void decode_##n(const uint8_t* b, DecodedBlock* out); \
  void quant_##n(const float* x, uint8_t* b);
EP_MOE_DECODED_FORMAT(q4_1)
EP_MOE_DECODED_FORMAT(q5_0)
EP_MOE_DECODED_FORMAT(q5_1)
EP_MOE_DECODED_FORMAT(iq4_nl)
EP_MOE_DECODED_FORMAT(q2_k)
EP_MOE_DECODED_FORMAT(q3_k)
EP_MOE_DECODED_FORMAT(iq2_xxs)
EP_MOE_DECODED_FORMAT(iq2_xs)
EP_MOE_DECODED_FORMAT(iq2_s)
EP_MOE_DECODED_FORMAT(iq3_xxs)
EP_MOE_DECODED_FORMAT(iq3_s)
EP_MOE_DECODED_FORMAT(iq1_s)
EP_MOE_DECODED_FORMAT(iq1_m)
#undef EP_MOE_DECODED_FORMAT

// FP8_E4M3 (quant_fp8.cpp).
void dequant_fp8(const uint8_t* b, float* y);
void quant_fp8(const float* x, uint8_t* b);

}  // namespace qf
}  // namespace ep_moe

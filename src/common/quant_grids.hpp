// The grids of GGUF's IQ1/IQ2/IQ3 formats (quant_grids.cpp) and their sign
// table, expanded to values.
#pragma once

#include <cstdint>

namespace ep_moe {
namespace grids {

// Level codes of each entry (quant_grids.cpp says how they are packed).
extern const uint16_t kIq2xxsCodes[256], kIq2xsCodes[512], kIq2sCodes[1024];  // levels 8, 25, 43
extern const uint16_t kIq3xxsCodes[256];                                      // 4, 12, ..., 52, 62
extern const uint16_t kIq3sCodes[512];                                        // 1, 3, ..., 15
extern const uint16_t kIq1sCodes[2048];                                       // -1, 0, 1

// The grids as values: entry e's 8 (or 4) int8 values in the bytes of
// a u64 (u32), element j in byte j.
struct Expanded {
  uint64_t iq2xxs[256], iq2xs[512], iq2s[1024], iq1s[2048];
  uint32_t iq3xxs[256], iq3s[512];
  // The 7-bit sign codes of IQ2_XXS, IQ2_XS and IQ3_XXS: 8 sign bits, the
  // eighth making their count even; as a u64 of 0xff for each negative
  // element.
  uint64_t sign_mask[128];
  // byte_mask of every byte.
  uint64_t bit_mask[256];
};
const Expanded& expanded();

// Bit j of a byte of signs (IQ2_S, IQ3_S, and the 7-bit codes' byte) as a
// u64 of 0xff for element j.
inline uint64_t byte_mask(uint8_t bits) {
  uint64_t m = 0;
  for (int j = 0; j < 8; ++j)
    if (bits >> j & 1) m |= uint64_t{0xff} << (8 * j);
  return m;
}
// The 8 bytes of g negated where m is 0xff: every grid value is a
// non-zero magnitude below 128, so no byte borrows from the next.
inline uint64_t apply_signs(uint64_t g, uint64_t m) { return (g ^ m) + (m & 0x0101010101010101ull); }

}  // namespace grids
}  // namespace ep_moe

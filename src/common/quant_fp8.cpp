// ep_moe's block-scaled FP8 (EP_MOE_DTYPE_FP8_E4M3): per 128 elements of a
// row an f32 scale, then 128 OCP E4M3FN codes (sign, 4 exponent bits with
// bias 7, 3 mantissa bits; no infinities; S.1111.111 is NaN; largest 448).
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/quant.hpp"
#include "common/quant_formats.hpp"

namespace ep_moe {

float e4m3_value(uint8_t code) {
  if (e4m3_nan(code)) return NAN;
  const int e = (code >> 3) & 15, m = code & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  return code & 0x80 ? -mag : mag;
}

uint8_t e4m3_code(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (!(a < 464.0f)) return sign | 0x7E;  // 448 (464 and up round past it; saturate)
  if (a == 0.0f) return sign;
  int e;
  std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): its leading bit is 2^(e-1)
  // The step of a's binade: 2^(e-1-3) for normal values (exponent field
  // e - 1 + 7 >= 1), 2^-9 below 2^-6 (the subnormals' fixed step).
  const bool subnormal = e - 1 < -6;
  const int step = subnormal ? -9 : e - 4;
  const auto q = static_cast<int>(std::nearbyint(std::ldexp(a, -step)));  // ties to even
  if (subnormal) return static_cast<uint8_t>(sign | q);                   // q = 8 is 2^-6, code 0x08: the same bits
  // q in [8, 16]: 16 carries into the next binade.
  int ef = e - 1 + 7, m = q - 8;
  if (m == 8) {
    ++ef;
    m = 0;
  }
  if (ef > 15 || (ef == 15 && m == 7)) return sign | 0x7E;
  return static_cast<uint8_t>(sign | (ef << 3) | m);
}

std::string fp8_fault(const void* rows_data, int64_t rows, int64_t cols) {
  const auto* p = static_cast<const uint8_t*>(rows_data);
  char buf[160];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 128; ++b, p += 132) {
      float s;
      std::memcpy(&s, p, 4);
      if (!std::isfinite(s)) {
        std::snprintf(buf, sizeof buf, "row %lld, columns %lld..%lld: the block's scale is %g",
                      static_cast<long long>(r), static_cast<long long>(128 * b), static_cast<long long>(128 * b + 127),
                      static_cast<double>(s));
        return buf;
      }
      for (int i = 0; i < 128; ++i)
        if (e4m3_nan(p[4 + i])) {
          std::snprintf(buf, sizeof buf, "row %lld, column %lld: E4M3 code 0x%02x is NaN", static_cast<long long>(r),
                        static_cast<long long>(128 * b + i), p[4 + i]);
          return buf;
        }
    }
  return "";
}

namespace qf {

void dequant_fp8(const uint8_t* b, float* y) {
  float s;
  std::memcpy(&s, b, 4);
  for (int i = 0; i < 128; ++i) y[i] = s * e4m3_value(b[4 + i]);
}

void quant_fp8(const float* x, uint8_t* b) {
  float amax = 0;
  for (int i = 0; i < 128; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = amax / 448.0f;
  std::memcpy(b, &s, 4);
  for (int i = 0; i < 128; ++i) b[4 + i] = s > 0 ? e4m3_code(x[i] / s) : 0;
}

}  // namespace qf
}  // namespace ep_moe

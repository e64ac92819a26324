// Element types: sizes and scalar conversions (portable; the vector kernels
// have their own fast paths).
#pragma once

#include <cstdint>
#include <cstring>

#include "ep_moe/ep_moe.h"

namespace ep_moe {

inline bool dtype_is_float(ep_moe_dtype_t t) {
  return t == EP_MOE_DTYPE_F32 || t == EP_MOE_DTYPE_BF16 || t == EP_MOE_DTYPE_F16;
}
inline bool dtype_valid(ep_moe_dtype_t t) {
  return dtype_is_float(t) || t == EP_MOE_DTYPE_I32 || t == EP_MOE_DTYPE_I64 || t == EP_MOE_DTYPE_U8;
}
inline size_t dtype_size(ep_moe_dtype_t t) {
  switch (t) {
    case EP_MOE_DTYPE_BF16:
    case EP_MOE_DTYPE_F16: return 2;
    case EP_MOE_DTYPE_I64: return 8;
    case EP_MOE_DTYPE_U8: return 1;
    default: return 4;
  }
}
const char* dtype_name(ep_moe_dtype_t t);

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ffu;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return bits_f32(u);
}

// Round to nearest even, with overflow to infinity and subnormals.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (au < 0x38800000u) {                                      // below the smallest normal 2^-14: subnormal or zero
    if (au < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to 0
    const uint32_t e = au >> 23;
    const uint32_t m = (au & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 - (e - 127) + 13 - 1 ... bits to drop
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = au - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

inline float load_elem(const void* p, ep_moe_dtype_t t, int64_t i) {
  switch (t) {
    case EP_MOE_DTYPE_BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case EP_MOE_DTYPE_F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
inline void store_elem(void* p, ep_moe_dtype_t t, int64_t i, float v) {
  switch (t) {
    case EP_MOE_DTYPE_BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    case EP_MOE_DTYPE_F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}
inline void set_zero(void* p, ep_moe_dtype_t t, int64_t i) {
  const size_t s = dtype_size(t);
  std::memset(static_cast<char*>(p) + i * static_cast<int64_t>(s), 0, s);
}
inline void copy_elem(void* dst, const void* src, ep_moe_dtype_t t, int64_t i) {
  const size_t s = dtype_size(t);
  std::memcpy(static_cast<char*>(dst) + i * static_cast<int64_t>(s),
              static_cast<const char*>(src) + i * static_cast<int64_t>(s), s);
}

}  // namespace ep_moe

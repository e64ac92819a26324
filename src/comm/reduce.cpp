#include "comm/reduce.hpp"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/dtype.hpp"

namespace ep_moe {

namespace {
constexpr size_t kChunk = 1024;

template <class Load, class Store>
void sum_float(void* dst, const void* const* srcs, int ns, size_t off, size_t n, size_t esize, Load load, Store store) {
  float acc[kChunk];
  for (size_t base = 0; base < n; base += kChunk) {
    const size_t m = n - base < kChunk ? n - base : kChunk;
    for (size_t i = 0; i < m; ++i) acc[i] = 0.0f;
    for (int s = 0; s < ns; ++s) {
      const char* src = static_cast<const char*>(srcs[s]) + (off + base) * esize;
      for (size_t i = 0; i < m; ++i) acc[i] += load(src, i);
    }
    char* d = static_cast<char*>(dst) + base * esize;
    for (size_t i = 0; i < m; ++i) store(d, i, acc[i]);
  }
}

template <class T>
void sum_int(void* dst, const void* const* srcs, int ns, size_t off, size_t n) {
  T acc[kChunk];
  for (size_t base = 0; base < n; base += kChunk) {
    const size_t m = n - base < kChunk ? n - base : kChunk;
    for (size_t i = 0; i < m; ++i) acc[i] = 0;
    for (int s = 0; s < ns; ++s) {
      const T* src = static_cast<const T*>(srcs[s]) + off + base;
      // Wrap-around like two's complement hardware, without signed overflow UB.
      for (size_t i = 0; i < m; ++i)
        acc[i] = static_cast<T>(static_cast<typename std::make_unsigned<T>::type>(acc[i]) +
                                static_cast<typename std::make_unsigned<T>::type>(src[i]));
    }
    std::memcpy(static_cast<T*>(dst) + base, acc, m * sizeof(T));
  }
}
}  // namespace

void sum_into(void* dst, const void* const* srcs, int ns, size_t off, size_t n, ep_moe_dtype_t dtype) {
  switch (dtype) {
    case EP_MOE_DTYPE_F32:
      sum_float(
          dst, srcs, ns, off, n, 4, [](const char* p, size_t i) { return reinterpret_cast<const float*>(p)[i]; },
          [](char* p, size_t i, float v) { reinterpret_cast<float*>(p)[i] = v; });
      break;
    case EP_MOE_DTYPE_BF16:
      sum_float(
          dst, srcs, ns, off, n, 2,
          [](const char* p, size_t i) { return bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]); },
          [](char* p, size_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = f32_to_bf16(v); });
      break;
    case EP_MOE_DTYPE_F16:
      sum_float(
          dst, srcs, ns, off, n, 2,
          [](const char* p, size_t i) { return f16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]); },
          [](char* p, size_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = f32_to_f16(v); });
      break;
    case EP_MOE_DTYPE_I32: sum_int<int32_t>(dst, srcs, ns, off, n); break;
    case EP_MOE_DTYPE_I64: sum_int<int64_t>(dst, srcs, ns, off, n); break;
    case EP_MOE_DTYPE_U8: sum_int<uint8_t>(dst, srcs, ns, off, n); break;
    default: break;
  }
}

}  // namespace ep_moe

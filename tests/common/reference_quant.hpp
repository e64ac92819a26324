// Test-side GGUF block formats, written from the format definitions and
// sharing no code with the library: random valid blocks of a given
// magnitude, their dequantization in double, and the int8 activation
// quantization the kernels state (ep_moe.h, docs/quantization.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "reference_moe.hpp"

namespace refq {

// Public ep_moe_dtype_t values of the block formats.
enum Type { Q8_0 = 6, Q4_0 = 7, Q4_K = 8, Q5_K = 9, Q6_K = 10, IQ4_XS = 11, MXFP4 = 12 };

inline int block_elems(int t) { return (t == Q8_0 || t == Q4_0 || t == MXFP4) ? 32 : 256; }
inline int block_bytes(int t) {
  switch (t) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case MXFP4: return 17;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 136;  // IQ4_XS
  }
}
// The block size of the activations the kernels quantize for weights of t.
inline int act_block(int t) { return block_elems(t); }

inline const int kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
inline const int kE2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline double h16(const uint8_t* p) { return ref::from_f16(static_cast<uint16_t>(p[0] | (p[1] << 8))); }
inline void put16(uint8_t* p, float v) {
  const uint16_t h = ref::to_f16(v);
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}

// One block's values in double.
inline void dequant_block(int t, const uint8_t* b, double* y) {
  auto lo = [](uint8_t v) { return v & 15; };
  auto hi = [](uint8_t v) { return v >> 4; };
  switch (t) {
    case Q8_0:
      for (int i = 0; i < 32; ++i) y[i] = h16(b) * static_cast<int8_t>(b[2 + i]);
      return;
    case Q4_0:
      for (int i = 0; i < 16; ++i) {
        y[i] = h16(b) * (lo(b[2 + i]) - 8);
        y[i + 16] = h16(b) * (hi(b[2 + i]) - 8);
      }
      return;
    case MXFP4: {
      const double d = std::ldexp(1.0, b[0] - 128);  // half of the E8M0 scale: the values are doubled
      for (int i = 0; i < 16; ++i) {
        y[i] = d * kE2m1x2[lo(b[1 + i])];
        y[i + 16] = d * kE2m1x2[hi(b[1 + i])];
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const uint8_t* s = b + 4;
      const uint8_t* qs = t == Q5_K ? b + 48 : b + 16;
      for (int j = 0; j < 8; ++j) {
        // 6-bit scale and min of sub-block j: j < 4 in the low 6 bits of
        // bytes j and j+4; j >= 4 the low/high nibbles of byte j+4 with the
        // top 2 bits of bytes j-4 and j.
        const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        const int mn = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = qs[32 * (j / 2) + i];
          int q = j % 2 ? hi(byte) : lo(byte);
          if (t == Q5_K) q += ((b[16 + i] >> j) & 1) * 16;
          y[32 * j + i] = h16(b) * sc * q - h16(b + 2) * mn;
        }
      }
      return;
    }
    case Q6_K:
      for (int e = 0; e < 256; ++e) {
        const int half = e / 128, s = (e % 128) / 32, i = e % 32;
        const uint8_t l = b[64 * half + 32 * (s % 2) + i];
        const int q = (s < 2 ? lo(l) : hi(l)) + 16 * ((b[128 + 32 * half + i] >> (2 * s)) & 3) - 32;
        y[e] = h16(b + 208) * static_cast<int8_t>(b[192 + e / 16]) * q;
      }
      return;
    default: {  // IQ4_XS
      const int sh = b[2] | (b[3] << 8);
      for (int j = 0; j < 8; ++j) {
        const int ls = (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        for (int i = 0; i < 16; ++i) {
          y[32 * j + i] = h16(b) * ls * kIq4nl[lo(b[8 + 16 * j + i])];
          y[32 * j + 16 + i] = h16(b) * ls * kIq4nl[hi(b[8 + 16 * j + i])];
        }
      }
      return;
    }
  }
}

// A [rows, cols] matrix of random valid blocks whose values are about
// `scale` in magnitude: the bytes, and the values (in *values).
inline std::vector<uint8_t> random_blocks(int t, int rows, int cols, float scale, std::mt19937& rng,
                                          std::vector<float>* values) {
  const int qk = block_elems(t), bb = block_bytes(t), nb = rows * (cols / qk);
  std::vector<uint8_t> out(static_cast<size_t>(nb) * bb);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& x : out) x = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> jitter(0.5f, 1.5f);
  for (int i = 0; i < nb; ++i) {
    uint8_t* b = out.data() + static_cast<size_t>(i) * bb;
    const float s = scale * jitter(rng);
    switch (t) {
      case Q8_0: put16(b, s / 64); break;
      case Q4_0: put16(b, s / 4); break;
      case MXFP4: b[0] = static_cast<uint8_t>(128 + std::lround(std::log2(s / 3))); break;
      case Q4_K:
      case Q5_K:
        put16(b, s / (32 * (t == Q5_K ? 16 : 8)));
        put16(b + 2, s / 32);
        break;
      case Q6_K:
        put16(b + 208, s / (64 * 32));
        for (int g = 0; g < 16; ++g) b[192 + g] = static_cast<uint8_t>(static_cast<int8_t>(byte(rng) % 255 - 127));
        break;
      default: put16(b, s / (16 * 64)); break;  // IQ4_XS
    }
  }
  values->resize(static_cast<size_t>(rows) * cols);
  std::vector<double> y(static_cast<size_t>(qk));
  for (int i = 0; i < nb; ++i) {
    dequant_block(t, out.data() + static_cast<size_t>(i) * bb, y.data());
    for (int e = 0; e < qk; ++e)
      (*values)[static_cast<size_t>(i) * qk + e] = static_cast<float>(y[static_cast<size_t>(e)]);
  }
  return out;
}

}  // namespace refq

// Test-side GGUF block formats, written from the format definitions and
// sharing no code with the library: random valid blocks of a given
// magnitude, their dequantization in double, and the int8 activation
// quantization the kernels state (ep_moe.h, docs/quantization.md). The
// grid formats (IQ2_*, IQ3_*, IQ1_*) are the exception: their values come
// from the public ep_moe_dequantize, which io.quant_against_gguf holds to
// gguf.quants.dequantize bit for bit (their grids are tables of hundreds
// of entries that a second copy here would only duplicate).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "reference_moe.hpp"

namespace refq {

// Public ep_moe_dtype_t values of the block formats.
enum Type {
  Q8_0 = 6,
  Q4_0 = 7,
  Q4_K = 8,
  Q5_K = 9,
  Q6_K = 10,
  IQ4_XS = 11,
  MXFP4 = 12,
  Q2_K = 13,
  Q3_K = 14,
  Q4_1 = 15,
  Q5_0 = 16,
  Q5_1 = 17,
  IQ4_NL = 18,
  IQ2_XXS = 19,
  IQ2_XS = 20,
  IQ2_S = 21,
  IQ3_XXS = 22,
  IQ3_S = 23,
  IQ1_S = 24,
  IQ1_M = 25
};

inline bool is_grid(int t) { return t >= IQ2_XXS && t <= IQ1_M; }
inline int block_elems(int t) {
  return (t == Q8_0 || t == Q4_0 || t == MXFP4 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == IQ4_NL) ? 32 : 256;
}
inline int block_bytes(int t) {
  switch (t) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case MXFP4: return 17;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ4_XS: return 136;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case IQ4_NL: return 18;
    case IQ2_XXS: return 66;
    case IQ2_XS: return 74;
    case IQ2_S: return 82;
    case IQ3_XXS: return 98;
    case IQ3_S: return 110;
    case IQ1_S: return 50;
    default: return 56;  // IQ1_M
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
    case Q4_1:
    case Q5_0:
    case Q5_1:
    case IQ4_NL: {
      // d (f16), [m (f16)], [32 fifth bits], 16 bytes of nibbles: element i
      // < 16 the low nibble of byte i, else the high one of byte i - 16.
      const int qs = t == Q4_1 ? 4 : t == Q5_0 ? 6 : t == Q5_1 ? 8 : 2;
      const uint32_t qh =
          t == Q5_0 || t == Q5_1
              ? static_cast<uint32_t>(b[qs - 4] | (b[qs - 3] << 8) | (b[qs - 2] << 16) | (b[qs - 1] << 24))
              : 0;
      for (int i = 0; i < 32; ++i) {
        const int nib = i < 16 ? lo(b[qs + i]) : hi(b[qs + i - 16]);
        const int q = nib + 16 * static_cast<int>((qh >> i) & 1);
        y[i] = t == Q4_1 || t == Q5_1 ? h16(b) * q + h16(b + 2) : t == Q5_0 ? h16(b) * (q - 16) : h16(b) * kIq4nl[nib];
      }
      return;
    }
    case Q2_K:
      // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin:
      // element 128 h + 32 s + i is bits 2 s of qs[32 h + i].
      for (int e = 0; e < 256; ++e) {
        const int q = (b[16 + 32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3;
        y[e] = h16(b + 80) * lo(b[e / 16]) * q - h16(b + 82) * hi(b[e / 16]);
      }
      return;
    case Q3_K:
      // hmask[32], qs[64] (as Q2_K's), 12 bytes of 6-bit scales (offset
      // 32), d: a clear bit e / 32 of hmask[e % 32] subtracts 4.
      for (int e = 0; e < 256; ++e) {
        const int q =
            ((b[32 + 32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3) - 4 * !((b[e % 32] >> (e / 32)) & 1);
        const int j = e / 16;
        const int sc =
            ((j < 8 ? lo(b[96 + j]) : hi(b[96 + j - 8])) | (((b[104 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        y[e] = h16(b + 108) * sc * q;
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
      case IQ4_XS: put16(b, s / (16 * 64)); break;
      case Q4_1:
      case Q5_1:
        put16(b, s / (t == Q4_1 ? 8 : 16));
        put16(b + 2, -s);
        break;
      case Q5_0: put16(b, s / 16); break;
      case IQ4_NL: put16(b, s / 64); break;
      case Q2_K:
        put16(b + 80, s / 24);
        put16(b + 82, s / 16);
        break;
      case Q3_K: put16(b + 108, s / 128); break;
      case IQ2_XXS:
      case IQ2_XS:
      case IQ2_S: put16(b, s / 86); break;
      case IQ3_XXS: put16(b, s / 250); break;
      case IQ3_S: put16(b, s / 240); break;
      case IQ1_S: put16(b, s / 8); break;
      default: {  // IQ1_M: its f16 scale in the top nibbles of 4 u16 words
        const uint16_t h = ref::to_f16(s / 8);
        for (int w = 0; w < 4; ++w)
          b[49 + 2 * w] = static_cast<uint8_t>((b[49 + 2 * w] & 0x0F) | ((h >> (4 * w)) & 0xF) << 4);
        break;
      }
    }
  }
  if (is_grid(t)) {
    values->resize(static_cast<size_t>(rows) * cols);
    if (ep_moe_dequantize(values->data(), out.data(), static_cast<ep_moe_dtype_t>(t), rows, cols) != EP_MOE_OK)
      values->clear();
    return out;
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

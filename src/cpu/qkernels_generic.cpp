// Portable block-format kernels (kernels.hpp's QGemmFn): per block an exact
// integer dot product of the weights' quantized values with the activation
// row's int8 values, then the scales, as ggml's vec_dot kernels compute it.
// The reference the vector kernels are tested against.
#include <cstring>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "cpu/kernels.hpp"
#include "cpu/qdecoded.hpp"

namespace ep_moe {
namespace cpu {

namespace {

inline float f16(const uint8_t* p) { return f16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

// Sum of the 32 activation values of sub-block j (from the 16-sums).
inline int asum32(const int16_t* s, int64_t j) { return s[2 * j] + s[2 * j + 1]; }

template <int T>
float dot_row(const uint8_t* w, const void* arow, int k);

// Q8_0: d_w d_a sum(w a) per block of 32.
template <>
float dot_row<EP_MOE_DTYPE_Q8_0>(const uint8_t* w, const void* arow, int k) {
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  float acc = 0;
  for (int b = 0; b < k / 32; ++b, w += 34) {
    int sum = 0;
    for (int i = 0; i < 32; ++i) sum += static_cast<int8_t>(w[2 + i]) * q[32 * b + i];
    acc += f16(w) * d[b] * static_cast<float>(sum);
  }
  return acc;
}

// Q4_0: d_w d_a (sum(q a) - 8 sum(a)).
template <>
float dot_row<EP_MOE_DTYPE_Q4_0>(const uint8_t* w, const void* arow, int k) {
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  const int16_t* s = act_s(arow, k);
  float acc = 0;
  for (int b = 0; b < k / 32; ++b, w += 18) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += (w[2 + i] & 0xF) * q[32 * b + i] + (w[2 + i] >> 4) * q[32 * b + 16 + i];
    acc += f16(w) * d[b] * static_cast<float>(sum - 8 * asum32(s, b));
  }
  return acc;
}

// MXFP4: 2^(e-128) d_a sum(v a), v the doubled E2M1 values.
template <>
float dot_row<EP_MOE_DTYPE_MXFP4>(const uint8_t* w, const void* arow, int k) {
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  float acc = 0;
  for (int b = 0; b < k / 32; ++b, w += 17) {
    int sum = 0;
    for (int i = 0; i < 16; ++i)
      sum += kMxfp4Values[w[1 + i] & 0xF] * q[32 * b + i] + kMxfp4Values[w[1 + i] >> 4] * q[32 * b + 16 + i];
    acc += e8m0_half(w[0]) * d[b] * static_cast<float>(sum);
  }
  return acc;
}

// Q4_K and Q5_K: per block d_a (d sum_j sc_j dot_j - dmin sum_j m_j asum_j).
template <bool Five>
float dot_row_k45(const uint8_t* w, const void* arow, int k) {
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  const int16_t* s = act_s(arow, k);
  const int bb = Five ? 176 : 144;
  float acc = 0;
  for (int b = 0; b < k / 256; ++b, w += bb) {
    const uint8_t* sc = w + 4;
    const uint8_t* qh = w + 16;
    const uint8_t* qs = Five ? w + 48 : w + 16;
    int isum = 0, imin = 0;
    for (int j = 0; j < 8; ++j) {
      int scj, mj;
      if (j < 4) {
        scj = sc[j] & 63;
        mj = sc[j + 4] & 63;
      } else {
        scj = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        mj = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
      }
      const int8_t* a = q + 256 * b + 32 * j;
      int dot = 0;
      for (int i = 0; i < 32; ++i) {
        int v = (j % 2 == 0) ? (qs[32 * (j / 2) + i] & 0xF) : (qs[32 * (j / 2) + i] >> 4);
        if (Five) v |= ((qh[i] >> j) & 1) << 4;
        dot += v * a[i];
      }
      isum += scj * dot;
      imin += mj * asum32(s, 8 * b + j);
    }
    acc += d[8 * b] * (f16(w) * static_cast<float>(isum) - f16(w + 2) * static_cast<float>(imin));
  }
  return acc;
}

template <>
float dot_row<EP_MOE_DTYPE_Q4_K>(const uint8_t* w, const void* arow, int k) {
  return dot_row_k45<false>(w, arow, k);
}
template <>
float dot_row<EP_MOE_DTYPE_Q5_K>(const uint8_t* w, const void* arow, int k) {
  return dot_row_k45<true>(w, arow, k);
}

// Q6_K: per block d_a d sum_g sc_g (dot_g - 32 asum_g), groups of 16.
template <>
float dot_row<EP_MOE_DTYPE_Q6_K>(const uint8_t* w, const void* arow, int k) {
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  const int16_t* s = act_s(arow, k);
  float acc = 0;
  for (int b = 0; b < k / 256; ++b, w += 210) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    int dots[16] = {};
    for (int h = 0; h < 2; ++h)
      for (int sb = 0; sb < 4; ++sb)
        for (int i = 0; i < 32; ++i) {
          const int e = 128 * h + 32 * sb + i;
          const int l = sb < 2 ? (ql[64 * h + 32 * sb + i] & 0xF) : (ql[64 * h + 32 * (sb - 2) + i] >> 4);
          dots[e / 16] += (l | (((qh[32 * h + i] >> (2 * sb)) & 3) << 4)) * q[256 * b + e];
        }
    int isum = 0;
    for (int g = 0; g < 16; ++g) isum += sc[g] * (dots[g] - 32 * s[16 * b + g]);
    acc += d[8 * b] * f16(w + 208) * static_cast<float>(isum);
  }
  return acc;
}

// IQ4_XS: per block d_a d sum_j (ls_j - 32) sum(v a), v from the table.
template <>
float dot_row<EP_MOE_DTYPE_IQ4_XS>(const uint8_t* w, const void* arow, int k) {
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  float acc = 0;
  for (int b = 0; b < k / 256; ++b, w += 136) {
    const int sh = w[2] | (w[3] << 8);
    const uint8_t* sl = w + 4;
    const uint8_t* qs = w + 8;
    int isum = 0;
    for (int j = 0; j < 8; ++j) {
      const int ls = ((sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
      const int8_t* a = q + 256 * b + 32 * j;
      int dot = 0;
      for (int i = 0; i < 16; ++i)
        dot += kIq4nlValues[qs[16 * j + i] & 0xF] * a[i] + kIq4nlValues[qs[16 * j + i] >> 4] * a[16 + i];
      isum += (ls - 32) * dot;
    }
    acc += d[8 * b] * f16(w) * static_cast<float>(isum);
  }
  return acc;
}

// FP8_E4M3: per block its scale times the sum over its 4 runs of 32 of
// d_a sum(value a), values from a table of the 256 codes.
template <>
float dot_row<EP_MOE_DTYPE_FP8_E4M3>(const uint8_t* w, const void* arow, int k) {
  static const auto table = [] {
    struct T {
      float v[256];
    } t;
    for (int c = 0; c < 256; ++c) t.v[c] = e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  const int8_t* q = act_q(arow);
  const float* d = act_d(arow, k);
  float acc = 0;
  for (int b = 0; b < k / 128; ++b, w += 132) {
    float s;
    std::memcpy(&s, w, 4);
    float part = 0;
    for (int c = 0; c < 4; ++c) {
      float run = 0;
      for (int i = 0; i < 32; ++i) run += table.v[w[4 + 32 * c + i]] * static_cast<float>(q[128 * b + 32 * c + i]);
      part += d[4 * b + c] * run;
    }
    acc += s * part;
  }
  return acc;
}

template <int T>
void qgemm(int m, const void* const* a, int k, const void* panel, int nr, float* c, int ldc, const void* /*next*/) {
  const size_t rb = quant_row_bytes(static_cast<ep_moe_dtype_t>(T), k);
  for (int j = 0; j < nr; ++j) {
    const uint8_t* w = static_cast<const uint8_t*>(panel) + static_cast<size_t>(j) * rb;
    for (int i = 0; i < m; ++i) c[i * ldc + j] = dot_row<T>(w, a[i], k);
  }
}

}  // namespace

void qkernels_generic(QGemmFn* out) {
  out[quant_index(EP_MOE_DTYPE_Q8_0)] = qgemm<EP_MOE_DTYPE_Q8_0>;
  out[quant_index(EP_MOE_DTYPE_Q4_0)] = qgemm<EP_MOE_DTYPE_Q4_0>;
  out[quant_index(EP_MOE_DTYPE_Q4_K)] = qgemm<EP_MOE_DTYPE_Q4_K>;
  out[quant_index(EP_MOE_DTYPE_Q5_K)] = qgemm<EP_MOE_DTYPE_Q5_K>;
  out[quant_index(EP_MOE_DTYPE_Q6_K)] = qgemm<EP_MOE_DTYPE_Q6_K>;
  out[quant_index(EP_MOE_DTYPE_IQ4_XS)] = qgemm<EP_MOE_DTYPE_IQ4_XS>;
  out[quant_index(EP_MOE_DTYPE_MXFP4)] = qgemm<EP_MOE_DTYPE_MXFP4>;
  out[quant_index(EP_MOE_DTYPE_FP8_E4M3)] = qgemm<EP_MOE_DTYPE_FP8_E4M3>;
  qdecoded_generic(out);
}

}  // namespace cpu
}  // namespace ep_moe

#include "common/quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/dtype.hpp"
#include "common/quant_formats.hpp"

namespace ep_moe {

const int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  return bits_f32(bits);
}

void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

namespace {

uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
void wr16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xff);
  p[1] = static_cast<uint8_t>(v >> 8);
}
float rdf16(const uint8_t* p) { return f16_to_f32(rd16(p)); }

void dq_q8_0(const uint8_t* b, float* y) {
  const float d = rdf16(b);
  for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
}

void dq_q4_0(const uint8_t* b, float* y) {
  const float d = rdf16(b);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>((b[2 + i] & 0xF) - 8);
    y[16 + i] = d * static_cast<float>((b[2 + i] >> 4) - 8);
  }
}

void dq_mxfp4(const uint8_t* b, float* y) {
  const float d = e8m0_half(b[0]);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(kMxfp4Values[b[1 + i] & 0xF]);
    y[16 + i] = d * static_cast<float>(kMxfp4Values[b[1 + i] >> 4]);
  }
}

void dq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = rdf16(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 32; ++i) {
        const int e = 128 * h + 32 * s + i;
        const uint8_t l = s < 2 ? (ql[64 * h + 32 * s + i] & 0xF) : (ql[64 * h + 32 * (s - 2) + i] >> 4);
        const int v = (l | (((qh[32 * h + i] >> (2 * s)) & 3) << 4)) - 32;
        y[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(v);
      }
}

void dq_iq4_xs(const uint8_t* b, float* y) {
  const float d = rdf16(b);
  const uint16_t sh = rd16(b + 2);
  const uint8_t* sl = b + 4;
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 8; ++j) {
    const int ls = ((sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    for (int i = 0; i < 16; ++i) {
      y[32 * j + i] = dl * static_cast<float>(kIq4nlValues[qs[16 * j + i] & 0xF]);
      y[32 * j + 16 + i] = dl * static_cast<float>(kIq4nlValues[qs[16 * j + i] >> 4]);
    }
  }
}

template <bool five>
void dq_k45(const uint8_t* b, float* y) {
  const float d = rdf16(b), dmin = rdf16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = five ? b + 48 : b + 16;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, scales, &sc, &m);
    const float dj = d * sc, mj = dmin * m;
    const uint8_t* q = qs + 32 * (j / 2);
    for (int i = 0; i < 32; ++i) {
      int v = (j % 2 == 0) ? (q[i] & 0xF) : (q[i] >> 4);
      if (five) v |= ((qh[i] >> j) & 1) << 4;
      y[32 * j + i] = dj * static_cast<float>(v) - mj;
    }
  }
}

// Round half away from zero, as ggml's nearest_int / np_roundf.
int round_away(float x) { return static_cast<int>(std::round(x)); }

void quant_block_q8_0(const float* x, uint8_t* b) {
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  wr16(b, f32_to_f16(d));
  for (int i = 0; i < 32; ++i) b[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(round_away(x[i] * id)));
}

void quant_block_q4_0(const float* x, uint8_t* b) {
  float amax = 0, mx = 0;
  for (int i = 0; i < 32; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      mx = x[i];
    }
  const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  wr16(b, f32_to_f16(d));
  for (int i = 0; i < 16; ++i) {
    const int lo = std::min(15, std::max(0, static_cast<int>(x[i] * id + 8.5f)));
    const int hi = std::min(15, std::max(0, static_cast<int>(x[16 + i] * id + 8.5f)));
    b[2 + i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

void quant_block_mxfp4(const float* x, uint8_t* b) {
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const int e = amax > 0 ? static_cast<int>(std::floor(std::log2(amax))) - 2 + 127 : 0;
  b[0] = static_cast<uint8_t>(std::min(255, std::max(0, e)));
  const float d = e8m0_half(b[0]);
  auto best = [&](float v) {
    int bi = 0;
    float be = INFINITY;
    for (int q = 0; q < 16; ++q) {
      const float err = std::fabs(d * static_cast<float>(kMxfp4Values[q]) - v);
      if (err < be) {
        be = err;
        bi = q;
      }
    }
    return bi;
  };
  for (int i = 0; i < 16; ++i) b[1 + i] = static_cast<uint8_t>(best(x[i]) | (best(x[16 + i]) << 4));
}

// Q4_K / Q5_K (levels 15 or 31): per sub-block of 32 its range [min(0, lo),
// hi] in `levels` steps; the 8 steps and mins as 6-bit multiples of the
// block's d and dmin.
void quant_block_k45(const float* x, uint8_t* b, bool five) {
  const int levels = five ? 31 : 15;
  float step[8], mn[8];
  float max_step = 0, max_mn = 0;
  for (int j = 0; j < 8; ++j) {
    float lo = 0, hi = 0;
    for (int i = 0; i < 32; ++i) {
      lo = std::min(lo, x[32 * j + i]);
      hi = std::max(hi, x[32 * j + i]);
    }
    step[j] = (hi - lo) / static_cast<float>(levels);
    mn[j] = -lo;
    max_step = std::max(max_step, step[j]);
    max_mn = std::max(max_mn, mn[j]);
  }
  const float d = max_step / 63.0f, dmin = max_mn / 63.0f;
  const float dq = f16_to_f32(f32_to_f16(d)), dminq = f16_to_f32(f32_to_f16(dmin));
  wr16(b, f32_to_f16(d));
  wr16(b + 2, f32_to_f16(dmin));
  uint8_t sc[8], m[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = static_cast<uint8_t>(dq > 0 ? std::min(63, round_away(step[j] / dq)) : 0);
    m[j] = static_cast<uint8_t>(dminq > 0 ? std::min(63, round_away(mn[j] / dminq)) : 0);
  }
  uint8_t* scales = b + 4;
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
  uint8_t* qh = b + 16;
  uint8_t* qs = five ? b + 48 : b + 16;
  if (five) std::memset(qh, 0, 32);
  std::memset(qs, 0, 128);
  for (int j = 0; j < 8; ++j) {
    const float dj = dq * sc[j], mj = dminq * m[j];
    for (int i = 0; i < 32; ++i) {
      const int v = dj > 0 ? std::min(levels, std::max(0, round_away((x[32 * j + i] + mj) / dj))) : 0;
      qs[32 * (j / 2) + i] |= static_cast<uint8_t>((v & 0xF) << (4 * (j % 2)));
      if (five) qh[i] |= static_cast<uint8_t>(((v >> 4) & 1) << j);
    }
  }
}

void quant_block_q6_k(const float* x, uint8_t* b) {
  float scale[16], max_abs_scale = 0;
  for (int g = 0; g < 16; ++g) {
    float amax = 0;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[16 * g + i]));
    scale[g] = amax / 31.0f;
    max_abs_scale = std::max(max_abs_scale, scale[g]);
  }
  const float d = max_abs_scale / 127.0f, dq = f16_to_f32(f32_to_f16(d));
  auto* sc = reinterpret_cast<int8_t*>(b + 192);
  for (int g = 0; g < 16; ++g) sc[g] = static_cast<int8_t>(dq > 0 ? std::min(127, round_away(scale[g] / dq)) : 0);
  wr16(b + 208, f32_to_f16(d));
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  std::memset(ql, 0, 192);
  for (int e = 0; e < 256; ++e) {
    const float dg = dq * sc[e / 16];
    const int v = (dg > 0 ? std::min(31, std::max(-32, round_away(x[e] / dg))) : 0) + 32;
    const int h = e / 128, s = (e % 128) / 32, i = e % 32;
    if (s < 2) ql[64 * h + 32 * s + i] |= static_cast<uint8_t>(v & 0xF);
    else ql[64 * h + 32 * (s - 2) + i] |= static_cast<uint8_t>((v & 0xF) << 4);
    qh[32 * h + i] |= static_cast<uint8_t>(((v >> 4) & 3) << (2 * s));
  }
}

void quant_block_iq4_xs(const float* x, uint8_t* b) {
  float scale[8], max_abs = 0;
  for (int j = 0; j < 8; ++j) {
    float amax = 0, mx = 0;
    for (int i = 0; i < 32; ++i)
      if (std::fabs(x[32 * j + i]) > amax) {
        amax = std::fabs(x[32 * j + i]);
        mx = x[32 * j + i];
      }
    // The table's extremes are -127 and 113: the sign that maps the largest
    // magnitude onto -127.
    scale[j] = mx / -127.0f;
    max_abs = std::max(max_abs, std::fabs(scale[j]));
  }
  const float d = max_abs / 31.0f, dq = f16_to_f32(f32_to_f16(d));
  wr16(b, f32_to_f16(d));
  uint16_t sh = 0;
  uint8_t* sl = b + 4;
  uint8_t* qs = b + 8;
  std::memset(sl, 0, 4 + 128);
  for (int j = 0; j < 8; ++j) {
    const int l = dq > 0 ? std::min(31, std::max(-32, round_away(scale[j] / dq))) : 0;
    const int ls = l + 32;
    sl[j / 2] |= static_cast<uint8_t>((ls & 0xF) << (4 * (j % 2)));
    sh |= static_cast<uint16_t>(((ls >> 4) & 3) << (2 * j));
    const float dl = dq * static_cast<float>(l);
    for (int i = 0; i < 32; ++i) {
      int bi = 0;
      float be = INFINITY;
      for (int q = 0; q < 16; ++q) {
        const float err = std::fabs(dl * static_cast<float>(kIq4nlValues[q]) - x[32 * j + i]);
        if (err < be) {
          be = err;
          bi = q;
        }
      }
      qs[16 * j + i % 16] |= static_cast<uint8_t>(bi << (i < 16 ? 0 : 4));
    }
  }
  wr16(b + 2, sh);
}

void quant_block_q4_k(const float* x, uint8_t* b) { quant_block_k45(x, b, false); }
void quant_block_q5_k(const float* x, uint8_t* b) { quant_block_k45(x, b, true); }

// The decoded formats' dequantization: sc * v (+ mn), as the traits say.
template <void (*Decode)(const uint8_t*, DecodedBlock*), int Elems, bool Min>
void dq_decoded(const uint8_t* b, float* y) {
  DecodedBlock db;
  Decode(b, &db);
  for (int i = 0; i < Elems; ++i) {
    y[i] = db.sc[i / 16] * static_cast<float>(db.v[i]);
    if (Min) y[i] += db.mn[i / 16];
  }
}

// One entry per block format, by dtype: name, GGUF's name and number,
// geometry, activation rows, and its functions.
constexpr ActQuant k0 = ActQuant::Q8_0, kK = ActQuant::Q8_K;
#define EP_MOE_OWN(dt, n, gn, gt, el, by, aq, dq, q) \
  QuantTraits { EP_MOE_DTYPE_##dt, n, gn, gt, el, by, aq, dq, q, nullptr, false, true }
#define EP_MOE_DECODED(dt, n, gt, el, by, aq, mn)                                                                      \
  QuantTraits {                                                                                                        \
    EP_MOE_DTYPE_##dt, #n, #dt, gt, el, by, aq, dq_decoded<qf::decode_##n, el, mn>, qf::quant_##n, qf::decode_##n, mn, \
        false                                                                                                          \
  }
const QuantTraits kTraits[] = {
    EP_MOE_OWN(Q8_0, "q8_0", "Q8_0", 8, 32, 34, k0, dq_q8_0, quant_block_q8_0),
    EP_MOE_OWN(Q4_0, "q4_0", "Q4_0", 2, 32, 18, k0, dq_q4_0, quant_block_q4_0),
    EP_MOE_OWN(Q4_K, "q4_k", "Q4_K", 12, 256, 144, kK, dq_k45<false>, quant_block_q4_k),
    EP_MOE_OWN(Q5_K, "q5_k", "Q5_K", 13, 256, 176, kK, dq_k45<true>, quant_block_q5_k),
    EP_MOE_OWN(Q6_K, "q6_k", "Q6_K", 14, 256, 210, kK, dq_q6_k, quant_block_q6_k),
    EP_MOE_OWN(IQ4_XS, "iq4_xs", "IQ4_XS", 23, 256, 136, kK, dq_iq4_xs, quant_block_iq4_xs),
    EP_MOE_OWN(MXFP4, "mxfp4", "MXFP4", 39, 32, 17, k0, dq_mxfp4, quant_block_mxfp4),
    EP_MOE_DECODED(Q2_K, q2_k, 10, 256, 84, kK, true),
    EP_MOE_DECODED(Q3_K, q3_k, 11, 256, 110, kK, false),
    EP_MOE_DECODED(Q4_1, q4_1, 3, 32, 20, k0, true),
    EP_MOE_DECODED(Q5_0, q5_0, 6, 32, 22, k0, false),
    EP_MOE_DECODED(Q5_1, q5_1, 7, 32, 24, k0, true),
    EP_MOE_DECODED(IQ4_NL, iq4_nl, 20, 32, 18, k0, false),
    EP_MOE_DECODED(IQ2_XXS, iq2_xxs, 16, 256, 66, kK, false),
    EP_MOE_DECODED(IQ2_XS, iq2_xs, 17, 256, 74, kK, false),
    EP_MOE_DECODED(IQ2_S, iq2_s, 22, 256, 82, kK, false),
    EP_MOE_DECODED(IQ3_XXS, iq3_xxs, 18, 256, 98, kK, false),
    EP_MOE_DECODED(IQ3_S, iq3_s, 21, 256, 110, kK, false),
    EP_MOE_DECODED(IQ1_S, iq1_s, 19, 256, 50, kK, false),
    EP_MOE_DECODED(IQ1_M, iq1_m, 29, 256, 56, kK, false),
    // Not a GGUF type: safetensors' F8_E4M3 with its weight_scale_inv.
    QuantTraits{EP_MOE_DTYPE_FP8_E4M3, "fp8", "FP8_E4M3", -1, 128, 132, k0, qf::dequant_fp8, qf::quant_fp8, nullptr,
                false, false},
};
#undef EP_MOE_OWN
#undef EP_MOE_DECODED
static_assert(sizeof(kTraits) / sizeof(kTraits[0]) == kQuantTypes, "one traits entry per block format");

// kTraits ordered by quant_index (the entries above are in the order the
// formats were added, each naming its dtype).
struct ByIndex {
  const QuantTraits* at[kQuantTypes] = {};
  ByIndex() {
    for (const QuantTraits& t : kTraits) at[quant_index(t.dtype)] = &t;
  }
};
const ByIndex& by_index() {
  static const ByIndex b;
  return b;
}

}  // namespace

const QuantTraits* quant_traits(ep_moe_dtype_t t) {
  return dtype_is_quant(t) ? by_index().at[quant_index(t)] : nullptr;
}

int quant_dtype_of_gguf(int type) {
  for (const QuantTraits& t : kTraits)
    if (t.gguf_type >= 0 && t.gguf_type == type) return t.dtype;
  return -1;
}

int quant_block_elems(ep_moe_dtype_t t) {
  const QuantTraits* q = quant_traits(t);
  return q ? q->block_elems : 1;
}

int quant_block_bytes(ep_moe_dtype_t t) {
  const QuantTraits* q = quant_traits(t);
  return q ? q->block_bytes : static_cast<int>(dtype_size(t));
}

ActQuant act_quant_of(ep_moe_dtype_t weight) {
  const QuantTraits* q = quant_traits(weight);
  return q ? q->act : ActQuant::Q8_0;
}

void dequantize_row(ep_moe_dtype_t t, const void* src, float* dst, int64_t n) {
  const QuantTraits& q = *quant_traits(t);
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n / q.block_elems; ++i) q.dequant(p + i * q.block_bytes, dst + i * q.block_elems);
}

float dequantize_at(ep_moe_dtype_t t, const void* row, int64_t i) {
  const QuantTraits& q = *quant_traits(t);
  float y[256];
  q.dequant(static_cast<const uint8_t*>(row) + (i / q.block_elems) * q.block_bytes, y);
  return y[i % q.block_elems];
}

void quantize_row(ep_moe_dtype_t t, const float* src, void* dst, int64_t n) {
  const QuantTraits& q = *quant_traits(t);
  auto* p = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n / q.block_elems; ++i) q.quant(src + i * q.block_elems, p + i * q.block_bytes);
}

void quantize_act_row(const float* x, int64_t k, ActQuant aq, void* out) {
  const int64_t kp = act_row_padded(k);
  auto* q = static_cast<int8_t*>(out);
  auto* d = reinterpret_cast<float*>(static_cast<char*>(out) + kp);
  auto* s = reinterpret_cast<int16_t*>(static_cast<char*>(out) + kp + kp / 32 * 4);
  const int64_t bs = aq == ActQuant::Q8_K ? 256 : 32;
  for (int64_t b0 = 0; b0 < kp; b0 += bs) {
    float amax = 0;
    for (int64_t i = b0; i < std::min(b0 + bs, k); ++i) amax = std::max(amax, std::fabs(x[i]));
    const float db = amax / 127.0f, id = db != 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = b0; i < b0 + bs; ++i) q[i] = i < k ? static_cast<int8_t>(std::nearbyint(x[i] * id)) : 0;
    for (int64_t j = b0 / 32; j < (b0 + bs) / 32; ++j) d[j] = db;
  }
  for (int64_t g = 0; g < kp / 16; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
    s[g] = static_cast<int16_t>(sum);
  }
}

}  // namespace ep_moe

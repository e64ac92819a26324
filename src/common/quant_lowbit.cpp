// GGUF's low-bit block formats that ep_moe computes through their decoded
// form (quant.hpp's DecodedBlock): Q4_1, Q5_0, Q5_1, IQ4_NL (32 elements)
// and Q2_K, Q3_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (256).
// The decoders follow GGUF's block layouts, grids and scale rules; each
// scale is computed in f32 in the order GGUF's dequantization computes it,
// so sc * v (+ mn) is its value bit for bit (tests/io/quant_ref_test).
//
// The quantizers make valid blocks for weights ep_moe quantizes itself (the
// bench, the demo, the tests): one scale per sub-block from its largest
// magnitude, values rounded to the nearest level, grid points the nearest
// by squared distance. They do not search scales to minimise the error as
// llama.cpp's do (checkpoints come quantized).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.hpp"
#include "common/quant.hpp"
#include "common/quant_formats.hpp"
#include "common/quant_grids.hpp"

namespace ep_moe {
namespace qf {

namespace {

uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void wr16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xff);
  p[1] = static_cast<uint8_t>(v >> 8);
}
float f16at(const uint8_t* p) { return f16_to_f32(rd16(p)); }
// A scale as stored (f16) and read back.
float f16_round(float x) { return f16_to_f32(f32_to_f16(x)); }
void put8(int8_t* v, uint64_t bytes) { std::memcpy(v, &bytes, 8); }
void fill2(float* a, int i, float x) { a[2 * i] = a[2 * i + 1] = x; }
int round_away(float x) { return static_cast<int>(std::round(x)); }
int clampi(int v, int lo, int hi) { return std::min(hi, std::max(lo, v)); }

float amax_of(const float* x, int n) {
  float a = 0;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}
// The value of largest magnitude (its sign kept).
float signed_max(const float* x, int n) {
  float a = 0, m = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > a) {
      a = std::fabs(x[i]);
      m = x[i];
    }
  return m;
}

// ---- 32-element formats ----------------------------------------------------

// 32 values: the low nibbles of qs, then the high ones, each with bit i of
// qh as its fifth bit, less offset.
void nibbles(const uint8_t* qs, uint32_t qh, int offset, int8_t* v) {
  for (int i = 0; i < 32; ++i) {
    const int lo = i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
    v[i] = static_cast<int8_t>((lo | (((qh >> i) & 1) << 4)) - offset);
  }
}

// Min/max formats (Q4_1, Q5_1): levels steps from the block's minimum.
void quant_minmax(const float* x, uint8_t* b, int levels, bool five) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < 32; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float d = (hi - lo) / static_cast<float>(levels), id = d != 0 ? 1.0f / d : 0.0f;
  wr16(b, f32_to_f16(d));
  wr16(b + 2, f32_to_f16(lo));
  uint8_t* qs = b + (five ? 8 : 4);
  uint32_t qh = 0;
  std::memset(qs, 0, 16);
  for (int i = 0; i < 32; ++i) {
    const int q = clampi(static_cast<int>((x[i] - lo) * id + 0.5f), 0, levels);
    qs[i % 16] |= static_cast<uint8_t>((q & 0xF) << (i < 16 ? 0 : 4));
    qh |= static_cast<uint32_t>((q >> 4) & 1) << i;
  }
  if (five) std::memcpy(b + 4, &qh, 4);
}

}  // namespace

void decode_q4_1(const uint8_t* b, DecodedBlock* o) {
  fill2(o->sc, 0, f16at(b));
  fill2(o->mn, 0, f16at(b + 2));
  nibbles(b + 4, 0, 0, o->v);
}
void quant_q4_1(const float* x, uint8_t* b) { quant_minmax(x, b, 15, false); }

void decode_q5_0(const uint8_t* b, DecodedBlock* o) {
  fill2(o->sc, 0, f16at(b));
  nibbles(b + 6, rd32(b + 2), 16, o->v);
}
void quant_q5_0(const float* x, uint8_t* b) {
  const float d = signed_max(x, 32) / -16.0f, id = d != 0 ? 1.0f / d : 0.0f;
  wr16(b, f32_to_f16(d));
  uint8_t* qs = b + 6;
  uint32_t qh = 0;
  std::memset(qs, 0, 16);
  for (int i = 0; i < 32; ++i) {
    const int q = clampi(static_cast<int>(x[i] * id + 16.5f), 0, 31);
    qs[i % 16] |= static_cast<uint8_t>((q & 0xF) << (i < 16 ? 0 : 4));
    qh |= static_cast<uint32_t>(q >> 4) << i;
  }
  std::memcpy(b + 2, &qh, 4);
}

void decode_q5_1(const uint8_t* b, DecodedBlock* o) {
  fill2(o->sc, 0, f16at(b));
  fill2(o->mn, 0, f16at(b + 2));
  nibbles(b + 8, rd32(b + 4), 0, o->v);
}
void quant_q5_1(const float* x, uint8_t* b) { quant_minmax(x, b, 31, true); }

void decode_iq4_nl(const uint8_t* b, DecodedBlock* o) {
  fill2(o->sc, 0, f16at(b));
  for (int i = 0; i < 16; ++i) {
    o->v[i] = kIq4nlValues[b[2 + i] & 0xF];
    o->v[16 + i] = kIq4nlValues[b[2 + i] >> 4];
  }
}
void quant_iq4_nl(const float* x, uint8_t* b) {
  // The table's extremes are -127 and 113: the sign that maps the largest
  // magnitude onto -127.
  const float d = f16_round(signed_max(x, 32) / -127.0f);
  wr16(b, f32_to_f16(d));
  std::memset(b + 2, 0, 16);
  for (int i = 0; i < 32; ++i) {
    int bi = 0;
    float be = INFINITY;
    for (int q = 0; q < 16; ++q) {
      const float err = std::fabs(d * static_cast<float>(kIq4nlValues[q]) - x[i]);
      if (err < be) {
        be = err;
        bi = q;
      }
    }
    b[2 + i % 16] |= static_cast<uint8_t>(bi << (i < 16 ? 0 : 4));
  }
}

// ---- Q2_K, Q3_K --------------------------------------------------------------
// Element e = 128 h + 32 s + i of both is 2 bits at shift 2 s of qs[32 h + i].

void decode_q2_k(const uint8_t* b, DecodedBlock* o) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = f16at(b + 80), dmin = f16at(b + 82);
  for (int e = 0; e < 256; ++e) o->v[e] = static_cast<int8_t>((qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3);
  for (int g = 0; g < 16; ++g) {
    o->sc[g] = d * static_cast<float>(scales[g] & 0xF);
    o->mn[g] = -(dmin * static_cast<float>(scales[g] >> 4));
  }
}
void quant_q2_k(const float* x, uint8_t* b) {
  float step[16], mn[16], max_step = 0, max_mn = 0;
  for (int g = 0; g < 16; ++g) {
    float lo = 0, hi = 0;
    for (int i = 0; i < 16; ++i) {
      lo = std::min(lo, x[16 * g + i]);
      hi = std::max(hi, x[16 * g + i]);
    }
    step[g] = (hi - lo) / 3.0f;
    mn[g] = -lo;
    max_step = std::max(max_step, step[g]);
    max_mn = std::max(max_mn, mn[g]);
  }
  const float d = f16_round(max_step / 15.0f), dmin = f16_round(max_mn / 15.0f);
  wr16(b + 80, f32_to_f16(d));
  wr16(b + 82, f32_to_f16(dmin));
  uint8_t* qs = b + 16;
  std::memset(qs, 0, 64);
  for (int g = 0; g < 16; ++g) {
    const int sc = d > 0 ? clampi(round_away(step[g] / d), 0, 15) : 0;
    const int m = dmin > 0 ? clampi(round_away(mn[g] / dmin), 0, 15) : 0;
    b[g] = static_cast<uint8_t>(sc | (m << 4));
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    for (int i = 0; i < 16; ++i) {
      const int e = 16 * g + i;
      const int q = dl > 0 ? clampi(round_away((x[e] + ml) / dl), 0, 3) : 0;
      qs[32 * (e / 128) + e % 32] |= static_cast<uint8_t>(q << (2 * (e / 32 % 4)));
    }
  }
}

void decode_q3_k(const uint8_t* b, DecodedBlock* o) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = f16at(b + 108);
  for (int e = 0; e < 256; ++e) {
    const int lo = (qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3;
    const int high = (hmask[e % 32] >> (e / 32)) & 1;
    o->v[e] = static_cast<int8_t>(lo - (high ? 0 : 4));
  }
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
    const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    o->sc[j] = d * static_cast<float>((low | (high << 4)) - 32);
  }
}
void quant_q3_k(const float* x, uint8_t* b) {
  // Per 16 elements the value of largest magnitude maps onto -4.
  float scale[16], max_abs = 0;
  for (int g = 0; g < 16; ++g) {
    scale[g] = signed_max(x + 16 * g, 16) / -4.0f;
    max_abs = std::max(max_abs, std::fabs(scale[g]));
  }
  const float d = f16_round(max_abs / 31.0f);
  wr16(b + 108, f32_to_f16(d));
  uint8_t* hmask = b;
  uint8_t* qs = b + 32;
  uint8_t* sc = b + 96;
  std::memset(b, 0, 108);
  for (int j = 0; j < 16; ++j) {
    const int l = d > 0 ? clampi(round_away(scale[j] / d), -32, 31) : 0;
    const int s = l + 32;
    sc[j % 8] |= static_cast<uint8_t>((s & 0xF) << (j < 8 ? 0 : 4));
    sc[8 + j % 4] |= static_cast<uint8_t>((s >> 4) << (2 * (j / 4)));
    const float dl = d * static_cast<float>(l);
    for (int i = 0; i < 16; ++i) {
      const int e = 16 * j + i;
      const int q = dl != 0 ? clampi(round_away(x[e] / dl), -4, 3) : 0;
      qs[32 * (e / 128) + e % 32] |= static_cast<uint8_t>(((q + 4) & 3) << (2 * (e / 32 % 4)));
      hmask[e % 32] |= static_cast<uint8_t>(((q + 4) >> 2) << (e / 32));
    }
  }
}

// ---- grid formats -------------------------------------------------------------

void decode_iq2_xxs(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const float d = f16at(b);
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t aux0 = rd32(b + 2 + 8 * ib), aux1 = rd32(b + 6 + 8 * ib);
    fill2(o->sc, ib, d * (0.5f + static_cast<float>(aux1 >> 28)) * 0.25f);
    for (int l = 0; l < 4; ++l)
      put8(o->v + 32 * ib + 8 * l,
           grids::apply_signs(g.iq2xxs[(aux0 >> (8 * l)) & 0xFF], g.sign_mask[(aux1 >> (7 * l)) & 127]));
  }
}

void decode_iq2_xs(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const float d = f16at(b);
  for (int l = 0; l < 32; ++l) {
    const uint16_t q = rd16(b + 2 + 2 * l);
    put8(o->v + 8 * l, grids::apply_signs(g.iq2xs[q & 511], g.sign_mask[q >> 9]));
  }
  for (int j = 0; j < 16; ++j)
    o->sc[j] = d * (0.5f + static_cast<float>((b[66 + j / 2] >> (4 * (j % 2))) & 0xF)) * 0.25f;
}

void decode_iq2_s(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const float d = f16at(b);
  const uint8_t* qs = b + 2;
  const uint8_t* signs = b + 34;
  const uint8_t* qh = b + 66;
  for (int l = 0; l < 32; ++l) {
    const int idx = qs[l] | (((qh[l / 4] >> (2 * (l % 4))) & 3) << 8);
    put8(o->v + 8 * l, grids::apply_signs(g.iq2s[idx], g.bit_mask[signs[l]]));
  }
  for (int j = 0; j < 16; ++j)
    o->sc[j] = d * (0.5f + static_cast<float>((b[74 + j / 2] >> (4 * (j % 2))) & 0xF)) * 0.25f;
}

void decode_iq3_xxs(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const float d = f16at(b);
  const uint8_t* qs = b + 2;
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t aux = rd32(b + 66 + 4 * ib);
    fill2(o->sc, ib, d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f);
    for (int l = 0; l < 4; ++l) {
      const uint64_t v = g.iq3xxs[qs[8 * ib + 2 * l]] | static_cast<uint64_t>(g.iq3xxs[qs[8 * ib + 2 * l + 1]]) << 32;
      put8(o->v + 32 * ib + 8 * l, grids::apply_signs(v, g.sign_mask[(aux >> (7 * l)) & 127]));
    }
  }
}

void decode_iq3_s(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const float d = f16at(b);
  const uint8_t* qs = b + 2;
  const uint8_t* qh = b + 66;
  const uint8_t* signs = b + 74;
  for (int l = 0; l < 32; ++l) {
    uint64_t v = 0;
    for (int h = 0; h < 2; ++h) {
      const int q = 2 * l + h;
      v |= static_cast<uint64_t>(g.iq3s[qs[q] | (((qh[q / 8] >> (q % 8)) & 1) << 8)]) << (32 * h);
    }
    put8(o->v + 8 * l, grids::apply_signs(v, g.bit_mask[signs[l]]));
  }
  for (int ib = 0; ib < 8; ++ib)
    fill2(o->sc, ib, d * static_cast<float>(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF)));
}

namespace {
// 8 ternary grid values g as 8 g + 1 (delta +1/8) or 8 g - 1 (delta -1/8).
void put_ternary(int8_t* v, uint64_t grid, bool minus) {
  for (int j = 0; j < 8; ++j)
    v[j] = static_cast<int8_t>(8 * static_cast<int8_t>(grid >> (8 * j) & 0xFF) + (minus ? -1 : 1));
}
}  // namespace

void decode_iq1_s(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const float d = f16at(b);
  for (int ib = 0; ib < 8; ++ib) {
    const uint16_t h = rd16(b + 34 + 2 * ib);
    fill2(o->sc, ib, d * static_cast<float>(2 * ((h >> 12) & 7) + 1) * 0.125f);
    for (int l = 0; l < 4; ++l)
      put_ternary(o->v + 32 * ib + 8 * l, g.iq1s[b[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)], (h & 0x8000) != 0);
  }
}

void decode_iq1_m(const uint8_t* b, DecodedBlock* o) {
  const auto& g = grids::expanded();
  const uint8_t* qs = b;
  const uint8_t* qh = b + 32;
  uint16_t sc[4];
  for (int k = 0; k < 4; ++k) sc[k] = rd16(b + 48 + 2 * k);
  const auto bits =
      static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
  const float d = f16_to_f32(bits);
  for (int j = 0; j < 16; ++j) o->sc[j] = d * static_cast<float>(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1) * 0.125f;
  for (int q = 0; q < 32; ++q) {
    const int h = qh[q / 2] >> (4 * (q % 2));
    put_ternary(o->v + 8 * q, g.iq1s[qs[q] | ((h & 7) << 8)], (h & 8) != 0);
  }
}

// ---- grid quantizers ------------------------------------------------------------

namespace {

// The nearest grid entry (squared distance) of every tuple of level
// indices: `dims` values of `nl` levels each, entries as level indices.
class NearestGrid {
 public:
  NearestGrid(const uint8_t* entries, int n, int dims, int nl, const float* levels) : dims_(dims), nl_(nl) {
    int tuples = 1;
    for (int i = 0; i < dims; ++i) tuples *= nl;
    best_.resize(static_cast<size_t>(tuples));
    std::vector<int> t(static_cast<size_t>(dims));
    for (int c = 0; c < tuples; ++c) {
      for (int i = 0, r = c; i < dims; ++i, r /= nl) t[static_cast<size_t>(i)] = r % nl;
      float be = INFINITY;
      for (int e = 0; e < n; ++e) {
        float err = 0;
        for (int i = 0; i < dims; ++i) {
          const float diff = levels[t[static_cast<size_t>(i)]] - levels[entries[e * dims + i]];
          err += diff * diff;
        }
        if (err < be) {
          be = err;
          best_[static_cast<size_t>(c)] = static_cast<uint16_t>(e);
        }
      }
    }
  }
  // The entry for magnitudes a[0 .. dims) in units of the levels.
  int find(const float* a, const float* levels) const {
    int code = 0;
    for (int i = dims_ - 1; i >= 0; --i) {
      int li = 0;
      for (int l = 1; l < nl_; ++l)
        if (std::fabs(a[i] - levels[l]) < std::fabs(a[i] - levels[li])) li = l;
      code = code * nl_ + li;
    }
    return best_[static_cast<size_t>(code)];
  }

 private:
  int dims_, nl_;
  std::vector<uint16_t> best_;
};

// A grid's entries as level indices, from its expanded values.
template <class T>
std::vector<uint8_t> level_indices(const T* grid, int n, int dims, const float* levels, int nl) {
  std::vector<uint8_t> out(static_cast<size_t>(n * dims));
  for (int e = 0; e < n; ++e)
    for (int i = 0; i < dims; ++i) {
      const auto v = static_cast<float>(static_cast<int8_t>(grid[e] >> (8 * i) & 0xFF));
      for (int l = 0; l < nl; ++l)
        if (levels[l] == v) out[static_cast<size_t>(e * dims + i)] = static_cast<uint8_t>(l);
    }
  return out;
}

const float kL2[3] = {8, 25, 43}, kL3xxs[8] = {4, 12, 20, 28, 36, 44, 52, 62}, kL3s[8] = {1, 3, 5, 7, 9, 11, 13, 15},
            kL1[3] = {-1, 0, 1};

template <class T, int N>
const NearestGrid& nearest(const T (&grid)[N], int dims, const float* levels, int nl) {
  // One per grid (the template is instantiated per grid size; IQ2_XXS/XS/S
  // and IQ3_XXS/S differ in N or T).
  static const NearestGrid g = [&] {
    const auto idx = level_indices(grid, N, dims, levels, nl);
    return NearestGrid(idx.data(), N, dims, nl, levels);
  }();
  return g;
}

// The sign bits of 8 values, with the eighth making the count of negative
// ones even (the smallest magnitude flipped where it is odd): 7-bit codes.
int sign_code7(const float* x, float* a) {
  int bits = 0, smallest = 0;
  for (int j = 0; j < 8; ++j) {
    if (x[j] < 0) bits |= 1 << j;
    if (std::fabs(x[j]) < std::fabs(x[smallest])) smallest = j;
  }
  int ones = 0;
  for (int j = 0; j < 8; ++j) ones += bits >> j & 1;
  if (ones & 1) bits ^= 1 << smallest;
  for (int j = 0; j < 8; ++j) a[j] = std::fabs(x[j]);
  return bits & 127;
}

// Scales of the IQ2/IQ3 forms db = d (base + ls) mul, ls in 0 .. 15: the d
// (f16) and each sub-block's ls for targets t (the sub-blocks' amax over the
// grid's largest level).
float grid_scales(const float* t, int n, float base, float mul, int* ls) {
  float tmax = 0;
  for (int i = 0; i < n; ++i) tmax = std::max(tmax, t[i]);
  const float d = f16_round(tmax / ((base + 15.0f) * mul));
  for (int i = 0; i < n; ++i) ls[i] = d > 0 ? clampi(round_away(t[i] / (d * mul) - base), 0, 15) : 0;
  return d;
}

// The 8 values at x in units of db, as a grid entry of the IQ2 grids.
template <class T, int N>
int iq2_entry(const T (&grid)[N], const float* x, float db, int* code7, uint8_t* signs8) {
  float a[8];
  const int c = sign_code7(x, a);
  if (code7) *code7 = c;
  if (signs8) {
    *signs8 = 0;
    for (int j = 0; j < 8; ++j)
      if (x[j] < 0) *signs8 |= static_cast<uint8_t>(1 << j);
    for (int j = 0; j < 8; ++j) a[j] = std::fabs(x[j]);
  }
  for (float& v : a) v = db > 0 ? v / db : 0;
  return nearest(grid, 8, kL2, 3).find(a, kL2);
}

}  // namespace

void quant_iq2_xxs(const float* x, uint8_t* b) {
  const auto& g = grids::expanded();
  float t[8];
  int ls[8];
  for (int ib = 0; ib < 8; ++ib) t[ib] = amax_of(x + 32 * ib, 32) / 43.0f;
  const float d = grid_scales(t, 8, 0.5f, 0.25f, ls);
  wr16(b, f32_to_f16(d));
  for (int ib = 0; ib < 8; ++ib) {
    const float db = d * (0.5f + static_cast<float>(ls[ib])) * 0.25f;
    uint32_t aux0 = 0, aux1 = static_cast<uint32_t>(ls[ib]) << 28;
    for (int l = 0; l < 4; ++l) {
      int c7;
      const int e = iq2_entry(g.iq2xxs, x + 32 * ib + 8 * l, db, &c7, nullptr);
      aux0 |= static_cast<uint32_t>(e) << (8 * l);
      aux1 |= static_cast<uint32_t>(c7) << (7 * l);
    }
    std::memcpy(b + 2 + 8 * ib, &aux0, 4);
    std::memcpy(b + 6 + 8 * ib, &aux1, 4);
  }
}

void quant_iq2_xs(const float* x, uint8_t* b) {
  const auto& g = grids::expanded();
  float t[16];
  int ls[16];
  for (int j = 0; j < 16; ++j) t[j] = amax_of(x + 16 * j, 16) / 43.0f;
  const float d = grid_scales(t, 16, 0.5f, 0.25f, ls);
  wr16(b, f32_to_f16(d));
  for (int j = 0; j < 8; ++j) b[66 + j] = static_cast<uint8_t>(ls[2 * j] | (ls[2 * j + 1] << 4));
  for (int l = 0; l < 32; ++l) {
    const float db = d * (0.5f + static_cast<float>(ls[l / 2])) * 0.25f;
    int c7;
    const int e = iq2_entry(g.iq2xs, x + 8 * l, db, &c7, nullptr);
    wr16(b + 2 + 2 * l, static_cast<uint16_t>(e | (c7 << 9)));
  }
}

void quant_iq2_s(const float* x, uint8_t* b) {
  const auto& g = grids::expanded();
  float t[16];
  int ls[16];
  for (int j = 0; j < 16; ++j) t[j] = amax_of(x + 16 * j, 16) / 43.0f;
  const float d = grid_scales(t, 16, 0.5f, 0.25f, ls);
  wr16(b, f32_to_f16(d));
  std::memset(b + 66, 0, 8);
  for (int j = 0; j < 8; ++j) b[74 + j] = static_cast<uint8_t>(ls[2 * j] | (ls[2 * j + 1] << 4));
  for (int l = 0; l < 32; ++l) {
    const float db = d * (0.5f + static_cast<float>(ls[l / 2])) * 0.25f;
    uint8_t s8;
    const int e = iq2_entry(g.iq2s, x + 8 * l, db, nullptr, &s8);
    b[2 + l] = static_cast<uint8_t>(e & 0xFF);
    b[34 + l] = s8;
    b[66 + l / 4] |= static_cast<uint8_t>((e >> 8) << (2 * (l % 4)));
  }
}

void quant_iq3_xxs(const float* x, uint8_t* b) {
  const auto& g = grids::expanded();
  const NearestGrid& ng = nearest(g.iq3xxs, 4, kL3xxs, 8);
  float t[8];
  int ls[8];
  for (int ib = 0; ib < 8; ++ib) t[ib] = amax_of(x + 32 * ib, 32) / 62.0f;
  const float d = grid_scales(t, 8, 0.5f, 0.5f, ls);
  wr16(b, f32_to_f16(d));
  for (int ib = 0; ib < 8; ++ib) {
    const float db = d * (0.5f + static_cast<float>(ls[ib])) * 0.5f;
    uint32_t aux = static_cast<uint32_t>(ls[ib]) << 28;
    for (int l = 0; l < 4; ++l) {
      float a[8];
      aux |= static_cast<uint32_t>(sign_code7(x + 32 * ib + 8 * l, a)) << (7 * l);
      for (float& v : a) v = db > 0 ? v / db : 0;
      b[2 + 8 * ib + 2 * l] = static_cast<uint8_t>(ng.find(a, kL3xxs));
      b[2 + 8 * ib + 2 * l + 1] = static_cast<uint8_t>(ng.find(a + 4, kL3xxs));
    }
    std::memcpy(b + 66 + 4 * ib, &aux, 4);
  }
}

void quant_iq3_s(const float* x, uint8_t* b) {
  const auto& g = grids::expanded();
  const NearestGrid& ng = nearest(g.iq3s, 4, kL3s, 8);
  float t[8];
  int ls[8];
  for (int ib = 0; ib < 8; ++ib) t[ib] = amax_of(x + 32 * ib, 32) / 15.0f;
  // db = d (1 + 2 s): base 0.5, mul 2.
  const float d = grid_scales(t, 8, 0.5f, 2.0f, ls);
  wr16(b, f32_to_f16(d));
  std::memset(b + 66, 0, 8 + 32 + 4);
  for (int ib = 0; ib < 8; ++ib) {
    b[106 + ib / 2] |= static_cast<uint8_t>(ls[ib] << (4 * (ib % 2)));
    const float db = d * static_cast<float>(1 + 2 * ls[ib]);
    for (int q = 8 * ib; q < 8 * ib + 8; ++q) {
      float a[4];
      for (int j = 0; j < 4; ++j) {
        const float v = x[4 * q + j];
        if (v < 0) b[74 + q / 2] |= static_cast<uint8_t>(1 << (4 * (q % 2) + j));
        a[j] = db > 0 ? std::fabs(v) / db : 0;
      }
      const int e = ng.find(a, kL3s);
      b[2 + q] = static_cast<uint8_t>(e & 0xFF);
      b[66 + q / 8] |= static_cast<uint8_t>((e >> 8) << (q % 8));
    }
  }
}

namespace {
// The ternary entry for 8 values in units of dl with shift delta, and its
// squared error.
int iq1_entry(const float* x, float dl, float delta, float* err) {
  const auto& g = grids::expanded();
  float a[8];
  for (int j = 0; j < 8; ++j) a[j] = dl > 0 ? x[j] / dl - delta : 0;
  const int e = nearest(g.iq1s, 8, kL1, 3).find(a, kL1);
  float s = 0;
  for (int j = 0; j < 8; ++j) {
    const float v = dl * (static_cast<float>(static_cast<int8_t>(g.iq1s[e] >> (8 * j) & 0xFF)) + delta) - x[j];
    s += v * v;
  }
  *err += s;
  return e;
}
// n groups of 8 at x with scale dl: the entries and whether delta is
// -1/8 (the sign with the smaller error).
bool iq1_groups(const float* x, int n, float dl, int* entries) {
  int plus[4], minus[4];
  float ep = 0, em = 0;
  for (int l = 0; l < n; ++l) {
    plus[l] = iq1_entry(x + 8 * l, dl, 0.125f, &ep);
    minus[l] = iq1_entry(x + 8 * l, dl, -0.125f, &em);
  }
  const bool neg = em < ep;
  for (int l = 0; l < n; ++l) entries[l] = neg ? minus[l] : plus[l];
  return neg;
}
}  // namespace

void quant_iq1_s(const float* x, uint8_t* b) {
  float t[8], tmax = 0;
  for (int ib = 0; ib < 8; ++ib) tmax = std::max(tmax, t[ib] = amax_of(x + 32 * ib, 32) / 1.125f);
  const float d = f16_round(tmax / 15.0f);
  wr16(b, f32_to_f16(d));
  for (int ib = 0; ib < 8; ++ib) {
    const int s = d > 0 ? clampi(round_away((t[ib] / d - 1.0f) / 2.0f), 0, 7) : 0;
    int e[4];
    const bool neg = iq1_groups(x + 32 * ib, 4, d * static_cast<float>(2 * s + 1), e);
    uint16_t h = static_cast<uint16_t>((s << 12) | (neg ? 0x8000 : 0));
    for (int l = 0; l < 4; ++l) {
      b[2 + 4 * ib + l] = static_cast<uint8_t>(e[l] & 0xFF);
      h = static_cast<uint16_t>(h | ((e[l] >> 8) << (3 * l)));
    }
    wr16(b + 34 + 2 * ib, h);
  }
}

void quant_iq1_m(const float* x, uint8_t* b) {
  float t[16], tmax = 0;
  for (int j = 0; j < 16; ++j) tmax = std::max(tmax, t[j] = amax_of(x + 16 * j, 16) / 1.125f);
  const uint16_t dbits = f32_to_f16(tmax / 15.0f);
  const float d = f16_to_f32(dbits);
  uint16_t sc[4] = {};
  std::memset(b + 32, 0, 16);
  for (int j = 0; j < 16; ++j) {
    const int s = d > 0 ? clampi(round_away((t[j] / d - 1.0f) / 2.0f), 0, 7) : 0;
    sc[j / 4] = static_cast<uint16_t>(sc[j / 4] | (s << (3 * (j % 4))));
    const float dl = d * static_cast<float>(2 * s + 1);
    for (int h = 0; h < 2; ++h) {
      const int q = 2 * j + h;
      int e;
      const bool neg = iq1_groups(x + 8 * q, 1, dl, &e);
      b[q] = static_cast<uint8_t>(e & 0xFF);
      b[32 + q / 2] |= static_cast<uint8_t>(((e >> 8) | (neg ? 8 : 0)) << (4 * (q % 2)));
    }
  }
  for (int k = 0; k < 4; ++k) wr16(b + 48 + 2 * k, static_cast<uint16_t>(sc[k] | ((dbits >> (4 * k)) & 0xF) << 12));
}

}  // namespace qf
}  // namespace ep_moe

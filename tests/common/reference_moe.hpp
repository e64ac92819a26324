// An independent reference for the MoE layer: a plain single-rank dense
// MoE in double precision, written from the semantics (vLLM fused_topk /
// grouped_topk routing, gated FFN experts, shared expert with optional
// sigmoid gate). It shares no code with the library.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace ref {

enum Act { SILU = 0, GELU = 1, GELU_TANH = 2, SWIGLU_OAI = 3 };
enum DType { F32 = 0, BF16 = 1, F16 = 2 };

// ---- 16-bit float encodings (round to nearest even), test-side copies ----
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float from_f16(uint16_t h) {
  // ldexp-based decode: independent of the library's bit twiddling.
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 31, man = h & 1023;
  double v;
  if (exp == 0) v = std::ldexp(man, -24);
  else if (exp == 31) v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else v = std::ldexp(1024 + man, exp - 25);
  return static_cast<float>(sign ? -v : v);
}
inline uint16_t to_f16(float f) {
  // Search-free encode for finite values within range, by rounding the
  // significand with nearbyint (ties to even under the default mode).
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1;    // a = 1.x * 2^exp
  if (exp < -14) {    // subnormal: units of 2^-24
    const double q = std::nearbyint(std::ldexp(a, 24));
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
  }
  double q = std::nearbyint(std::ldexp(a, 10 - exp));  // 1024 .. 2048
  if (q >= 2048) {
    q /= 2;
    ++exp;
  }
  if (exp > 15) return static_cast<uint16_t>(sign | 0x7c00);
  return static_cast<uint16_t>(sign | ((exp + 15) << 10) | (static_cast<int>(q) - 1024));
}

// Rounds v to what a buffer of dtype `dt` stores.
inline float round_to(float v, int dt) {
  if (dt == BF16) return from_bf16(to_bf16(v));
  if (dt == F16) return from_f16(to_f16(v));
  return v;
}

// Encodes floats (already representable) into a byte buffer of dtype dt.
inline std::vector<uint8_t> encode(const std::vector<float>& v, int dt) {
  std::vector<uint8_t> out(v.size() * (dt == F32 ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == F32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = dt == BF16 ? to_bf16(v[i]) : to_f16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
inline std::vector<float> decode(const void* p, size_t n, int dt) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dt == F32) {
      std::memcpy(&out[i], static_cast<const char*>(p) + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
      out[i] = dt == BF16 ? from_bf16(h) : from_f16(h);
    }
  }
  return out;
}

struct Spec {
  int H = 64, I = 32, E = 8, K = 2;
  int act = SILU;
  bool sigmoid = false, renormalize = true;
  int groups = 0, topk_group = 0;
  bool use_bias = false;
  double scale = 1.0;
  int Is = 0;  // shared expert intermediate (0 = none)
  bool shared_gate = false;
  bool expert_bias = false;  // routed experts have gate, up and down biases (GPT-OSS)
  // Routed experts in block formats: the int8 activation blocks (elements)
  // the kernels quantize the inputs of gate/up and of down to (0: none).
  int act_block_gu = 0, act_block_down = 0;
  // The same for the shared expert when its parts are held as blocks.
  int shared_act_block_gu = 0, shared_act_block_down = 0;
};

// How near (in int8 steps) to a rounding boundary an activation must fall
// for the kernels' f32 value, a few 1e-5 steps from the float64 one, to
// round the other way: well inside this.
constexpr double kNearBoundary = 1e-3;

// x as the kernels quantize an activation row for block-format weights: per
// block of `bs`, d = amax / 127 and q = x * (127 / amax) rounded to nearest
// even, in f32; the row's values q * d. `near` (optional) gets each
// element's step d where it lies within kNearBoundary of a rounding
// boundary (the kernels may land one step apart there), else 0.
inline std::vector<double> quantize_acts(const std::vector<double>& x, int bs, std::vector<double>* near = nullptr) {
  const int n = static_cast<int>(x.size());
  std::vector<double> out(x.size());
  if (near) near->assign(x.size(), 0.0);
  for (int b0 = 0; b0 < n; b0 += bs) {
    float amax = 0;
    for (int i = b0; i < std::min(n, b0 + bs); ++i)
      amax = std::max(amax, std::fabs(static_cast<float>(x[static_cast<size_t>(i)])));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    for (int i = b0; i < std::min(n, b0 + bs); ++i) {
      const float v = static_cast<float>(x[static_cast<size_t>(i)]) * id;
      out[static_cast<size_t>(i)] = static_cast<double>(std::nearbyint(v)) * d;
      if (near && std::fabs(std::fabs(v - std::floor(v)) - 0.5) < kNearBoundary) (*near)[static_cast<size_t>(i)] = d;
    }
  }
  return out;
}

// Weights as the layer stores them (already rounded to the weight dtype).
struct Weights {
  std::vector<std::vector<float>> gate, up, down;        // per expert: [I,H], [I,H], [H,I]
  std::vector<float> s_gate, s_up, s_down;               // [Is,H], [Is,H], [H,Is]
  std::vector<float> s_gate_w;                           // [H]
  std::vector<float> bias;                               // [E]
  std::vector<std::vector<float>> gate_b, up_b, down_b;  // per expert: [I], [I], [H] (expert_bias)
  // Routed experts given in a block format: the blocks (per expert) whose
  // values gate, up and down hold.
  std::vector<std::vector<uint8_t>> gate_q, up_q, down_q;
  std::vector<uint8_t> s_gate_q, s_up_q, s_down_q;  // the shared expert's, likewise
};

inline Weights random_weights(const Spec& s, int wdt, std::mt19937& rng) {
  // Scales keep activations O(1) through the FFN for any H, I.
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float sw = 1.0f / std::sqrt(static_cast<float>(s.H));
  auto fill = [&](size_t count, float scale) {
    std::vector<float> v(count);
    for (auto& x : v) x = round_to(n(rng) * scale, wdt);
    return v;
  };
  Weights w;
  // The clamped SwiGLU clamps at 7: larger gate/up weights reach it.
  const float gu = s.act == SWIGLU_OAI ? 4.0f * sw : sw;
  for (int e = 0; e < s.E; ++e) {
    w.gate.push_back(fill(static_cast<size_t>(s.I) * s.H, gu));
    w.up.push_back(fill(static_cast<size_t>(s.I) * s.H, gu));
    w.down.push_back(fill(static_cast<size_t>(s.H) * s.I, 1.0f / std::sqrt(static_cast<float>(s.I))));
    if (s.expert_bias) {  // f32, as the layer keeps them
      auto vec = [&](int count, float scale) {
        std::vector<float> v(static_cast<size_t>(count));
        for (auto& x : v) x = n(rng) * scale;
        return v;
      };
      w.gate_b.push_back(vec(s.I, 1.0f));
      w.up_b.push_back(vec(s.I, 1.0f));
      w.down_b.push_back(vec(s.H, 0.5f));
    }
  }
  if (s.Is > 0) {
    w.s_gate = fill(static_cast<size_t>(s.Is) * s.H, sw);
    w.s_up = fill(static_cast<size_t>(s.Is) * s.H, sw);
    w.s_down = fill(static_cast<size_t>(s.H) * s.Is, 1.0f / std::sqrt(static_cast<float>(s.Is)));
    if (s.shared_gate) {
      w.s_gate_w.resize(static_cast<size_t>(s.H));
      for (auto& x : w.s_gate_w) x = n(rng) * sw;  // f32 as given
    }
  }
  if (s.use_bias) {
    w.bias.resize(static_cast<size_t>(s.E));
    for (auto& x : w.bias) x = 0.05f * n(rng);
  }
  return w;
}

// The gated activation of a (gate, up) pair.
inline double act_fn(int act, double g, double u) {
  switch (act) {
    case GELU: return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))) * u;
    case GELU_TANH: return 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g))) * u;
    case SWIGLU_OAI: {  // GPT-OSS: alpha 1.702, swiglu_limit 7
      const double gc = std::min(g, 7.0), uc = std::max(-7.0, std::min(u, 7.0));
      return (uc + 1.0) * gc / (1.0 + std::exp(-1.702 * gc));
    }
    default: return g / (1.0 + std::exp(-g)) * u;
  }
}

// Top-k indices, ties to the lower index.
inline std::vector<int> top(const std::vector<double>& v, int k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int a, int b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// Routes one token in double. Returns false when the choice sits on a
// near-tie (gap below `margin`), where f32 and double may choose differently.
inline bool route(const Spec& s, const float* logits, const Weights& w, std::vector<int>& ids,
                  std::vector<double>& weights, double margin = 1e-4) {
  std::vector<double> sc(static_cast<size_t>(s.E));
  if (s.sigmoid) {
    for (int e = 0; e < s.E; ++e) sc[static_cast<size_t>(e)] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
  } else {
    double mx = -1e300, sum = 0;
    for (int e = 0; e < s.E; ++e) mx = std::max(mx, static_cast<double>(logits[e]));
    for (int e = 0; e < s.E; ++e) sum += sc[static_cast<size_t>(e)] = std::exp(logits[e] - mx);
    for (auto& x : sc) x /= sum;
  }
  std::vector<double> sel = sc;
  if (s.use_bias)
    for (int e = 0; e < s.E; ++e) sel[static_cast<size_t>(e)] += w.bias[static_cast<size_t>(e)];
  bool clear = true;
  if (s.groups > 0) {
    const int per = s.E / s.groups;
    std::vector<double> gs(static_cast<size_t>(s.groups));
    for (int g = 0; g < s.groups; ++g) {
      std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs[static_cast<size_t>(g)] = s.use_bias ? (per >= 2 ? v[0] + v[1] : v[0]) : v[0];
    }
    auto kept = top(gs, s.topk_group);
    if (s.topk_group < s.groups) {
      std::vector<double> sorted = gs;
      std::sort(sorted.rbegin(), sorted.rend());
      if (sorted[static_cast<size_t>(s.topk_group - 1)] - sorted[static_cast<size_t>(s.topk_group)] < margin)
        clear = false;
    }
    std::vector<char> keep(static_cast<size_t>(s.groups), 0);
    for (int g : kept) keep[static_cast<size_t>(g)] = 1;
    for (int e = 0; e < s.E; ++e)
      if (!keep[static_cast<size_t>(e / per)]) sel[static_cast<size_t>(e)] = -std::numeric_limits<double>::infinity();
  }
  ids = top(sel, s.K);
  if (s.K < s.E) {
    std::vector<double> sorted = sel;
    std::sort(sorted.rbegin(), sorted.rend());
    const double a = sorted[static_cast<size_t>(s.K - 1)], b = sorted[static_cast<size_t>(s.K)];
    if (std::isfinite(b) && a - b < margin) clear = false;
  }
  weights.resize(static_cast<size_t>(s.K));
  double sum = 0;
  for (int k = 0; k < s.K; ++k)
    sum += weights[static_cast<size_t>(k)] = sc[static_cast<size_t>(ids[static_cast<size_t>(k)])];
  for (auto& x : weights) {
    if (s.renormalize) x /= sum;
    x *= s.scale;
  }
  return clear;
}

// One token through the MoE: y = sum_k w_k FFN_{id_k}(x) + [gate] * shared(x).
// slack (optional, [H]): per output, what the block-format experts' h
// elements on a rounding boundary may move it (one step each, through down).
inline void moe_token(const Spec& s, const Weights& w, const float* x, const std::vector<int>& ids,
                      const std::vector<double>& wts, double* y, double* slack = nullptr) {
  for (int i = 0; i < s.H; ++i) y[i] = 0;
  if (slack)
    for (int i = 0; i < s.H; ++i) slack[i] = 0;
  // Biases (gb, ub, db) may be null; qgu, qd: the activation block sizes
  // of block-format weights (0: float weights).
  auto ffn = [&](const std::vector<float>& g, const std::vector<float>& u, const std::vector<float>& d, int inter,
                 double scale, const float* gb, const float* ub, const float* db, int qgu, int qd) {
    std::vector<double> xv(x, x + s.H);
    if (qgu > 0) xv = quantize_acts(xv, qgu);
    std::vector<double> h(static_cast<size_t>(inter));
    for (int j = 0; j < inter; ++j) {
      double a = gb ? gb[j] : 0.0, b = ub ? ub[j] : 0.0;
      for (int i = 0; i < s.H; ++i) {
        a += static_cast<double>(g[static_cast<size_t>(j) * s.H + i]) * xv[static_cast<size_t>(i)];
        b += static_cast<double>(u[static_cast<size_t>(j) * s.H + i]) * xv[static_cast<size_t>(i)];
      }
      h[static_cast<size_t>(j)] = act_fn(s.act, a, b);
    }
    std::vector<double> near;
    if (qd > 0) h = quantize_acts(h, qd, &near);
    for (int i = 0; i < s.H; ++i) {
      double acc = db ? db[i] : 0.0, move = 0;
      for (int j = 0; j < inter; ++j) {
        acc += static_cast<double>(d[static_cast<size_t>(i) * inter + j]) * h[static_cast<size_t>(j)];
        if (!near.empty()) move += std::fabs(d[static_cast<size_t>(i) * inter + j]) * near[static_cast<size_t>(j)];
      }
      y[i] += scale * acc;
      if (slack) slack[i] += std::fabs(scale) * move;
    }
  };
  for (size_t k = 0; k < ids.size(); ++k) {
    const auto e = static_cast<size_t>(ids[k]);
    const bool b = s.expert_bias;
    ffn(w.gate[e], w.up[e], w.down[e], s.I, wts[k], b ? w.gate_b[e].data() : nullptr, b ? w.up_b[e].data() : nullptr,
        b ? w.down_b[e].data() : nullptr, s.act_block_gu, s.act_block_down);
  }
  if (s.Is > 0) {
    double g = 1.0;
    if (s.shared_gate) {
      double dot = 0;
      for (int i = 0; i < s.H; ++i) dot += static_cast<double>(w.s_gate_w[static_cast<size_t>(i)]) * x[i];
      g = 1.0 / (1.0 + std::exp(-dot));
    }
    ffn(w.s_gate, w.s_up, w.s_down, s.Is, g, nullptr, nullptr, nullptr, s.shared_act_block_gu, s.shared_act_block_down);
  }
}

}  // namespace ref

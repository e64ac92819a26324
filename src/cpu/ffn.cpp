#include "cpu/ffn.hpp"

#include <algorithm>
#include <cmath>

namespace ep_moe {
namespace cpu {

float activate(Act act, float g) {
  switch (act) {
    case Act::Silu: return g / (1.0f + std::exp(-g));
    case Act::Gelu: return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f));
    case Act::GeluTanh: {
      const float c = 0.79788456080286536f;  // sqrt(2 / pi)
      return 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g)));
    }
  }
  return g;
}

FfnRunner::FfnRunner(const Kernels& k, int32_t hidden, int32_t max_inter, int64_t chunk_rows, bool bf16_activations)
    : k_(k), hidden_(hidden), chunk_(std::max<int64_t>(1, chunk_rows)), bf16_act_(bf16_activations && k.tile_bf16) {
  // Room for a whole padded tile row so epilogues never bounds-check.
  const int32_t h = k.nr / 2;
  ldh_ = (max_inter + h - 1) / h * h;
  ldh_ = std::max(ldh_, k.nr);
  h_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(ldh_) * sizeof(float));
  y_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(hidden_) * sizeof(float));
  if (bf16_act_) {
    xb_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(hidden_) * 2);
    hb_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(ldh_) * 2);
  }
}

void FfnRunner::run(ThreadPool& pool, const std::vector<ExpertJob>& jobs, const float* x, int64_t ldx, float* acc,
                    int64_t ldacc, Act act) {
  std::vector<Segment> segs;
  int64_t used = 0;
  for (const ExpertJob& j : jobs) {
    int64_t b = 0;
    while (b < j.n) {
      const int64_t take = std::min(j.n - b, chunk_ - used);
      segs.push_back(Segment{&j, b, take, used});
      used += take;
      b += take;
      if (used == chunk_) {
        run_chunk(pool, segs, used, x, ldx, acc, ldacc, act);
        segs.clear();
        used = 0;
      }
    }
  }
  if (used > 0) run_chunk(pool, segs, used, x, ldx, acc, ldacc, act);
}

void FfnRunner::run_chunk(ThreadPool& pool, const std::vector<Segment>& segs, int64_t rows, const float* x,
                          int64_t ldx, float* acc, int64_t ldacc, Act act) {
  const int nr = k_.nr, mr = k_.mr, h = nr / 2;
  float* hbuf = h_.data<float>();
  float* ybuf = y_.data<float>();
  // bf16 weights on a CPU with bf16 dot products: the rows of x (gathered
  // in pair order) and h go through the tiles in bf16, as a GPU GEMM would.
  bool dot = bf16_act_;
  for (const Segment& s : segs)
    dot = dot && s.job->gate_up->dtype == EP_MOE_DTYPE_BF16 && s.job->down->dtype == EP_MOE_DTYPE_BF16;
  uint16_t* xb = dot ? xb_.data<uint16_t>() : nullptr;
  uint16_t* hb = dot ? hb_.data<uint16_t>() : nullptr;
  if (dot) {
    const int64_t block = 16;
    pool.parallel_for(static_cast<size_t>((rows + block - 1) / block), [&](size_t b, int) {
      const int64_t r0 = static_cast<int64_t>(b) * block, r1 = std::min<int64_t>(rows, r0 + block);
      size_t s = 0;
      for (int64_t r = r0; r < r1; ++r) {
        while (r >= segs[s].offset + segs[s].len) ++s;
        const int64_t tok = segs[s].job->rows[segs[s].begin + (r - segs[s].offset)];
        k_.to_bf16(x + tok * ldx, xb + r * hidden_, hidden_);
      }
    });
  }

  // Items of a phase: (segment, panel) pairs, flattened.
  std::vector<std::pair<int32_t, int32_t>> items;
  auto build = [&](bool gate_up) {
    items.clear();
    for (size_t s = 0; s < segs.size(); ++s) {
      const PackedWeight* w = gate_up ? segs[s].job->gate_up : segs[s].job->down;
      for (int32_t p = 0; p < w->panels(); ++p) items.emplace_back(static_cast<int32_t>(s), p);
    }
  };

  // Phase A: h = act(x W_gate^T) * (x W_up^T), per (segment, panel).
  build(true);
  pool.parallel_for(items.size(), [&](size_t it, int) {
    const Segment& s = segs[static_cast<size_t>(items[it].first)];
    const int32_t p = items[it].second;
    const PackedWeight& w = *s.job->gate_up;
    const TileFn tile = k_.tile[w.dtype];
    const float* a[16];
    const uint16_t* a16[16];
    float c[16 * 32];
    for (int64_t r0 = 0; r0 < s.len; r0 += mr) {
      const int m = static_cast<int>(std::min<int64_t>(mr, s.len - r0));
      if (dot) {
        for (int i = 0; i < m; ++i) a16[i] = xb + (s.offset + r0 + i) * hidden_;
        k_.tile_bf16(m, a16, w.k, w.panel(p), c);
        float hv[32];
        for (int i = 0; i < m; ++i) {
          const float* ci = c + i * nr;
          for (int j = 0; j < h; ++j) hv[j] = activate(act, ci[j]) * ci[h + j];
          k_.to_bf16(hv, hb + (s.offset + r0 + i) * ldh_ + static_cast<int64_t>(p) * h, h);
        }
        continue;
      }
      for (int i = 0; i < m; ++i) a[i] = x + static_cast<int64_t>(s.job->rows[s.begin + r0 + i]) * ldx;
      tile(m, a, w.k, w.panel(p), c);
      for (int i = 0; i < m; ++i) {
        float* dst = hbuf + (s.offset + r0 + i) * ldh_ + static_cast<int64_t>(p) * h;
        const float* ci = c + i * nr;
        for (int j = 0; j < h; ++j) dst[j] = activate(act, ci[j]) * ci[h + j];
      }
    }
  });

  // Phase B: y = h W_down^T, per (segment, panel of hidden columns).
  build(false);
  pool.parallel_for(items.size(), [&](size_t it, int) {
    const Segment& s = segs[static_cast<size_t>(items[it].first)];
    const int32_t p = items[it].second;
    const PackedWeight& w = *s.job->down;
    const TileFn tile = k_.tile[w.dtype];
    const float* a[16];
    const uint16_t* a16[16];
    float c[16 * 32];
    const int32_t col0 = p * nr;
    const int ncols = std::min(nr, hidden_ - col0);
    for (int64_t r0 = 0; r0 < s.len; r0 += mr) {
      const int m = static_cast<int>(std::min<int64_t>(mr, s.len - r0));
      if (dot) {
        for (int i = 0; i < m; ++i) a16[i] = hb + (s.offset + r0 + i) * ldh_;
        k_.tile_bf16(m, a16, w.k, w.panel(p), c);
      } else {
        for (int i = 0; i < m; ++i) a[i] = hbuf + (s.offset + r0 + i) * ldh_;
        tile(m, a, w.k, w.panel(p), c);
      }
      for (int i = 0; i < m; ++i) {
        float* dst = ybuf + (s.offset + r0 + i) * hidden_ + col0;
        for (int j = 0; j < ncols; ++j) dst[j] = c[i * nr + j];
      }
    }
  });

  // Phase C: acc[token] += weight * y, split by hidden columns so no two
  // threads touch the same element; rows are added in a fixed order.
  const int64_t col_block = 64;
  const size_t blocks = static_cast<size_t>((hidden_ + col_block - 1) / col_block);
  pool.parallel_for(blocks, [&](size_t b, int) {
    const int64_t c0 = static_cast<int64_t>(b) * col_block;
    const int64_t c1 = std::min<int64_t>(hidden_, c0 + col_block);
    for (const Segment& s : segs) {
      for (int64_t i = 0; i < s.len; ++i) {
        const float w = s.job->weights[s.begin + i];
        float* dst = acc + static_cast<int64_t>(s.job->rows[s.begin + i]) * ldacc;
        const float* src = ybuf + (s.offset + i) * hidden_;
        for (int64_t c = c0; c < c1; ++c) dst[c] += w * src[c];
      }
    }
  });
  (void)rows;
}

}  // namespace cpu
}  // namespace ep_moe

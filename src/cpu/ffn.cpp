#include "cpu/ffn.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ep_moe {
namespace cpu {

namespace {
// Most rows per kernel call (the c tile lives on the stack: kRows x 32 f32).
constexpr int kRows = 64;
// Most gate/up panels per work item of phase A: consecutive panels, so each
// kernel call prefetches the panel its thread takes next (12 measured best
// on qwen3 T=512; fewer when that would leave threads without items).
constexpr int32_t kMaxPanels = 12;
}  // namespace

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
    : k_(k), hidden_(hidden), chunk_(std::max<int64_t>(1, chunk_rows)), bf16_act_(bf16_activations && k.gemm_bf16) {
  // Room for a whole padded tile row so epilogues never bounds-check.
  const int32_t h = k.nr / 2;
  ldh_ = (max_inter + h - 1) / h * h;
  ldh_ = std::max(ldh_, k.nr);
  ldxb_ = hidden_ + 32;  // rows 64 B off a 4 KiB multiple: no L1 set aliasing across rows
  h_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(ldh_) * sizeof(float));
  if (bf16_act_) {
    xb_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(ldxb_) * 2);
    hb_.resize(static_cast<size_t>(chunk_) * static_cast<size_t>(ldh_) * 2);
  }
}

void FfnRunner::run(ThreadPool& pool, const std::vector<ExpertJob>& jobs, const float* x, int64_t ldx, float* acc,
                    int64_t ldacc, Act act, const uint16_t* x16, int64_t ldx16) {
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
        run_chunk(pool, segs, used, x, ldx, acc, ldacc, act, x16, ldx16);
        segs.clear();
        used = 0;
      }
    }
  }
  if (used > 0) run_chunk(pool, segs, used, x, ldx, acc, ldacc, act, x16, ldx16);
}

void FfnRunner::run_chunk(ThreadPool& pool, const std::vector<Segment>& segs, int64_t rows, const float* x,
                          int64_t ldx, float* acc, int64_t ldacc, Act act, const uint16_t* x16, int64_t ldx16) {
  const int nr = k_.nr, h = nr / 2;
  float* hbuf = h_.data<float>();
  // bf16 weights on a CPU with bf16 dot products: the rows of x (gathered
  // in pair order) and h go through the tiles in bf16, as a GPU GEMM would.
  bool dot = bf16_act_;
  for (const Segment& s : segs)
    dot = dot && s.job->gate_up->dtype == EP_MOE_DTYPE_BF16 && s.job->down->dtype == EP_MOE_DTYPE_BF16;
  uint16_t* xb = dot ? xb_.data<uint16_t>() : nullptr;
  uint16_t* hb = dot ? hb_.data<uint16_t>() : nullptr;
  if (dot) {
    pool.parallel_ranges(static_cast<size_t>(rows), 16, [&](size_t b0, size_t b1, int) {
      const auto r0 = static_cast<int64_t>(b0), r1 = static_cast<int64_t>(b1);
      size_t s = 0;
      for (int64_t r = r0; r < r1; ++r) {
        while (r >= segs[s].offset + segs[s].len) ++s;
        const int64_t tok = segs[s].job->rows[segs[s].begin + (r - segs[s].offset)];
        if (x16) std::memcpy(xb + r * ldxb_, x16 + tok * ldx16, static_cast<size_t>(hidden_) * 2);
        else k_.to_bf16(x + tok * ldx, xb + r * ldxb_, hidden_);
      }
    });
  }

  // Phase A: h = act(x W_gate^T) * (x W_up^T), per (segment, block of
  // per_item gate/up panels), flattened; the segment's rows in one kernel
  // call (kRows at most), which prefetches the block's next panel.
  int64_t all_panels = 0;
  for (const Segment& s : segs) all_panels += s.job->gate_up->panels();
  const int32_t per_item =
      static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(kMaxPanels, all_panels / (8 * pool.size()))));
  std::vector<std::pair<int32_t, int32_t>> items;
  for (size_t s = 0; s < segs.size(); ++s)
    for (int32_t p = 0; p < segs[s].job->gate_up->panels(); p += per_item) items.emplace_back(static_cast<int32_t>(s), p);
  pool.parallel_for(items.size(), [&](size_t it, int) {
    const Segment& s = segs[static_cast<size_t>(items[it].first)];
    const PackedWeight& w = *s.job->gate_up;
    const int32_t p_end = std::min(w.panels(), items[it].second + per_item);
    const float* a[kRows];
    const uint16_t* a16[kRows];
    alignas(64) float c[kRows * 32];
    for (int32_t p = items[it].second; p < p_end; ++p) {
      const void* next = p + 1 < p_end ? w.panel(p + 1) : nullptr;
      for (int64_t r0 = 0; r0 < s.len; r0 += kRows) {
        const int m = static_cast<int>(std::min<int64_t>(kRows, s.len - r0));
        if (dot) {
          for (int i = 0; i < m; ++i) a16[i] = xb + (s.offset + r0 + i) * ldxb_;
          k_.gemm_bf16(m, a16, w.k, w.panel(p), c, nr, r0 == 0 ? next : nullptr);
        } else {
          for (int i = 0; i < m; ++i) a[i] = x + static_cast<int64_t>(s.job->rows[s.begin + r0 + i]) * ldx;
          k_.gemm[w.dtype](m, a, w.k, w.panel(p), c, nr, r0 == 0 ? next : nullptr);
        }
        for (int i = 0; i < m; ++i) {
          const float* ci = c + i * nr;
          float hv[32];
          float* dst = dot ? hv : hbuf + (s.offset + r0 + i) * ldh_ + static_cast<int64_t>(p) * h;
          if (act == Act::Silu) k_.silu_mul(ci, ci + h, dst, h);
          else
            for (int j = 0; j < h; ++j) dst[j] = activate(act, ci[j]) * ci[h + j];
          if (dot) k_.to_bf16(hv, hb + (s.offset + r0 + i) * ldh_ + static_cast<int64_t>(p) * h, h);
        }
      }
    }
  });

  // Phase B: acc[token] += weight * (h W_down^T), per block of panels of
  // hidden columns (every down weight has hidden_ rows): a thread owns its
  // columns of acc, so the weighted combine is fused in, and each token's
  // rows are added in job order then row order, whatever the thread count.
  // Within a block the segments come first and their panels second, so a
  // thread streams each expert's block of panels as one contiguous run
  // (qwen3 T=8: 88-93 % -> 97-98 % of the read bandwidth against visiting
  // every expert's panel p before any panel p+1); each call prefetches the
  // panel visited next. Blocks of up to 8 panels, at least 4 per thread
  // (qwen3 T=8 at ~80 GB/s: 2.06-2.10 ms against 2.35 ms with blocks of 4).
  const int32_t panels = (hidden_ + nr - 1) / nr;
  const int32_t per_block = std::max(1, std::min(8, panels / (4 * pool.size())));
  pool.parallel_for(static_cast<size_t>((panels + per_block - 1) / per_block), [&](size_t bi, int) {
    const float* a[kRows];
    const uint16_t* a16[kRows];
    alignas(64) float c[kRows * 32];
    const int32_t p0 = static_cast<int32_t>(bi) * per_block, p_end = std::min(panels, p0 + per_block);
    for (size_t si = 0; si < segs.size(); ++si) {
      const Segment& s = segs[si];
      const PackedWeight& w = *s.job->down;
      for (int32_t p = p0; p < p_end; ++p) {
        const int32_t col0 = p * nr;
        const int ncols = std::min(nr, hidden_ - col0);
        const void* next = p + 1 < p_end            ? w.panel(p + 1)
                           : si + 1 < segs.size() ? segs[si + 1].job->down->panel(p0)
                                                  : nullptr;
        for (int64_t r0 = 0; r0 < s.len; r0 += kRows) {
          const int m = static_cast<int>(std::min<int64_t>(kRows, s.len - r0));
          if (dot) {
            for (int i = 0; i < m; ++i) a16[i] = hb + (s.offset + r0 + i) * ldh_;
            k_.gemm_bf16(m, a16, w.k, w.panel(p), c, nr, r0 == 0 ? next : nullptr);
          } else {
            for (int i = 0; i < m; ++i) a[i] = hbuf + (s.offset + r0 + i) * ldh_;
            k_.gemm[w.dtype](m, a, w.k, w.panel(p), c, nr, r0 == 0 ? next : nullptr);
          }
          k_.scatter_add(acc + col0, ldacc, s.job->rows + s.begin + r0, s.job->weights + s.begin + r0, c, nr, m, ncols);
        }
      }
    }
  });
  (void)rows;
}

}  // namespace cpu
}  // namespace ep_moe

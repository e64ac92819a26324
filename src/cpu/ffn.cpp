#include "cpu/ffn.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "common/dtype.hpp"
#include "common/error.hpp"

namespace ep_moe {
namespace cpu {

namespace {
// Most rows per kernel call (the c tile lives on the stack: kRows x 32 f32).
constexpr int kRows = 64;
// Most gate/up panels per claim of phase A (long enough runs to stream, short
// enough to balance a prefill; fewer when that would leave threads without
// claims).
constexpr int32_t kMaxPanels = 12;
// Phase B's row-block order (below): how many bytes of down panels a claim
// may hold for it, and the columns one scatter_add then covers.
constexpr size_t kRowBlockClaimBytes = size_t{256} << 10;
constexpr int kRowBlockColumns = 64;
}  // namespace

float activate(Act act, float g, float u) {
  switch (act) {
    case Act::Silu: return g / (1.0f + std::exp(-g)) * u;
    case Act::Gelu: return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
    case Act::GeluTanh: {
      const float c = 0.79788456080286536f;  // sqrt(2 / pi)
      return 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g))) * u;
    }
    case Act::SwigluOai: {
      // GPT-OSS: the gate clamped from above, the up both ways, at its
      // swiglu_limit 7; alpha 1.702; (u + 1), not u.
      constexpr float kLimit = 7.0f, kAlpha = 1.702f;
      const float gc = std::min(g, kLimit), uc = std::min(std::max(u, -kLimit), kLimit);
      return (uc + 1.0f) * gc / (1.0f + std::exp(-kAlpha * gc));
    }
  }
  return g * u;
}

namespace {
// c[i * ldc + j] += b[j] for m rows and n columns: a down bias, added to an
// expert's output rows before they are weighted into the accumulator.
void add_bias_rows(float* c, int64_t ldc, int m, int n, const float* b) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) c[i * ldc + j] += b[j];
}
}  // namespace

FfnRunner::FfnRunner(const Kernels& k, int32_t hidden, int32_t max_inter, int64_t chunk_rows, bool bf16_activations)
    : k_(k),
      hidden_(hidden),
      chunk_(std::max<int64_t>(1, chunk_rows)),
      bf16_act_(bf16_activations && k.gemm_bf16),
      bf16_rows_(bf16_activations) {
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

void FfnRunner::reserve_quant(int threads, ep_moe_dtype_t t) {
  if (xq_.size() == 0) {
    ldxq_ = act_row_bytes(hidden_);
    ldhq_ = act_row_bytes(ldh_);
    xq_.resize(static_cast<size_t>(chunk_) * ldxq_);
    hq_.resize(static_cast<size_t>(chunk_) * ldhq_);
  }
  if (!dtype_is_quant(t)) return;
  if (k_.tiles(t, std::numeric_limits<int64_t>::max())) {
    const int64_t kmax = (std::max(hidden_, ldh_) + 255) / 256 * 256;
    const size_t bytes = std::max(tile_bytes_, qtile_panel_bytes(t, kmax, k_.nr));
    if (threads > tile_threads_ || bytes > tile_bytes_) {
      tile_bytes_ = bytes;
      tile_threads_ = std::max(tile_threads_, threads);
      tiles_.resize(static_cast<size_t>(tile_threads_) * tile_bytes_);
    }
  }
}

bool FfnRunner::tiled(const Segment& sg, bool down) const {
  const PackedWeight& w = down ? *sg.job->down : *sg.job->gate_up;
  return w.quant() && tile_ok_ && k_.tiles(w.dtype, sg.len) && qtile_panel_bytes(w.dtype, w.k, k_.nr) <= tile_bytes_;
}

const void* FfnRunner::tile_panel(const PackedWeight& w, int32_t p, int t) {
  char* out = tiles_.data<char>() + static_cast<size_t>(t) * tile_bytes_;
  k_.qunpack[quant_index(w.dtype)](w.panel(p), w.k, out);
  return out;
}

void FfnRunner::set_engine(MatrixEngine* e, int64_t min_rows, int threads) {
  engine_ = e;
  engine_min_rows_ = std::max<int64_t>(1, min_rows);
  engine_threads_ = threads;
  if (!e) return;
  const auto rows = static_cast<size_t>(chunk_ + e->max_rows());
  xd_.resize(rows * static_cast<size_t>(hidden_) * 2);
  hd_.resize(rows * static_cast<size_t>(ldh_) * 2);
  ec_stride_ = static_cast<size_t>(e->max_rows()) * static_cast<size_t>(e->tile_cols());
  ec_.resize(static_cast<size_t>(std::max(1, threads)) * ec_stride_ * sizeof(float));
}

void FfnRunner::engine_gemm(int shape, int64_t m, const uint16_t* a, const void* w, float* c, int thread) {
  if (engine_failed_.load(std::memory_order_relaxed)) return;
  try {
    engine_->gemm(shape, m, a, w, c, thread);
  } catch (...) {
    std::lock_guard<std::mutex> lock(engine_mu_);
    if (!engine_error_) engine_error_ = std::current_exception();
    engine_failed_.store(true, std::memory_order_relaxed);
  }
}

// After a phase (the pool's threads joined): the failure engine_gemm kept.
void FfnRunner::rethrow_engine_error() {
  if (!engine_failed_.load(std::memory_order_relaxed)) return;
  engine_failed_.store(false, std::memory_order_relaxed);
  std::rethrow_exception(std::exchange(engine_error_, nullptr));
}

bool FfnRunner::on_engine(const Segment& sg, bool down) const {
  if (!engine_ || !bf16_rows_ || sg.len < engine_min_rows_) return false;
  const PackedWeight& w = down ? *sg.job->down : *sg.job->gate_up;
  if (w.dtype != EP_MOE_DTYPE_BF16 || w.nr != k_.nr || engine_->shape_of(w.k) < 0) return false;
  if (w.panels() < engine_->tile_cols() / w.nr) return false;  // not one whole tile
  // h is written by gate/up panel (nr / 2 values of it each): a down of
  // depth inter exactly, a multiple of that.
  return !down || (w.k == sg.job->inter && w.k % (k_.nr / 2) == 0 && w.k <= ldh_);
}

void FfnRunner::reserve_jobs(size_t max_jobs) {
  segs_.reserve(max_jobs);
  ord_.reserve(max_jobs);
  first_.reserve(max_jobs + 1);
}

void FfnRunner::run(ThreadPool& pool, const std::vector<ExpertJob>& jobs, const float* x, int64_t ldx, float* acc,
                    int64_t ldacc, Act act, const uint16_t* x16, int64_t ldx16) {
  tile_ok_ = tile_threads_ >= pool.size();
  if (engine_ && pool.size() > engine_threads_)
    fail(EP_MOE_ERR_INTERNAL, "FfnRunner: a pool of %d threads, the matrix engine has %d", pool.size(),
         engine_threads_);
  segs_.clear();
  int64_t used = 0;
  for (const ExpertJob& j : jobs) {
    int64_t b = 0;
    while (b < j.n) {
      const int64_t take = std::min(j.n - b, chunk_ - used);
      segs_.push_back(Segment{&j, b, take, used});
      used += take;
      b += take;
      if (used == chunk_) {
        run_chunk(used, pool, x, ldx, acc, ldacc, act, x16, ldx16);
        segs_.clear();
        used = 0;
      }
    }
  }
  if (used > 0) run_chunk(used, pool, x, ldx, acc, ldacc, act, x16, ldx16);
}

void FfnRunner::run_chunk(int64_t rows, ThreadPool& pool, const float* x, int64_t ldx, float* acc, int64_t ldacc,
                          Act act, const uint16_t* x16, int64_t ldx16) {
  // bf16 weights on a CPU with bf16 dot products: the rows of x (gathered
  // in pair order) and h go through the tiles in bf16, as a GPU GEMM would.
  Chunk ch;
  ch.dot = bf16_act_;
  bool quant_gu = false, quant_down = false;
  for (const Segment& s : segs_) {
    ch.dot = ch.dot && s.job->gate_up->dtype == EP_MOE_DTYPE_BF16 && s.job->down->dtype == EP_MOE_DTYPE_BF16;
    quant_gu = quant_gu || s.job->gate_up->quant();
    quant_down = quant_down || s.job->down->quant();
  }
  for (Segment& s : segs_) {
    s.eng_gu = on_engine(s, false);
    s.eng_down = on_engine(s, true);
    ch.eng_gu = ch.eng_gu || s.eng_gu;
    ch.eng_down = ch.eng_down || s.eng_down;
    if (s.eng_gu || s.eng_down) engine_rows_ += s.len;
  }
  ch.hbuf = h_.data<float>();
  ch.xb = ch.dot ? xb_.data<uint16_t>() : nullptr;
  ch.hb = ch.dot ? hb_.data<uint16_t>() : nullptr;
  ch.xq = quant_gu ? xq_.data<char>() : nullptr;
  ch.hq = quant_down ? hq_.data<char>() : nullptr;
  if (ch.dot) gather_bf16_rows(ch, rows, pool, x, ldx, x16, ldx16);
  if (ch.eng_gu) gather_engine_rows(rows, pool, x, ldx, x16, ldx16);
  if (ch.xq) quantize_rows(ch, rows, pool, x, ldx, false);
  phase_a(ch, pool, x, ldx, act);
  rethrow_engine_error();
  if (ch.hq) quantize_rows(ch, rows, pool, x, ldx, true);
  phase_b(ch, pool, acc, ldacc);
  rethrow_engine_error();
}

// The chunk's rows of x in bf16, in pair order (from x16 when given).
void FfnRunner::gather_bf16_rows(const Chunk& ch, int64_t rows, ThreadPool& pool, const float* x, int64_t ldx,
                                 const uint16_t* x16, int64_t ldx16) {
  const std::vector<Segment>& segs = segs_;
  uint16_t* xb = ch.xb;
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

void FfnRunner::gather_engine_rows(int64_t rows, ThreadPool& pool, const float* x, int64_t ldx, const uint16_t* x16,
                                   int64_t ldx16) {
  const std::vector<Segment>& segs = segs_;
  uint16_t* xd = xd_.data<uint16_t>();
  pool.parallel_ranges(static_cast<size_t>(rows), 16, [&](size_t b0, size_t b1, int) {
    const auto r0 = static_cast<int64_t>(b0), r1 = static_cast<int64_t>(b1);
    size_t s = 0;
    for (int64_t r = r0; r < r1; ++r) {
      while (r >= segs[s].offset + segs[s].len) ++s;
      if (!segs[s].eng_gu) continue;
      const int64_t tok = segs[s].job->rows[segs[s].begin + (r - segs[s].offset)];
      if (x16) std::memcpy(xd + r * hidden_, x16 + tok * ldx16, static_cast<size_t>(hidden_) * 2);
      else k_.to_bf16(x + tok * ldx, xd + r * hidden_, hidden_);
    }
  });
}

void FfnRunner::quantize_rows(const Chunk& ch, int64_t rows, ThreadPool& pool, const float* x, int64_t ldx, bool down) {
  const std::vector<Segment>& segs = segs_;
  // Up to 8 rows a block, but every thread some when there are fewer
  // (decode: the rows of 8 experts' single tokens).
  const auto threads = static_cast<int64_t>(pool.size());
  const auto block = static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(8, (rows + threads - 1) / threads)));
  pool.parallel_ranges(static_cast<size_t>(rows), block, [&](size_t b0, size_t b1, int) {
    const auto r0 = static_cast<int64_t>(b0), r1 = static_cast<int64_t>(b1);
    size_t s = 0;
    for (int64_t r = r0; r < r1; ++r) {
      while (r >= segs[s].offset + segs[s].len) ++s;
      const ExpertJob& j = *segs[s].job;
      const PackedWeight& w = down ? *j.down : *j.gate_up;
      if (!w.quant()) continue;
      const ActQuant aq = act_quant_of(w.dtype);
      if (down) {
        k_.quantize_act(ch.hbuf + r * ldh_, w.k, aq, ch.hq + r * static_cast<int64_t>(ldhq_));
      } else {
        const int64_t tok = j.rows[segs[s].begin + (r - segs[s].offset)];
        k_.quantize_act(x + tok * ldx, w.k, aq, ch.xq + r * static_cast<int64_t>(ldxq_));
      }
    }
  });
}

// A segment of one row (decode) goes through its runs of panels in gemv
// calls, when the kernels have one for its weights, and a segment of 2 ..
// run_rows rows through gemm_run, where the kernels have it (both phases):
// the rows of such a segment, else 0.
int FfnRunner::run_rows_of(const Segment& sg, const PackedWeight& w, bool dot) const {
  if (w.quant()) return 0;  // the block kernels take every row count
  return k_.runs_rows(sg.len, w.dtype, dot) ? static_cast<int>(sg.len) : 0;
}

// Rows a[0 .. m) (row16: the bf16 one, for m = 1 on the dot tiles) over
// `run` panels from p: row i's results at c + i * run * nr.
void FfnRunner::run_panels(bool dot, const PackedWeight& w, int m, const float* const* a, const uint16_t* row16,
                           int32_t p, int run, float* c, const void* next) const {
  const int nr = k_.nr;
  if (m > 1) k_.gemm_run[w.dtype](m, a, w.k, w.panel(p), run, c, run * nr, next);
  else if (dot) k_.gemv_bf16(row16, w.k, w.panel(p), run, c, next);
  else k_.gemv[w.dtype](a[0], w.k, w.panel(p), run, c, next);
}

// The fused activation of one row of a gate/up panel's results (ci: its
// nr values, gate then up) into row `row` of h, at panel p's h columns;
// with biases, they are added to ci first (each row is used once). A
// segment whose down is on the engine gets its h in hd_ too (bf16, dense).
void FfnRunner::activate_panel(const Chunk& ch, Act act, float* ci, int64_t row, int32_t p, const Segment& sg) {
  const int h = k_.nr / 2;
  const ExpertJob& job = *sg.job;
  float hv[32];
  float* dst = ch.dot ? hv : ch.hbuf + row * ldh_ + static_cast<int64_t>(p) * h;
  if (job.gate_bias) {
    const float* gb = job.gate_bias + static_cast<int64_t>(p) * h;
    const float* ub = job.up_bias + static_cast<int64_t>(p) * h;
    for (int j = 0; j < h; ++j) {
      ci[j] += gb[j];
      ci[h + j] += ub[j];
    }
  }
  if (act == Act::Silu) k_.silu_mul(ci, ci + h, dst, h);
  else
    for (int j = 0; j < h; ++j) dst[j] = activate(act, ci[j], ci[h + j]);
  if (ch.dot) k_.to_bf16(hv, ch.hb + row * ldh_ + static_cast<int64_t>(p) * h, h);
  if (sg.eng_down)
    k_.to_bf16(dst,
               hd_.data<uint16_t>() + sg.offset * ldh_ + (row - sg.offset) * job.down->k + static_cast<int64_t>(p) * h,
               h);
}

// Whole tile p0 .. of segment sg's gate/up through the engine (in calls of
// its most rows, from xd_), and the activation of its results.
void FfnRunner::engine_gate_up(const Chunk& ch, Act act, const Segment& sg, int32_t p0, int t) {
  const PackedWeight& w = *sg.job->gate_up;
  const int shape = engine_->shape_of(w.k);
  const int32_t cols = engine_->tile_cols(), nr = k_.nr;
  float* cb = ec_.data<float>() + static_cast<size_t>(t) * ec_stride_;
  const uint16_t* xs = xd_.data<uint16_t>() + sg.offset * hidden_;
  for (int64_t r0 = 0; r0 < sg.len; r0 += engine_->max_rows()) {
    const int64_t m = std::min(engine_->max_rows(), sg.len - r0);
    engine_gemm(shape, m, xs + r0 * hidden_, w.panel(p0), cb, t);
    for (int64_t i = 0; i < m; ++i)
      for (int32_t j = 0; j < cols / nr; ++j)
        activate_panel(ch, act, cb + i * cols + j * nr, sg.offset + r0 + i, p0 + j, sg);
  }
}

// Whole tile p .. of segment s's down through the engine (from hd_),
// combined into acc.
void FfnRunner::engine_down(const Segment& s, int32_t p, int t, float* acc, int64_t ldacc) {
  const PackedWeight& w = *s.job->down;
  const int shape = engine_->shape_of(w.k);
  const int32_t cols = engine_->tile_cols(), col0 = p * k_.nr, ncols = std::min(cols, hidden_ - col0);
  float* cb = ec_.data<float>() + static_cast<size_t>(t) * ec_stride_;
  const uint16_t* hs = hd_.data<uint16_t>() + s.offset * ldh_;
  for (int64_t r0 = 0; r0 < s.len; r0 += engine_->max_rows()) {
    const int64_t m64 = std::min(engine_->max_rows(), s.len - r0);
    const int m = static_cast<int>(m64);
    engine_gemm(shape, m64, hs + r0 * w.k, w.panel(p), cb, t);
    if (s.job->down_bias) add_bias_rows(cb, cols, m, cols, s.job->down_bias + col0);
    k_.scatter_add(acc + col0, ldacc, s.job->rows + s.begin + r0, s.job->weights + s.begin + r0, cb, cols, m, ncols);
  }
}

// Rows r0 .. r0 + m of segment s (m returned, kRows at most) through down
// panel p into c, ldc floats a row; tile: panel p unpacked for the int8
// tiles (tiled segments), else null.
int FfnRunner::down_rows(const Chunk& ch, const Segment& s, const PackedWeight& w, int32_t p, int64_t r0, float* c,
                         int ldc, const void* next, const void* tile) const {
  const int m = static_cast<int>(std::min<int64_t>(kRows, s.len - r0));
  if (w.quant()) {
    const void* aq[kRows];
    for (int i = 0; i < m; ++i) aq[i] = ch.hq + (s.offset + r0 + i) * static_cast<int64_t>(ldhq_);
    if (tile) k_.qtile[quant_index(w.dtype)](m, aq, w.k, tile, c, ldc, next);
    else k_.qgemm[quant_index(w.dtype)](m, aq, w.k, w.panel(p), k_.nr, c, ldc, next);
  } else if (ch.dot) {
    const uint16_t* a16[kRows];
    for (int i = 0; i < m; ++i) a16[i] = ch.hb + (s.offset + r0 + i) * ldh_;
    k_.gemm_bf16(m, a16, w.k, w.panel(p), c, ldc, next);
  } else {
    const float* a[kRows];
    for (int i = 0; i < m; ++i) a[i] = ch.hbuf + (s.offset + r0 + i) * ldh_;
    k_.gemm[w.dtype](m, a, w.k, w.panel(p), c, ldc, next);
  }
  return m;
}

void FfnRunner::phase_a(const Chunk& ch, ThreadPool& pool, const float* x, int64_t ldx, Act act) {
  const std::vector<Segment>& segs = segs_;
  const int nr = k_.nr;
  const bool dot = ch.dot;
  uint16_t* xb = ch.xb;
  const char* xq = ch.xq;
  // Phase A: h = act(x W_gate^T) * (x W_up^T), per gate/up panel of each
  // segment, numbered in the order below (first[s]: segment s's first). The
  // panels go out in one contiguous share per thread (parallel_shares), so
  // a thread streams its run of panels, expert after expert, and every
  // kernel call prefetches the panel that thread takes next, across claims
  // too; the segment's rows in one kernel call (kRows at most).
  // Segments with the most rows come first (stable): the arithmetic-heavy
  // ones (a shared expert over every token) then run on the first thread
  // while the other streams routed experts, instead of at the back of the
  // last share, where the helper's steals made both threads compute with
  // memory idle. Phase A's outputs do not depend on this order (the bits
  // are the same).
  // (Stable by the tie-break on position in segs: std::stable_sort would
  // take a temporary buffer from the heap, std::sort works in place.)
  std::vector<const Segment*>& ord = ord_;
  ord.clear();
  for (const Segment& sg : segs) ord.push_back(&sg);
  std::sort(ord.begin(), ord.end(),
            [](const Segment* l, const Segment* r) { return l->len != r->len ? l->len > r->len : l < r; });
  // A segment's items: its panels; on the engine, its whole tiles of tp
  // panels first, then the panels past the last whole tile.
  const int32_t tp = engine_ ? engine_->tile_cols() / nr : 1;
  const auto items_of = [&](const Segment& sg) {
    const int32_t np = sg.job->gate_up->panels();
    return sg.eng_gu ? np / tp + np % tp : np;
  };
  // Item i of a segment: its first panel.
  const auto panel_of_item = [&](const Segment& sg, int64_t i) {
    if (!sg.eng_gu) return static_cast<int32_t>(i);
    const int64_t whole = sg.job->gate_up->panels() / tp;
    return static_cast<int32_t>(i < whole ? i * tp : whole * tp + (i - whole));
  };
  std::vector<int64_t>& first = first_;
  first.assign(segs.size() + 1, 0);
  for (size_t s = 0; s < segs.size(); ++s) first[s + 1] = first[s] + items_of(*ord[s]);
  const int64_t all_panels = first.back();
  const auto gate_up_panel = [&](int64_t i, size_t s) {
    while (i >= first[s + 1]) ++s;
    return ord[s]->job->gate_up->panel(panel_of_item(*ord[s], i - first[s]));
  };
  const auto grain_a =
      static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(kMaxPanels, all_panels / (8 * pool.size()))));
  pool.parallel_shares(static_cast<size_t>(all_panels), grain_a, grain_a, [&](size_t b, size_t e, size_t nx, int t) {
    const float* a[kRows];
    const uint16_t* a16[kRows];
    alignas(64) float c[kRows * 32];
    size_t si =
        static_cast<size_t>(std::upper_bound(first.begin(), first.end(), static_cast<int64_t>(b)) - first.begin()) - 1;
    for (auto q = static_cast<int64_t>(b); q < static_cast<int64_t>(e);) {
      while (q >= first[si + 1]) ++si;
      const Segment& s = *ord[si];
      const PackedWeight& w = *s.job->gate_up;
      const int64_t item = q - first[si];
      const int32_t p = panel_of_item(s, item);
      if (s.eng_gu && item < w.panels() / tp) {
        engine_gate_up(ch, act, s, p, t);
        ++q;
        continue;
      }
      // The panel this thread takes after those up to `after`.
      const auto next_after = [&](int64_t after) -> const void* {
        return after < static_cast<int64_t>(e)        ? gate_up_panel(after, si)
               : nx < static_cast<size_t>(all_panels) ? gate_up_panel(static_cast<int64_t>(nx), si)
                                                      : nullptr;
      };
      if (const int rr = s.eng_gu ? 0 : run_rows_of(s, w, dot)) {
        const int64_t run = std::min<int64_t>({static_cast<int64_t>(e), first[si + 1], q + kRows * 32 / (nr * rr)}) - q;
        for (int i = 0; i < rr; ++i) a[i] = x ? x + static_cast<int64_t>(s.job->rows[s.begin + i]) * ldx : nullptr;
        run_panels(dot, w, rr, a, xb ? xb + s.offset * ldxb_ : nullptr, p, static_cast<int>(run), c,
                   next_after(q + run));
        for (int i = 0; i < rr; ++i)
          for (int64_t j = 0; j < run; ++j)
            activate_panel(ch, act, c + (i * run + j) * nr, s.offset + i, p + static_cast<int32_t>(j), s);
        q += run;
        continue;
      }
      const void* next = next_after(q + 1);
      const void* tile = tiled(s, false) ? tile_panel(w, p, t) : nullptr;
      for (int64_t r0 = 0; r0 < s.len; r0 += kRows) {
        const int m = static_cast<int>(std::min<int64_t>(kRows, s.len - r0));
        if (w.quant()) {
          const void* aq[kRows];
          for (int i = 0; i < m; ++i) aq[i] = xq + (s.offset + r0 + i) * static_cast<int64_t>(ldxq_);
          if (tile) k_.qtile[quant_index(w.dtype)](m, aq, w.k, tile, c, nr, r0 == 0 ? next : nullptr);
          else k_.qgemm[quant_index(w.dtype)](m, aq, w.k, w.panel(p), nr, c, nr, r0 == 0 ? next : nullptr);
        } else if (dot) {
          for (int i = 0; i < m; ++i) a16[i] = xb + (s.offset + r0 + i) * ldxb_;
          k_.gemm_bf16(m, a16, w.k, w.panel(p), c, nr, r0 == 0 ? next : nullptr);
        } else {
          for (int i = 0; i < m; ++i) a[i] = x + static_cast<int64_t>(s.job->rows[s.begin + r0 + i]) * ldx;
          k_.gemm[w.dtype](m, a, w.k, w.panel(p), c, nr, r0 == 0 ? next : nullptr);
        }
        for (int i = 0; i < m; ++i) activate_panel(ch, act, c + i * nr, s.offset + r0 + i, p, s);
      }
      ++q;
    }
  });
}

void FfnRunner::phase_b(const Chunk& ch, ThreadPool& pool, float* acc, int64_t ldacc) {
  const std::vector<Segment>& segs = segs_;
  const int nr = k_.nr;
  const bool dot = ch.dot;
  float* hbuf = ch.hbuf;
  uint16_t* hb = ch.hb;
  // Phase B: acc[token] += weight * (h W_down^T), per block of panels of
  // hidden columns (every down weight has hidden_ rows): a thread owns its
  // columns of acc, so the weighted combine is fused in, and each token's
  // rows are added in job order then row order, whatever the thread count.
  // Within a block the segments come first and their panels second, so a
  // thread streams each expert's block of panels as one contiguous run
  // (visiting every expert's panel p before any panel p+1 streams worse);
  // each call prefetches the panel visited next, across claims too. The
  // blocks are claims of parallel_shares: up to 16 panels from the front of
  // a thread's own share, a quarter of that when helping another: fewer,
  // longer runs than small blocks dealt out one at a time. Near its
  // share's end an owner claims at most half of what is left, down to the
  // steal size, a quarter of the grain (parallel_shares), so that no thread
  // waits out its peer's last full claim.
  const int32_t panels = (hidden_ + nr - 1) / nr;
  const auto grain_b = static_cast<size_t>(std::max(1, std::min(16, panels / (2 * pool.size()))));
  // With segments on the matrix engine, claims are of whole engine tiles
  // (units of etp panels; the last unit may be short): a claim then holds
  // whole tiles, its panels past them (the last unit's) on the tiles.
  const int32_t etp = ch.eng_down ? engine_->tile_cols() / nr : 1;
  const int32_t units = (panels + etp - 1) / etp;
  const auto grain_u = std::max<size_t>(1, grain_b / static_cast<size_t>(etp));
  const int32_t run_b = std::max(1, kRowBlockColumns / nr);  // panels per scatter_add in row-block order
  pool.parallel_shares(
      static_cast<size_t>(units), grain_u, std::max<size_t>(1, grain_u / 4),
      [&](size_t b, size_t e, size_t nxu, int t) {
        const float* a[kRows];
        alignas(64) float c[kRows * std::max(32, kRowBlockColumns)];
        const auto p0 = static_cast<int32_t>(b) * etp, p_end = std::min(static_cast<int32_t>(e) * etp, panels);
        const size_t nx = nxu * static_cast<size_t>(etp);
        for (size_t si = 0; si < segs.size(); ++si) {
          const Segment& s = segs[si];
          const PackedWeight& w = *s.job->down;
          // The panel this thread visits after those up to `after`.
          const auto next_after = [&](int32_t after) -> const void* {
            return after < p_end                      ? w.panel(after)
                   : si + 1 < segs.size()             ? segs[si + 1].job->down->panel(p0)
                   : nx < static_cast<size_t>(panels) ? segs[0].job->down->panel(static_cast<int32_t>(nx))
                                                      : nullptr;
          };
          // The segment's panels on the tiles: from s0.
          int32_t s0 = p0;
          if (s.eng_down) {
            for (; s0 + etp <= p_end; s0 += etp) engine_down(s, s0, t, acc, ldacc);
            if (s0 == p_end) continue;
          }
          if (const int rr = run_rows_of(s, w, dot)) {
            // The claim's panels in runs through gemv / gemm_run, each run's
            // columns combined in one call (the same sums as per panel).
            for (int i = 0; i < rr; ++i) a[i] = hbuf + (s.offset + i) * ldh_;
            for (int32_t p = s0; p < p_end;) {
              const int32_t run = std::min(p_end - p, kRows * 32 / (nr * rr)), col0 = p * nr;
              run_panels(dot, w, rr, a, hb ? hb + s.offset * ldh_ : nullptr, p, run, c, next_after(p + run));
              if (s.job->down_bias) add_bias_rows(c, run * nr, rr, run * nr, s.job->down_bias + col0);
              k_.scatter_add(acc + col0, ldacc, s.job->rows + s.begin, s.job->weights + s.begin, c, run * nr, rr,
                             std::min(run * nr, hidden_ - col0));
              p += run;
            }
            continue;
          }
          // Row block by row block, each through the whole claim, run_b panels
          // into one c and one scatter_add of their 64 columns:
          // - A segment of one row block (at most kRows rows: a routed expert
          //   in a prefill). Panel by panel, each scatter_add would write one
          //   64-byte line (AVX2; two on AVX-512) of each row of the segment,
          //   the accumulator's lines coming back from memory between calls
          //   (the weights stream past them); a run of 4 lines per row halves
          //   the scatter time.
          // - More rows than one kernel call takes, over a claim of narrow down
          //   panels (a shared expert's shard over a prefill: deepseek-v3's
          //   2048 cut 32 ways is k = 64, 2 KiB a bf16 panel): each row block
          //   through the whole claim (in L2 after the first block). Panel by
          //   panel, over 512 tokens of 7168, that is a 14.7 MB accumulator, a
          //   line of every row for every panel.
          // The sums are the same as panel by panel (each acc element still
          // gets its one addition per row of the segment, segments in order),
          // so the bits are too.
          // Unpacked panels: each once, so a segment of more row blocks goes
          // panel by panel.
          const size_t panel_bytes = w.panel_bytes();
          const bool tile = tiled(s, true);
          if (s.len <= kRows || (!tile && static_cast<size_t>(p_end - s0) * panel_bytes <= kRowBlockClaimBytes)) {
            for (int64_t r0 = 0; r0 < s.len; r0 += kRows)
              for (int32_t p = s0; p < p_end; p += run_b) {
                const int32_t np = std::min(run_b, p_end - p), col0 = p * nr;
                const int m = static_cast<int>(std::min<int64_t>(kRows, s.len - r0));
                for (int32_t j = 0; j < np; ++j)
                  down_rows(ch, s, w, p + j, r0, c + j * nr, np * nr, r0 == 0 ? next_after(p + j + 1) : nullptr,
                            tile ? tile_panel(w, p + j, t) : nullptr);
                if (s.job->down_bias) add_bias_rows(c, np * nr, m, np * nr, s.job->down_bias + col0);
                k_.scatter_add(acc + col0, ldacc, s.job->rows + s.begin + r0, s.job->weights + s.begin + r0, c, np * nr,
                               m, std::min(np * nr, hidden_ - col0));
              }
            continue;
          }
          for (int32_t p = s0; p < p_end; ++p) {
            const int32_t col0 = p * nr;
            const int ncols = std::min(nr, hidden_ - col0);
            const void* next = next_after(p + 1);
            const void* tp = tile ? tile_panel(w, p, t) : nullptr;
            for (int64_t r0 = 0; r0 < s.len; r0 += kRows) {
              const int m = down_rows(ch, s, w, p, r0, c, nr, r0 == 0 ? next : nullptr, tp);
              if (s.job->down_bias) add_bias_rows(c, nr, m, nr, s.job->down_bias + col0);
              k_.scatter_add(acc + col0, ldacc, s.job->rows + s.begin + r0, s.job->weights + s.begin + r0, c, nr, m,
                             ncols);
            }
          }
        }
      });
}

}  // namespace cpu
}  // namespace ep_moe

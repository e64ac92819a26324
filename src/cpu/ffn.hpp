// Grouped expert FFN on the CPU: for every expert job, the rows it owns go
// through gate_up -> gated activation -> down, and the weighted results are
// added into an f32 accumulator in token order.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "cpu/aligned.hpp"
#include "cpu/kernels.hpp"
#include "cpu/matrix_engine.hpp"
#include "cpu/pack.hpp"
#include "cpu/thread_pool.hpp"

namespace ep_moe {
namespace cpu {

enum class Act : int { Silu = 0, Gelu = 1, GeluTanh = 2, SwigluOai = 3 };

struct ExpertJob {
  const PackedWeight* gate_up = nullptr;  // from pack_gate_up
  const PackedWeight* down = nullptr;     // [hidden, inter]
  int32_t inter = 0;
  const int32_t* rows = nullptr;   // token rows of x / acc, n entries
  const float* weights = nullptr;  // n entries
  int64_t n = 0;
  // Optional biases (all three or none), in f32: gate and up, inter values
  // each, padded with zeros to the packed gate/up's panels (gate_up->n / 2
  // values each); down, hidden values padded to its panels (down->n).
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
};

class FfnRunner {
 public:
  // Workspace for up to `chunk_rows` (token, expert) pairs at a time with
  // intermediate sizes up to `max_inter`. `bf16_activations`: the layer's
  // activations are bf16, so bf16 weights may use the bf16 pair-dot tiles
  // (x and h rounded to bf16, as in a GPU bf16 GEMM); with f32 or f16
  // activations the tiles widen the weights and keep f32 activations.
  FfnRunner(const Kernels& k, int32_t hidden, int32_t max_inter, int64_t chunk_rows, bool bf16_activations);

  // acc[rows[i]] += weights[i] * down(act(gate(x[rows[i]]), up(x[rows[i]])))
  // for every job and row, in job order then row order for each token.
  // x: f32 rows, ldx floats apart. x16 (optional): the same rows in bf16,
  // ldx16 elements apart; where the bf16 tiles run (reads_bf16_rows) they
  // are copied from x16 instead of narrowed from x, and x may be null.
  void run(ThreadPool& pool, const std::vector<ExpertJob>& jobs, const float* x, int64_t ldx, float* acc, int64_t ldacc,
           Act act, const uint16_t* x16 = nullptr, int64_t ldx16 = 0);

  // Whether every job with weights of `weight_dtype` runs on the bf16
  // tiles, which read x in bf16 only: then run() needs x16, not x.
  bool reads_bf16_rows(ep_moe_dtype_t weight_dtype) const { return bf16_act_ && weight_dtype == EP_MOE_DTYPE_BF16; }

  size_t workspace_bytes() const { return h_.size() + xb_.size() + hb_.size(); }

  // Sizes the per-run lists for up to `max_jobs` jobs, so that run()
  // allocates nothing for that many (more still work: the lists grow).
  // A job has at most one segment in a chunk, so jobs bound every list.
  void reserve_jobs(size_t max_jobs);

  // Room for the int8 activation rows of block-format weights (x and h of
  // a chunk, quantized once each per chunk): call before the first run()
  // with such a job (at store time: run() allocates nothing). Every
  // block-format gate_up of one run must share one activation format, and
  // every block-format down one (the layer keeps one storage type per part).
  // Where the kernels have int8 tiles for `t` (Kernels::tiles), room for
  // `threads` unpacked panels (a run on more threads keeps to the block
  // kernels). Called once per format held.
  void reserve_quant(int threads, ep_moe_dtype_t t);

  // A matrix engine (cpu/matrix_engine.hpp; borrowed, it must outlive the
  // runner, or null: none) for the bf16 GEMMs of an expert with at least
  // `min_rows` rows in a chunk, when the layer's activations are bf16 and
  // the weight's depth is one of the engine's shapes: x and h then go to
  // it in bf16 (as on the pair-dot tiles), and it computes whole tiles of
  // tile_cols columns, the panels past the last whole tile staying on the
  // tiles. `threads`: the most pool threads a run() will have. Allocates
  // the engine's workspace now.
  void set_engine(MatrixEngine* e, int64_t min_rows, int threads);
  // Rows (token, expert pairs) that went through the engine since the
  // runner was made.
  int64_t engine_rows() const { return engine_rows_; }

 private:
  struct Segment {
    const ExpertJob* job;
    int64_t begin, len;  // rows of the job
    int64_t offset;      // first workspace row
    // Through the matrix engine: the gate/up tiles, the down tiles.
    bool eng_gu = false, eng_down = false;
  };
  // One chunk of at most chunk_ rows: the bf16 rows (with the dot tiles),
  // phase A (gate/up and the activation into h), phase B (down, combined
  // into acc).
  struct Chunk {
    bool dot = false;  // the bf16 pair-dot tiles, reading xb and hb
    float* hbuf = nullptr;
    uint16_t* xb = nullptr;
    uint16_t* hb = nullptr;
    // Block-format gate_up / down in the chunk: their int8 activation rows
    // (xq, hq; act_row_bytes apart) in pair order, else null.
    char* xq = nullptr;
    char* hq = nullptr;
    bool eng_gu = false, eng_down = false;  // some segment's gate/up, down on the engine
  };
  void run_chunk(int64_t rows, ThreadPool& pool, const float* x, int64_t ldx, float* acc, int64_t ldacc, Act act,
                 const uint16_t* x16, int64_t ldx16);
  void gather_bf16_rows(const Chunk& ch, int64_t rows, ThreadPool& pool, const float* x, int64_t ldx,
                        const uint16_t* x16, int64_t ldx16);
  // The engine segments' rows of x into xd_, dense (hidden_ a row).
  void gather_engine_rows(int64_t rows, ThreadPool& pool, const float* x, int64_t ldx, const uint16_t* x16,
                          int64_t ldx16);
  // Whether segment sg's gate/up (down false) or down goes to the engine.
  bool on_engine(const Segment& sg, bool down) const;
  // The chunk's rows of x (xq) or of h (hq, after phase A) as int8
  // activation rows, for the segments whose weight `down`? is in a block format.
  void quantize_rows(const Chunk& ch, int64_t rows, ThreadPool& pool, const float* x, int64_t ldx, bool down);
  // The int8 tiles (Kernels::tiles): whether segment sg's rows go through
  // them for its gate_up (down false) or down; thread
  // t's unpacked panel from block panel p of w.
  bool tiled(const Segment& sg, bool down) const;
  const void* tile_panel(const PackedWeight& w, int32_t p, int t);
  void phase_a(const Chunk& ch, ThreadPool& pool, const float* x, int64_t ldx, Act act);
  void activate_panel(const Chunk& ch, Act act, float* ci, int64_t row, int32_t p, const Segment& sg);
  void engine_gate_up(const Chunk& ch, Act act, const Segment& sg, int32_t p0, int t);
  void engine_down(const Segment& s, int32_t p, int t, float* acc, int64_t ldacc);
  int down_rows(const Chunk& ch, const Segment& s, const PackedWeight& w, int32_t p, int64_t r0, float* c, int ldc,
                const void* next, const void* tile) const;
  void phase_b(const Chunk& ch, ThreadPool& pool, float* acc, int64_t ldacc);
  int run_rows_of(const Segment& sg, const PackedWeight& w, bool dot) const;
  void run_panels(bool dot, const PackedWeight& w, int m, const float* const* a, const uint16_t* row16, int32_t p,
                  int run, float* c, const void* next) const;

  const Kernels& k_;
  int32_t hidden_, ldh_, ldxb_ = 0;
  int64_t chunk_;
  AlignedBuffer h_;
  // With bf16 pair-dot tiles: the chunk's rows of x, and h, in bf16.
  AlignedBuffer xb_, hb_;
  bool bf16_act_ = false;
  // Block-format weights: int8 activation rows of x and h (reserve_quant).
  AlignedBuffer xq_, hq_;
  size_t ldxq_ = 0, ldhq_ = 0;  // bytes a row
  // Unpacked panels for the int8 tiles: one per thread, tile_bytes_ each.
  AlignedBuffer tiles_;
  size_t tile_bytes_ = 0;
  int tile_threads_ = 0;
  bool tile_ok_ = false;  // this run: the pool has no more threads than tiles_ has room for
  // Per chunk: its segments (segs_), them by rows (ord_), and the first
  // gate/up panel of each in that order (first_): kept between runs.
  std::vector<Segment> segs_;
  // The matrix engine (set_engine) and its workspace: the engine
  // segments' x rows (xd_, dense, hidden_ a row) and h rows (hd_: segment
  // s's row i at s.offset * ldh_ + i * its down depth), each with room
  // for a call's padded rows past the chunk; one result tile per thread
  // (ec_, ec_stride_ floats apart).
  MatrixEngine* engine_ = nullptr;
  int64_t engine_min_rows_ = 0;
  int engine_threads_ = 0;
  bool bf16_rows_ = false;  // the layer's activations are bf16
  AlignedBuffer xd_, hd_, ec_;
  size_t ec_stride_ = 0;
  int64_t engine_rows_ = 0;
  // An engine call inside a pool job must not throw (ThreadPool): the
  // first failure is kept here, the later calls of the phase skip, and
  // it is thrown after the phase (engine_gemm, rethrow_engine_error).
  std::atomic<bool> engine_failed_{false};
  std::mutex engine_mu_;
  std::exception_ptr engine_error_;
  void engine_gemm(int shape, int64_t m, const uint16_t* a, const void* w, float* c, int thread);
  void rethrow_engine_error();
  std::vector<const Segment*> ord_;
  std::vector<int64_t> first_;
};

// The gated activation of one (gate, up) value pair.
float activate(Act act, float gate, float up);

}  // namespace cpu
}  // namespace ep_moe

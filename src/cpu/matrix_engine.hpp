// A matrix engine for the bf16 expert GEMMs of a prefill: a library's
// GEMM (oneDNN's brgemm, which runs on AMX tiles where the CPU has them)
// that reads the layer's own packed bf16 panels in place, so the weights
// are held once, in one layout, for the engine, the tiles, the loader and
// the re-placement. It lives in the optional module libep_moe_onednn.so
// (backend/modules.hpp); make_matrix_engine loads it.
//
// The layout it reads: a bf16 PackedWeight's panels (pack.hpp) are nr
// columns of W^T in k-pair order, element (k, j) of a panel at
// (k / 2) * 2 nr + 2 j + k % 2: for a depth that is a multiple of 32 this
// is oneDNN's BA16a<nr>b2a, and a run of consecutive panels is a
// K x (panels * nr) matrix of that format starting at the first one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ep_moe {
namespace cpu {

struct Kernels;

struct MatrixEngineDesc {
  int threads = 1;              // callers' thread indices are 0 .. threads - 1
  int32_t nr = 32;              // the panels' width: 16, 32, 48 or 64
  int32_t tile_panels = 8;      // panels one call covers
  std::vector<int32_t> depths;  // the k of every shape a call may take (multiples of 32)
  bool need_amx = true;         // fail (UNSUPPORTED) where the library's kernels have no AMX
};

class MatrixEngine {
 public:
  virtual ~MatrixEngine() = default;
  // The library's kernels, e.g. "oneDNN 2.6.3 brg:avx512_core_amx_bf16".
  virtual const std::string& name() const = 0;
  virtual bool amx() const = 0;
  // The index of the shape of depth k, or -1 when the engine has none.
  virtual int shape_of(int32_t k) const = 0;
  // Most rows one call takes.
  virtual int64_t max_rows() const = 0;
  // The rows a call of m rows reads from a and writes to c (m rounded up
  // to the engine's next row count: those extra rows of a are read,
  // whatever they hold, and their rows of c written with junk).
  virtual int64_t padded_rows(int64_t m) const = 0;
  // Columns a call writes: tile_panels * nr.
  virtual int32_t tile_cols() const = 0;
  // c[i * tile_cols + j] = sum_k a[i * k + kk] * W[j][kk] for i < padded_rows(m)
  // (1 <= m <= max_rows()), j < tile_cols, over the tile_panels panels
  // starting at w: a dense bf16 rows of depth k (the shape's), c dense
  // f32. Thread-safe for distinct `thread`; allocates nothing. Errors
  // throw ep_moe::Error.
  virtual void gemm(int shape, int64_t m, const uint16_t* a, const void* w, float* c, int thread) = 0;
};

// The engine from libep_moe_onednn.so, or null with *why saying why not
// (not built, the module or oneDNN missing, no AMX where need_amx, a shape
// oneDNN does not run on its brgemm kernels). Creates every primitive now
// (a few ms): gemm() then only runs them.
std::unique_ptr<MatrixEngine> make_matrix_engine(const MatrixEngineDesc& d, std::string* why);

// Whether libep_moe_onednn.so loads (EP_MOE_FEATURE_ONEDNN).
bool matrix_engine_available();

// The fewest rows an expert needs for the engine to take its GEMMs: the
// smallest of 16, 32, 64, 128 and 256 rows at which the engine, and at
// every larger one of them, ran one tile of depth `depth` (one of its
// shapes) in less time than the kernels k on the same panels (the
// bf16 pair-dot tiles where `dot`, else the widening ones with f32 rows),
// one thread, in cache, the best of 7 alternated rounds each (best_ratio); INT64_MAX
// when the engine was slower even at 256. Measured once per process for
// each (depth, table, dot): ~10 ms with AVX-512, less on AMX.
int64_t engine_min_rows(MatrixEngine& e, const Kernels& k, bool dot, int32_t depth);
// The most rows engine_min_rows measures.
constexpr int64_t kEngineMeasuredRows = 256;

}  // namespace cpu
}  // namespace ep_moe

// When the matrix engine takes an expert's GEMMs: measured against the
// layer's own tiles (matrix_engine.hpp).
#include "cpu/matrix_engine.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "common/dtype.hpp"
#include "cpu/aligned.hpp"
#include "cpu/best_ratio.hpp"
#include "cpu/kernels.hpp"

namespace ep_moe {
namespace cpu {

namespace {
constexpr int64_t kRowCounts[] = {16, 32, 64, 128, kEngineMeasuredRows};

int64_t measure(MatrixEngine& e, const Kernels& k, bool dot, int32_t depth) {
  const int shape = e.shape_of(depth);
  const int32_t cols = e.tile_cols(), nr = k.nr;
  const int64_t max_m = kRowCounts[sizeof(kRowCounts) / sizeof(kRowCounts[0]) - 1];
  if (shape < 0 || e.max_rows() < max_m || cols % nr != 0) return std::numeric_limits<int64_t>::max();
  const auto kd = static_cast<size_t>(depth);
  // Small finite values, exact in bf16; the panels in the engine's layout
  // (pack.hpp's k-pair order) are just bf16 values to both.
  AlignedBuffer panels(kd * static_cast<size_t>(cols) * 2);
  AlignedBuffer rows16(static_cast<size_t>(e.padded_rows(max_m)) * kd * 2);
  AlignedBuffer rows32(static_cast<size_t>(max_m) * kd * 4);
  AlignedBuffer c(static_cast<size_t>(e.padded_rows(max_m)) * static_cast<size_t>(cols) * 4);
  const auto value = [](size_t i) { return static_cast<float>(static_cast<int>(i % 17) - 8) / 16.0f; };
  for (size_t i = 0; i < kd * static_cast<size_t>(cols); ++i)
    panels.data<uint16_t>()[i] = f32_to_bf16(value(i * 7 + 3));
  for (size_t i = 0; i < rows16.size() / 2; ++i) rows16.data<uint16_t>()[i] = f32_to_bf16(value(i));
  for (size_t i = 0; i < rows32.size() / 4; ++i) rows32.data<float>()[i] = value(i);
  const uint16_t* a16[64];
  const float* a32[64];
  const auto tiles = [&](int64_t m) {
    for (int64_t r0 = 0; r0 < m; r0 += 64) {
      const int mm = static_cast<int>(std::min<int64_t>(64, m - r0));
      for (int i = 0; i < mm; ++i) {
        a16[i] = rows16.data<uint16_t>() + static_cast<size_t>(r0 + i) * kd;
        a32[i] = rows32.data<float>() + static_cast<size_t>(r0 + i) * kd;
      }
      for (int32_t p = 0; p < cols / nr; ++p) {
        const void* panel = panels.data<uint16_t>() + static_cast<size_t>(p) * kd * static_cast<size_t>(nr);
        float* cp = c.data<float>() + r0 * cols + p * nr;
        if (dot) k.gemm_bf16(mm, a16, depth, panel, cp, cols, nullptr);
        else k.gemm[EP_MOE_DTYPE_BF16](mm, a32, depth, panel, cp, cols, nullptr);
      }
    }
  };
  const auto engine = [&](int64_t m) {
    e.gemm(shape, m, rows16.data<uint16_t>(), panels.data<uint16_t>(), c.data<float>(), 0);
  };
  int64_t from = std::numeric_limits<int64_t>::max();
  for (int i = static_cast<int>(sizeof(kRowCounts) / sizeof(kRowCounts[0])) - 1; i >= 0; --i) {
    const int64_t m = kRowCounts[i];
    if (best_ratio([&] { engine(m); }, [&] { tiles(m); }) >= 1.0) break;  // from here down the tiles hold
    from = m;
  }
  return from;
}
}  // namespace

int64_t engine_min_rows(MatrixEngine& e, const Kernels& k, bool dot, int32_t depth) {
  static std::mutex mu;
  static std::map<std::tuple<int32_t, const Kernels*, bool, std::string>, int64_t> done;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(depth, &k, dot, e.name());
  const auto it = done.find(key);
  if (it != done.end()) return it->second;
  const int64_t v = measure(e, k, dot, depth);
  done.emplace(key, v);
  return v;
}

}  // namespace cpu
}  // namespace ep_moe

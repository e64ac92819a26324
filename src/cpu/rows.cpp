#include "cpu/rows.hpp"

#include <cstring>

#include "common/dtype.hpp"

namespace ep_moe {
namespace cpu {

namespace {
// The dtype is chosen once per row.
void convert_row(const Kernels& k, float* dst, const void* src, ep_moe_dtype_t dt, int64_t n) {
  if (dt == EP_MOE_DTYPE_F32) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  else if (dt == EP_MOE_DTYPE_BF16) k.from_bf16(static_cast<const uint16_t*>(src), dst, n);
  else k.from_f16(static_cast<const uint16_t*>(src), dst, n);
}

void store_row(const Kernels& k, void* dst, ep_moe_dtype_t dt, const float* src, int64_t n) {
  if (dt == EP_MOE_DTYPE_F32) std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  else if (dt == EP_MOE_DTYPE_BF16) k.to_bf16(src, static_cast<uint16_t*>(dst), n);
  else k.to_f16(src, static_cast<uint16_t*>(dst), n);
}
}  // namespace

size_t RowOps::row_bytes() const { return static_cast<size_t>(h_) * dtype_size(dt_); }

void RowOps::widen(const void* src, int64_t n, float* dst, size_t src_stride) const {
  const size_t row = src_stride ? src_stride : row_bytes();
  pool_.parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    for (size_t t = t0; t < t1; ++t)
      convert_row(k_, dst + static_cast<int64_t>(t) * h_, static_cast<const char*>(src) + t * row, dt_, h_);
  });
}

void RowOps::narrow(const float* src, int64_t n, void* dst) const {
  const size_t row = row_bytes();
  pool_.parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    for (size_t t = t0; t < t1; ++t)
      store_row(k_, static_cast<char*>(dst) + t * row, dt_, src + static_cast<int64_t>(t) * h_, h_);
  });
}

void RowOps::zero(float* dst, int64_t n) const {
  pool_.parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    std::memset(dst + static_cast<int64_t>(t0) * h_, 0, (t1 - t0) * static_cast<size_t>(h_) * 4);
  });
}

void RowOps::copy(void* dst, const void* src, int64_t n) const {
  const size_t row = row_bytes();
  pool_.parallel_ranges(static_cast<size_t>(n), 16, [&](size_t t0, size_t t1, int) {
    std::memcpy(static_cast<char*>(dst) + t0 * row, static_cast<const char*>(src) + t0 * row, (t1 - t0) * row);
  });
}

}  // namespace cpu
}  // namespace ep_moe

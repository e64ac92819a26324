// Whole hidden rows of a layer (hidden_size values in the activation
// dtype) widened to f32, narrowed back, cleared and copied, in blocks of
// rows over the pool, with the CPU's vector converters (bit-identical to
// the scalar ones).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/kernels.hpp"
#include "cpu/thread_pool.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cpu {

class RowOps {
 public:
  RowOps(ThreadPool& pool, const Kernels& k, ep_moe_dtype_t act_dtype, int64_t hidden)
      : pool_(pool), k_(k), dt_(act_dtype), h_(hidden) {}
  // n rows at src (src_stride bytes apart; 0: packed) -> f32 rows at dst.
  void widen(const void* src, int64_t n, float* dst, size_t src_stride = 0) const;
  // n f32 rows -> packed rows in the activation dtype.
  void narrow(const float* src, int64_t n, void* dst) const;
  // n f32 rows of zeros.
  void zero(float* dst, int64_t n) const;
  // n packed rows in the activation dtype (dst and src do not overlap).
  void copy(void* dst, const void* src, int64_t n) const;
  // Bytes of one packed row in the activation dtype.
  size_t row_bytes() const;

 private:
  ThreadPool& pool_;
  const Kernels& k_;
  ep_moe_dtype_t dt_;
  int64_t h_;
};

}  // namespace cpu
}  // namespace ep_moe

// The B side's FfnRunner of ep_moe_ab_bench (ab_variant_ffn.cpp): the
// variant's cpu/ffn.cpp behind a handle, so that the bench's own file sees
// only the library's FfnRunner.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu/ffn.hpp"

namespace ep_moe {
namespace cpu {

class AbVariantFfn {
 public:
  AbVariantFfn(const Kernels& k, int32_t hidden, int32_t max_inter, int64_t chunk_rows, bool bf16_activations);
  ~AbVariantFfn();
  AbVariantFfn(const AbVariantFfn&) = delete;
  AbVariantFfn& operator=(const AbVariantFfn&) = delete;
  void reserve_jobs(size_t max_jobs);
  void reserve_quant(int threads, ep_moe_dtype_t t);
  void run(ThreadPool& pool, const std::vector<ExpertJob>& jobs, const float* x, int64_t ldx, float* acc, int64_t ldacc,
           Act act);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cpu
}  // namespace ep_moe

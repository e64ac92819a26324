// ep_moe_ab_bench's B side of the expert path: cpu/ffn.cpp from
// EP_MOE_AB_VARIANT_DIR when that directory has one (it comes first on this
// file's include path), else the library's own, built a second time under
// other names so that both live in one process. A change to FfnRunner
// (phase order, claims, the fused combine) is then measured against the
// library's FfnRunner as kernel changes are. The variant must keep
// ffn.hpp's ExpertJob, Act and constructor as they are: the bench hands
// both sides the same jobs.
#define FfnRunner FfnRunnerAbVariant
#define activate activate_ab_variant
#include "cpu/ffn.cpp"
#undef activate
#undef FfnRunner

#include <memory>

#include "ab_variant_ffn.hpp"

namespace ep_moe {
namespace cpu {

struct AbVariantFfn::Impl : FfnRunnerAbVariant {
  using FfnRunnerAbVariant::FfnRunnerAbVariant;
};

AbVariantFfn::AbVariantFfn(const Kernels& k, int32_t hidden, int32_t max_inter, int64_t chunk_rows, bool bf16)
    : impl_(std::make_unique<Impl>(k, hidden, max_inter, chunk_rows, bf16)) {}
AbVariantFfn::~AbVariantFfn() = default;
void AbVariantFfn::reserve_jobs(size_t max_jobs) { impl_->reserve_jobs(max_jobs); }
void AbVariantFfn::reserve_quant(int threads, ep_moe_dtype_t t) { impl_->reserve_quant(threads, t); }
void AbVariantFfn::run(ThreadPool& pool, const std::vector<ExpertJob>& jobs, const float* x, int64_t ldx, float* acc,
                       int64_t ldacc, Act act) {
  impl_->run(pool, jobs, x, ldx, acc, ldacc, act);
}

}  // namespace cpu
}  // namespace ep_moe

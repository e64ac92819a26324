// The CUDA layer (device_layer.hpp's DeviceLayer): its weights, workspace
// and steps. cuda_layer.cu holds the set-up, the uploads, routing, the
// plan, permutation and combine of compute() and the distributed flows'
// row kernels; expert_gemm.cu the expert GEMMs (cuBLASLt, or the grouped
// kernels) and the activation.
#pragma once

#include <map>
#include <tuple>
#include <vector>

#include "cuda/device_common.cuh"
#include "cuda/device_layer.hpp"

namespace ep_moe {
namespace cuda {

enum class Gemm : int { GateUp = 0, Down = 1, SharedGateUp = 2, SharedDown = 3, Router = 4 };

class CudaLayer final : public DeviceLayer {
 public:
  explicit CudaLayer(const DeviceLayerDesc& d);
  ~CudaLayer() override;

  void upload(Part part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
              bool src_on_device) override;
  bool begin(void* stream) override;
  void route(const DeviceForward& f, int32_t* ids, float* w) override;
  void compute(const DeviceRows& rows, void* stream) override;
  void check_route(void* stream) override;
  void pack_rows(void* out, int64_t rows, int64_t valid, const void* hidden, const int32_t* ids, const float* w,
                 const int32_t* tok, const int32_t* dest, const int32_t* row_dest, void* stream) override;
  void unpack_rows(const void* in, int64_t rows, void* x, int32_t* ids, float* w, void* stream) override;
  void sum_returned(void* out, const void* own, const void* ret, const int32_t* off, const int32_t* idx, int64_t tokens,
                    void* stream) override;
  size_t row_bytes() const override { return row_bytes_; }
  void* buffer(Buf b) override { return buf(b).p; }
  size_t buffer_bytes(Buf b) const override { return const_cast<CudaLayer*>(this)->buf(b).bytes; }
  void copy(void* dst, const void* src, size_t bytes, void* stream) override {
    if (bytes == 0) return;
    DeviceGuard g(d_.device);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync");
  }
  void sync(void* stream) override {
    DeviceGuard g(d_.device);
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  }
  DeviceStats stats() override;
  int64_t weight_bytes() const override { return weight_bytes_; }
  void read_load(int64_t* out) override {
    DeviceGuard g(d_.device);
    check(cudaDeviceSynchronize(), "wait for the forwards");  // their streams are the caller's
    static_assert(sizeof(unsigned long long) == sizeof(int64_t), "64-bit counts");
    check(cudaMemcpy(out, load_.p, static_cast<size_t>(d_.num_experts) * 8, cudaMemcpyDeviceToHost), "read load");
  }
  void reset_load() override {
    DeviceGuard g(d_.device);
    check(cudaMemset(load_.p, 0, static_cast<size_t>(d_.num_experts) * 8), "reset load");
    check(cudaDeviceSynchronize(), "reset load");
  }
  void extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) override;
  void copy_expert_from(const DeviceLayer& src, int32_t src_slot, int32_t dst_slot) override;
  void copy_router_from(const DeviceLayer& src) override;
  void* scratch(size_t bytes) override {
    if (bytes > scratch_.bytes) {
      DeviceGuard g(d_.device);
      if (scratch_.p) check(cudaFree(scratch_.p), "cudaFree");
      scratch_.p = nullptr;
      scratch_.bytes = 0;
      scratch_.alloc(bytes, "staging scratch");
    }
    return scratch_.p;
  }
  int pointer_device(const void* p) const override;
  int device_ordinal() const override { return d_.device; }
  void download(void* dst, const void* src, size_t bytes) const override {
    DeviceGuard g(d_.device);
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "read device buffer");
  }

 private:
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
  };
  Buffer& buf(Buf b) { return bufs_[static_cast<int>(b)]; }
  // Y[n, N] = X[n, Kd] W^T in f32 through cuBLASLt; false when it offers no
  // algorithm for these shapes and alignments (the caller falls back).
  // batch > 1: `batch` groups of n rows each, strided (weights N Kd apart,
  // rows n Kd, results n N).
  bool lt_gemm(Gemm kind, ep_moe_dtype_t dt, const void* W, const void* X, float* Y, int64_t n, int N, int Kd,
               cudaStream_t s, int batch);
  // The same for groups of rows, with per-group weights; `off` on the
  // device (null: one group of `rows` rows).
  // (`cnt`, `pad`: group l's rows are [l pad, l pad + cnt[l]) when pad > 0.)
  // `rows_hint`: the expected rows per group, which picks the tile shape.
  void grouped_gemm(ep_moe_dtype_t dt, const void* X, const void* W, int64_t w_stride, float* Y, const int32_t* off,
                    const int* cnt, int64_t pad, int groups, int64_t rows, int N, int Kd, cudaStream_t s,
                    int64_t rows_hint);
  void act(const float* h, void* a, int64_t rows, int64_t I, cudaStream_t s);
  // The experts' gate/up GEMM with the activation fused: rows of X (groups
  // by `off`) -> A [rows, I] in the GEMM type.
  void grouped_gated(const void* X, void* A, const int32_t* off, int groups, int I, int Kd, cudaStream_t s,
                     int64_t rows_hint);
  void check_errors(const int* hm);
  // compute()'s steps: the plan (returns the pad of padded slots, 0: none;
  // *hoff: the offsets on the host when it synchronised), the counts'
  // read-back, the permutation into expert order, the routed and shared
  // experts' GEMMs (expert_gemm.cu), and the combine into token order.
  int64_t plan(const DeviceRows& r, cudaStream_t s, int64_t P, bool sync_free, const int32_t** hoff);
  int64_t read_counts(cudaStream_t s, const int32_t** hoff);
  void permute(const DeviceRows& r, cudaStream_t s, int64_t P, int64_t s0, int64_t sn);
  void routed_experts(cudaStream_t s, int64_t P, int64_t pad, bool sync_free, const int32_t* hoff);
  void shared_expert(cudaStream_t s, int64_t sn);
  void combine(const DeviceRows& r, cudaStream_t s, int64_t P, int64_t s0, int64_t s1, int64_t sn);

  DeviceLayerDesc d_;
  ep_moe_dtype_t gdt_;  // GEMM operand type: the weight dtype
  size_t ges_;          // its size
  size_t row_bytes_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t mm_ = nullptr;
  DevBuf lt_ws_;
  using AlgoKey = std::tuple<int, int, int, int64_t, int>;  // kind, dtype, alignment, rows, batch
  std::map<AlgoKey, std::pair<bool, cublasLtMatmulAlgo_t>> algos_;

  // Weights.
  DevBuf w_gu_, w_down_, s_gu_, s_down_, router_, bias_, s_gate_;
  int64_t weight_bytes_ = 0;
  // Placement tables.
  DevBuf rep_begin_, rep_slots_, slot_rank_, g2l_;
  DevBuf load_;     // [E] pairs computed here (the load window)
  DevBuf scratch_;  // host data over a device communicator (re-placement)
  // Workspace of compute(), sized for max_rows.
  DevBuf pair_local_, pair_w_, pair_pos_, offsets_, cursor_, meta_;
  DevBuf xperm_, h_, a_, y_, xs_, hs_, as_, ys_, gs_, xf_, logits_;
  // Workspace of the distributed flows (buffer()).
  DevBuf flow_[12];
  Buffer bufs_[14];
  void* staging_[2] = {nullptr, nullptr};
  int* host_meta_ = nullptr;  // pinned copy of meta_ + offsets_
  cudaEvent_t ev_[4] = {};    // start, routed+permuted, experts, combined
  cudaEvent_t ev_meta_ = nullptr;
  bool capturing_ = false, have_stats_ = false, have_times_ = false;
  int64_t last_shared_rows_ = 0, cap_rows_ = 0;
  DeviceStats last_;
  int64_t last_rows_ = 0;
  size_t meta_ints_ = 0;
};

}  // namespace cuda
}  // namespace ep_moe

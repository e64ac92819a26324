// libep_moe_onednn.so: the matrix engine (cpu/matrix_engine.hpp) on
// oneDNN's matmul primitives.
//
// oneDNN 2.6 runs a matmul on its brgemm kernels (AMX tiles where the CPU
// has them, else AVX-512) only for dense rows and a row count fixed when
// the primitive is made; a run-time row count or a row stride falls back
// to its reference code. So the engine makes one primitive per depth and
// per row count of a fixed ladder (kRowCounts) up front, a call runs the
// smallest that holds its rows, and the caller keeps its rows dense.
//
// Threads: Debian's oneDNN runs on OpenMP. The engine is called from the
// layer's own pool, one call per pool thread at a time, each on one
// thread: the calling thread's OpenMP thread count is set to 1 around
// every oneDNN call (and put back), so oneDNN never starts an OpenMP team
// of its own beside the pool, and a host's OpenMP setting on that thread
// is left as it was. Each thread has its own stream, memory objects and
// scratchpad, so gemm() allocates nothing.
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "backend/modules.hpp"
#include "common/error.hpp"
#include "cpu/aligned.hpp"

namespace ep_moe {
namespace {

// Steps of 16 rows (an AMX tile's) to 128, then of 32 and 64: a call pads
// its rows by less than 1/8 from 128 rows on.
constexpr int64_t kRowCounts[] = {16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512};
constexpr int kBuckets = sizeof(kRowCounts) / sizeof(kRowCounts[0]);

// The calling thread's OpenMP thread count at 1 for a scope.
class OneOmpThread {
 public:
  OneOmpThread() : prev_(omp_get_max_threads()) {
    if (prev_ != 1) omp_set_num_threads(1);
  }
  ~OneOmpThread() {
    if (prev_ != 1) omp_set_num_threads(prev_);
  }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  int prev_;
};

dnnl::memory::format_tag panel_tag(int32_t nr) {
  using tag = dnnl::memory::format_tag;
  switch (nr) {
    case 16: return tag::BA16a16b2a;
    case 32: return tag::BA16a32b2a;
    case 48: return tag::BA16a48b2a;
    case 64: return tag::BA16a64b2a;
    default: return tag::undef;
  }
}

class OnednnEngine final : public cpu::MatrixEngine {
 public:
  explicit OnednnEngine(const cpu::MatrixEngineDesc& d) : eng_(dnnl::engine::kind::cpu, 0) {
    using dt = dnnl::memory::data_type;
    const dnnl::memory::format_tag wtag = panel_tag(d.nr);
    if (wtag == dnnl::memory::format_tag::undef)
      fail(EP_MOE_ERR_UNSUPPORTED, "oneDNN engine: panels %d columns wide have no oneDNN format", d.nr);
    if (d.threads < 1 || d.tile_panels < 1 || d.depths.empty())
      fail(EP_MOE_ERR_INVALID_ARGUMENT, "oneDNN engine: bad description");
    cols_ = d.tile_panels * d.nr;
    const OneOmpThread one;
    size_t scratch = 0;
    for (const int32_t k : d.depths) {
      if (k <= 0 || k % 32 != 0) fail(EP_MOE_ERR_UNSUPPORTED, "oneDNN engine: depth %d is not a multiple of 32", k);
      Shape s;
      s.k = k;
      for (int b = 0; b < kBuckets; ++b) {
        const int64_t m = kRowCounts[b];
        const dnnl::memory::desc a({m, k}, dt::bf16, dnnl::memory::format_tag::ab);
        const dnnl::memory::desc w({k, cols_}, dt::bf16, wtag);
        const dnnl::memory::desc c({m, cols_}, dt::f32, dnnl::memory::format_tag::ab);
        dnnl::primitive_attr attr;
        attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, w, c), attr, eng_);
        const std::string impl = pd.impl_info_str();
        if (impl.rfind("brg", 0) != 0)
          fail(EP_MOE_ERR_UNSUPPORTED, "oneDNN engine: oneDNN runs a %lld x %d x %d bf16 matmul on '%s', not brgemm",
               static_cast<long long>(m), k, cols_, impl.c_str());
        if (impl_.empty()) impl_ = impl;
        scratch = std::max(scratch, pd.scratchpad_desc().get_size());
        s.prim[b] = dnnl::matmul(pd);
        s.a[b] = a;
        s.w[b] = w;
        s.c[b] = c;
      }
      shapes_.push_back(std::move(s));
    }
    amx_ = impl_.find("amx") != std::string::npos;
    if (d.need_amx && !amx_)
      fail(EP_MOE_ERR_UNSUPPORTED, "oneDNN engine: oneDNN's kernels here are '%s', without AMX", impl_.c_str());
    const dnnl_version_t* v = dnnl_version();
    name_ = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
            " " + impl_;
    // Per thread: a stream, the memory objects of every primitive (their
    // pointers set per call) and a scratchpad.
    scratch_bytes_ = (scratch + 63) / 64 * 64;
    scratch_.resize(static_cast<size_t>(d.threads) * std::max<size_t>(scratch_bytes_, 64));
    per_thread_.resize(static_cast<size_t>(d.threads));
    for (int t = 0; t < d.threads; ++t) {
      PerThread& pt = per_thread_[static_cast<size_t>(t)];
      pt.stream = dnnl::stream(eng_);
      pt.scratch =
          dnnl::memory(dnnl::memory::desc({static_cast<int64_t>(scratch_bytes_)}, dt::u8, dnnl::memory::format_tag::a),
                       eng_, scratch_.data<char>() + static_cast<size_t>(t) * scratch_bytes_);
      for (const Shape& s : shapes_)
        for (int b = 0; b < kBuckets; ++b) {
          pt.mem.push_back(dnnl::memory(s.a[b], eng_, DNNL_MEMORY_NONE));
          pt.mem.push_back(dnnl::memory(s.w[b], eng_, DNNL_MEMORY_NONE));
          pt.mem.push_back(dnnl::memory(s.c[b], eng_, DNNL_MEMORY_NONE));
        }
    }
  }

  const std::string& name() const override { return name_; }
  bool amx() const override { return amx_; }
  int shape_of(int32_t k) const override {
    for (size_t i = 0; i < shapes_.size(); ++i)
      if (shapes_[i].k == k) return static_cast<int>(i);
    return -1;
  }
  int64_t max_rows() const override { return kRowCounts[kBuckets - 1]; }
  int64_t padded_rows(int64_t m) const override { return kRowCounts[bucket(m)]; }
  int32_t tile_cols() const override { return cols_; }

  void gemm(int shape, int64_t m, const uint16_t* a, const void* w, float* c, int thread) override {
    if (shape < 0 || static_cast<size_t>(shape) >= shapes_.size() || m < 1 || m > max_rows() || thread < 0 ||
        static_cast<size_t>(thread) >= per_thread_.size())
      fail(EP_MOE_ERR_INTERNAL, "oneDNN engine: bad call (shape %d, %lld rows, thread %d)", shape,
           static_cast<long long>(m), thread);
    const int b = bucket(m);
    PerThread& pt = per_thread_[static_cast<size_t>(thread)];
    const size_t base = (static_cast<size_t>(shape) * kBuckets + static_cast<size_t>(b)) * 3;
    dnnl_memory_t ma = pt.mem[base].get(), mw = pt.mem[base + 1].get(), mc = pt.mem[base + 2].get();
    const OneOmpThread one;
    // The C interface: no argument map to build (and allocate) per call.
    check(dnnl_memory_set_data_handle_v2(ma, const_cast<uint16_t*>(a), nullptr));
    check(dnnl_memory_set_data_handle_v2(mw, const_cast<void*>(w), nullptr));
    check(dnnl_memory_set_data_handle_v2(mc, c, nullptr));
    const dnnl_exec_arg_t args[] = {
        {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, pt.scratch.get()}};
    check(dnnl_primitive_execute(shapes_[static_cast<size_t>(shape)].prim[b].get(), pt.stream.get(), 4, args));
  }

 private:
  struct Shape {
    int32_t k = 0;
    dnnl::primitive prim[kBuckets];
    dnnl::memory::desc a[kBuckets], w[kBuckets], c[kBuckets];
  };
  struct PerThread {
    dnnl::stream stream;
    dnnl::memory scratch;
    std::vector<dnnl::memory> mem;  // by shape, bucket: a, w, c
  };
  static int bucket(int64_t m) {
    int b = 0;
    while (b + 1 < kBuckets && kRowCounts[b] < m) ++b;
    return b;
  }
  static void check(dnnl_status_t st) {
    if (st == dnnl_out_of_memory) fail(EP_MOE_ERR_OUT_OF_MEMORY, "oneDNN engine: oneDNN ran out of memory");
    if (st != dnnl_success) fail(EP_MOE_ERR_INTERNAL, "oneDNN engine: oneDNN call failed (status %d)", st);
  }

  dnnl::engine eng_;
  int32_t cols_ = 0;
  std::vector<Shape> shapes_;
  std::string impl_, name_;
  bool amx_ = false;
  size_t scratch_bytes_ = 0;
  AlignedBuffer scratch_;
  std::vector<PerThread> per_thread_;
};

std::unique_ptr<cpu::MatrixEngine> create_engine(const cpu::MatrixEngineDesc& d) {
  try {
    return std::make_unique<OnednnEngine>(d);
  } catch (const dnnl::error& e) {
    fail(EP_MOE_ERR_UNSUPPORTED, "oneDNN engine: %s (status %d)", e.what(), static_cast<int>(e.status));
  }
}

}  // namespace
}  // namespace ep_moe

extern "C" __attribute__((visibility("default"))) const ep_moe::backend::OnednnModule* EP_MOE_ONEDNN_MODULE_ENTRY() {
  static const ep_moe::backend::OnednnModule m = {ep_moe::backend::kModuleAbi, EP_MOE_VERSION_NUMBER,
                                                  &ep_moe::create_engine};
  return &m;
}

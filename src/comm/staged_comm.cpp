#include "comm/staged_comm.hpp"

#include "common/dtype.hpp"
#include "common/error.hpp"

namespace ep_moe {

namespace {
size_t total(const size_t* counts, int n) {
  size_t s = 0;
  for (int i = 0; i < n; ++i) s += counts[i];
  return s;
}

class StagedComm final : public Comm {
 public:
  StagedComm(Comm* inner, DeviceStaging* dev) : c_(inner), dev_(dev) { timeout_ms_ = inner->timeout_ms(); }
  int rank() const override { return c_->rank(); }
  int size() const override { return c_->size(); }
  int ranks_in_process() const override { return c_->ranks_in_process(); }
  const char* backend() const override { return c_->backend(); }
  void all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dt, void*) override {
    stage({CollectiveOp::AllReduce, count, nullptr, nullptr, dt}, out, in);
  }
  void reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dt, void*) override {
    stage({CollectiveOp::ReduceScatter, count, nullptr, nullptr, dt}, out, in);
  }
  void all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dt, void*) override {
    stage({CollectiveOp::AllGather, count, nullptr, nullptr, dt}, out, in);
  }
  void all_gather_v(void* out, const void* in, const size_t* counts, ep_moe_dtype_t dt, void*) override {
    stage({CollectiveOp::AllGatherV, 0, counts, nullptr, dt}, out, in);
  }
  void all_to_all_v(void* out, const size_t* out_counts, const void* in, const size_t* in_counts, ep_moe_dtype_t dt,
                    void*) override {
    stage({CollectiveOp::AllToAllV, 0, in_counts, out_counts, dt}, out, in);
  }
  void barrier(void* stream) override { c_->barrier(stream); }
  ep_moe_status_t async_error(int* peer, std::string* message) const override { return c_->async_error(peer, message); }
  std::unique_ptr<Comm> split(int, int) override {
    fail(EP_MOE_ERR_UNSUPPORTED, "a staged view of a communicator cannot be split");
  }
  void fail_collective(ep_moe_status_t s, const std::string& m) noexcept override { c_->fail_collective(s, m); }
  void abort() noexcept override { c_->abort(); }

 private:
  void stage(const Collective& x, void* out, const void* in) {
    size_t ib = 0, ob = 0;
    collective_bytes(x, *this, &ib, &ob);
    auto* d = static_cast<char*>(dev_->scratch(staged_scratch_bytes(ib, ob)));
    char* dout = d + (ib + 255) / 256 * 256;
    dev_->copy(d, in, ib, nullptr);
    dev_->sync(nullptr);
    run_collective(c_, x, dout, d, nullptr);
    dev_->copy(out, dout, ob, nullptr);
    dev_->sync(nullptr);
  }
  Comm* c_;
  DeviceStaging* dev_;
};
}  // namespace

void run_collective(Comm* c, const Collective& x, void* out, const void* in, void* stream) {
  switch (x.op) {
    case CollectiveOp::AllReduce: c->all_reduce(out, in, x.count, x.dt, stream); break;
    case CollectiveOp::ReduceScatter: c->reduce_scatter(out, in, x.count, x.dt, stream); break;
    case CollectiveOp::AllGather: c->all_gather(out, in, x.count, x.dt, stream); break;
    case CollectiveOp::AllGatherV: c->all_gather_v(out, in, x.counts, x.dt, stream); break;
    case CollectiveOp::AllToAllV: c->all_to_all_v(out, x.out_counts, in, x.counts, x.dt, stream); break;
  }
}

void collective_bytes(const Collective& x, const Comm& c, size_t* in, size_t* out) {
  const size_t es = dtype_size(x.dt), n = static_cast<size_t>(c.size());
  switch (x.op) {
    case CollectiveOp::AllReduce: *in = *out = x.count * es; break;
    case CollectiveOp::ReduceScatter:
      *in = x.count * n * es;
      *out = x.count * es;
      break;
    case CollectiveOp::AllGather:
      *in = x.count * es;
      *out = x.count * n * es;
      break;
    case CollectiveOp::AllGatherV:
      *in = x.counts[c.rank()] * es;
      *out = total(x.counts, c.size()) * es;
      break;
    case CollectiveOp::AllToAllV:
      *in = total(x.counts, c.size()) * es;
      *out = total(x.out_counts, c.size()) * es;
      break;
  }
}

size_t staged_scratch_bytes(size_t in, size_t out) { return (in + 255) / 256 * 256 + out + 1; }

std::unique_ptr<Comm> make_staged_comm(Comm* inner, DeviceStaging* dev) {
  return std::make_unique<StagedComm>(inner, dev);
}

}  // namespace ep_moe

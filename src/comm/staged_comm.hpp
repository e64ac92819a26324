// Collectives described as values, and a host view of a device communicator:
// host buffers in and out over a communicator that moves device memory
// (NCCL), each collective staged through device scratch. The CUDA layer uses
// it for its count exchange and the re-placement's records and weights.
#pragma once

#include <cstddef>
#include <memory>

#include "comm/comm.hpp"

namespace ep_moe {

enum class CollectiveOp { AllReduce, ReduceScatter, AllGather, AllGatherV, AllToAllV };

// One collective: what it is, apart from its buffers and stream.
struct Collective {
  CollectiveOp op;
  size_t count;              // elements (per rank for reduce-scatter)
  const size_t* counts;      // the v variants: per-rank counts (sent, for all-to-all)
  const size_t* out_counts;  // all-to-all: per-rank counts received
  ep_moe_dtype_t dt;
};

// Runs `x` on `c`.
void run_collective(Comm* c, const Collective& x, void* out, const void* in, void* stream);
// The bytes this rank gives and gets in `x` over `c`.
void collective_bytes(const Collective& x, const Comm& c, size_t* in, size_t* out);

// The device memory a staged view moves its bytes through.
class DeviceStaging {
 public:
  virtual ~DeviceStaging() = default;
  virtual void* scratch(size_t bytes) = 0;  // at least `bytes` of device memory, kept until the next call
  virtual void copy(void* dst, const void* src, size_t bytes, void* stream) = 0;
  virtual void sync(void* stream) = 0;
};

// Device scratch a staged collective of `in` / `out` bytes needs.
size_t staged_scratch_bytes(size_t in, size_t out);

// A view of `inner` (borrowed) taking host buffers; `dev` borrowed too.
std::unique_ptr<Comm> make_staged_comm(Comm* inner, DeviceStaging* dev);

}  // namespace ep_moe

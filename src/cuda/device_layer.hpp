// The CUDA backend of one rank's MoE layer (a layer whose config names a
// device). The layer (src/layer) keeps the configuration, the expert map and
// the C API contract; this part holds the weights on the device and runs the
// forward data flow there: route -> plan -> permute -> expert GEMMs
// (cuBLASLt, or the synchronisation-free grouped kernel) -> combine
// (+ shared expert) -> one all-reduce on the caller's stream.
//
// This header has no CUDA types, so the rest of the library builds without
// the toolkit; device_layer_unsupported.cpp stands in when it is absent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/staged_comm.hpp"
#include "common/source.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace cuda {

// Everything the device side needs to know, fixed at create.
struct DeviceLayerDesc {
  int device = 0;
  int32_t hidden = 0, inter = 0, num_experts = 0, top_k = 0;
  int32_t activation = EP_MOE_ACT_SILU;
  ep_moe_dtype_t weight_dtype = EP_MOE_DTYPE_F32, act_dtype = EP_MOE_DTYPE_F32, router_dtype = EP_MOE_DTYPE_F32;
  bool sigmoid = false, renormalize = true, use_bias = false, weight_zero = false;
  int32_t num_group = 0, topk_group = 0;
  float scale = 1.0f;
  int32_t shared_count = 0;  // this rank's shard of the shared intermediate
  bool shared_gate = false;
  int64_t max_tokens = 0;
  int32_t sync_free_tokens = 0;
  // Placement: local slots, this rank, and per expert its replica slots.
  int32_t num_local = 0, ep_rank = 0, ep_size = 1, my_slot_begin = 0;
  std::vector<int32_t> replica_begin, replica_slots, slot_rank;
  std::vector<int32_t> global_to_local;  // [E]: local slot of an expert, -1 when not here
  // Workspace of the distributed flows (rows after the DP gather or the
  // all-to-all receive; rows sent; pinned staging for host communicators).
  int64_t max_rows = 0, max_send_rows = 0, max_ret_rows = 0, max_index = 0;
  size_t row_bytes = 0;  // one packed row [hidden | K ids | K weights] (the layer's wire format)
  size_t ids_off = 0;    // where a row's ids start (4-byte aligned)
  size_t staging_bytes = 0;
};

// Which weight a device upload fills (common/source.hpp; the layer never
// gives a device layer biases of experts or of the router).
using Part = WeightPart;

// The routing inputs of one forward (device pointers, this rank's tokens).
struct DeviceForward {
  int64_t tokens = 0;
  const void* hidden = nullptr;
  const void* router_logits = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  bool own_router = false;  // logits = hidden x router^T (the layer holds one)
  void* stream = nullptr;
};

// Rows the experts run on (device pointers): token rows with their top-k
// choice. `ids` NULL: no routed pairs (the shared expert alone).
struct DeviceRows {
  int64_t n = 0;
  const void* x = nullptr;       // [n, H] act dtype
  const int32_t* ids = nullptr;  // [n, K] global ids; -1: another rank's pair, or a padding row
  const float* w = nullptr;      // [n, K]
  // true: every id >= 0 is this rank's (all-to-all rows, chosen by the
  // sender); false: the replica is chosen here and other ranks' pairs are
  // skipped (or given weight 0).
  bool assigned = false;
  int64_t shared_begin = 0, shared_end = 0;  // rows that get the shared expert
  void* out = nullptr;                       // [n, H] act dtype
};

// What the last forward did, for the layer's attributes. Counts are read
// from the device lazily (after the forward's work completes).
struct DeviceStats {
  int64_t local_pairs = 0, skipped = 0, active = 0;
  int64_t permute_ns = 0, permute_bytes = 0, expert_ns = 0, combine_ns = 0, combine_bytes = 0;
  int32_t sync_free = -1;
};

// Device workspace of the distributed flows (DP gather, all-to-all), sized
// at create; the layer (layer/cuda_backend.cpp) plans on the host and moves rows
// with these.
enum class Buf {
  Ids,
  Weights,  // [max_tokens, K]: this rank's routed tokens
  SendRows,
  RecvRows,  // packed rows [hidden | ids | weights]
  AllX,
  AllIds,
  AllW,     // unpacked rows: [max_rows, H] act dtype, [max_rows, K] ids, weights
  Partial,  // [max_rows, H] act dtype: expert output of the rows
  Own,      // [max_tokens, H] act dtype: reduce-scatter result, own shared output
  RetRecv,  // [max_tokens * fanout, H] act dtype: returned rows (all-to-all)
  Index,    // int32 plan arrays uploaded from the host (all-to-all)
  StageIn,
  StageOut,  // pinned host memory for host communicators
};

// A CUDA layer's device state; its scratch, copies and syncs also stage
// host collectives over a device communicator (comm/staged_comm.hpp).
class DeviceLayer : public DeviceStaging {
 public:
  ~DeviceLayer() override = default;
  // Copies rows x cols of `src` (any float dtype, host or device memory:
  // `src_on_device`) into the part, starting at row `row0` of local slot
  // `slot` (ignored for the shared and small parts).
  virtual void upload(Part part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
                      bool src_on_device) = 0;
  // Starts a forward: clears the statistics; reports whether `stream` is
  // being captured into a CUDA graph.
  virtual bool begin(void* stream) = 0;
  // Routes f.tokens rows into ids/w ([T, K], device).
  virtual void route(const DeviceForward& f, int32_t* ids, float* w) = 0;
  // Synchronises and throws INVALID_ARGUMENT when routing found bad logits.
  virtual void check_route(void* stream) = 0;
  // Experts (and the shared expert) on rows; writes rows.out. Synchronises
  // once to read per-expert counts unless the rows are few (or captured).
  virtual void compute(const DeviceRows& rows, void* stream) = 0;
  // rows [hidden | K ids | K weights] (row_bytes each, see row_bytes()):
  // row j is token tok[j] (j itself when tok is NULL; rows >= valid are
  // padding: zeros and ids -1); when `dest` is set, ids of pairs whose
  // dest[t*K+k] differs from row_dest[j] are sent as -1.
  virtual void pack_rows(void* out, int64_t rows, int64_t valid, const void* hidden, const int32_t* ids, const float* w,
                         const int32_t* tok, const int32_t* dest, const int32_t* row_dest, void* stream) = 0;
  virtual void unpack_rows(const void* in, int64_t rows, void* x, int32_t* ids, float* w, void* stream) = 0;
  // out[t] = own[t] + sum of ret rows idx[off[t] .. off[t+1]) (act dtype).
  virtual void sum_returned(void* out, const void* own, const void* ret, const int32_t* off, const int32_t* idx,
                            int64_t tokens, void* stream) = 0;
  virtual size_t row_bytes() const = 0;
  virtual void* buffer(Buf b) = 0;
  virtual size_t buffer_bytes(Buf b) const = 0;
  // Stream-ordered copies (kind inferred from the pointers); sync waits.
  void copy(void* dst, const void* src, size_t bytes, void* stream) override = 0;
  void sync(void* stream) override = 0;
  virtual DeviceStats stats() = 0;
  virtual int64_t weight_bytes() const = 0;
  // The per-logical-expert count of real pairs computed here since the last
  // reset ([E]; waits for the device), and the reset.
  virtual void read_load(int64_t* out) = 0;
  virtual void reset_load() = 0;
  // Live re-placement (replace.cpp): `n` units [gate row | up row | down
  // column] (H elements each, weight dtype) from row j0 of local slot `slot`
  // (-1: the shared shard) into host memory.
  virtual void extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) = 0;
  // Device-to-device copies from another layer of the same shapes.
  virtual void copy_expert_from(const DeviceLayer& src, int32_t src_slot, int32_t dst_slot) = 0;
  virtual void copy_router_from(const DeviceLayer& src) = 0;
  // At least `bytes` of device memory for host data over a device
  // communicator (grows; forward only uses what setup sized).
  void* scratch(size_t bytes) override = 0;
  // The device whose memory p is (managed memory: this layer's), or -1 for
  // host memory.
  virtual int pointer_device(const void* p) const = 0;
  // Whether p is memory of this layer's device.
  bool is_device_pointer(const void* p) const { return pointer_device(p) == device_ordinal(); }
  virtual int device_ordinal() const = 0;
  // Copies `bytes` of device memory to the host.
  virtual void download(void* dst, const void* src, size_t bytes) const = 0;
};

// Creates the device part; throws EP_MOE_ERR_UNSUPPORTED when the library
// was built without CUDA or the device does not exist.
std::unique_ptr<DeviceLayer> create_device_layer(const DeviceLayerDesc& d);

}  // namespace cuda
}  // namespace ep_moe

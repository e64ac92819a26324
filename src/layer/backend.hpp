// What differs between a CPU layer and a CUDA layer.
//
// Layer (layer.cpp) keeps what both share: the configuration and its
// checks, the expert map and replica tables, which weights each local slot
// has, the small host vectors (score bias, shared gate, router bias), the
// host side of the all-to-all plan (alltoall.cpp) and the order of a step's
// collectives with their failure protocol. A backend holds the weights'
// storage and the activations' workspace, and runs the steps that touch
// them. Layer::forward() calls the same steps whichever backend it has:
//   route -> [choice_to_host -> host plan -> count exchange] ->
//   allgather() or alltoall().
// A new backend (a device, a matrix engine with its own weight layout)
// implements this interface in its own file and is chosen in the Layer
// constructor; nothing else in the layer changes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/source.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {

class Comm;
class Layer;
struct Stages;

// How the DP gather moves rows (EP_MOE_LAYER_ATTR_LAST_GATHER).
enum class Gather : int { None = 0, Padded = 1, Compact = 2 };

// One kept expert of a live re-placement: its complete slot in the old
// layer, its slot in the new one, and whether it is the expert's first
// slot in the new layer (its later slots, replicas, are copies).
struct KeptSlot {
  int32_t old_slot, new_slot;
  bool first;
};

class LayerBackend {
 public:
  virtual ~LayerBackend() = default;

  // --- the weights ----------------------------------------------------------
  // Stores `rows` x `cols` of `src` into `part`, from row `row0` of local
  // slot `slot` (-1 for the shared expert's shard and the layer-wide parts).
  // Layer::store has checked the weight and narrowed a shared-expert source
  // to this rank's shard. Gate/up parts come one half at a time (row0 0 or
  // the slot's intermediate size). Bias parts are f32 vectors already
  // checked finite; Bias, SharedGate and RouterBias are also kept by the
  // layer, which the CPU reads in place. `src_on_device`: device memory.
  virtual void put(WeightPart part, int32_t slot, int64_t row0, const Source& src, int64_t rows, int64_t cols,
                   bool src_on_device) = 0;
  // Whether this backend computes expert and router biases (and GPT-OSS's
  // clamped activation); the layer refuses them by name otherwise.
  virtual bool takes_biases() const = 0;
  // The storage types of the routed experts' gate/up and down weights
  // (EP_MOE_DTYPE_F32 ... or a block format), or -1 before the first is
  // stored: every expert of a layer keeps one type per part.
  virtual void routed_types(int32_t* gate_up, int32_t* down) const = 0;
  // Where a caller's weight pointer lives: a device ordinal, or -1 for
  // host memory (always -1 on the CPU); and a copy of device memory back.
  virtual int pointer_device(const void* p) const = 0;
  virtual void download(void* dst, const void* src, size_t bytes) const = 0;

  // --- live re-placement (replace.cpp) --------------------------------------
  // `n` units [gate row | up row | down column] (H elements each, in the
  // layer's unit_dtype(); parts held as blocks dequantized) from unit j0 of
  // local slot `slot` (-1: the shared shard).
  virtual void extract_units(int32_t slot, int32_t j0, int32_t n, uint8_t* out) const = 0;
  // A routed slot's weights as stored: gate rows (I), up rows (I), down
  // rows (H), each its blocks (block formats) or elements.
  virtual void extract_rows(int32_t slot, uint8_t* out) const = 0;
  // A slot's biases [gate (I) | up (I) | down (H)] in f32.
  virtual void extract_biases(int32_t slot, uint8_t* out) const = 0;
  // The kept experts and the router come from `old` (the same backend and
  // shapes) in two steps: keep_before_vote may fail and leaves `old` as it
  // was; keep_at_commit cannot fail and may take `old`'s storage.
  virtual void keep_before_vote(const LayerBackend& old, const std::vector<KeptSlot>& kept, bool router) = 0;
  virtual void keep_at_commit(LayerBackend& old, const std::vector<KeptSlot>& kept, bool router) noexcept = 0;
  // The shared expert's shard copied from `old`, whose range it is, as it is
  // held (blocks stay blocks); false where it moves as units only.
  virtual bool keep_shared(const LayerBackend& old) = 0;

  // --- the forward steps, in the order forward() calls them ----------------
  // Before validation: wakes what a forward will use (the CPU's pool).
  virtual void wake() {}
  // This rank's top-k choice of a.num_tokens tokens from the router logits,
  // the layer's own router or the caller's choice (checked). The CPU writes
  // it into the layer's host choice (ids_/weights_), a device into its own.
  virtual void route(const ep_moe_forward_args_t& a) = 0;
  // The all-to-all plan is made on the host: the choice into ids_/weights_
  // where route() left it elsewhere.
  virtual void choice_to_host(const ep_moe_forward_args_t& a) = 0;
  // The all-gather flow: DP gather -> experts on every row (+ the shared
  // expert) -> ONE all-reduce or reduce-scatter -> this rank's rows in out.
  virtual void allgather(const ep_moe_forward_args_t& a, Stages& st, int64_t dp_offset, int64_t padded,
                         Gather gather) = 0;
  // The all-to-all flow, after the layer's plan and count exchange: rows
  // out, experts, partial sums back, combine (+ the shared expert).
  virtual void alltoall(const ep_moe_forward_args_t& a, Stages& st) = 0;

  // --- statistics and attributes ---------------------------------------------
  // The per-expert load the backend counted itself, added into `load` ([E];
  // a CUDA layer counts on the device), and its reset. The CPU counts into
  // the layer's window as it plans, and adds nothing here.
  virtual void read_load(int64_t* load) = 0;
  virtual void reset_load() = 0;
  // The attributes that depend on the backend (the last step's statistics,
  // threads, ISA, weight bytes); false for the others.
  virtual bool attr(ep_moe_layer_attr_t a, int64_t* value) const = 0;
  // A communicator over `c` for host buffers when `c` moves device memory
  // (the bytes are staged through this backend's device); nullptr when `c`
  // takes host buffers as it is.
  virtual std::unique_ptr<Comm> host_view(Comm* c) = 0;
};

// The backends, created by the Layer constructor once the plans are sized
// (`max_rows`: rows the experts may see; `send_rows`: rows a step sends;
// `fanout`: rows a token sends under all-to-all). They keep a reference to
// the layer, which outlives them.
std::unique_ptr<LayerBackend> make_cpu_backend(Layer& layer, int64_t max_rows, int64_t send_rows, int64_t fanout);
std::unique_ptr<LayerBackend> make_cuda_backend(Layer& layer, int64_t max_rows, int64_t send_rows, int64_t fanout);

}  // namespace ep_moe

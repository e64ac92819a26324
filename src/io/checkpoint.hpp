// A checkpoint on disk (safetensors file, sharded safetensors with an index,
// or GGUF) seen as MoE layers: which tensor holds which weight of which
// expert, where its bytes are, and the layer configuration it declares.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "ep_moe/ep_moe.h"
#include "io/gguf.hpp"
#include "io/semantics.hpp"
#include "io/source.hpp"
#include "io/tensor.hpp"

namespace ep_moe {
namespace io {

enum class Format : int { Safetensors = 0, Gguf = 1 };

// Tensor naming schemes (values of ep_moe_naming_t).
enum class Naming : int {
  Auto = 0,
  HfPerExpert = 1,        // {p}layers.L.mlp.experts.e.{gate,up,down}_proj.weight
  Mixtral = 2,            // {p}layers.L.block_sparse_moe.experts.e.{w1,w3,w2}.weight
  HfFused = 3,            // {p}layers.L.mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
  HfFusedTransposed = 4,  // the same names, stored [E, H, 2I] and [E, I, H]
  Gguf = 5                // blk.L.ffn_{gate,up,down}_exps.weight [E, I, H] ...
};
const char* naming_name(Naming n);

// One weight matrix: a [rows, cols] view (checkpoint orientation, as
// ep_moe_layer_set_weight takes it) of bytes in a tensor.
//
// GPT-OSS's MXFP4 experts as OpenAI ships them are two tensors a weight: the
// blocks (U8 [E, rows, cols / 32, 16], two 4-bit codes a byte) and their
// scales (U8 [E, rows, cols / 32], an E8M0 exponent each). Such a slice has
// `scales` set: `tensor` and `offset` are the blocks', `scales_offset` the
// first row's scale; the loader reads both and puts them together into
// GGUF MXFP4 blocks (the same codes and exponents, nibbles reordered).
struct Slice {
  const TensorInfo* tensor = nullptr;
  uint64_t offset = 0;  // absolute file offset of element (0, 0)
  int64_t rows = 0, cols = 0;
  bool transposed = false;  // stored [cols, rows]
  const TensorInfo* scales = nullptr;
  uint64_t scales_offset = 0;
  // Block-scaled FP8 (the DeepSeek-V3 release): `tensor` holds F8_E4M3
  // codes [rows, cols] at `offset`, `scales` its weight_scale_inv
  // [ceil(rows / fp8_block_rows), cols / 128] (F32, BF16 or F16) from
  // `scales_offset`; the loader puts them together into FP8_E4M3 blocks.
  bool fp8 = false;
  int64_t fp8_block_rows = 128;

  // The bytes the weight takes in the checkpoint (blocks and scales).
  uint64_t bytes() const {
    const auto n = static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
    if (fp8)
      return n + static_cast<uint64_t>((rows + fp8_block_rows - 1) / fp8_block_rows) *
                     static_cast<uint64_t>(cols / 128) * scales->block_bytes;
    return scales ? n / 32 * 17 : tensor->bytes_of(n);
  }
};

// Checks a weight_scale_inv tensor `sc` against its F8_E4M3 weight `w`
// ([rows, cols]; scales [ceil(rows / block_rows), cols / 128] in F32, BF16
// or F16) and makes `out` the FP8 slice of both (checkpoint_fp8.cpp).
void attach_fp8_scales(const std::string& fname, const TensorInfo* w, const TensorInfo* sc, int64_t rows, int64_t cols,
                       int64_t block_rows, Slice* out);

// What a checkpoint's tensors say about one MoE layer: its shapes and which
// optional weights it has (the routing and activation are in Semantics).
struct LayerShape {
  int32_t hidden = 0, inter = 0, experts = 0, shared_inter = 0;
  bool shared_gate = false, score_bias = false, router = false, router_bias = false;
  // Routed experts have gate, up and down biases (GPT-OSS).
  bool expert_bias = false;
  // The fused gate_up_proj alternates gate and up rows (GPT-OSS); its bias too.
  bool gate_up_interleaved = false;
  Elem expert_elem = Elem::Other;
  // An expert tensor whose encoding the loader cannot read (a GGUF Q4_K,
  // an FP8 safetensors dtype, ...): its name and type; empty when none.
  std::string unloadable, unloadable_type;
};

class Checkpoint {
 public:
  // Opens a path: a .safetensors file, a model.safetensors.index.json, a
  // directory holding either, or a GGUF file. Every header is parsed and
  // validated here. `naming` Auto detects the scheme; `prefix` (may be
  // empty) restricts HF names to those starting with it.
  static std::unique_ptr<Checkpoint> open(const std::string& path, Naming naming, const std::string& prefix);

  Format format() const { return format_; }
  Naming naming() const { return naming_; }
  const std::string& prefix() const { return prefix_; }
  size_t num_files() const { return files_.size(); }
  const ByteSource& file(int i) const { return *files_[static_cast<size_t>(i)]; }
  size_t num_tensors() const { return tensors_.size(); }
  uint64_t header_bytes() const { return header_bytes_; }
  int32_t num_layers() const { return num_layers_; }

  // Layer indices that hold routed experts, ascending.
  const std::vector<int32_t>& moe_layers() const { return moe_layers_; }
  bool is_moe_layer(int32_t layer) const;

  // The shapes of one MoE layer (throws NOT_FOUND for a layer without
  // experts, FORMAT for inconsistent shapes, UNSUPPORTED when the layer
  // holds tensors the layer would ignore, naming them).
  LayerShape layer_shape(int32_t layer) const;
  // What the layer's architecture computes (io/semantics.hpp), given its
  // layer_shape(): throws UNSUPPORTED when the configuration cannot say.
  Semantics layer_semantics(int32_t layer, const LayerShape& shape) const;
  // model_type (safetensors' config.json) or general.architecture (GGUF);
  // "" when the checkpoint names none.
  const std::string& arch() const { return arch_; }

  // Locates a weight: routed tensors by expert (fused gate_up is reported
  // for EP_MOE_WEIGHT_EXPERT_GATE_UP when the checkpoint stores it so);
  // returns false when the checkpoint has no such tensor.
  bool locate(int32_t layer, ep_moe_weight_t which, int32_t expert, Slice* out) const;

 private:
  Checkpoint() = default;
  void index_names(Naming want, const std::string& prefix);
  void read_hf_config(const std::string& dir);
  void open_gguf_splits(const std::string& path);
  const TensorInfo* tensor(int32_t layer, int role, int32_t expert) const;
  int64_t hidden_hint(int32_t layer) const;
  bool fused_transposed(int32_t layer) const;
  Elem expert_sizes(int32_t layer, int64_t* H, int64_t* I) const;
  // Rows per scale of block-scaled FP8 weights: config.json's
  // quantization_config.weight_block_size[0] (128 if none); throws
  // UNSUPPORTED for a quantization_config ep_moe cannot read
  // (checkpoint_fp8.cpp).
  int64_t fp8_block_rows() const;
  // A weight's MXFP4 blocks and scales (the roles given), checked against
  // [E, rows, cols / 32, 16] and [E, rows, cols / 32]: its Slice for
  // `expert`; false when the layer has neither tensor.
  bool locate_mxfp4(int32_t layer, int blocks_role, int32_t experts, int64_t rows, int64_t cols, int32_t expert,
                    Slice* out) const;

  Format format_ = Format::Safetensors;
  Naming naming_ = Naming::Auto;
  bool naming_forced_ = false;
  std::string prefix_;
  std::vector<std::unique_ptr<ByteSource>> files_;
  std::vector<TensorInfo> tensors_;
  uint64_t header_bytes_ = 0;
  int32_t num_layers_ = 0;
  std::vector<int32_t> moe_layers_;
  // (layer, role, expert) -> index into tensors_; expert -1 for non-expert tensors.
  std::map<std::tuple<int32_t, int, int32_t>, size_t> roles_;
  std::map<int32_t, int32_t> expert_count_;  // per layer, from the tensors
  // Per layer: tensors in its MoE block's namespace that play no role the
  // layer knows (expert biases, another router, ...).
  std::map<int32_t, std::vector<std::string>> unknown_;
  // Declared configuration.
  std::map<std::string, double> cfg_num_;
  std::map<std::string, std::string> cfg_str_;
  bool has_config_ = false;
  GgufFile gguf_;
  std::string arch_;
};

// Loads an HF config.json (capped at 16 MiB); exposed for tests.
void parse_hf_config(const std::string& text, const std::string& name, std::map<std::string, double>* nums,
                     std::map<std::string, std::string>* strs);

}  // namespace io
}  // namespace ep_moe

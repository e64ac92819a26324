// C API shims of checkpoint reading.
#include <algorithm>
#include <memory>

#include "capi/handle.hpp"
#include "capi/objects.hpp"
#include "common/quant.hpp"

using namespace ep_moe;
using namespace ep_moe::capi;

namespace {
const io::Checkpoint& ck_of(const ep_moe_checkpoint_t* c) { return *checked(c, Kind::Checkpoint, "checkpoint")->ck; }

void copy_text(char* dst, size_t cap, const std::string& s) {
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}
}  // namespace

extern "C" {

ep_moe_status_t ep_moe_checkpoint_config_init(ep_moe_checkpoint_config_t* out) {
  return guard(__func__, nullptr, Kind::Checkpoint, [&] {
    checked_out(out, "out");
    ep_moe_checkpoint_config_t c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.naming = EP_MOE_NAMING_AUTO;
    *out = c;
  });
}

ep_moe_status_t ep_moe_checkpoint_open(ep_moe_checkpoint_t** out, const char* path,
                                       const ep_moe_checkpoint_config_t* config) {
  return guard(__func__, nullptr, Kind::Checkpoint, [&] {
    checked_out(out, "out");
    checked_out(path, "path");
    io::Naming naming = io::Naming::Auto;
    std::string prefix;
    if (config) {
      const auto& c = checked_config(config, "config");
      EP_MOE_CHECK_ARG(c.naming >= EP_MOE_NAMING_AUTO && c.naming <= EP_MOE_NAMING_GGUF,
                       "config->naming %d is not an ep_moe_naming_t value", c.naming);
      naming = static_cast<io::Naming>(c.naming);
      if (c.name_prefix) prefix = c.name_prefix;
    }
    auto h = std::make_unique<ep_moe_checkpoint>();
    h->ck = io::Checkpoint::open(path, naming, prefix);
    register_handle(h.get());
    *out = h.release();
  });
}

void ep_moe_checkpoint_close(ep_moe_checkpoint_t* checkpoint) {
  if (checkpoint == nullptr || !retire_handle(checkpoint, Kind::Checkpoint)) return;
  delete checkpoint;
}

const char* ep_moe_checkpoint_last_error(const ep_moe_checkpoint_t* checkpoint) {
  return handle_last_error(checkpoint, checkpoint, Kind::Checkpoint);
}

const char* ep_moe_checkpoint_architecture(const ep_moe_checkpoint_t* checkpoint) {
  if (checkpoint == nullptr || !is_live(checkpoint, Kind::Checkpoint)) return "";
  return checkpoint->ck->arch().c_str();
}

ep_moe_status_t ep_moe_checkpoint_get_attr(int64_t* out, const ep_moe_checkpoint_t* checkpoint,
                                           ep_moe_checkpoint_attr_t attr) {
  return guard(__func__, checkpoint, Kind::Checkpoint, [&] {
    const io::Checkpoint& ck = ck_of(checkpoint);
    checked_out(out, "out");
    int64_t v = 0;
    switch (attr) {
      case EP_MOE_CHECKPOINT_ATTR_FORMAT: v = static_cast<int64_t>(ck.format()); break;
      case EP_MOE_CHECKPOINT_ATTR_NAMING: v = static_cast<int64_t>(ck.naming()); break;
      case EP_MOE_CHECKPOINT_ATTR_NUM_FILES: v = static_cast<int64_t>(ck.num_files()); break;
      case EP_MOE_CHECKPOINT_ATTR_NUM_TENSORS: v = static_cast<int64_t>(ck.num_tensors()); break;
      case EP_MOE_CHECKPOINT_ATTR_NUM_MOE_LAYERS: v = static_cast<int64_t>(ck.moe_layers().size()); break;
      case EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS: v = ck.num_layers(); break;
      case EP_MOE_CHECKPOINT_ATTR_HEADER_BYTES: v = static_cast<int64_t>(ck.header_bytes()); break;
      default:
        fail(EP_MOE_ERR_INVALID_ARGUMENT, "attr %d is not an ep_moe_checkpoint_attr_t value", static_cast<int>(attr));
    }
    *out = v;
  });
}

ep_moe_status_t ep_moe_checkpoint_moe_layers(int32_t* out, size_t out_len, size_t* out_count,
                                             const ep_moe_checkpoint_t* checkpoint) {
  return guard(__func__, checkpoint, Kind::Checkpoint, [&] {
    const io::Checkpoint& ck = ck_of(checkpoint);
    checked_out(out_count, "out_count");
    EP_MOE_CHECK_ARG(out != nullptr || out_len == 0, "out is NULL but out_len is %zu", out_len);
    const auto& layers = ck.moe_layers();
    std::copy(layers.begin(), layers.begin() + static_cast<long>(std::min(out_len, layers.size())), out);
    *out_count = layers.size();
  });
}

ep_moe_status_t ep_moe_checkpoint_layer_config(ep_moe_layer_config_t* config, const ep_moe_checkpoint_t* checkpoint,
                                               int32_t layer) {
  return guard(__func__, checkpoint, Kind::Checkpoint, [&] {
    const io::Checkpoint& ck = ck_of(checkpoint);
    ep_moe_layer_config_t c = checked_config(static_cast<const ep_moe_layer_config_t*>(config), "config");
    const io::LayerShape s = ck.layer_shape(layer);
    if (!s.unloadable.empty())
      fail(EP_MOE_ERR_UNSUPPORTED,
           "layer %d: expert tensor '%s' is %s, which this version of ep_moe cannot load (F32, F16, BF16, F8_E4M3 with "
           "its weight_scale_inv; in GGUF also the block formats of docs/quantization.md): no layer configuration is "
           "derived for what "
           "ep_moe_layer_load would refuse",
           layer, s.unloadable.c_str(), s.unloadable_type.c_str());
    const io::Semantics m = ck.layer_semantics(layer, s);
    c.hidden_size = s.hidden;
    c.intermediate_size = s.inter;
    c.num_experts = s.experts;
    if (m.top_k > 0) c.top_k = m.top_k;
    c.activation = m.activation;
    // CPU layers keep block-format experts as they are whatever weight_dtype
    // says; it names their gate's format where its blocks divide both sizes
    // (it is then what float-given experts would be quantized to), else
    // bf16. CUDA layers (device >= 0) widen them to bf16 as they are stored.
    const auto et = static_cast<ep_moe_dtype_t>(io::elem_dtype(s.expert_elem));
    if (dtype_is_quant(et)) {
      const int qk = quant_block_elems(et);
      c.weight_dtype = c.device < 0 && s.hidden % qk == 0 && s.inter % qk == 0 ? et : EP_MOE_DTYPE_BF16;
    } else {
      c.weight_dtype = et == EP_MOE_DTYPE_BF16 || et == EP_MOE_DTYPE_F16 ? et : EP_MOE_DTYPE_F32;
    }
    c.scoring = m.scoring;
    c.renormalize = m.renormalize;
    c.num_expert_group = m.groups;
    c.topk_group = m.topk_group;
    c.use_score_bias = s.score_bias ? 1 : 0;
    c.routed_scaling_factor = m.scale;
    c.shared_intermediate_size = s.shared_inter;
    c.shared_expert_gate = s.shared_gate ? 1 : 0;
    *config = c;
  });
}

ep_moe_status_t ep_moe_tensor_info_init(ep_moe_tensor_info_t* out) {
  return guard(__func__, nullptr, Kind::Checkpoint, [&] {
    checked_out(out, "out");
    std::memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
  });
}

ep_moe_status_t ep_moe_checkpoint_tensor_info(ep_moe_tensor_info_t* out, const ep_moe_checkpoint_t* checkpoint,
                                              int32_t layer, ep_moe_weight_t which, int32_t expert) {
  return guard(__func__, checkpoint, Kind::Checkpoint, [&] {
    const io::Checkpoint& ck = ck_of(checkpoint);
    checked_config(static_cast<const ep_moe_tensor_info_t*>(out), "out");
    EP_MOE_CHECK_ARG(which >= EP_MOE_WEIGHT_EXPERT_GATE && which <= EP_MOE_WEIGHT_ROUTER_BIAS,
                     "which %d is not an ep_moe_weight_t value", static_cast<int>(which));
    io::Slice sl;
    if (!ck.locate(layer, which, expert, &sl))
      fail(EP_MOE_ERR_NOT_FOUND, "layer %d has no such weight (which %d, expert %d)", layer, static_cast<int>(which),
           expert);
    const io::TensorInfo& t = *sl.tensor;
    ep_moe_tensor_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    copy_text(info.name, sizeof info.name, t.name);
    copy_text(info.dtype, sizeof info.dtype, sl.scales ? std::string("MXFP4") : t.type_name);
    info.n_dims = static_cast<int32_t>(std::min<size_t>(t.shape.size(), 8));
    for (int i = 0; i < info.n_dims; ++i) info.dims[i] = t.shape[static_cast<size_t>(i)];
    info.tensor_bytes = static_cast<int64_t>(t.bytes + (sl.scales ? sl.scales->bytes : 0));
    info.bytes = static_cast<int64_t>(sl.bytes());
    info.file_index = t.file;
    info.transposed = sl.transposed ? 1 : 0;
    *out = info;
  });
}

ep_moe_status_t ep_moe_layer_load(ep_moe_layer_t* layer, const ep_moe_checkpoint_t* checkpoint, int32_t layer_index) {
  return guard(__func__, layer, Kind::Layer, [&] {
    checked(layer, Kind::Layer, "layer");
    const HandleUse ck_use(checkpoint, Kind::Checkpoint, __func__);  // held while reading: a close waits
    const io::Checkpoint& ck = ck_of(checkpoint);
    layer->layer->load(ck, layer_index);
  });
}

}  // extern "C"

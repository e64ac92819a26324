// Block-scaled FP8 weights in safetensors (the DeepSeek-V3 / Kimi-K2 /
// Qwen3 -FP8 releases): an F8_E4M3 [rows, cols] weight and its F32 (or
// BF16, F16) weight_scale_inv [ceil(rows / R), cols / 128], R from
// config.json's quantization_config.weight_block_size (128 x 128 in every
// release).
#include <cmath>
#include <string>

#include "common/error.hpp"
#include "io/checkpoint.hpp"

namespace ep_moe {
namespace io {

void attach_fp8_scales(const std::string& fname, const TensorInfo* w, const TensorInfo* sc, int64_t rows, int64_t cols,
                       int64_t block_rows, Slice* out) {
  if (cols % 128 != 0)
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s: F8_E4M3 tensor '%s' has rows of %lld elements; ep_moe keeps block-scaled FP8 in whole blocks of 128 "
         "columns",
         fname.c_str(), w->name.c_str(), static_cast<long long>(cols));
  const int64_t srows = (rows + block_rows - 1) / block_rows, scols = cols / 128;
  const bool type_ok = sc->type_name == "F32" || sc->type_name == "BF16" || sc->type_name == "F16";
  if (!type_ok || sc->shape.size() != 2 || sc->shape[0] != srows || sc->shape[1] != scols)
    fail(EP_MOE_ERR_FORMAT,
         "%s: '%s' should be the F32 (or BF16, F16) scales of '%s' [%lld, %lld] in blocks of %lld x 128: [%lld, %lld]; "
         "it is %s with %zu dimensions%s",
         fname.c_str(), sc->name.c_str(), w->name.c_str(), static_cast<long long>(rows), static_cast<long long>(cols),
         static_cast<long long>(block_rows), static_cast<long long>(srows), static_cast<long long>(scols),
         sc->type_name.c_str(), sc->shape.size(),
         sc->shape.size() == 2
             ? (" [" + std::to_string(sc->shape[0]) + ", " + std::to_string(sc->shape[1]) + "]").c_str()
             : "");
  out->scales = sc;
  out->scales_offset = sc->offset;
  out->fp8 = true;
  out->fp8_block_rows = block_rows;
}

int64_t Checkpoint::fp8_block_rows() const {
  const auto str = [&](const char* k) {
    const auto it = cfg_str_.find(k);
    return it == cfg_str_.end() ? std::string() : it->second;
  };
  const auto num = [&](const char* k, double d) {
    const auto it = cfg_num_.find(k);
    return it == cfg_num_.end() ? d : it->second;
  };
  const std::string method = str("quantization_config.quant_method"), fmt = str("quantization_config.fmt");
  if (!method.empty() && method != "fp8")
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: quantization_config.quant_method is '%s'; ep_moe reads F8_E4M3 weights as 'fp8'",
         files_[0]->name().c_str(), method.c_str());
  if (!fmt.empty() && fmt != "e4m3")
    fail(EP_MOE_ERR_UNSUPPORTED, "%s: quantization_config.fmt is '%s'; ep_moe reads E4M3 (e4m3)",
         files_[0]->name().c_str(), fmt.c_str());
  const double r = num("quantization_config.weight_block_size.0", 128),
               c = num("quantization_config.weight_block_size.1", 128);
  if (c != 128 || !(r >= 1 && r <= 65536) || r != std::floor(r))
    fail(EP_MOE_ERR_UNSUPPORTED,
         "%s: quantization_config.weight_block_size is [%g, %g]; ep_moe keeps block-scaled FP8 in blocks of 128 "
         "columns (and up to 65536 rows)",
         files_[0]->name().c_str(), r, c);
  return static_cast<int64_t>(r);
}

}  // namespace io
}  // namespace ep_moe

// C API: versions, statuses, features, logging, thread-local errors.
#include <cmath>
#include <cstring>

#include "backend/modules.hpp"
#include "cpu/matrix_engine.hpp"
#include "capi/handle.hpp"
#include "common/dtype.hpp"
#include "common/quant.hpp"

using namespace ep_moe;
using namespace ep_moe::capi;

#define EP_MOE_STR2(x) #x
#define EP_MOE_STR(x) EP_MOE_STR2(x)

extern "C" {

uint32_t ep_moe_version(void) { return EP_MOE_VERSION_NUMBER; }

const char* ep_moe_version_string(void) {
  return EP_MOE_STR(EP_MOE_VERSION_MAJOR) "." EP_MOE_STR(EP_MOE_VERSION_MINOR) "." EP_MOE_STR(EP_MOE_VERSION_PATCH);
}

const char* ep_moe_status_string(ep_moe_status_t status) {
  switch (status) {
    case EP_MOE_OK: return "success";
    case EP_MOE_ERR_INVALID_ARGUMENT: return "invalid argument";
    case EP_MOE_ERR_OUT_OF_MEMORY: return "out of memory";
    case EP_MOE_ERR_UNSUPPORTED: return "not supported by this build or machine";
    case EP_MOE_ERR_BUFFER_TOO_SMALL: return "buffer too small";
    case EP_MOE_ERR_STRUCT_SIZE: return "unknown struct_size (struct not initialised with its *_config_init?)";
    case EP_MOE_ERR_INVALID_HANDLE: return "invalid handle";
    case EP_MOE_ERR_INTERNAL: return "internal error";
    case EP_MOE_ERR_TIMEOUT: return "timed out";
    case EP_MOE_ERR_ABORTED: return "aborted";
    case EP_MOE_ERR_REMOTE: return "a peer rank failed";
    case EP_MOE_ERR_IO: return "I/O error";
    case EP_MOE_ERR_FORMAT: return "malformed data";
    case EP_MOE_ERR_NOT_FOUND: return "not found";
    case EP_MOE_ERR_STATE: return "invalid state for this call";
    case EP_MOE_ERR_DEVICE: return "a CUDA device call failed";
    default: break;
  }
  return "unknown status";
}

const char* ep_moe_last_error(void) { return thread_error(); }

int ep_moe_has_feature(uint32_t features) {
  uint32_t built = EP_MOE_FEATURE_CPU | EP_MOE_FEATURE_LOCAL_COMM | EP_MOE_FEATURE_CALLBACKS;
  // The optional backends count when their module loads (loaded here, once).
  const uint32_t cuda_bits = EP_MOE_FEATURE_CUDA | EP_MOE_FEATURE_NCCL | EP_MOE_FEATURE_CUBLASLT;
  if (features & cuda_bits) {
    try {
      if (const backend::CudaModule* m = backend::cuda_module(nullptr)) {
        if (m->cuda_layer) built |= EP_MOE_FEATURE_CUDA | EP_MOE_FEATURE_CUBLASLT;
        if (m->nccl) built |= EP_MOE_FEATURE_NCCL;
      }
    } catch (...) {  // never throws across the C boundary
    }
  }
  if (features & EP_MOE_FEATURE_MPI) {
    try {
      if (backend::mpi_module(nullptr)) built |= EP_MOE_FEATURE_MPI;
    } catch (...) {
    }
  }
  if (features & EP_MOE_FEATURE_ONEDNN) {
    try {
      if (cpu::matrix_engine_available()) built |= EP_MOE_FEATURE_ONEDNN;
    } catch (...) {
    }
  }
  return features != 0 && (features & ~built) == 0 ? 1 : 0;
}

ep_moe_status_t ep_moe_dtype_block(int64_t* out_elems, int64_t* out_bytes, ep_moe_dtype_t dtype) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    EP_MOE_CHECK_ARG(dtype_valid(dtype) || dtype_is_quant(dtype), "dtype %d is not an ep_moe_dtype_t value",
                     static_cast<int>(dtype));
    if (out_elems) *out_elems = quant_block_elems(dtype);
    if (out_bytes) *out_bytes = quant_block_bytes(dtype);
  });
}

const char* ep_moe_dtype_name(ep_moe_dtype_t dtype) {
  return dtype_valid(dtype) || dtype_is_quant(dtype) ? dtype_name(dtype) : nullptr;
}

namespace {
// The checks ep_moe_quantize and ep_moe_dequantize share.
void check_blocks_call(ep_moe_dtype_t dtype, const void* out, const void* in, int64_t rows, int64_t cols) {
  EP_MOE_CHECK_ARG(dtype_is_quant(dtype), "dtype %d is not a block format", static_cast<int>(dtype));
  EP_MOE_CHECK_ARG(rows >= 0 && cols >= 0, "rows %lld and cols %lld must be >= 0", static_cast<long long>(rows),
                   static_cast<long long>(cols));
  const int qk = quant_block_elems(dtype);
  EP_MOE_CHECK_ARG(cols % qk == 0, "%s rows are whole blocks of %d elements; cols %lld is not", dtype_name(dtype), qk,
                   static_cast<long long>(cols));
  EP_MOE_CHECK_ARG(rows == 0 || cols == 0 || (out != nullptr && in != nullptr), "out or in is NULL");
}
}  // namespace

ep_moe_status_t ep_moe_quantize(void* out, ep_moe_dtype_t dtype, const float* in, int64_t rows, int64_t cols) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    check_blocks_call(dtype, out, in, rows, cols);
    const auto n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
    for (size_t i = 0; i < n; ++i)
      EP_MOE_CHECK_ARG(std::isfinite(in[i]), "in[%lld][%lld] is not finite", static_cast<long long>(i / cols),
                       static_cast<long long>(i % cols));
    const size_t rb = quant_row_bytes(dtype, cols);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(dtype, in + r * cols, static_cast<char*>(out) + static_cast<size_t>(r) * rb, cols);
  });
}

ep_moe_status_t ep_moe_dequantize(float* out, const void* in, ep_moe_dtype_t dtype, int64_t rows, int64_t cols) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    check_blocks_call(dtype, out, in, rows, cols);
    const size_t rb = quant_row_bytes(dtype, cols);
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row(dtype, static_cast<const char*>(in) + static_cast<size_t>(r) * rb, out + r * cols, cols);
  });
}

ep_moe_status_t ep_moe_fp8_pack(void* out, const uint8_t* weight, const float* scale_inv, int64_t rows, int64_t cols) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    EP_MOE_CHECK_ARG(rows >= 0 && cols >= 0, "rows %lld and cols %lld must be >= 0", static_cast<long long>(rows),
                     static_cast<long long>(cols));
    EP_MOE_CHECK_ARG(cols % 128 == 0, "cols %lld is not a multiple of 128 (whole blocks of columns)",
                     static_cast<long long>(cols));
    EP_MOE_CHECK_ARG(rows == 0 || cols == 0 || (out != nullptr && weight != nullptr && scale_inv != nullptr),
                     "out, weight or scale_inv is NULL");
    const int64_t nb = cols / 128;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float s = scale_inv[(r / 128) * nb + b];
        EP_MOE_CHECK_ARG(std::isfinite(s), "scale_inv[%lld][%lld] is %g", static_cast<long long>(r / 128),
                         static_cast<long long>(b), static_cast<double>(s));
        for (int64_t i = 0; i < 128; ++i)
          EP_MOE_CHECK_ARG(!e4m3_nan(weight[r * cols + 128 * b + i]), "weight[%lld][%lld] is an E4M3 NaN code (0x%02x)",
                           static_cast<long long>(r), static_cast<long long>(128 * b + i),
                           weight[r * cols + 128 * b + i]);
      }
    auto* o = static_cast<uint8_t*>(out);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b, o += 132) {
        std::memcpy(o, &scale_inv[(r / 128) * nb + b], 4);
        std::memcpy(o + 4, weight + r * cols + 128 * b, 128);
      }
  });
}

ep_moe_status_t ep_moe_set_log_callback(ep_moe_log_fn fn, ep_moe_log_level_t max_level, void* user_data) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    EP_MOE_CHECK_ARG(max_level >= EP_MOE_LOG_ERROR && max_level <= EP_MOE_LOG_DEBUG,
                     "max_level %d is not an ep_moe_log_level_t value", static_cast<int>(max_level));
    set_log_callback(fn, max_level, user_data);
  });
}

}  // extern "C"

// C API: versions, statuses, features, logging, thread-local errors.
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

ep_moe_status_t ep_moe_set_log_callback(ep_moe_log_fn fn, ep_moe_log_level_t max_level, void* user_data) {
  return guard(__func__, nullptr, Kind::ExpertMap, [&] {
    EP_MOE_CHECK_ARG(max_level >= EP_MOE_LOG_ERROR && max_level <= EP_MOE_LOG_DEBUG,
                     "max_level %d is not an ep_moe_log_level_t value", static_cast<int>(max_level));
    set_log_callback(fn, max_level, user_data);
  });
}

}  // extern "C"

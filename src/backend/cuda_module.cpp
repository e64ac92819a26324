// libep_moe_cuda.so's entry: the CUDA layer backend (or, built without
// cuBLASLt, its stand-in) and the NCCL communicator (or its stand-in).
#include "backend/modules.hpp"
#include "comm/nccl/nccl_comm.hpp"

extern "C" __attribute__((visibility("default"))) const ep_moe::backend::CudaModule* EP_MOE_CUDA_MODULE_ENTRY() {
  static const ep_moe::backend::CudaModule m = {
    ep_moe::backend::kModuleAbi,
    EP_MOE_VERSION_NUMBER,
#if defined(EP_MOE_HAVE_CUBLASLT)
    true,
#else
    false,
#endif
#if defined(EP_MOE_HAVE_NCCL)
    true,
#else
    false,
#endif
    &ep_moe::cuda::create_device_layer,
    &ep_moe::make_nccl_comm,
    &ep_moe::make_nccl_comm_from_id,
    &ep_moe::nccl_unique_id,
  };
  return &m;
}

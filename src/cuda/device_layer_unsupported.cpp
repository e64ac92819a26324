// Stands in for the CUDA backend when the library is built without the CUDA
// toolkit: a layer that names a device cannot be created.
#include "common/error.hpp"
#include "cuda/device_layer.hpp"

namespace ep_moe {
namespace cuda {

std::unique_ptr<DeviceLayer> create_device_layer(const DeviceLayerDesc& d) {
  fail(EP_MOE_ERR_UNSUPPORTED, "device %d: this build of ep_moe has no CUDA backend (EP_MOE_FEATURE_CUDA)", d.device);
}

}  // namespace cuda
}  // namespace ep_moe

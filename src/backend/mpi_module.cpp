// libep_moe_mpi.so's entry: the MPI transport.
#include "backend/modules.hpp"
#include "comm/mpi/mpi_transport.hpp"

extern "C" __attribute__((visibility("default"))) const ep_moe::backend::MpiModule* EP_MOE_MPI_MODULE_ENTRY() {
  static const ep_moe::backend::MpiModule m = {ep_moe::backend::kModuleAbi, EP_MOE_VERSION_NUMBER,
                                               &ep_moe::make_mpi_transport};
  return &m;
}

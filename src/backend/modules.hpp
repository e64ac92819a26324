// The optional backends live in modules loaded at run time, so that one
// libep_moe.so runs on a host without CUDA, NCCL or MPI and uses them where
// they are: libep_moe_cuda.so (the CUDA layer, cuBLASLt, NCCL) and
// libep_moe_mpi.so (the MPI transport) and libep_moe_onednn.so (the matrix
// engine on oneDNN, cpu/matrix_engine.hpp, with its OpenMP runtime). Each exports one C function that
// returns its table below; the core checks the table's ABI and version
// against its own before using it, and never unloads a module (objects it
// created, such as a communicator's transport, run its code until the end).
//
// Both sides are built together from this tree by the same compiler, so the
// table passes C++ types; errors cross as ep_moe::Error exceptions (their
// type is matched by name across the two objects, as the C++ ABI does for
// hidden types).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/comm.hpp"
#include "comm/message_comm.hpp"
#include "cpu/matrix_engine.hpp"
#include "cuda/device_layer.hpp"
#include "ep_moe/ep_moe.h"

namespace ep_moe {
namespace backend {

// Bumped whenever a table or a type it passes changes.
constexpr uint32_t kModuleAbi = 4;

struct CudaModule {
  uint32_t abi;
  int32_t version;        // EP_MOE_VERSION_NUMBER of the build
  bool cuda_layer, nccl;  // what it was built with (the CUDA layer runs its GEMMs on cuBLASLt)
  std::unique_ptr<cuda::DeviceLayer> (*create_device_layer)(const cuda::DeviceLayerDesc&);
  std::unique_ptr<Comm> (*make_nccl_comm)(void* nccl_comm, int timeout_ms);
  std::unique_ptr<Comm> (*make_nccl_comm_from_id)(const void* id, size_t id_size, int rank, int size, int timeout_ms);
  void (*nccl_unique_id)(void* out, size_t out_size);
};

struct MpiModule {
  uint32_t abi;
  int32_t version;
  std::unique_ptr<Transport> (*make_mpi_transport)(const void* mpi_comm, size_t comm_size);
};

struct OnednnModule {
  uint32_t abi;
  int32_t version;
  std::unique_ptr<cpu::MatrixEngine> (*create_matrix_engine)(const cpu::MatrixEngineDesc&);
};

// The modules' entry points and file names.
#define EP_MOE_CUDA_MODULE_ENTRY ep_moe_cuda_module_v1
#define EP_MOE_MPI_MODULE_ENTRY ep_moe_mpi_module_v1
#define EP_MOE_ONEDNN_MODULE_ENTRY ep_moe_onednn_module_v1
constexpr const char* kCudaModuleFile = "libep_moe_cuda.so";
constexpr const char* kMpiModuleFile = "libep_moe_mpi.so";
constexpr const char* kOnednnModuleFile = "libep_moe_onednn.so";

// The loaded module, or nullptr with *why saying why not (not built, the
// file or a library it needs missing, another build's module). Loaded once,
// on first use; thread-safe.
const CudaModule* cuda_module(std::string* why);
const MpiModule* mpi_module(std::string* why);
const OnednnModule* onednn_module(std::string* why);

}  // namespace backend
}  // namespace ep_moe

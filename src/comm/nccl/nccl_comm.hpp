// The `nccl` backend: collectives on the caller's CUDA stream over an NCCL
// communicator (borrowed from the caller, or created from a unique id).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "comm/comm.hpp"

namespace ep_moe {

// Throw UNSUPPORTED when the library was built without NCCL or no CUDA
// device is present.
std::unique_ptr<Comm> make_nccl_comm(void* nccl_comm, int timeout_ms);
std::unique_ptr<Comm> make_nccl_comm_from_id(const void* id, size_t id_size, int rank, int size, int timeout_ms);
void nccl_unique_id(void* out, size_t out_size);

}  // namespace ep_moe

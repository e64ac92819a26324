// The `mpi` backend: a duplicate of the caller's MPI communicator, used only
// through non-blocking collectives polled against the deadline.
#pragma once

#include <cstddef>
#include <memory>

#include "comm/message_comm.hpp"

namespace ep_moe {

// `mpi_comm` points at the caller's MPI_Comm, `comm_size` is its sizeof (a
// check that caller and library use the same MPI). Throws UNSUPPORTED when
// the library was built without MPI.
std::unique_ptr<Transport> make_mpi_transport(const void* mpi_comm, size_t comm_size);

}  // namespace ep_moe

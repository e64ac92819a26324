// Built when MPI is not: asking for the backend says so.
#include "comm/mpi/mpi_transport.hpp"
#include "common/error.hpp"

namespace ep_moe {
std::unique_ptr<Transport> make_mpi_transport(const void*, size_t) {
  fail(EP_MOE_ERR_UNSUPPORTED, "this ep_moe was built without MPI (install libopenmpi-dev and rebuild)");
}
}  // namespace ep_moe

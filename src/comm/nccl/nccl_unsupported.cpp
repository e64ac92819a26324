// Built when NCCL is not: asking for the backend says so.
#include "comm/nccl/nccl_comm.hpp"
#include "common/error.hpp"

namespace ep_moe {
std::unique_ptr<Comm> make_nccl_comm(void*, int) {
  fail(EP_MOE_ERR_UNSUPPORTED, "this ep_moe was built without NCCL (needs the CUDA toolkit with NCCL)");
}
std::unique_ptr<Comm> make_nccl_comm_from_id(const void*, size_t, int, int, int) {
  fail(EP_MOE_ERR_UNSUPPORTED, "this ep_moe was built without NCCL (needs the CUDA toolkit with NCCL)");
}
void nccl_unique_id(void*, size_t) {
  fail(EP_MOE_ERR_UNSUPPORTED, "this ep_moe was built without NCCL (needs the CUDA toolkit with NCCL)");
}
}  // namespace ep_moe

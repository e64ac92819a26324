// The NCCL backend on real GPUs: a communicator from a unique id (one rank
// per visible GPU, one thread each), collectives on a CUDA stream, results
// checked on the host. Without a CUDA device it prints "skipped: no CUDA
// device" and exits 77 (ctest's "skipped"), never "passed".
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ep_moe/ep_moe.h"

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

void rank_main(int rank, int size, const uint8_t* id) {
  cudaSetDevice(rank);
  ep_moe_comm_t* c = nullptr;
  if (ep_moe_comm_create_nccl_from_id(&c, id, 128, rank, size, nullptr) != EP_MOE_OK) {
    expect(false, std::string("create: ") + ep_moe_last_error());
    return;
  }
  expect(std::string(ep_moe_comm_backend(c)) == "nccl", "backend name");
  cudaStream_t s;
  cudaStreamCreate(&s);
  const size_t n = 4099;
  std::vector<float> h(n), back(n);
  for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>(rank + 1) * 0.5f + static_cast<float>(i % 7);
  float *d_in = nullptr, *d_out = nullptr;
  cudaMalloc(&d_in, n * sizeof(float));
  cudaMalloc(&d_out, n * size * sizeof(float));
  cudaMemcpy(d_in, h.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  expect(ep_moe_comm_all_reduce(d_out, d_in, n, EP_MOE_DTYPE_F32, c, s) == EP_MOE_OK,
         std::string("all_reduce: ") + ep_moe_comm_last_error(c));
  cudaMemcpy(back.data(), d_out, n * sizeof(float), cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < n; ++i) {
    float want = 0;
    for (int r = 0; r < size; ++r) want += static_cast<float>(r + 1) * 0.5f + static_cast<float>(i % 7);
    if (back[i] != want) {
      expect(false, "all_reduce value");
      break;
    }
  }
  std::vector<size_t> counts(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) counts[static_cast<size_t>(r)] = static_cast<size_t>(r + 3);
  expect(ep_moe_comm_all_gather_v(d_out, d_in, counts.data(), EP_MOE_DTYPE_F32, c, s) == EP_MOE_OK,
         std::string("all_gather_v: ") + ep_moe_comm_last_error(c));
  {
    std::vector<float> got(n * static_cast<size_t>(size));
    cudaMemcpy(got.data(), d_out, got.size() * sizeof(float), cudaMemcpyDeviceToHost);
    size_t at = 0;
    bool ok = true;
    for (int p = 0; p < size; ++p)
      for (size_t i = 0; i < counts[static_cast<size_t>(p)]; ++i, ++at)
        ok = ok && got[at] == static_cast<float>(p + 1) * 0.5f + static_cast<float>(i % 7);
    expect(ok, "all_gather_v values");
  }
  std::vector<size_t> sc(static_cast<size_t>(size), 5), rc(static_cast<size_t>(size), 5);
  expect(ep_moe_comm_all_to_all_v(d_out, rc.data(), d_in, sc.data(), EP_MOE_DTYPE_F32, c, s) == EP_MOE_OK,
         std::string("all_to_all_v: ") + ep_moe_comm_last_error(c));
  {
    std::vector<float> got(5 * static_cast<size_t>(size));
    cudaMemcpy(got.data(), d_out, got.size() * sizeof(float), cudaMemcpyDeviceToHost);
    bool ok = true;
    for (int q = 0; q < size; ++q)  // rank q sent us its elements [5 rank, 5 rank + 5)
      for (size_t j = 0; j < 5; ++j)
        ok = ok && got[static_cast<size_t>(q) * 5 + j] ==
                       static_cast<float>(q + 1) * 0.5f + static_cast<float>((5 * static_cast<size_t>(rank) + j) % 7);
    expect(ok, "all_to_all_v values");
  }
  expect(ep_moe_comm_barrier(c) == EP_MOE_OK, std::string("barrier: ") + ep_moe_comm_last_error(c));
  ep_moe_status_t ae = EP_MOE_ERR_INTERNAL;
  expect(ep_moe_comm_get_async_error(&ae, nullptr, c) == EP_MOE_OK && ae == EP_MOE_OK,
         "healthy: status " + std::to_string(static_cast<int>(ae)));
  cudaFree(d_in);
  cudaFree(d_out);
  cudaStreamDestroy(s);
  ep_moe_comm_destroy(c);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  if (!ep_moe_has_feature(EP_MOE_FEATURE_NCCL)) {
    std::printf("skipped: this ep_moe was built without NCCL\n");
    return 77;
  }
  uint8_t id[128];
  if (ep_moe_nccl_get_unique_id(id, sizeof id) != EP_MOE_OK) {
    std::fprintf(stderr, "FAIL: unique id: %s\n", ep_moe_last_error());
    return 1;
  }
  std::vector<std::thread> ts;
  for (int r = 0; r < devices; ++r) ts.emplace_back(rank_main, r, devices, id);
  for (auto& t : ts) t.join();
  std::printf("nccl_test: %d rank(s), %d failure(s)\n", devices, failures);
  return failures == 0 ? 0 : 1;
}

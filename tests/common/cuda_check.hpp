// CU(call): a CUDA runtime call that must succeed in a test or benchmark
// program; on failure it prints the error and the call, and exits 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CU(call)                                                                                               \
  do {                                                                                                         \
    cudaError_t e_ = (call);                                                                                   \
    if (e_ != cudaSuccess) {                                                                                   \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #call); \
      std::exit(1);                                                                                            \
    }                                                                                                          \
  } while (0)

// Device helpers shared by the CUDA workloads (nvcc only): the GPU's global nanosecond timer,
// a kernel that spins for a given GPU time, and the error check the host code uses.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace valve {

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for `ns` nanoseconds of GPU time.
__global__ void spin_kernel(uint64_t ns, uint32_t* sink) {
  const uint64_t t0 = globaltimer();
  uint32_t x = threadIdx.x;
  while (globaltimer() - t0 < ns) x = x * 1664525u + 1013904223u;
  if (x == 0xFFFFFFFFu) *sink = x;  // keeps the loop from being optimised away
}

}  // namespace valve

// Exits with status 2 and names the failing call, prefixed by the program's tag.
#define VALVE_CUDA_CHECK(tag, call)                                                    \
  do {                                                                                 \
    cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s failed: %s\n", tag, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// Kernels for valve-memprobe (built to PTX by build.sh): a long streaming kernel over a VMM
// range (the offline job), a fill and a checker (the online side's first use, and verification).
#include <stdint.h>

// Adds 1 to every word `passes` times. One launch of many passes is a long kernel that Valve
// preempts in the middle; untouched words end at (initial + passes) per launch.
extern "C" __global__ void stream_add(uint32_t* p, uint64_t n, uint32_t passes) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (uint32_t k = 0; k < passes; ++k)
    for (uint64_t i = first; i < n; i += stride) p[i] += 1u;
}

extern "C" __global__ void fill(uint32_t* p, uint64_t n, uint32_t v) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = v;
}

// Counts words that differ from v into *bad.
extern "C" __global__ void count_ne(const uint32_t* p, uint64_t n, uint32_t v,
                                    unsigned long long* bad) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  unsigned long long mine = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    mine += (p[i] != v);
  if (mine) atomicAdd(bad, mine);
}

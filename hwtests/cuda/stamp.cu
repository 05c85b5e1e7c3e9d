// The serving benchmark's first-kernel stamp (built to PTX by build.sh; loaded through the CUDA
// driver API by hwtests/serving/stamp.py): one thread writes %globaltimer (ns) at its start into
// the given device address. The graph server launches it just before a request's first kernel,
// and in a loop bracketed by host clock reads to map %globaltimer onto CLOCK_MONOTONIC.
extern "C" __global__ void valve_stamp(unsigned long long* out) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = t;
}

// Shared by hog.cu, online.cu and the CPU self-test: the heartbeat page layout (the contract with
// hwtests/src/heartbeat.rs) and the LCG whose jump-ahead lets the CPU verify the GPU's work.
#pragma once
#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define VALVE_HD __host__ __device__
#else
#define VALVE_HD
#endif

namespace valve {

constexpr uint64_t kMagic = 0x474F4845564C4156ull;  // "VALVEHOG" as little-endian bytes
constexpr uint32_t kVersion = 1;
enum : uint32_t { kStarting = 0, kRunning = 1, kFinished = 2, kFailed = 3 };
enum : uint32_t { kModePersistent = 0, kModeStreams = 1, kModeCopy = 2, kModeGraph = 3 };

struct HogHeader {
  uint64_t magic;             // 0: written last during init
  uint32_t version;           // 8
  uint32_t state;             // 12
  uint32_t stop;              // 16: the runner writes 1
  uint32_t num_slots;         // 20
  uint64_t copies_done;       // 24
  int32_t checksum_ok;        // 32: -1 unknown, 0 mismatch, 1 ok
  uint32_t mode;              // 36
  uint64_t total_iterations;  // 40
  uint8_t reserved[16];       // 48..64
};
static_assert(sizeof(HogHeader) == 64, "header is 64 bytes");
static_assert(offsetof(HogHeader, state) == 12, "layout");
static_assert(offsetof(HogHeader, stop) == 16, "layout");
static_assert(offsetof(HogHeader, copies_done) == 24, "layout");
static_assert(offsetof(HogHeader, checksum_ok) == 32, "layout");
static_assert(offsetof(HogHeader, total_iterations) == 40, "layout");

struct Slot {
  uint64_t counter;         // iterations completed by this block
  uint64_t globaltimer_ns;  // %globaltimer after the last one
};
static_assert(sizeof(Slot) == 16, "slot is 16 bytes");

constexpr size_t kSlotsOffset = 64;

// x -> a*x + c (mod 2^32). Numerical Recipes constants.
constexpr uint32_t kLcgA = 1664525u;
constexpr uint32_t kLcgC = 1013904223u;

VALVE_HD inline uint32_t lcg_seed(uint32_t slot, uint32_t thread) {
  uint32_t h = slot * 2654435761u ^ (thread + 0x9E3779B9u) * 40503u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}

// The state after n steps from x, in O(log n): compose the affine map with itself.
inline uint32_t lcg_jump(uint32_t x, uint64_t n, uint32_t a = kLcgA, uint32_t c = kLcgC) {
  uint32_t acc_a = 1, acc_c = 0;  // identity
  uint32_t cur_a = a, cur_c = c;  // one step
  while (n) {
    if (n & 1) {  // acc = cur o acc
      acc_c = cur_a * acc_c + cur_c;
      acc_a = cur_a * acc_a;
    }
    cur_c = cur_a * cur_c + cur_c;  // cur = cur o cur
    cur_a = cur_a * cur_a;
    n >>= 1;
  }
  return acc_a * x + acc_c;
}

// Nearest-rank percentile of sorted samples.
inline double percentile(const double* sorted, size_t n, double p) {
  if (n == 0) return 0.0;
  size_t rank = (size_t)(p * (double)n + 0.999999999);
  if (rank < 1) rank = 1;
  if (rank > n) rank = n;
  return sorted[rank - 1];
}

}  // namespace valve

// The online trigger of the floor experiment (`valve-hwtest --only-floor`): one CUDA context whose
// host thread busy-polls a request word in a shared page and, on each new request, launches either
// one tiny kernel that records %globaltimer at its start, or a burst of K kernels back to back on
// one stream, each spinning for a given GPU time (the page's burst_kernels and burst_kernel_ns).
// The single kernel answers "does online's first kernel start when offline's TSG leaves the
// engine, or when the disable ioctl returns?"; the burst answers "how long does a request of many
// kernels take while the disable lands?".
//
// The runner creates the page (/dev/shm/<name>, layout: TriggerPage in common.h) and writes shot n
// into `request`; the trigger writes the host times (CLOCK_MONOTONIC: when it saw the request,
// after the launch calls, after the sync), the first kernel's GPU start and the last one's end,
// then `done` = n. It ends when the runner sets `stop`, when its parent dies, or after
// --max-seconds.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "gpu_clock.cuh"

using valve::TriggerPage;

static TriggerPage* g_page = nullptr;

static void set_state(uint32_t s) {
  if (g_page) __atomic_store_n(&g_page->state, s, __ATOMIC_RELEASE);
}

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "trigger: %s failed: %s\n", #call, cudaGetErrorString(err_)); \
      set_state(valve::kTriggerFailed);                                                 \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

// Records the GPU time at its start (out[0]) and at its end (out[1]) in host-mapped memory.
__global__ void first_kernel(uint64_t* out) {
  const uint64_t t0 = valve::globaltimer();
  if (threadIdx.x == 0) {
    volatile uint64_t* o = out;
    o[0] = t0;
    o[1] = valve::globaltimer();
    __threadfence_system();
  }
}

// One kernel of a burst: 32 threads spin for `ns` of GPU time (so offline keeps the SMs); thread 0
// records the start and the end in host-mapped memory.
__global__ void burst_kernel(uint64_t ns, uint64_t* start, uint64_t* end) {
  const uint64_t t0 = valve::globaltimer();
  uint32_t x = threadIdx.x;
  while (valve::globaltimer() - t0 < ns) x = x * valve::kLcgA + valve::kLcgC;
  if (threadIdx.x == 0) {
    volatile uint64_t* s = start;
    volatile uint64_t* e = end;
    *s = t0;
    *e = valve::globaltimer() | (x == 0xFFFFFFFFu);  // uses x, so the loop stays
    __threadfence_system();
  }
}

// The host-mapped words: the single kernel's start and end, then every burst kernel's start, then
// every burst kernel's end.
constexpr size_t kBurstStarts = 2;
constexpr size_t kBurstEnds = kBurstStarts + valve::kTriggerMaxBurst;
constexpr size_t kOutWords = kBurstEnds + valve::kTriggerMaxBurst;
// A burst kernel may spin at most this long (the runner asks for microseconds).
constexpr uint64_t kMaxKernelNs = 100000000ull;

static uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

[[noreturn]] static void usage() {
  std::fprintf(stderr,
               "usage: trigger --shm NAME [--device D] [--warmup N] [--max-seconds S]\n"
               "NAME: a page in /dev/shm that the runner created (TriggerPage in common.h)\n");
  std::exit(64);
}

struct Options {
  std::string shm;
  int device = 0;
  int warmup = 20;
  double max_seconds = 300;
};

static Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) usage();
    const char* v = argv[++i];
    if (k == "--shm") o.shm = v;
    else if (k == "--device") o.device = std::atoi(v);
    else if (k == "--warmup") o.warmup = std::atoi(v);
    else if (k == "--max-seconds") o.max_seconds = std::atof(v);
    else usage();
  }
  if (o.shm.empty() || o.warmup < 1) usage();
  return o;
}

// Maps the runner's page and checks its magic; exits 2 if it is not a trigger page.
static TriggerPage* map_page(const std::string& name) {
  const std::string path = "/dev/shm/" + name;
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    std::perror(("trigger: " + path).c_str());
    std::exit(2);
  }
  void* p = mmap(nullptr, valve::kTriggerPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    std::perror("trigger: mmap");
    std::exit(2);
  }
  auto* page = static_cast<TriggerPage*>(p);
  if (__atomic_load_n(&page->magic, __ATOMIC_ACQUIRE) != valve::kTriggerMagic ||
      page->version != valve::kTriggerVersion) {
    std::fprintf(stderr, "trigger: %s is not a version-%u trigger page\n", path.c_str(),
                 valve::kTriggerVersion);
    std::exit(2);
  }
  return page;
}

// Launches the shot's kernels: the single tiny kernel (k = 0) or a burst of k spin kernels.
static cudaError_t launch(uint32_t k, uint64_t ns, cudaStream_t s, uint64_t* d_out) {
  if (k > valve::kTriggerMaxBurst || (k > 0 && (ns == 0 || ns > kMaxKernelNs))) {
    return cudaErrorInvalidValue;
  }
  if (k == 0) {
    first_kernel<<<1, 32, 0, s>>>(d_out);
    return cudaGetLastError();
  }
  for (uint32_t i = 0; i < k; ++i) {
    burst_kernel<<<1, 32, 0, s>>>(ns, d_out + kBurstStarts + i, d_out + kBurstEnds + i);
  }
  return cudaGetLastError();
}

// Writes shot n's fields, then `done` = n (release).
static void publish(uint64_t n, const uint64_t (&mono)[3], uint64_t start, uint64_t end,
                    uint32_t ran, cudaError_t err) {
  __atomic_store_n(&g_page->seen_mono_ns, mono[0], __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->launched_mono_ns, mono[1], __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->synced_mono_ns, mono[2], __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->gpu_start_ns, start, __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->gpu_end_ns, end, __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->burst_ran, ran, __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->error, (uint32_t)err, __ATOMIC_RELAXED);
  __atomic_store_n(&g_page->done, n, __ATOMIC_RELEASE);
}

// One shot: launch, sync, publish. Returns the CUDA error (cudaSuccess if none).
static cudaError_t shot(uint64_t n, cudaStream_t s, volatile uint64_t* h_out, uint64_t* d_out) {
  // Ordered after `request` by the caller's acquire load.
  const uint32_t k = __atomic_load_n(&g_page->burst_kernels, __ATOMIC_RELAXED);
  const uint64_t ns = __atomic_load_n(&g_page->burst_kernel_ns, __ATOMIC_RELAXED);
  const uint32_t words = k <= valve::kTriggerMaxBurst ? k : 0;
  h_out[0] = 0;
  h_out[1] = 0;
  for (uint32_t i = 0; i < words; ++i) {
    h_out[kBurstStarts + i] = 0;
    h_out[kBurstEnds + i] = 0;
  }
  uint64_t mono[3];
  mono[0] = mono_ns();
  cudaError_t err = launch(k, ns, s, d_out);
  mono[1] = mono_ns();
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  mono[2] = mono_ns();
  if (k == 0 || words == 0) {
    publish(n, mono, h_out[0], h_out[1], 0, err);
    return err;
  }
  uint32_t ran = 0;
  for (uint32_t i = 0; i < k; ++i) ran += h_out[kBurstEnds + i] != 0;
  publish(n, mono, h_out[kBurstStarts], h_out[kBurstEnds + k - 1], ran, err);
  return err;
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  g_page = map_page(o.shm);
  __atomic_store_n(&g_page->pid, (uint32_t)getpid(), __ATOMIC_RELAXED);
  // Spin in the sync: the lowest wake-up latency, as a latency-critical server would configure.
  CK(cudaSetDeviceFlags(cudaDeviceScheduleSpin));
  CK(cudaSetDevice(o.device));
  CK(cudaFree(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t* h_raw = nullptr;
  uint64_t* d_out = nullptr;
  CK(cudaHostAlloc((void**)&h_raw, kOutWords * sizeof(uint64_t), cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void**)&d_out, h_raw, 0));
  volatile uint64_t* h_out = h_raw;
  // Warm-up: loads both kernels (lazy loading loads each at its first launch) and creates the
  // stream's channel, so that a shot makes no RM call.
  for (int i = 0; i < o.warmup; ++i) {
    first_kernel<<<1, 32, 0, s>>>(d_out);
    burst_kernel<<<1, 32, 0, s>>>(1000, d_out + kBurstStarts, d_out + kBurstEnds);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
  }
  const pid_t parent = getppid();
  const uint64_t t_end = mono_ns() + (uint64_t)(o.max_seconds * 1e9);
  uint64_t last = __atomic_load_n(&g_page->request, __ATOMIC_ACQUIRE);
  uint64_t shots = 0;
  set_state(valve::kTriggerReady);
  for (uint64_t spins = 0;; ++spins) {
    if (__atomic_load_n(&g_page->stop, __ATOMIC_ACQUIRE)) break;
    const uint64_t n = __atomic_load_n(&g_page->request, __ATOMIC_ACQUIRE);
    if (n != last) {
      last = n;
      ++shots;
      const cudaError_t err = shot(n, s, h_out, d_out);
      if (err != cudaSuccess) {
        std::fprintf(stderr, "trigger: shot %llu failed: %s\n", (unsigned long long)n,
                     cudaGetErrorString(err));
        set_state(valve::kTriggerFailed);
        return 2;
      }
      continue;
    }
    if ((spins & 0xFFFFF) == 0 && (getppid() != parent || mono_ns() > t_end)) break;
    cpu_relax();
  }
  std::printf("{\"pid\":%d,\"shots\":%llu,\"warmup\":%d}\n", (int)getpid(),
              (unsigned long long)shots, o.warmup);
  std::fflush(stdout);
  set_state(valve::kTriggerFinished);
  return 0;
}

// The offline hog: keeps every SM busy with deterministic work that Valve preempts, and publishes a
// per-block heartbeat in shared host memory (/dev/shm/<name>) that the runner maps and watches.
//
// Each thread advances a 32-bit LCG kept in shared memory; the CPU verifies every thread's final
// state by jump-ahead, so a preemption that corrupted registers or shared memory is caught.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "gpu_clock.cuh"

using namespace valve;

static HogHeader* g_hdr = nullptr;

#define CK(call)                                                                       \
  do {                                                                                 \
    cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "hog: %s failed: %s\n", #call, cudaGetErrorString(err_));   \
      if (g_hdr) g_hdr->state = kFailed;                                               \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

using valve::globaltimer;

// One block = one heartbeat slot. Runs until *stop is nonzero or, when max_iters >= 0, for
// max_iters iterations (graph mode). Slot 0 (the one the runner's poller watches) is written every
// iteration; the others when (count & write_mask) == 0 and at exit, which keeps the frozen check
// valid (a running block writes within a few microseconds) without flooding PCIe. The LCG state is
// loaded from and stored to `state`, so it survives across launches.
__global__ void hog_kernel(Slot* slots, int slot_base, const volatile uint32_t* stop,
                           uint32_t* state, uint32_t a, uint32_t c, int steps,
                           long long max_iters, uint32_t write_mask) {
  extern __shared__ uint32_t sm[];
  __shared__ int s_stop;
  const int slot = slot_base + blockIdx.x;
  uint32_t* my_state = state + (size_t)slot * blockDim.x;
  sm[threadIdx.x] = my_state[threadIdx.x];
  volatile Slot* hb = slots + slot;
  const uint32_t mask = slot == 0 ? 0u : write_mask;
  uint64_t count = 0;
  if (threadIdx.x == 0) count = hb->counter;
  __syncthreads();
  for (long long it = 0;; ++it) {
    if (threadIdx.x == 0) s_stop = (*stop != 0u) || (max_iters >= 0 && it >= max_iters);
    __syncthreads();
    if (s_stop) break;
    uint32_t x = sm[threadIdx.x];
    for (int k = 0; k < steps; ++k) x = x * a + c;
    sm[threadIdx.x] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
      ++count;
      if ((count & mask) == 0) {
        hb->counter = count;
        hb->globaltimer_ns = globaltimer();
        __threadfence_system();
      }
    }
  }
  if (threadIdx.x == 0) {
    hb->counter = count;
    hb->globaltimer_ns = globaltimer();
    __threadfence_system();
  }
  my_state[threadIdx.x] = sm[threadIdx.x];
}

struct Options {
  std::string shm;
  std::string mode = "persistent";
  int streams = 4;
  int steps = 256;
  int block = 256;
  int smem_kb = -1;
  int device = 0;
  int copy_mb = 256;
  int graph_nodes = 8;
  int graph_iters = 200;
  double max_seconds = 600;
  bool sysmem_poll = false;
  int blocks_per_sm = 0;  // 0: as many as fit
};

// With VALVE_HOG_TRACE set, each start-up stage is printed to stderr with a timestamp.
static void trace(const char* stage) {
  static const bool on = std::getenv("VALVE_HOG_TRACE") != nullptr;
  if (!on) return;
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  std::fprintf(stderr, "hog[%d] %ld.%06ld %s\n", (int)getpid(), (long)ts.tv_sec, ts.tv_nsec / 1000, stage);
}

[[noreturn]] static void usage() {
  std::fprintf(stderr,
               "usage: hog --shm NAME [--mode persistent|streams|copy|graph] [--streams S]\n"
               "           [--steps N] [--block T] [--smem-kb K] [--device D] [--copy-mb M]\n"
               "           [--graph-nodes N] [--graph-iters I] [--max-seconds T] [--sysmem-poll 1]\n"
               "           [--blocks-per-sm N]\n"
               "--sysmem-poll 1: every block reads the stop flag from host memory and writes its\n"
               "heartbeat every iteration (heavy PCIe traffic; slows preemption down)\n");
  std::exit(64);
}

static Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) usage();
    std::string v = argv[++i];
    if (k == "--shm") o.shm = v;
    else if (k == "--mode") o.mode = v;
    else if (k == "--streams") o.streams = std::atoi(v.c_str());
    else if (k == "--steps") o.steps = std::atoi(v.c_str());
    else if (k == "--block") o.block = std::atoi(v.c_str());
    else if (k == "--smem-kb") o.smem_kb = std::atoi(v.c_str());
    else if (k == "--device") o.device = std::atoi(v.c_str());
    else if (k == "--copy-mb") o.copy_mb = std::atoi(v.c_str());
    else if (k == "--graph-nodes") o.graph_nodes = std::atoi(v.c_str());
    else if (k == "--graph-iters") o.graph_iters = std::atoi(v.c_str());
    else if (k == "--max-seconds") o.max_seconds = std::atof(v.c_str());
    else if (k == "--sysmem-poll") o.sysmem_poll = std::atoi(v.c_str()) != 0;
    else if (k == "--blocks-per-sm") o.blocks_per_sm = std::atoi(v.c_str());
    else usage();
  }
  if (o.shm.empty() || o.streams < 1 || o.steps < 1 || o.block < 32 || o.block > 1024) usage();
  return o;
}

static void on_signal(int) {
  if (g_hdr) *(volatile uint32_t*)&g_hdr->stop = 1;
}

static volatile Slot* slot_ptr(int i) {
  return reinterpret_cast<volatile Slot*>(reinterpret_cast<char*>(g_hdr) + kSlotsOffset) + i;
}

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  uint32_t mode;
  if (o.mode == "persistent") mode = kModePersistent;
  else if (o.mode == "streams") mode = kModeStreams;
  else if (o.mode == "copy") mode = kModeCopy;
  else if (o.mode == "graph") mode = kModeGraph;
  else usage();

  trace("start");
  CK(cudaSetDevice(o.device));
  CK(cudaFree(0));
  trace("context created");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, o.device));

  size_t smem = (size_t)o.block * sizeof(uint32_t);
  if (o.smem_kb > 0 && (size_t)o.smem_kb * 1024 > smem) smem = (size_t)o.smem_kb * 1024;
  if (smem > 48 * 1024)
    CK(cudaFuncSetAttribute(hog_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hog_kernel, o.block, smem));
  if (per_sm < 1) {
    std::fprintf(stderr, "hog: a block of %d threads with %zu B shared memory does not fit an SM\n",
                 o.block, smem);
    return 2;
  }
  if (o.blocks_per_sm > 0 && o.blocks_per_sm < per_sm) per_sm = o.blocks_per_sm;
  const int grid = prop.multiProcessorCount * per_sm;
  const int streams = mode == kModeStreams ? o.streams : 1;
  // Floor, so that every block of every stream is resident at once (they never end on their own).
  const int per_stream = grid / streams;
  const int num_slots = per_stream * streams;

  // The shared heartbeat page, pinned and mapped for the GPU.
  const size_t bytes = ((kSlotsOffset + sizeof(Slot) * num_slots) + 4095) / 4096 * 4096;
  std::string path = "/dev/shm/" + o.shm;
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
    std::perror(("hog: " + path).c_str());
    return 2;
  }
  void* page = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (page == MAP_FAILED) {
    std::perror("hog: mmap");
    return 2;
  }
  std::memset(page, 0, bytes);
  g_hdr = static_cast<HogHeader*>(page);
  trace("shm mapped");
  CK(cudaHostRegister(page, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  trace("shm registered");
  HogHeader* d_hdr = nullptr;
  CK(cudaHostGetDevicePointer((void**)&d_hdr, page, 0));
  Slot* d_slots = reinterpret_cast<Slot*>(reinterpret_cast<char*>(d_hdr) + kSlotsOffset);
  // The kernels poll a flag in device memory (cheap, L2); a host thread relays the runner's stop
  // request into it. With --sysmem-poll they poll the host page directly.
  uint32_t* d_flag = nullptr;
  CK(cudaMalloc(&d_flag, sizeof(uint32_t)));
  CK(cudaMemset(d_flag, 0, sizeof(uint32_t)));
  const volatile uint32_t* d_stop = o.sysmem_poll ? &d_hdr->stop : d_flag;
  const uint32_t write_mask = o.sysmem_poll ? 0u : 15u;

  // Initial LCG states.
  const size_t nstate = (size_t)num_slots * o.block;
  std::vector<uint32_t> h_state(nstate);
  for (int s = 0; s < num_slots; ++s)
    for (int t = 0; t < o.block; ++t) h_state[(size_t)s * o.block + t] = lcg_seed(s, t);
  uint32_t* d_state = nullptr;
  CK(cudaMalloc(&d_state, nstate * sizeof(uint32_t)));
  CK(cudaMemcpy(d_state, h_state.data(), nstate * sizeof(uint32_t), cudaMemcpyHostToDevice));

  trace("state copied");
  g_hdr->version = kVersion;
  g_hdr->state = kStarting;
  g_hdr->num_slots = (uint32_t)num_slots;
  g_hdr->checksum_ok = -1;
  g_hdr->mode = mode;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *(volatile uint64_t*)&g_hdr->magic = kMagic;
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);

  std::vector<cudaStream_t> ss(streams);
  for (auto& s : ss) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  };
  volatile uint32_t* stop = &g_hdr->stop;

  cudaGraphExec_t graph_exec = nullptr;
  if (mode == kModeGraph) {
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(ss[0], cudaStreamCaptureModeThreadLocal));
    for (int n = 0; n < o.graph_nodes; ++n)
      hog_kernel<<<grid, o.block, smem, ss[0]>>>(d_slots, 0, d_stop, d_state, kLcgA, kLcgC,
                                                 o.steps, o.graph_iters, write_mask);
    CK(cudaStreamEndCapture(ss[0], &graph));
    CK(cudaGraphInstantiate(&graph_exec, graph, 0));
    CK(cudaGraphLaunch(graph_exec, ss[0]));
  } else {
    for (int s = 0; s < streams; ++s)
      hog_kernel<<<per_stream, o.block, smem, ss[s]>>>(d_slots, s * per_stream, d_stop, d_state,
                                                       kLcgA, kLcgC, o.steps, -1, write_mask);
  }
  CK(cudaGetLastError());

  std::thread relay([&] {
    while (!*stop) usleep(200);
    cudaStream_t rs;
    CK(cudaStreamCreateWithFlags(&rs, cudaStreamNonBlocking));
    static const uint32_t one = 1;
    CK(cudaMemcpyAsync(d_flag, &one, sizeof one, cudaMemcpyHostToDevice, rs));
    CK(cudaStreamSynchronize(rs));
  });

  // Copy mode: a host thread keeps a copy engine busy and counts completed copies. Its buffers
  // are freed by the main thread after the kernels ended: cudaFree synchronizes the device, so a
  // copier freeing them as the stop came in waited for the persistent kernels while holding
  // CUDA's lock, and the relay could not deliver the stop flag that ends them (a hog that never
  // stopped, seen twice in the hardware test's copy-engine cells).
  std::thread copier;
  void *copy_h = nullptr, *copy_d = nullptr;
  cudaStream_t copy_s = nullptr;
  if (mode == kModeCopy) {
    copier = std::thread([&] {
      const size_t cb = (size_t)o.copy_mb << 20;
      void *h = nullptr, *d = nullptr;
      cudaStream_t cs;
      CK(cudaMallocHost(&h, cb));
      CK(cudaMalloc(&d, cb));
      CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
      std::memset(h, 1, cb);
      while (!*stop) {
        CK(cudaMemcpyAsync(d, h, cb, cudaMemcpyHostToDevice, cs));
        CK(cudaStreamSynchronize(cs));
        __atomic_add_fetch(&g_hdr->copies_done, 1, __ATOMIC_SEQ_CST);
      }
      copy_h = h;
      copy_d = d;
      copy_s = cs;
    });
  }

  // Running = every slot has ticked (and, in copy mode, a copy has completed).
  for (;;) {
    bool all = true;
    for (int i = 0; i < num_slots && all; ++i) all = slot_ptr(i)->counter > 0;
    if (mode == kModeCopy) all = all && __atomic_load_n(&g_hdr->copies_done, __ATOMIC_SEQ_CST) > 0;
    if (all) break;
    if (elapsed() > 60 || *stop) {
      std::fprintf(stderr, "hog: not every block started within 60 s (grid %d)\n", grid);
      g_hdr->state = kFailed;
      *stop = 1;
      relay.join();
      if (copier.joinable()) copier.join();  // a joinable thread's destructor would abort
      cudaDeviceSynchronize();
      return 2;
    }
    usleep(200);
  }
  *(volatile uint32_t*)&g_hdr->state = kRunning;
  trace("running");

  while (!*stop && elapsed() < o.max_seconds) {
    if (mode == kModeGraph) {
      CK(cudaStreamSynchronize(ss[0]));
      if (!*stop) CK(cudaGraphLaunch(graph_exec, ss[0]));
    } else {
      usleep(1000);
    }
  }
  *stop = 1;
  if (copier.joinable()) copier.join();
  relay.join();
  CK(cudaDeviceSynchronize());
  if (copy_s != nullptr) {
    cudaFreeHost(copy_h);
    cudaFree(copy_d);
    cudaStreamDestroy(copy_s);
  }

  // Verify every thread against the CPU's jump-ahead.
  CK(cudaMemcpy(h_state.data(), d_state, nstate * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  uint64_t total = 0, bad = 0;
  for (int s = 0; s < num_slots; ++s) {
    const uint64_t iters = slot_ptr(s)->counter;
    total += iters;
    for (int t = 0; t < o.block; ++t) {
      const uint32_t want = lcg_jump(lcg_seed(s, t), iters * (uint64_t)o.steps);
      if (h_state[(size_t)s * o.block + t] != want) ++bad;
    }
  }
  g_hdr->total_iterations = total;
  g_hdr->checksum_ok = bad == 0 ? 1 : 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  g_hdr->state = bad == 0 ? kFinished : kFailed;
  std::printf(
      "{\"pid\":%d,\"device\":\"%s\",\"mode\":\"%s\",\"slots\":%d,\"blocks_per_sm\":%d,"
      "\"block\":%d,\"smem_bytes\":%zu,\"total_iterations\":%llu,\"copies\":%llu,"
      "\"bad_threads\":%llu,\"checksum_ok\":%s,\"sysmem_poll\":%s,\"seconds\":%.3f}\n",
      (int)getpid(), prop.name, o.mode.c_str(), num_slots, per_sm, o.block, smem,
      (unsigned long long)total, (unsigned long long)g_hdr->copies_done,
      (unsigned long long)bad, bad == 0 ? "true" : "false", o.sysmem_poll ? "true" : "false",
      elapsed());
  std::fflush(stdout);
  cudaHostUnregister(page);
  munmap(page, bytes);
  close(fd);
  return bad == 0 ? 0 : 1;
}

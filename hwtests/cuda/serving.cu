// An LLM-serving-like online client: requests arrive open-loop with Poisson arrivals; each is a
// prefill kernel, then decode iterations of a few back-to-back kernels separated by host think
// time (sampling). Reports request latency (end - arrival) as one JSON line; all times are
// CLOCK_MONOTONIC so the runner can line them up with other processes.
//
// Protocol on stdout/stdin: after warm-up it prints `READY <pid>` and waits for a line on stdin
// (EOF also means go). With --settle-requests N > 0 it then runs N unrecorded requests, each
// followed by --settle-gap-ms of idle, prints `SETTLED` and waits for a second line. Then the
// measured requests, then the JSON line.
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <time.h>
#include <unistd.h>

#include "common.h"
#include "gpu_clock.cuh"

#define CK(call) VALVE_CUDA_CHECK("serving", call)

using valve::spin_kernel;

static uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// Busy-waits until CLOCK_MONOTONIC reaches `t`.
static void spin_until(uint64_t t) {
  while (mono_ns() < t) {
  }
}

// Sleeps until ~200 us before `t`, then spins the rest (sleep wake-up jitter stays out).
static void wait_until(uint64_t t) {
  const uint64_t spin_ns = 200000;
  if (mono_ns() + spin_ns < t) {
    const uint64_t wake = t - spin_ns;
    timespec ts;
    ts.tv_sec = (time_t)(wake / 1000000000ull);
    ts.tv_nsec = (long)(wake % 1000000000ull);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
    }
  }
  spin_until(t);
}

// Blocks until a line (or EOF) arrives on stdin.
static void wait_go() {
  for (;;) {
    const int c = std::getchar();
    if (c == EOF || c == '\n') return;
  }
}

[[noreturn]] static void usage() {
  std::fprintf(
      stderr,
      "usage: serving [--duration-s S] [--rate R] [--seed N] [--prefill-us P] [--decode-iters N]\n"
      "               [--decode-kernels K] [--decode-kernel-us U] [--gap-us G] [--blocks B]\n"
      "               [--threads T] [--settle-requests N] [--settle-gap-ms M] [--device D]\n"
      "Poisson arrivals at R requests/s over S seconds (seed N); each request: one P us prefill\n"
      "kernel, then N decode iterations of K back-to-back U us kernels with G us of host think\n"
      "time between iterations. B blocks per kernel (default: the number of SMs).\n");
  std::exit(64);
}

static bool parse_num(const char* s, double* out) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s, &end);
  if (errno != 0 || end == s || *end != '\0') return false;
  *out = v;
  return true;
}

int main(int argc, char** argv) {
  double duration_s = 8, rate = 10, seed = 1, prefill_us = 3000, decode_iters = 16,
         decode_kernels = 4, decode_kernel_us = 250, gap_us = 300, blocks_arg = 0, threads = 128,
         settle_requests = 0, settle_gap_ms = 250, device = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage();
    double v;
    if (!parse_num(argv[++i], &v)) usage();
    if (k == "--duration-s") duration_s = v;
    else if (k == "--rate") rate = v;
    else if (k == "--seed") seed = v;
    else if (k == "--prefill-us") prefill_us = v;
    else if (k == "--decode-iters") decode_iters = v;
    else if (k == "--decode-kernels") decode_kernels = v;
    else if (k == "--decode-kernel-us") decode_kernel_us = v;
    else if (k == "--gap-us") gap_us = v;
    else if (k == "--blocks") blocks_arg = v;
    else if (k == "--threads") threads = v;
    else if (k == "--settle-requests") settle_requests = v;
    else if (k == "--settle-gap-ms") settle_gap_ms = v;
    else if (k == "--device") device = v;
    else usage();
  }
  if (!(duration_s > 0) || !(rate > 0) || seed < 0 || prefill_us < 0 || decode_iters < 0 ||
      decode_kernels < 1 || decode_kernel_us < 0 || gap_us < 0 || blocks_arg < 0 ||
      threads < 1 || threads > 1024 || settle_requests < 0 || settle_gap_ms < 0 || device < 0)
    usage();
  const int n_iters = (int)decode_iters, n_kernels = (int)decode_kernels;
  const int n_settle = (int)settle_requests, dev = (int)device, n_threads = (int)threads;

  CK(cudaSetDevice(dev));
  CK(cudaFree(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const int blocks = blocks_arg >= 1 ? (int)blocks_arg : prop.multiProcessorCount;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint32_t* sink;
  CK(cudaMalloc(&sink, sizeof(uint32_t)));
  const uint64_t prefill_ns = (uint64_t)(prefill_us * 1e3);
  const uint64_t decode_ns = (uint64_t)(decode_kernel_us * 1e3);
  const uint64_t gap_ns = (uint64_t)(gap_us * 1e3);

  auto decode_iteration = [&] {
    for (int k = 0; k < n_kernels; ++k) spin_kernel<<<blocks, n_threads, 0, s>>>(decode_ns, sink);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
  };
  // One request: prefill, then the decode iterations with think time between them.
  auto request = [&] {
    spin_kernel<<<blocks, n_threads, 0, s>>>(prefill_ns, sink);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
    for (int it = 0; it < n_iters; ++it) {
      decode_iteration();
      if (it + 1 < n_iters) spin_until(mono_ns() + gap_ns);
    }
  };

  // Warm-up, not recorded: one prefill and 20 decode iterations.
  spin_kernel<<<blocks, n_threads, 0, s>>>(prefill_ns, sink);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));
  for (int i = 0; i < 20; ++i) decode_iteration();

  std::printf("READY %d\n", (int)getpid());
  std::fflush(stdout);
  wait_go();

  if (n_settle > 0) {
    for (int i = 0; i < n_settle; ++i) {
      request();
      wait_until(mono_ns() + (uint64_t)(settle_gap_ms * 1e6));
    }
    std::printf("SETTLED\n");
    std::fflush(stdout);
    wait_go();
  }

  // Open-loop Poisson arrivals: the same seed gives the same sequence in every run.
  std::mt19937_64 rng((uint64_t)seed);
  std::exponential_distribution<double> inter(rate);
  std::vector<double> offsets_s;
  for (double t = inter(rng); t < duration_s; t += inter(rng)) offsets_s.push_back(t);
  const uint64_t base = mono_ns();
  const size_t n = offsets_s.size();
  std::vector<uint64_t> arrival(n), start(n), end(n);
  for (size_t i = 0; i < n; ++i) arrival[i] = base + (uint64_t)(offsets_s[i] * 1e9);

  for (size_t i = 0; i < n; ++i) {
    wait_until(arrival[i]);  // a request whose predecessor is still running starts late
    start[i] = mono_ns();
    request();
    end[i] = mono_ns();
  }
  CK(cudaGetLastError());

  std::vector<double> lat(n), service(n);
  double sum = 0, busy_ns = 0;
  size_t late = 0;
  for (size_t i = 0; i < n; ++i) {
    lat[i] = (double)(end[i] - arrival[i]) / 1e3;
    service[i] = (double)(end[i] - start[i]) / 1e3;
    sum += lat[i];
    busy_ns += (double)(end[i] - start[i]);
    if (start[i] > arrival[i] + 100000) ++late;  // queued behind its predecessor (> 100 us)
  }
  std::vector<double> sorted = lat, sorted_service = service;
  std::sort(sorted.begin(), sorted.end());
  std::sort(sorted_service.begin(), sorted_service.end());
  const uint64_t start_ns = n ? arrival[0] : base, end_ns = n ? end[n - 1] : base;
  const unsigned long long launches =
      (unsigned long long)n * (1ull + (unsigned long long)n_iters * (unsigned long long)n_kernels);

  std::printf(
      "{\"device\":\"%s\",\"pid\":%d,\"requests\":%zu,\"p50_us\":%.1f,\"p90_us\":%.1f,"
      "\"p99_us\":%.1f,\"max_us\":%.1f,\"mean_us\":%.1f,\"service_p50_us\":%.1f,"
      "\"busy_s\":%.6f,\"start_ns\":%llu,\"end_ns\":%llu,\"window_s\":%.6f,\"launches\":%llu,"
      "\"late_requests\":%zu,\"duration_s\":%g,\"rate\":%g,\"seed\":%llu,\"prefill_us\":%g,"
      "\"decode_iters\":%d,\"decode_kernels\":%d,\"decode_kernel_us\":%g,\"gap_us\":%g,"
      "\"blocks\":%d,\"threads\":%d,\"settle_requests\":%d,\"latency_us\":[",
      prop.name, (int)getpid(), n, valve::percentile(sorted.data(), n, 0.5),
      valve::percentile(sorted.data(), n, 0.9), valve::percentile(sorted.data(), n, 0.99),
      n ? sorted[n - 1] : 0.0, n ? sum / (double)n : 0.0,
      valve::percentile(sorted_service.data(), n, 0.5), busy_ns / 1e9,
      (unsigned long long)start_ns, (unsigned long long)end_ns,
      (double)(end_ns - start_ns) / 1e9, launches, late, duration_s, rate,
      (unsigned long long)seed, prefill_us, n_iters, n_kernels, decode_kernel_us, gap_us, blocks,
      n_threads, n_settle);
  for (size_t i = 0; i < n; ++i) std::printf("%s%.1f", i ? "," : "", lat[i]);
  std::printf("]}\n");
  std::fflush(stdout);
  return 0;
}

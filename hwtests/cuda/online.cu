// The latency-critical online client: launches a short kernel back to back (with a little CPU think
// time between launches) and reports the round-trip latency distribution as one JSON line.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <unistd.h>

#include "common.h"
#include "gpu_clock.cuh"

#define CK(call) VALVE_CUDA_CHECK("online", call)

using valve::spin_kernel;

[[noreturn]] static void usage() {
  std::fprintf(stderr,
               "usage: online [--count N | --duration-s S] [--think-us U] [--kernel-us K]\n"
               "              [--blocks B] [--device D] [--graph 1]\n"
               "--graph 1: capture the kernel into a CUDA graph once and launch the graph each time\n");
  std::exit(64);
}

int main(int argc, char** argv) {
  long count = 2000;
  double duration_s = 0, think_us = 50, kernel_us = 20;
  int blocks = 1, device = 0, use_graph = 0;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) usage();
    const char* v = argv[++i];
    if (k == "--count") count = std::atol(v);
    else if (k == "--duration-s") duration_s = std::atof(v);
    else if (k == "--think-us") think_us = std::atof(v);
    else if (k == "--kernel-us") kernel_us = std::atof(v);
    else if (k == "--blocks") blocks = std::atoi(v);
    else if (k == "--device") device = std::atoi(v);
    else if (k == "--graph") use_graph = std::atoi(v);
    else usage();
  }
  if (count < 1 || blocks < 1) usage();
  using clk = std::chrono::steady_clock;
  // Context creation: what an eBPF watcher on the ioctl path could slow down.
  const auto t_init = clk::now();
  CK(cudaSetDevice(device));
  CK(cudaFree(0));
  const double init_us = std::chrono::duration<double, std::micro>(clk::now() - t_init).count();
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint32_t* sink;
  CK(cudaMalloc(&sink, sizeof(uint32_t)));
  auto think = [&] {
    const auto until = clk::now() + std::chrono::nanoseconds((long long)(think_us * 1e3));
    while (clk::now() < until) {
    }
  };
  const uint64_t ns = (uint64_t)(kernel_us * 1e3);
  cudaGraphExec_t graph_exec = nullptr;
  if (use_graph) {
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    spin_kernel<<<blocks, 32, 0, s>>>(ns, sink);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&graph_exec, graph, 0));
  }
  auto submit = [&] {
    if (use_graph) {
      CK(cudaGraphLaunch(graph_exec, s));
    } else {
      spin_kernel<<<blocks, 32, 0, s>>>(ns, sink);
    }
  };
  for (int i = 0; i < 50; ++i) {  // warm-up, not recorded
    submit();
    CK(cudaStreamSynchronize(s));
  }
  std::vector<double> rt;
  rt.reserve(duration_s > 0 ? 100000 : count);
  const auto start = clk::now();
  for (long i = 0;; ++i) {
    if (duration_s > 0) {
      if (std::chrono::duration<double>(clk::now() - start).count() >= duration_s) break;
    } else if (i >= count) {
      break;
    }
    const auto t0 = clk::now();
    submit();
    CK(cudaStreamSynchronize(s));
    rt.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
    think();
  }
  CK(cudaGetLastError());
  std::vector<double> sorted = rt;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0;
  for (double x : rt) sum += x;
  const size_t n = sorted.size();
  std::printf(
      "{\"device\":\"%s\",\"count\":%zu,\"kernel_us\":%.1f,\"think_us\":%.1f,\"p50_us\":%.1f,"
      "\"p90_us\":%.1f,\"p99_us\":%.1f,\"max_us\":%.1f,\"mean_us\":%.1f,\"context_init_us\":%.0f,"
      "\"graph\":%s,\"pid\":%d}\n",
      prop.name, n, kernel_us, think_us, valve::percentile(sorted.data(), n, 0.5),
      valve::percentile(sorted.data(), n, 0.9), valve::percentile(sorted.data(), n, 0.99),
      n ? sorted[n - 1] : 0.0, n ? sum / n : 0.0, init_us, use_graph ? "true" : "false",
      (int)getpid());
  return 0;
}

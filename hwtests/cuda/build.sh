#!/usr/bin/env bash
# Builds the hardware-test workloads into OUTDIR: hog, online, serving, memstream.ptx and stamp.ptx
# (nvcc, sm_90 by default; set CUDA_ARCH to change), and libvalve_ioctl_log.so (gcc). A stamp.ptx
# that fails to build is reported and left out (only the serving benchmark's --stamp-first-kernel needs
# it), so it never stops the rest. With --cpu-only, only the gcc/g++ parts
# and their self-tests (what CI can build without CUDA).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
logger="$here/../ioctl-logger"
cpu_only=0
if [ "${1:-}" = "--cpu-only" ]; then cpu_only=1; shift; fi
out="${1:?usage: build.sh [--cpu-only] OUTDIR}"
mkdir -p "$out"

gcc -O2 -Wall -Wextra -shared -fPIC -o "$out/libvalve_ioctl_log.so" "$logger/valve_ioctl_log.c" -ldl -lpthread
gcc -O2 -Wall -Wextra -DVALVE_IOCTL_LOG_NO_INTERPOSE -o "$out/logger-selftest" "$logger/selftest.c" "$logger/valve_ioctl_log.c"
gcc -O2 -Wall -o "$out/logger-passthrough" "$logger/passthrough.c"
g++ -O2 -Wall -Wextra -std=c++17 -o "$out/common-selftest" "$here/selftest.cpp"
[ "$cpu_only" = 1 ] && exit 0

nvcc_bin="$(command -v nvcc || true)"
[ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc_bin" ]; then
  echo "build.sh: nvcc not found (install the CUDA toolkit or add it to PATH)" >&2
  exit 1
fi
arch="${CUDA_ARCH:-sm_90}"
"$nvcc_bin" -O2 -std=c++17 -arch="$arch" -lineinfo -o "$out/hog" "$here/hog.cu"
"$nvcc_bin" -O2 -std=c++17 -arch="$arch" -lineinfo -o "$out/online" "$here/online.cu"
"$nvcc_bin" -O2 -std=c++17 -arch="$arch" -lineinfo -o "$out/serving" "$here/serving.cu"
"$nvcc_bin" -O2 -arch="$arch" -ptx -o "$out/memstream.ptx" "$here/memstream.cu"
built="hog, online, serving, memstream.ptx"
if "$nvcc_bin" -O2 -arch="$arch" -ptx -o "$out/stamp.ptx" "$here/stamp.cu"; then
  built="$built, stamp.ptx"
else
  rm -f "$out/stamp.ptx"
  echo "build.sh: stamp.cu did not build; the serving benchmark's --stamp-first-kernel cannot run" >&2
fi
echo "built $built, libvalve_ioctl_log.so in $out"

#!/usr/bin/env bash
# Valve's hardware test, for a GPU host: builds the CUDA workloads with the host's nvcc, then runs
# valve-hwtest (preemption latency, frozen checks, online interference, the gate benchmark,
# channel subsets, multi-GPU).
#
# Usage: scripts/hwtest.sh [valve-hwtest options...]
#   e.g. --only-ctx: only what the daemon costs a new CUDA process's context creation (no daemon, just
#   started, settled, settled without eBPF probes; under 2 minutes after the CUDA build;
#   docs/hardening.md section 6)
#   VALVE_BIN=DIR   directory with prebuilt valvectl and valve-hwtest (default: .carry/bin, else
#                   target/release, else cargo build --release)
#   OUT=DIR         where report.md / report.json go (the device tool sets it; default: a temp dir)
# Without an NVIDIA driver it prints SKIP and exits 0. It never loads, unloads or resets anything.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -e /dev/nvidiactl ]; then
  echo "SKIP: no NVIDIA driver here (/dev/nvidiactl missing); run this on a GPU host"
  exit 0
fi

bin="${VALVE_BIN:-}"
if [ -z "$bin" ]; then
  for d in .carry/bin target/release; do
    if [ -x "$d/valve-hwtest" ] && [ -x "$d/valvectl" ]; then bin="$d"; break; fi
  done
fi
if [ -z "$bin" ]; then
  echo "no prebuilt binaries: building with cargo"
  cargo build --release -p valvectl -p valve-hwtests
  bin=target/release
fi

out="${OUT:-$(mktemp -d)}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== host"
nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader 2>/dev/null || true
head -1 /proc/driver/nvidia/version || true

echo "== building CUDA workloads"
bash hwtests/cuda/build.sh "$work/cuda"

echo "== valve-hwtest"
set +e
"$bin/valve-hwtest" --bins "$work/cuda" --valvectl "$bin/valvectl" --out "$out" --date "$(date -u +%F)" "$@" 2>&1 | tee "$out/hwtest.log"
rc=${PIPESTATUS[0]}
set -e
echo "== report: $out/report.md (exit $rc)"
exit "$rc"

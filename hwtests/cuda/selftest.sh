#!/usr/bin/env bash
# CPU self-tests of the hardware-test workloads: LCG jump-ahead and percentiles (g++), the ioctl
# logger's formatting (gcc) and its interposition under LD_PRELOAD. No GPU needed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
bash "$here/build.sh" --cpu-only "$out"
"$out/common-selftest"
"$out/logger-selftest"
VALVE_IOCTL_LOG="$out/log" LD_PRELOAD="$out/libvalve_ioctl_log.so" "$out/logger-passthrough"
if [ -s "$out/log" ]; then echo "FAIL: the logger logged a failed ioctl"; exit 1; fi

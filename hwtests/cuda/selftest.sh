#!/usr/bin/env bash
# CPU self-tests of the hardware-test workloads: LCG jump-ahead and percentiles (g++), the ioctl
# logger's formatting (gcc) and its interposition under LD_PRELOAD; the same for the offline job's
# scheduling library (TSG timeslice, compute preemption mode). No GPU needed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
bash "$here/build.sh" --cpu-only "$out"
"$out/common-selftest"
"$out/logger-selftest"
VALVE_IOCTL_LOG="$out/log" LD_PRELOAD="$out/libvalve_ioctl_log.so" "$out/logger-passthrough"
if [ -s "$out/log" ]; then echo "FAIL: the logger logged a failed ioctl"; exit 1; fi
"$out/timeslice-selftest"
# Under the timeslice library, ioctls pass through unchanged and nothing is set (no TSG here).
VALVE_TSG_TIMESLICE_US=200 LD_PRELOAD="$out/libvalve_timeslice.so" "$out/logger-passthrough" 2>"$out/ts.err"
if grep -q "TSG" "$out/ts.err"; then echo "FAIL: the timeslice library acted without a TSG"; exit 1; fi
VALVE_TSG_TIMESLICE_US=2x LD_PRELOAD="$out/libvalve_timeslice.so" "$out/logger-passthrough" 2>"$out/ts.err" >/dev/null
grep -q "is not 1-10000000" "$out/ts.err" || { echo "FAIL: a bad VALVE_TSG_TIMESLICE_US was not reported"; exit 1; }
# The same for the compute preemption mode: nothing read without a compute object; a bad mode is reported.
VALVE_COMPUTE_PREEMPT=cilp LD_PRELOAD="$out/libvalve_timeslice.so" "$out/logger-passthrough" 2>"$out/pm.err"
if grep -q "valve-preempt" "$out/pm.err"; then echo "FAIL: the library read a mode without a compute object"; exit 1; fi
VALVE_COMPUTE_PREEMPT=fast LD_PRELOAD="$out/libvalve_timeslice.so" "$out/logger-passthrough" 2>"$out/pm.err" >/dev/null
grep -q "is not wfi, cta, cilp or report" "$out/pm.err" || { echo "FAIL: a bad VALVE_COMPUTE_PREEMPT was not reported"; exit 1; }

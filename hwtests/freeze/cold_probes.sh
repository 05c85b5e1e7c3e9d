#!/usr/bin/env bash
# What the launch watcher's probes cost a request's first driver calls after idle time (issue 49:
# a caught arrival's first kernel is 0.075 ms later than alone). One GPU host, root, the daemon.
# cold_probes.py (a copy, a graph replay, `.item()`, each timed on the host) runs: alone; labelled
# online under a gate that holds offline frozen (--fixed-cooldown 10s; offline: a process with no
# GPU work), waits tracked; the same with --no-waits (launch probes only); alone again. The gate's
# probe counts in its status give the probed calls per request.
# PLAN=frozen instead: alone; beside hwtests/cuda's hog frozen by hand (`valvectl preempt --pid`,
# no gate); beside the hog frozen by a gate (as above, waits tracked); alone again: whether a
# frozen offline context slows a request's copy or graph on the GPU.
# Usage: sudo [PLAN=frozen] hwtests/freeze/cold_probes.sh OUT [COUNT] [THINK_US]   (defaults 100, 200000)
#   needs valvectl (VALVECTL, default .carry/bin/valvectl), PyTorch with CUDA and, for
#   PLAN=frozen, the CUDA workloads (BIN=dir, default: built by hwtests/cuda/build.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:?usage: cold_probes.sh OUT [COUNT] [THINK_US]}
count=${2:-100} think=${3:-200000}
[ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here (/dev/nvidiactl missing); run this on a GPU host"; exit 0; }
[ "$(id -u)" = 0 ] || { echo "run as root (the daemon loads BPF)" >&2; exit 2; }
valvectl=${VALVECTL:-$repo/.carry/bin/valvectl}
[ -x "$valvectl" ] || { echo "no valvectl at $valvectl: build it or set VALVECTL" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d /tmp/valve-cold-probes.XXXXXX)
sock="$work/valve.sock"
vc() { "$valvectl" --socket "$sock" "$@"; }
started=() preempt_pid=""

cleanup() {
  rc=$?
  [ -n "$preempt_pid" ] && { kill -TERM "$preempt_pid" 2>/dev/null; wait "$preempt_pid" 2>/dev/null || true; }
  [ -S "$sock" ] && vc gate stop >/dev/null 2>&1 || true
  for p in "${started[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${started[@]}"; do wait "$p" 2>/dev/null || true; done
  cp "$work"/*.log "$out"/ 2>/dev/null || true
  rm -rf "$work" /dev/shm/valve-cold-hog
  echo "results in $out (exit $rc)"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

measure() { # NAME: one run, labelled online, into OUT/NAME.json
  VALVE_LABEL=valve-cold-online python3 "$here/cold_probes.py" --label "$1" --count "$count" \
    --think-us "$think" >"$out/$1.json"
  echo "$1: $(cat "$out/$1.json")"
}
under_gate() { # NAME [gate start options]: the run under a gate holding offline frozen
  local name=$1
  shift
  vc gate start --online-label valve-cold-online --offline "$idle_offline" --no-arrivals \
    --issue serial --fixed-cooldown 10s "$@" >"$work/$name-gate.log" 2>&1 || echo "gate start failed: $(cat "$work/$name-gate.log")"
  measure "$name"
  vc --json gate status >"$out/$name-gate-status.json" 2>&1 || true
  vc gate stop >/dev/null 2>&1 || true
}

measure alone
"$valvectl" --socket "$sock" daemon --state-dir "$work/state" --max-hold 120s >"$work/daemon.log" 2>&1 &
started+=($!)
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "the daemon did not start (daemon.log)" >&2; exit 1; }
if [ "${PLAN:-probes}" = frozen ]; then
  bin=${BIN:-$work/bin}
  [ -x "$bin/hog" ] || bash "$repo/hwtests/cuda/build.sh" "$bin" >"$out/build.log" 2>&1
  "$bin/hog" --shm valve-cold-hog --max-seconds 600 >"$work/hog.log" 2>&1 &
  idle_offline=$!
  started+=($idle_offline)
  sleep 3
  # valvectl itself in the background: it resumes the hog on SIGTERM.
  "$valvectl" --socket "$sock" preempt --pid "$idle_offline" --for 200s >"$work/preempt.log" 2>&1 &
  preempt_pid=$!
  sleep 2
  echo "preempt --pid hog: $(head -c 300 "$work/preempt.log")"
  measure frozen
  kill -TERM "$preempt_pid"; wait "$preempt_pid" || echo "preempt ended with $?"
  preempt_pid=""
  under_gate frozen-gate
  kill -TERM "$idle_offline"; wait "$idle_offline" || true
  measure alone2
  exit 0
fi
sleep 600 &
idle_offline=$!
started+=($idle_offline)
under_gate gate-waits
under_gate gate-no-waits --no-waits
vc gate stop >/dev/null 2>&1 || true
measure alone2

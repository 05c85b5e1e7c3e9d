#!/usr/bin/env bash
# What a frozen offline process still costs an online launch after idle time (issue 49: a caught
# arrival's first kernel is 0.07-0.09 ms later than alone). One GPU host, root, the daemon.
# `online --graph 1` (a 5-us kernel as a CUDA graph, launched and synchronised, then THINK_US of
# host spin) runs in turn: alone; beside an idle second CUDA context (a process that made one and
# spins on the CPU); beside the hog frozen by `valvectl preempt --pid` for the whole run; beside the
# hog frozen the same way while a gate watches online (its launch probes on, the hog left to the
# operator's hold: a caught arrival's state); beside the hog under the gate alone (each launch
# after idle preempts it: an uncaught arrival); beside the hog running (time-sliced); alone
# again. Each at THINK_US (idle, as between requests) and at 1 ms.
# Where valve-rmquery is built, the channel resident on the compute engine is sampled while online
# idles alone and beside the frozen hog. Nothing is judged: the round trips are recorded.
# PLAN=gate (the second plan) instead: alone; the hog frozen by a gate (--fixed-cooldown 10s, so
# online's launches every THINK_US keep it frozen: each is a caught arrival's launch); the same
# with the daemon's threads moved to the upper half of the CPUs and online to the lower; alone.
# Usage: sudo [PLAN=gate] hwtests/freeze/idle_launch.sh OUT [COUNT] [THINK_US]   (defaults 120, 200000)
#   needs CUDA workloads built by hwtests/cuda/build.sh (BIN=dir, default: built into a temp dir),
#   valvectl (VALVECTL, default .carry/bin/valvectl) and optionally valve-rmquery (RMQUERY).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:?usage: idle_launch.sh OUT [COUNT] [THINK_US]}
count=${2:-120} think=${3:-200000}
[ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here (/dev/nvidiactl missing); run this on a GPU host"; exit 0; }
[ "$(id -u)" = 0 ] || { echo "run as root (the daemon loads BPF)" >&2; exit 2; }
valvectl=${VALVECTL:-$repo/.carry/bin/valvectl}
[ -x "$valvectl" ] || { echo "no valvectl at $valvectl: build it or set VALVECTL" >&2; exit 2; }
rmquery=${RMQUERY:-$repo/.carry/bin/valve-rmquery}
mkdir -p "$out"
work=$(mktemp -d /tmp/valve-idle-launch.XXXXXX)
bin=${BIN:-$work/bin}
[ -x "$bin/online" ] && [ -x "$bin/hog" ] || bash "$repo/hwtests/cuda/build.sh" "$bin" >"$out/build.log" 2>&1
sock="$work/valve.sock"
vc() { "$valvectl" --socket "$sock" "$@"; }
started=() preempt_pid="" hog=""

cleanup() {
  rc=$?
  # The hold first (valvectl resumes on SIGTERM before it exits), then the rest.
  [ -n "$preempt_pid" ] && { kill -TERM "$preempt_pid" 2>/dev/null; wait "$preempt_pid" 2>/dev/null || true; }
  for p in "${started[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${started[@]}"; do wait "$p" 2>/dev/null || true; done
  cp "$work"/*.log "$out"/ 2>/dev/null || true
  rm -rf "$work" /dev/shm/valve-idle-hog
  echo "results in $out (exit $rc)"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

"$valvectl" --socket "$sock" daemon --state-dir "$work/state" --max-hold 300s >"$work/daemon.log" 2>&1 &
started+=($!)
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "the daemon did not start (daemon.log)" >&2; exit 1; }
daemon_pid=${started[0]}
online_cpus=""

measure() { # NAME THINK_US: one online run (labelled online, on $online_cpus), into OUT/NAME.json
  VALVE_LABEL=valve-idle-online ${online_cpus:+taskset -c "$online_cpus"} "$bin/online" --graph 1 --kernel-us 5 --count "$count" --think-us "$2" >"$out/$1.json"
  echo "$1: $(cat "$out/$1.json")"
}
resident() { # NAME: the resident compute channel while online idles (one run beside it)
  [ -x "$rmquery" ] || return 0
  VALVE_LABEL=valve-idle-online "$bin/online" --graph 1 --kernel-us 5 --count 20 --think-us "$think" >/dev/null &
  local o=$!
  sleep 1
  "$rmquery" resident --samples 2000 --interval-us 1000 >"$out/$1-resident.json" 2>&1 || true
  wait "$o" || true
  echo "$1 resident: $(head -c 400 "$out/$1-resident.json")"
}
pair() { measure "$1-idle" "$think"; measure "$1-hot" 1000; }
hold_hog() { # the operator's hold on the hog; valvectl itself in the background (its pid in $!)
  "$valvectl" --socket "$sock" preempt --pid "$hog" --for 280s >"$work/preempt.log" 2>&1 &
  preempt_pid=$!
  sleep 2
  echo "preempt --pid hog: $(head -c 300 "$work/preempt.log")"
}
release_hog() {
  kill -TERM "$preempt_pid"; wait "$preempt_pid" || echo "preempt ended with $?"
  preempt_pid=""
  echo "after release: $(tail -c 200 "$work/preempt.log")"
}

start_hog() {
  "$bin/hog" --shm valve-idle-hog --max-seconds 600 >"$work/hog.log" 2>&1 &
  hog=$!
  started+=($hog)
  sleep 3
}

if [ "${PLAN:-operator}" = gate ]; then
  pair alone
  start_hog
  vc gate start --online-label valve-idle-online --offline "$hog" --no-arrivals --issue serial \
    --fixed-cooldown 10s >"$work/gate.log" 2>&1 || echo "gate start failed"
  echo "gate start: $(head -c 300 "$work/gate.log")"
  sleep 1
  pair held
  vc --json gate status >"$out/held-gate-status.json" 2>&1 || true
  n=$(nproc)
  taskset -a -p -c "$((n / 2))-$((n - 1))" "$daemon_pid" >"$work/taskset.log" 2>&1 || echo "taskset failed"
  online_cpus="0-$((n / 2 - 1))"
  pair held-apart
  vc --json gate status >"$out/held-apart-gate-status.json" 2>&1 || true
  vc --json gate stop >"$work/gate-stop.log" 2>&1 || true
  kill -TERM "$hog"; wait "$hog" || true
  pair alone2
  vc --json status >"$out/status.json" 2>&1 || true
  exit 0
fi

pair alone
resident alone
"$bin/hog" --shm valve-idle-hog --max-seconds 600 >"$work/hog.log" 2>&1 &
hog=$!
started+=($hog)
sleep 3
hold_hog
pair frozen
resident frozen
vc gate start --online-label valve-idle-online --offline "$hog" --no-arrivals --issue serial >"$work/gate.log" 2>&1 || echo "gate start failed"
echo "gate start: $(head -c 300 "$work/gate.log")"
sleep 2
pair frozen-gate
release_hog
sleep 1
pair gate
vc --json gate status >"$out/gate-status.json" 2>&1 || true
vc --json gate stop >"$work/gate-stop.log" 2>&1 || true
sleep 1
measure running-idle "$think"
kill -TERM "$hog"; wait "$hog" || true
pair alone2
vc --json status >"$out/status.json" 2>&1 || true

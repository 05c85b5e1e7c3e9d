#!/usr/bin/env bash
# Several GPU benchmarks at once on a multi-GPU host, one per GPU ("lane"), so that one device
# call measures what would otherwise take one call each.
#
#   hwtests/lanes.sh OUTDIR 'COMMAND FOR GPU 0' ['COMMAND FOR GPU 1' ...]
#
# Lane i runs its command with bash, as root, in its own mount namespace where /run/valve and
# /var/lib/valve are empty tmpfs (its own daemon sockets, state file and saved reservations), with
#   VALVE_GPU=i            the benchmarks' GPU by Valve's index: pool, reclaims, profiles, NVML
#   CUDA_VISIBLE_DEVICES=i and CUDA_DEVICE_ORDER=PCI_BUS_ID: its processes' cuda:0 is that GPU
#   VALVE_BENCH_LABEL=batch-gI   its offline label, so that no other lane's gate freezes its jobs
#   LANE=i, LANES=N   this lane and how many run at once (reports record both)
#   LANE_CPUS=a-b     the CPUs it is pinned to: the host's CPUs split into one block per GPU, so
#                     a lane on a 64-core, 4-GPU host gets 16 cores, as a one-GPU host has, and
#                     no lane's CPU work slows another's (sweeps beside other lanes were 3-5x
#                     noisier unpinned). VALVE_LANES_SHARE_CPUS=1, or fewer CPUs than GPUs, shares
#                     them all instead (LANE_CPUS=shared).
#   VALVE_DAEMON_CPUS=a-b  where pinned: all the host's CPUs, for the lane's Valve daemon (the
#                     benchmarks start it with this affinity). The kernel admits a SCHED_DEADLINE
#                     thread only when its affinity spans its root domain, so a daemon pinned to a
#                     lane's block would run its edge threads at normal priority (measured: the
#                     gate's threads did so in pinned lanes, with SCHED_DEADLINE unpinned). The
#                     daemon's threads sleep nearly always; they take no lane's CPU time worth noting.
# An empty
# command leaves its GPU idle. Each lane's output goes to OUTDIR/lane-I.log; the exit status is
# the number of lanes that failed. Before anything starts, Valve's GPU order (`valvectl gpus`,
# PCI order) is checked against nvidia-smi's: a lane must not control one GPU and compute on another.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: $0 OUTDIR 'COMMAND FOR GPU 0' ['COMMAND FOR GPU 1' ...]}
shift
[ $# -ge 1 ] || { echo "lanes: no commands: give one per GPU" >&2; exit 2; }
mkdir -p "$out"
valvectl=${VALVECTL:-$([ -x .carry/valvectl ] && echo .carry/valvectl || echo target/release/valvectl)}

# Valve numbers GPUs by PCI address; so do nvidia-smi and CUDA with CUDA_DEVICE_ORDER=PCI_BUS_ID.
valve_pci=$("$valvectl" --json gpus | python3 -c 'import json,sys; [print(g["pci_bus_id"][-7:].lower()) for g in json.load(sys.stdin)["gpus"]]') \
  || { echo "lanes: valvectl gpus failed" >&2; exit 2; }
smi_pci=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | sed 's/.*\(.......\)$/\1/' | tr A-F a-f)
if [ "$valve_pci" != "$smi_pci" ]; then
  printf 'lanes: Valve and nvidia-smi number the GPUs differently:\nvalve:\n%s\nnvidia-smi:\n%s\n' \
    "$valve_pci" "$smi_pci" >&2
  exit 2
fi
gpus=$(echo "$smi_pci" | wc -l)
[ $# -le "$gpus" ] || { echo "lanes: $# commands for $gpus GPUs" >&2; exit 2; }

# One block of CPUs per GPU (not per command, so GPU i's lane gets the same CPUs whichever lanes
# run), as taskset lists ("0-15"); "shared" for every lane when there are fewer CPUs than GPUs.
mapfile -t blocks < <(python3 - "$gpus" "${VALVE_LANES_SHARE_CPUS:-0}" <<'PY'
import os, sys
gpus, share = int(sys.argv[1]), sys.argv[2] == "1"
cpus = sorted(os.sched_getaffinity(0))
per = len(cpus) // gpus
for g in range(gpus):
    block = cpus[g * per:(g + 1) * per]
    if share or per < 1:
        print("shared")
    elif block == list(range(block[0], block[-1] + 1)):
        print(f"{block[0]}-{block[-1]}" if len(block) > 1 else str(block[0]))
    else:
        print(",".join(map(str, block)))
PY
)
lane_cpus() { echo "${blocks[$1]:-shared}"; }
all_cpus=$(python3 -c 'import os; c = sorted(os.sched_getaffinity(0)); print(",".join(map(str, c)))')

lane_body='mount -t tmpfs valve-lane /run/valve && mount -t tmpfs valve-lane /var/lib/valve && exec bash -c "$LANE_COMMAND"'
lanes=0
for cmd in "$@"; do [ -z "$cmd" ] || lanes=$((lanes + 1)); done
pids=()
i=0
for cmd in "$@"; do
  if [ -n "$cmd" ]; then
    mkdir -p /run/valve /var/lib/valve
    mine=$(lane_cpus "$i")
    pin=(); daemon_cpus=
    [ "$mine" = shared ] || { pin=(taskset -c "$mine"); daemon_cpus=$all_cpus; }
    echo "lane $i (GPU $i, $(echo "$smi_pci" | sed -n "$((i + 1))p"), CPUs $mine): $cmd" | tee "$out/lane-$i.log"
    LANES=$lanes LANE=$i VALVE_GPU=$i CUDA_VISIBLE_DEVICES=$i CUDA_DEVICE_ORDER=PCI_BUS_ID VALVE_BENCH_LABEL=batch-g$i \
      LANE_CPUS=$mine VALVE_DAEMON_CPUS=$daemon_cpus LANE_COMMAND="$cmd" "${pin[@]}" unshare --mount --propagation private bash -c "$lane_body" \
      >>"$out/lane-$i.log" 2>&1 &
    pids[i]=$!
  fi
  i=$((i + 1))
done
failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[i]}"; then status=0; else status=$?; fi
  echo "lane $i: exit $status ($(date -u +%H:%M:%S))" | tee -a "$out/lane-$i.log"
  [ "$status" -eq 0 ] || failed=$((failed + 1))
done
exit "$failed"

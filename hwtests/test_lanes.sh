#!/usr/bin/env bash
# CPU test of hwtests/lanes.sh with stand-ins for nvidia-smi and valvectl: each lane sees its own
# /run/valve and its own GPU, label, count and CPUs; a failed lane is counted; a GPU order that Valve
# and nvidia-smi disagree on, or more commands than GPUs, stops everything before it starts.
# Needs root (a lane mounts tmpfs in its own mount namespace); elsewhere it says so and skips.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" -ne 0 ] || ! command -v unshare >/dev/null; then
  echo "SKIP: lanes.sh needs root and unshare (mount namespaces)"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
fail() { echo "FAIL: $*"; exit 1; }

stubs() {  # $1: the PCI list nvidia-smi prints; Valve's is always 06, 07
  printf '#!/bin/sh\nprintf "%s"\n' "$1" >"$tmp/bin/nvidia-smi"
  cat >"$tmp/valvectl" <<'EOF'
#!/bin/sh
echo '{"driver":"580","gpus":[{"index":0,"pci_bus_id":"0000:06:00.0"},{"index":1,"pci_bus_id":"0000:07:00.0"}]}'
EOF
  chmod +x "$tmp/bin/nvidia-smi" "$tmp/valvectl"
}
lanes() { PATH="$tmp/bin:$PATH" VALVECTL="$tmp/valvectl" bash "$here/lanes.sh" "$@"; }

stubs '00000000:06:00.0\n00000000:07:00.0\n'
probe='touch /run/valve/mine-$LANE; sleep 0.5; ls /run/valve > '"$tmp"'/ls-$LANE;
  echo "$VALVE_GPU $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER $VALVE_BENCH_LABEL $LANE $LANES" > '"$tmp"'/env-$LANE'
lanes "$tmp/out" "$probe" "$probe; exit 3" >/dev/null
status=$?
[ "$status" -eq 1 ] || fail "one failed lane of two: exit $status, expected 1"
[ "$(cat "$tmp/ls-0")" = "mine-0" ] || fail "lane 0 saw $(cat "$tmp/ls-0" | tr '\n' ' ') in /run/valve"
[ "$(cat "$tmp/ls-1")" = "mine-1" ] || fail "lane 1 saw $(cat "$tmp/ls-1" | tr '\n' ' ') in /run/valve"
[ "$(cat "$tmp/env-0")" = "0 0 PCI_BUS_ID batch-g0 0 2" ] || fail "lane 0's environment: $(cat "$tmp/env-0")"
[ "$(cat "$tmp/env-1")" = "1 1 PCI_BUS_ID batch-g1 1 2" ] || fail "lane 1's environment: $(cat "$tmp/env-1")"
! ls /run/valve/mine-* >/dev/null 2>&1 || fail "a lane's file reached the host's /run/valve"
grep -q "lane 1: exit 3" "$tmp/out/lane-1.log" || fail "lane 1's log does not give its exit status"

# Each lane runs on its own block of CPUs (LANE_CPUS), the same as its affinity; with fewer CPUs than
# GPUs, or VALVE_LANES_SHARE_CPUS=1, every lane shares them all.
ncpu=$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
cpuprobe='echo "$LANE_CPUS $(python3 -c "import os; print(sorted(os.sched_getaffinity(0)))")" > '"$tmp"'/cpu-$LANE;
  echo "${VALVE_DAEMON_CPUS:-unset}" > '"$tmp"'/dcpu-$LANE'
lanes "$tmp/outc" "$cpuprobe" "$cpuprobe" >/dev/null || fail "the CPU probe lanes failed"
if [ "$ncpu" -ge 2 ]; then
  read -r l0 a0 <"$tmp/cpu-0"; read -r l1 a1 <"$tmp/cpu-1"
  [ "$l0" != shared ] && [ "$l1" != shared ] || fail "with $ncpu CPUs and 2 GPUs a lane shared: $l0 / $l1"
  python3 - "$(cat "$tmp/cpu-0")" "$(cat "$tmp/cpu-1")" "$ncpu" <<'PY' || fail "lane CPU blocks: $(cat "$tmp"/cpu-*)"
import ast, sys
(l0, a0), (l1, a1) = (x.split(" ", 1) for x in sys.argv[1:3])
a0, a1, n = set(ast.literal_eval(a0)), set(ast.literal_eval(a1)), int(sys.argv[3])
assert a0 and a1 and not (a0 & a1), "the blocks overlap"
assert len(a0) == len(a1) == n // 2, "the blocks are not half the CPUs each"
PY
  # The lane's daemon gets every CPU back (SCHED_DEADLINE needs the whole root domain).
  want=$(python3 -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))')
  [ "$(cat "$tmp/dcpu-0")" = "$want" ] || fail "a pinned lane's VALVE_DAEMON_CPUS: $(cat "$tmp/dcpu-0"), expected $want"
fi
VALVE_LANES_SHARE_CPUS=1 lanes "$tmp/outs" "$cpuprobe" >/dev/null || fail "the shared-CPU lane failed"
[ "$(cut -d' ' -f1 "$tmp/cpu-0")" = shared ] || fail "VALVE_LANES_SHARE_CPUS=1 still pinned: $(cat "$tmp/cpu-0")"
[ "$(cat "$tmp/dcpu-0")" = unset ] || fail "a shared lane set VALVE_DAEMON_CPUS=$(cat "$tmp/dcpu-0")"

# An empty command leaves its GPU idle and is not counted.
lanes "$tmp/out2" "" "$probe" >/dev/null || fail "an idle lane and a passing one: exit $?"
[ "$(cut -d' ' -f1,6 "$tmp/env-1")" = "1 1" ] || fail "with lane 0 idle, lane 1 saw $(cat "$tmp/env-1")"

# Valve and nvidia-smi must number the GPUs alike; nothing starts otherwise.
stubs '00000000:07:00.0\n00000000:06:00.0\n'
rm -f "$tmp"/env-*
msg=$(lanes "$tmp/out3" "$probe" 2>&1)
[ $? -eq 2 ] && echo "$msg" | grep -q "number the GPUs differently" || fail "order mismatch not refused: $msg"
[ ! -e "$tmp/env-0" ] || fail "a lane ran although the GPU orders differ"

stubs '00000000:06:00.0\n00000000:07:00.0\n'
msg=$(lanes "$tmp/out4" true true true 2>&1)
[ $? -eq 2 ] && echo "$msg" | grep -q "3 commands for 2 GPUs" || fail "more commands than GPUs not refused: $msg"
echo "lanes.sh: 5 checks passed"

#!/usr/bin/env bash
# What a third process can see of a freeze (GPU host, root): two PyTorch training jobs A and B
# under the ioctl logger (their channels and the work submit tokens CUDA asks RM for), then
# valve-rmquery's freeze probe on A: every channel disabled, then each channel left out in
# turn. Per hold: each channel's state through a diag object, the resident compute channel,
# the allocated channel IDs, and A's and B's iterations inside the hold (their progress).
#
# Usage: sudo hwtests/freeze/probe.sh OUT     (about 1 min; RMQUERY, PYTHON override the tools)
set -euo pipefail
out="${1:?usage: probe.sh OUT}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
rmquery="${RMQUERY:-$repo/.carry/bin/valve-rmquery}"
python="${PYTHON:-python3}"
[ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here"; exit 0; }
[ -x "$rmquery" ] || { echo "probe.sh: no valve-rmquery at $rmquery (cargo build --release -p valve-hwtests)" >&2; exit 1; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$out/work"
mkdir -p "$work"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

gcc -O2 -shared -fPIC -o "$work/liblog.so" "$repo/hwtests/ioctl-logger/valve_ioctl_log.c" -ldl -lpthread
for c in a b; do
  LD_PRELOAD="$work/liblog.so" VALVE_IOCTL_LOG="$work/rm-$c.log" \
    "$python" "$repo/hwtests/serving/training.py" --progress "$work/iters-$c.log" --size small \
    --device cuda >"$work/train-$c.out" 2>&1 &
  pids+=($!)
  eval "pid_$c=$!"
done
for _ in $(seq 900); do
  [ "$(wc -l <"$work/iters-a.log" 2>/dev/null || echo 0)" -ge 50 ] &&
    [ "$(wc -l <"$work/iters-b.log" 2>/dev/null || echo 0)" -ge 50 ] && break
  sleep 0.1
done
echo "jobs: A=$pid_a B=$pid_b"
# A's channels (classes ending in 6f: the GPFIFO channels) as CLIENT:HANDLE, from its log.
chans=$(awk -v pid="$(printf %x "$pid_a")" '$1 == "alloc" && $2 == pid && $6 ~ /6f$/ {print $3 ":" $5}' "$work/rm-a.log")
[ -n "$chans" ] || { echo "probe.sh: no channels of A in its ioctl log" >&2; exit 1; }
echo "A's channels: $(echo $chans)"
{
  echo "{\"all\": $("$rmquery" freeze $chans --hold-ms 1000)"
  for c in $chans; do
    echo ", \"without $c\": $("$rmquery" freeze $chans --leave-out "$c" --hold-ms 300)"
  done
  echo "}"
} >"$work/holds.json"
kill "$pid_a" "$pid_b" 2>/dev/null || true
wait 2>/dev/null || true
status=0
"$python" "$repo/hwtests/freeze/analyze.py" "$work" "$pid_a" "$pid_b" >"$out/summary.txt" 2>&1 || status=$?
cat "$out/summary.txt"
tar -czf "$out/freeze-probe.tar.gz" -C "$out" work summary.txt
exit "$status"

#!/usr/bin/env bash
# `valvectl top --once` on a GPU host, with an offline training job frozen by hand: starts the
# daemon with metrics, a small PyTorch training job, waits until the daemon has discovered it,
# freezes it with `valvectl preempt --pid --for`, and prints top's frame and its JSON while the job
# is frozen, then once more after it was resumed.
#
#   hwtests/top/frozen.sh OUTDIR
#
# VALVECTL (default: .carry/valvectl, else target/release/valvectl). Needs root, one NVIDIA GPU
# and PyTorch. Leaves nothing frozen: the preempt resumes after --for, and the daemon resumes
# whatever it froze when it stops.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
valvectl=${VALVECTL:-}
[ -n "$valvectl" ] || for c in .carry/valvectl target/release/valvectl; do [ -x "$c" ] && valvectl=$c && break; done
[ -x "${valvectl:-}" ] || { echo "top check: no valvectl binary: cargo build --release, or set VALVECTL" >&2; exit 2; }
[ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here; run this on a GPU host"; exit 0; }

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

"$valvectl" daemon --metrics-addr 127.0.0.1:9402 >"$out/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -S /run/valve/valve.sock ] && break; sleep 0.2; done
CUBLAS_WORKSPACE_CONFIG=:4096:8 VALVE_LABEL=batch python3 hwtests/serving/training.py --progress "$out/train.iters" --size small --device cuda \
  >"$out/train.log" 2>&1 &
train=$!
pids=("$train" "${pids[@]}") # the job stops before the daemon
for _ in $(seq 120); do
  "$valvectl" --json ps 2>/dev/null | grep -q "\"pid\": *$train\b" && break
  sleep 0.5
done
"$valvectl" --json ps >"$out/ps.json"
grep -q "\"pid\": *$train\b" "$out/ps.json" || { echo "top check: the daemon never discovered pid $train" >&2; exit 1; }
sleep 3 # a few seconds of metrics while it runs

"$valvectl" preempt --pid "$train" --for 6s >"$out/preempt.log" 2>&1 &
pids=("$!" "${pids[@]}")
sleep 2
echo "== valvectl top --once (pid $train frozen by valvectl preempt)"
"$valvectl" top --once | tee "$out/top-frozen.txt"
"$valvectl" top --once --json >"$out/top-frozen.json"
sleep 6
echo "== valvectl top --once (after the preempt resumed it)"
"$valvectl" top --once | tee "$out/top-resumed.txt"
"$valvectl" top --once --json >"$out/top-resumed.json"
python3 - "$out" "$train" <<'EOF'
import json, sys
out, pid = sys.argv[1], int(sys.argv[2])
def state(name):
    doc = json.load(open(f"{out}/{name}"))
    return [p.get("state") for g in doc.get("gpus", []) for p in g.get("processes", []) if p.get("pid") == pid]
frozen, resumed = state("top-frozen.json"), state("top-resumed.json")
print(f"pid {pid}: while preempted {frozen}, after {resumed}")
ok = frozen and all(s == "frozen" for s in frozen) and resumed and all(s == "running" for s in resumed)
print("top check:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF

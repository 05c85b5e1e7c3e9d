#!/usr/bin/env bash
# Valve under CUDA MPS on one GPU (root, a GPU host with CUDA, PyTorch and nvidia-cuda-mps-control).
# Starts the Valve daemon, then MPS (private pipe and log directories), then two small PyTorch
# training clients A and B that log one timestamp per iteration, and checks:
#   1. `valvectl ps` marks A and B as MPS clients and the MPS server as the server;
#   2. `valvectl preempt --pid A` and `gate start --offline A` refuse with exit code 10, and A
#      keeps running;
# and records, without judging (the research questions in docs/mps.md):
#   3. iterations of A and B during a 3 s raw disable of every channel discovery knows for A and
#      the server;
#   4. the same for the channels A allocated under channel groups it duplicated from another RM
#      client (RM_DUP_OBJECT, seen by the LD_PRELOAD ioctl logger); whether B stops too.
# MPS is stopped with `echo quit | nvidia-cuda-mps-control` on every way out (trap).
# Usage: sudo hwtests/mps/probe.sh [OUT_DIR]   (VALVECTL=path, PYTHON=python3, GPU=0)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
valvectl=${VALVECTL:-}
[ -n "$valvectl" ] || for c in "$repo/.carry/valvectl" "$repo/target/release/valvectl"; do
  [ -x "$c" ] && valvectl=$c && break
done
[ -x "${valvectl:-}" ] || { echo "no valvectl: build it (cargo build --release -p valvectl) or set VALVECTL" >&2; exit 2; }
python=${PYTHON:-python3}
# Optional: valve-rmquery (cargo build --release -p valve-hwtests --bin valve-rmquery) records what
# RM tells a third process about the channel groups and the resident channel.
rmquery=${RMQUERY:-}
[ -n "$rmquery" ] || for c in "$repo/.carry/valve-rmquery" "$repo/target/release/valve-rmquery"; do
  [ -x "$c" ] && rmquery=$c && break
done
gpu=${GPU:-0}
out=${1:-${OUT:-/tmp}/mps-probe}
[ "$(id -u)" = 0 ] || { echo "run as root (the daemon loads BPF)" >&2; exit 2; }
command -v nvidia-cuda-mps-control >/dev/null || { echo "nvidia-cuda-mps-control not found" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d /tmp/valve-mps.XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY="$work/pipe" CUDA_MPS_LOG_DIRECTORY="$work/log"
export CUDA_VISIBLE_DEVICES=$gpu
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" "$work/state"
sock="$work/valve.sock"
vc() { "$valvectl" --socket "$sock" "$@"; }
started=()

stop_mps() {
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
  for _ in $(seq 50); do [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || return 0; sleep 0.1; done
  echo "MPS control socket still there after quit" >&2
}
cleanup() {
  rc=$?
  touch "$work/stop"
  for p in "${started[@]}"; do kill "$p" 2>/dev/null || true; done
  stop_mps
  for p in "${started[@]}"; do wait "$p" 2>/dev/null || true; done
  cp -r "$work"/*.log "$work"/*.json "$CUDA_MPS_LOG_DIRECTORY" "$out"/ 2>/dev/null || true
  rm -rf "$work"
  echo "results in $out (exit $rc)"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

gcc -O2 -shared -fPIC -o "$work/liblog.so" "$repo/hwtests/ioctl-logger/valve_ioctl_log.c" -ldl -lpthread

# The daemon first, so that it watches the MPS server and the clients from their start.
# Started directly, not through `vc`: $! must be the daemon itself, not a subshell.
"$valvectl" --socket "$sock" daemon --state-dir "$work/state" --max-hold 10s >"$work/daemon.log" 2>&1 &
started+=($!)
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { echo "the daemon did not start (daemon.log)" >&2; exit 1; }
vc --json gpus >"$work/gpus.json"

# The control daemon and the server it starts carry the ioctl logger too.
LD_PRELOAD="$work/liblog.so" VALVE_IOCTL_LOG="$work/rm.log" nvidia-cuda-mps-control -d

cat >"$work/train.py" <<'EOF'
import os, sys, time, torch
log, stop = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(256, 2048, device="cuda")
with open(log, "w", buffering=1) as f:
    while not os.path.exists(stop):
        for _ in range(20):
            loss = model(x).square().mean()
            opt.zero_grad(); loss.backward(); opt.step()
        torch.cuda.synchronize()
        f.write(f"{time.time():.6f}\n")
EOF
for c in a b; do
  LD_PRELOAD="$work/liblog.so" VALVE_IOCTL_LOG="$work/rm.log" \
    "$python" "$work/train.py" "$work/iters_$c.log" "$work/stop" &
  started+=($!)
  eval "pid_$c=$!"
done
for _ in $(seq 600); do
  [ "$(cat "$work/iters_a.log" 2>/dev/null | wc -l)" -ge 20 ] && [ "$(cat "$work/iters_b.log" 2>/dev/null | wc -l)" -ge 20 ] && break
  sleep 0.1
done
echo "clients: A=$pid_a B=$pid_b"

verdicts=()
check() { # name, condition result (0 = pass)
  if [ "$2" = 0 ]; then verdicts+=("PASS $1"); else verdicts+=("FAIL $1"); fi
}

vc --json ps >"$work/ps.json"
"$python" - "$work/ps.json" "$pid_a" "$pid_b" <<'EOF' && r=0 || r=$?
import json, sys
ps = {p["pid"]: p for p in json.load(open(sys.argv[1]))["processes"]}
a, b = int(sys.argv[2]), int(sys.argv[3])
servers = [p for p in ps.values() if p.get("mps") == "server"]
print("ps mps roles:", {pid: p.get("mps") for pid, p in ps.items()})
sys.exit(0 if ps.get(a, {}).get("mps") == "client" and ps.get(b, {}).get("mps") == "client" and servers else 1)
EOF
check "ps marks both clients and the server" "$r"

if [ -n "$rmquery" ]; then
  # The groups of A and of the server, as RM lists them (channels, VEIDs, VA spaces), and the
  # pids RM says hold an MPS server object.
  groups=$("$python" - "$work/ps.json" "$pid_a" <<'EOF'
import json, sys
a = int(sys.argv[2])
for p in json.load(open(sys.argv[1]))["processes"]:
    if p["pid"] == a or p.get("mps") == "server":
        for g in p.get("gpus", []):
            for t in g["tsgs"]:
                print(f'{g["client"]}:{t["handle"]}')
EOF
)
  # shellcheck disable=SC2086
  "$rmquery" --gpu "$gpu" group $groups >"$work/rm_groups.json" 2>&1 || true
  "$rmquery" --gpu "$gpu" mps-pids >"$work/rm_mps_pids.json" 2>&1 || true
  "$rmquery" --gpu "$gpu" resident --samples 1000 --interval-us 1000 >"$work/resident_free.json" 2>&1 || true
fi

t0=$(date +%s.%N)
vc preempt --pid "$pid_a" --for 3s >"$work/preempt.log" 2>&1 && r=0 || r=$?
echo "preempt --pid A: exit $r ($(head -c 300 "$work/preempt.log"))"
check "preempt --pid refuses an MPS client with exit 10 (got $r)" "$([ "$r" = 10 ]; echo $?)"
vc gate start --online 1 --offline "$pid_a" >"$work/gate.log" 2>&1 && r=0 || r=$?
[ "$r" = 0 ] && vc gate stop >/dev/null 2>&1
check "gate start refuses an MPS offline client with exit 10 (got $r)" "$([ "$r" = 10 ]; echo $?)"
sleep 3

# For the record: raw disables (valvectl preempt --target), which the daemon does not check.
"$python" - "$work" "$pid_a" <<'EOF'
import json, sys
work, a = sys.argv[1], int(sys.argv[2])
gpus = {g["device_instance"]: g["index"] for g in json.load(open(f"{work}/gpus.json"))["gpus"]}
ps = json.load(open(f"{work}/ps.json"))["processes"]
def targets(pids):
    t = []
    for p in ps:
        if p["pid"] in pids:
            for g in p.get("gpus", []):
                chans = [c for tsg in g["tsgs"] for c in tsg["channels"]]
                if chans and g["gpu"] is not None:
                    t.append(f'{g["gpu"]}:{g["client"]}:{",".join(chans)}')
    return t
server = [p["pid"] for p in ps if p.get("mps") == "server"]
open(f"{work}/targets_discovered.txt", "w").write(" ".join(f"--target {t}" for t in targets({a, *server})))
# The ioctl log: objects A duplicated, and the channels it allocated under them.
dups, devices, objs, chans = {}, {}, {}, []
for line in open(f"{work}/rm.log"):
    f = line.split()
    if f[0] == "dup" and int(f[1], 16) == a:
        dups[(f[2], f[4])] = (f[5], f[6], f[3])
    elif f[0] == "alloc" and int(f[1], 16) == a:
        objs[(f[2], f[4])] = (f[3], f[5], f[6])
for (client, h), (parent, cls, extra) in objs.items():
    if int(cls, 16) & 0xff == 0x6f and int(cls, 16) >= 0xc36f and (client, parent) in dups:
        # The dup'd group's parent is a device of A's client; its instance names the GPU.
        dev = dups[(client, parent)][2]
        inst = objs.get((client, dev), (None, None, "-"))[2]
        gpu = gpus.get(int(inst, 16)) if inst != "-" else None
        chans.append((gpu, client, h))
print(f"A duplicated {len(dups)} object(s); {len(chans)} channel(s) of A lie under duplicated objects")
json.dump({"dups": [list(k) + list(v) for k, v in dups.items()], "channels_under_dups": chans},
          open(f"{work}/dup_analysis.json", "w"))
by = {}
for gpu, client, h in chans:
    if gpu is not None:
        by.setdefault((gpu, client), []).append(h)
open(f"{work}/targets_dup.txt", "w").write(" ".join(f"--target {g}:{c}:{','.join(hs)}" for (g, c), hs in by.items()))
EOF

hold() { # name, targets file: a raw 3 s disable, then iterations of A and B inside it
  local name=$1 file=$2 t1 t2 r
  if [ ! -s "$file" ]; then echo "$name: no targets"; return; fi
  t1=$(date +%s.%N)
  local q=""
  if [ -n "$rmquery" ]; then
    # Which channel is resident on the compute engine while the hold lasts.
    "$rmquery" --gpu "$gpu" resident --samples 2500 --interval-us 1000 >"$work/resident_$name.json" 2>&1 &
    q=$!
  fi
  # shellcheck disable=SC2046
  "$valvectl" preempt $(cat "$file") --for 3s >"$work/hold_$name.log" 2>&1 && r=0 || r=$?
  t2=$(date +%s.%N)
  [ -z "$q" ] || wait "$q" || true
  "$python" - "$work" "$name" "$t1" "$t2" "$r" <<'EOF'
import json, sys
work, name, t1, t2, rc = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
res = {"hold": name, "exit": rc, "held_s": round(t2 - t1, 3)}
for c in "ab":
    ts = [float(l) for l in open(f"{work}/iters_{c}.log") if l.strip()]
    inside = [t for t in ts if t1 + 0.05 < t < t2 - 0.05]
    around = [t for t in ts if t1 - 5 < t < t2 + 1]
    gaps = [y - x for x, y in zip(around, around[1:])]
    res[c] = {"iterations_inside": len(inside), "longest_gap_s": round(max(gaps, default=0), 3)}
print(json.dumps(res))
with open(f"{work}/holds.json", "a") as f:
    f.write(json.dumps(res) + "\n")
EOF
  sleep 2
}
hold discovered "$work/targets_discovered.txt"
hold dup_channels "$work/targets_dup.txt"

"$python" - "$work" "$t0" <<'EOF'
import sys
work, t0 = sys.argv[1], float(sys.argv[2])
ts = [float(l) for l in open(f"{work}/iters_a.log") if l.strip()]
print(f"A ran {len([t for t in ts if t0 < t < t0 + 3])} iteration(s) in the 3 s after the refused preempt")
EOF
printf '%s\n' "${verdicts[@]}" | tee "$work/verdicts.log"
! grep -q '^FAIL' "$work/verdicts.log"

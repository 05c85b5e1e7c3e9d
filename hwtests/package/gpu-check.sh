#!/usr/bin/env bash
# The Debian packages on a GPU host: install them, then run doctor, preempt, gate and top from
# /usr/bin against a real PyTorch training job and a small GPU-bound online server, then purge.
#
#   hwtests/package/gpu-check.sh DEB_DIR OUT_DIR
#
# DEB_DIR holds valvectl_*.deb and valve-scheduler_*.deb (scripts/package.sh writes them to
# target/debian/). Needs root, one NVIDIA GPU and PyTorch. Prints PASS/FAIL per check and exits
# non-zero if any failed. Leaves nothing installed, running or frozen: the packages are purged,
# the daemon and the jobs are stopped on every exit path, and the daemon resumes what it froze.
set -euo pipefail
cd "$(dirname "$0")/../.."
debs=${1:?usage: $0 DEB_DIR OUT_DIR}
out=${2:?usage: $0 DEB_DIR OUT_DIR}
mkdir -p "$out"
[ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here; run this on a GPU host"; exit 0; }
[ "$(id -u)" = 0 ] || { echo "run as root: it installs packages and the daemon loads BPF" >&2; exit 2; }

pids=()
fails=0
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  dpkg --purge valvectl valve-scheduler >"$out/purge.log" 2>&1 || true
}
trap cleanup EXIT
check() { # NAME CONDITION-COMMAND...
  local name=$1; shift
  if "$@"; then echo "PASS $name"; else echo "FAIL $name"; fails=$((fails + 1)); fi
}

echo "== install"
check "dpkg -i both packages" dpkg -i "$debs"/valvectl_*.deb "$debs"/valve-scheduler_*.deb
check "/usr/bin/valvectl --version" /usr/bin/valvectl --version
check "/usr/bin/valve-scheduler --version" /usr/bin/valve-scheduler --version
check "config /etc/valve/valve.toml" test -f /etc/valve/valve.toml
check "group valve" getent group valve

echo "== doctor"
set +e
/usr/bin/valvectl doctor >"$out/doctor.txt" 2>&1
doctor_rc=$?
set -e
cat "$out/doctor.txt"
echo "doctor exit $doctor_rc"

echo "== daemon, preempt, top (hwtests/top/frozen.sh with /usr/bin/valvectl)"
check "preempt + top --once show the job frozen, then running" \
  env VALVECTL=/usr/bin/valvectl bash hwtests/top/frozen.sh "$out/top"

echo "== gate from /usr/bin"
/usr/bin/valvectl daemon --config /etc/valve/valve.toml >"$out/gate-daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -S /run/valve/valve.sock ] && break; sleep 0.2; done
CUBLAS_WORKSPACE_CONFIG=:4096:8 VALVE_LABEL=batch python3 hwtests/serving/training.py \
  --progress "$out/gate-train.iters" --size small --device cuda >"$out/gate-train.log" 2>&1 &
pids=("$!" "${pids[@]}")
python3 hwtests/package/gpu_server.py --port 18411 >"$out/online.log" 2>&1 &
pids=("$!" "${pids[@]}")
for _ in $(seq 120); do
  [ "$(/usr/bin/valvectl --json ps 2>/dev/null | grep -c '"pid"')" -ge 2 ] && break
  sleep 0.5
done
/usr/bin/valvectl --json ps >"$out/gate-ps.json" || true
check "gate start" /usr/bin/valvectl gate start --online-port 18411 --offline-label batch
python3 hwtests/package/gpu_server.py --client --port 18411 --requests 40 --gap-ms 150 >"$out/client.json"
/usr/bin/valvectl --json gate status >"$out/gate-status.json" || true
/usr/bin/valvectl top --once >"$out/gate-top.txt" 2>&1 || true
check "gate stop" /usr/bin/valvectl gate stop
check "the gate preempted offline for online's requests, every request answered" python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
st = json.load(open(f"{out}/gate-status.json"))
client = json.load(open(f"{out}/client.json"))
print("gate status:", json.dumps(st)[:600])
print("client:", json.dumps(client))
def find(d, key):
    if isinstance(d, dict):
        for k, v in d.items():
            if k == key:
                return v
            r = find(v, key)
            if r is not None:
                return r
    elif isinstance(d, list):
        for v in d:
            r = find(v, key)
            if r is not None:
                return r
    return None
pre = find(st, "preemptions")
ok = isinstance(pre, (int, float)) and pre > 0 and client.get("ok") == client.get("requests")
print("gate check:", "PASS" if ok else "FAIL", f"(preemptions {pre}, requests ok {client.get('ok')}/{client.get('requests')})")
sys.exit(0 if ok else 1)
EOF

echo "== $fails check(s) failed"
exit $((fails > 0))

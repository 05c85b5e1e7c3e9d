#!/usr/bin/env bash
# Bursty traffic, one command on one GPU host: the gate with its hold (history seeded from the
# trace's preceding hour, replayed through the gate's policy on the CPU) beside online alone,
# time-slicing, XSched and MPS, on the same window of the Azure code trace, server and job.
#
# Usage: sudo hwtests/serving/bursty.sh OUT [--dry-run] [--window-s S] [--load L] [--trace T]
#            [--arrival-seed N] [--budget PCT] [--service-s S] [--deadline-s S] [--peers LIST]
#   OUT            results go to OUT/bursty-results.tar.gz (and stay unpacked under OUT)
#   --window-s     seconds of trace per configuration (default 90); --load the busy share (0.1)
#   --service-s    the service time the rate comes from (default 0.3: graph-raw 3b on an H200, about)
#   --deadline-s   no part starts that would end past this many seconds (default 530: one 9-min call)
#   --peers        the peer parts after the plain one, in order (default xsched,mps); xsched-diag
#                  builds XSched and runs xsched_diag.sh (where its shim fails) instead of a part
#   --plain        the plain part's configurations (default alone,gate-hold,timeslice; a later call
#                  that runs only a peer keeps alone here, for its ratios to alone from the same run)
#   --setup-s      seconds a part takes beyond its windows (default 60: training, server, warm-ups)
#   --window-part K/N  replay only the K-th (from 0) of N equal stretches of the window, the hold
#                  seeded with all before it (a 1200-s window over three calls: 0/3, 1/3, 2/3);
#                  K-L/N replays stretches K to L as one (the hold learns across them on the GPU)
#   --dry-run      CPU only: checks the binaries, seeds the hold, prints the plan and each command
# Needs .carry/bin/valvectl and .carry/bin/gate_hold (cargo build --release -p valvectl, and
# cargo build --release -p valve-daemon --example gate_hold), .carry/xsched/xsched-src.tar.gz
# (xsched_pack.sh) and, where cmake is missing, .carry/whl/cmake-*.whl.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-}"
[ -n "$out" ] && [ "${out#--}" = "$out" ] || { sed -n 6,20p "$0" >&2; exit 2; }
shift
dry=0 window=90 load=0.1 trace=azure-code seed=0 budget=8 service=0.3 deadline=530 peers=xsched,mps
plain=alone,gate-hold,timeslice setup_s=60 part=
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift; continue ;;
    --window-s) window="$2" ;; --load) load="$2" ;; --trace) trace="$2" ;;
    --arrival-seed) seed="$2" ;; --budget) budget="$2" ;; --service-s) service="$2" ;;
    --deadline-s) deadline="$2" ;; --peers) peers="$2" ;; --plain) plain="$2" ;; --setup-s) setup_s="$2" ;;
    --window-part) part="$2" ;;
    *) echo "bursty.sh: unknown option $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
  shift 2
done
for p in ${peers//,/ }; do
  case "$p" in xsched|xsched-diag|mps) ;; *) echo "bursty.sh: --peers takes xsched, xsched-diag and mps, not $p" >&2; exit 2 ;; esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
bin="${VALVE_BIN:-$root/.carry/bin}"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "== [$(elapsed) s] $*"; }

missing=()
for f in "$bin/valvectl" "$bin/gate_hold"; do [ -x "$f" ] || missing+=("$f"); done
# XSched only where a part runs it.
case ",$peers," in *,xsched*) [ -f "$root/.carry/xsched/xsched-src.tar.gz" ] || missing+=("$root/.carry/xsched/xsched-src.tar.gz") ;; esac
if [ ${#missing[@]} -gt 0 ]; then
  echo "bursty.sh: missing ${missing[*]}: build the binaries into .carry/bin and pack XSched (the usage says how)" >&2
  [ "$dry" = 1 ] || exit 1
fi

work="$(mktemp -d /tmp/valve-bursty.XXXXXX)"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Whatever ends this script (a trap, a kill of python, the call's time limit): no MPS daemon and
# no xserver is left behind.
cleanup() {
  if [ -d "$work/mps/pipe" ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$work/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$work/mps/log" \
      nvidia-cuda-mps-control >/dev/null 2>&1 || true
  fi
  if [ -f "$out/xsched/xserver.pid" ]; then
    kill "$(cat "$out/xsched/xserver.pid")" 2>/dev/null || true
  fi
  if [ -n "${build_pid:-}" ]; then
    [ -f "$work/xsched-build.pid" ] && kill -TERM -- "-$(cat "$work/xsched-build.pid")" 2>/dev/null || true
    kill "$build_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

say "seeding the hold: the $trace stretch before the window, through gate_hold (the gate's policy)"
part_args=()
[ -n "$part" ] && part_args=(--window-part "$part")
seed_cmd=(python3 "$here/hold_seed.py" "$trace" --load "$load" --run-s "$window" --service-s "$service"
          --port "$port" --arrival-seed "$seed" --budget "$budget" --gate-hold "$bin/gate_hold" --out "$out/seed"
          "${part_args[@]}")
if [ -x "$bin/gate_hold" ]; then "${seed_cmd[@]}" | tee "$out/seed.log"; else echo "SKIPPED (no gate_hold): ${seed_cmd[*]}"; fi

bench=(python3 "$here/bench.py" --valvectl "$bin/valvectl" --server graph-raw --arrivals "$trace"
       --arrival-seed "$seed" --loads "$load" --rounds 1 --run-s "$window" --requests 100000 --min-requests 1
       --budget-s 100000 --port "$port" --nominal-service-s "$service" --gate-hold-budget "$budget"
       "${part_args[@]}")
# A stretch of the window runs for its share of it.
run_window=${window%.*}
if [ -n "$part" ]; then # K/N, or K-L/N: stretches K to L together
  first="${part%/*}"; count=1
  case "$first" in *-*) count=$(( ${first#*-} - ${first%-*} + 1 )) ;; esac
  run_window=$(( run_window * count / ${part#*/} ))
fi
# Where the plan stands (s): the time used, or in a dry run the time the parts planned so far need.
planned=0
plan() { # PART CONFIG_COUNT -> whether it fits before the deadline (said where not)
  local need=$(( setup_s + $2 * (run_window + 5) )) now
  now=$(elapsed)
  [ "$dry" = 1 ] && now=$planned
  if [ $(( now + need )) -gt "$deadline" ]; then
    say "SKIPPED $1: needs about $need s, $(( deadline - now )) s left of --deadline-s $deadline"
    return 1
  fi
  planned=$(( now + need ))
}
run_part() { # NAME CONFIGS [extra bench.py args...]
  local name="$1" configs="$2"; shift 2
  local n; n=$(tr ',' '\n' <<<"$configs" | wc -l)
  plan "$name ($configs)" "$n" || return 0
  if [ -n "${smoke_peer:-}" ] && [ "$dry" = 0 ]; then
    # A CUDA op as online and as training under the peer first: a peer that cannot run costs
    # seconds here, not its part's setup, and the time goes to the next part.
    mkdir -p "$out/$name"
    say "smoke of $smoke_peer"
    python3 "$here/peers.py" --smoke "$smoke_peer" "$@" --out "$out/$name" > "$out/$name/smoke.log" 2>&1 || true
    if ! grep -q "^SMOKE OK" "$out/$name/smoke.log"; then
      say "SKIPPED $name: its smoke failed:"; tail -5 "$out/$name/smoke.log"
      planned=$(elapsed)
      return 0
    fi
  fi
  local left=$(( deadline - $(elapsed) - 15 ))
  local cmd=("${bench[@]}" --configs "$configs" --out "$out/$name" --deadline-s "$left" "$@")
  if [ "$dry" = 1 ]; then
    echo "DRY: ${cmd[*]}"
    "${cmd[@]}" --check-args || { echo "bursty.sh: bench.py refused part $name's options" >&2; exit 1; }
    return 0
  fi
  say "part $name: $configs"
  mkdir -p "$out/$name"
  # bench.py's own SIGTERM handling reports the runs done; the call's limit stops it at the deadline.
  timeout --signal=TERM --kill-after=20 "$(( left + 10 ))" "${cmd[@]}" > "$out/$name/bench.log" 2>&1 \
    || say "part $name ended with exit $? (see $out/$name/bench.log)"
  tail -4 "$out/$name/bench.log"
}

if [ "$dry" = 0 ]; then
  [ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here (/dev/nvidiactl missing); --dry-run runs on a CPU"; exit 0; }
  nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader | tee "$out/device.txt"
fi
case ",$peers," in *,xsched,*|*,xsched-diag,*) want_xsched=1 ;; *) want_xsched=0 ;; esac
if [ "$dry" = 0 ] && [ "$want_xsched" = 1 ]; then
  say "building XSched in the background (its output: $out/xsched/xsched_build.out)"
  mkdir -p "$out/xsched"
  cpus="$(nproc)"; jobs=$(( cpus > 8 ? cpus / 2 : 2 ))
  # On the upper half of the cores, so that the server's and the gate's threads keep the lower.
  ( if [ "$cpus" -ge 8 ]; then pin=(taskset -c "$(( cpus / 2 ))-$(( cpus - 1 ))"); else pin=(); fi
    b0=$(date +%s)
    rc=0
    # In a session of its own, so that the cleanup can end the build's whole process group.
    "${pin[@]}" setsid nice -n 10 bash "$here/xsched_build.sh" "$root/.carry/xsched/xsched-src.tar.gz" \
      "$work/xsched-install" "$jobs" > "$out/xsched/xsched_build.out" 2>&1 &
    echo $! > "$work/xsched-build.pid"
    wait $! || rc=$?
    echo $(( $(date +%s) - b0 )) > "$out/xsched/build-seconds.txt"
    exit $rc ) &
  build_pid=$!
fi
if [ "$dry" = 0 ]; then
  say "building stamp.ptx (as hwtests/cuda/build.sh does, that file alone)"
  nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  mkdir -p "$work/cuda"
  "$nvcc_bin" -O2 -arch="${CUDA_ARCH:-sm_90}" -ptx -o "$work/cuda/stamp.ptx" "$root/hwtests/cuda/stamp.cu" \
    > "$out/cuda-build.log" 2>&1 || { cat "$out/cuda-build.log"; echo "bursty.sh: stamp.ptx did not build" >&2; exit 1; }
  bench+=(--stamp-first-kernel "$work/cuda/stamp.ptx")
else
  # A stand-in, so that bench.py --check-args can check the rest (it checks only that the file is there).
  mkdir -p "$work/cuda" && : > "$work/cuda/stamp.ptx"
  bench+=(--stamp-first-kernel "$work/cuda/stamp.ptx")
fi
hold=()
[ -f "$out/seed/gate-hold-history.json" ] && hold=(--hold-history "$out/seed/gate-hold-history.json")

run_part plain "$plain" "${hold[@]}"
for p in ${peers//,/ }; do
  if [ "${p%-diag}" = xsched ] && [ "$dry" = 0 ]; then
    say "waiting for the XSched build"
    if ! wait "$build_pid" || [ ! -x "$work/xsched-install/bin/xserver" ]; then
      say "SKIPPED xsched: its build failed (tail of $out/xsched/xsched_build.out:)"
      tail -20 "$out/xsched/xsched_build.out"
      cp "$work/xsched-install/"*.log "$out/xsched/" 2>/dev/null || true
      build_pid=""; continue
    fi
    build_pid=""
    say "XSched built in $(cat "$out/xsched/build-seconds.txt") s"
    cp "$work/xsched-install/"*.log "$work/xsched-install/SOURCES.txt" "$out/xsched/" 2>/dev/null || true
  fi
  if [ "$p" = xsched-diag ]; then
    say "where XSched's shim fails (xsched_diag.sh)"
    if [ "$dry" = 1 ]; then echo "DRY: bash $here/xsched_diag.sh $work/xsched-install $out/xsched/diag"
    else timeout 300 bash "$here/xsched_diag.sh" "$work/xsched-install" "$out/xsched/diag" || true; fi
    continue
  fi
  case "$p" in xsched) dir=(--xsched-dir "$work/xsched-install") ;; mps) dir=(--mps-dir "$work/mps") ;; esac
  smoke_peer="$p" run_part "$p" "$p" "${dir[@]}"
done

reports=()
for part in plain ${peers//,/ }; do [ -f "$out/$part/report.json" ] && reports+=("$out/$part/report.json"); done
if [ ${#reports[@]} -gt 0 ]; then
  python3 "$here/bursty_report.py" "${reports[@]}" --out "$out/bursty.md"
else
  say "no part wrote a report"
fi
say "done: windows of $window s of $trace; the hold's 20 minutes of trace, and alone and the gate without the hold on 5-minute windows, are not reached by a call this short"
# Written beside, then moved in: a tarball growing inside the directory it reads changes it.
tar -C "$out" --exclude=bursty-results.tar.gz -czf "$work/bursty-results.tar.gz" .
mv "$work/bursty-results.tar.gz" "$out/bursty-results.tar.gz"
echo "results: $out/bursty-results.tar.gz"

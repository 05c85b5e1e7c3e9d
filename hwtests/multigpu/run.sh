#!/usr/bin/env bash
# Tensor-parallel online serving across the GPUs of one host beside one offline training job per
# GPU: online alone, time-sliced (training, no Valve) and under the gate, in one command.
#
# Usage: sudo hwtests/multigpu/run.sh OUT [--dry-run] [--gpus N] [--load L] [--seconds S]
#            [--configs alone,timeslice,gate] [--size 8b] [--arrivals poisson|azure-code|azure-conv]
#   OUT           results: OUT/multigpu-results.tar.gz (also unpacked under OUT), OUT/report.md
#   --gpus N      ranks of the server, one per GPU, and one training job per GPU (default: every GPU)
#   --load L      the server's busy share the arrival rate is set for (default 0.3), from the service
#                 time measured on the idle server in the first configuration
#   --seconds S   arrivals per configuration (default 60); --alone-s the training's lead window alone (10)
#   --configs     any of alone, timeslice, gate, gate-serial, gate-parallel (the gate with --issue forced)
#   --size        tp_server.py's model: tiny, 3b, 8b (default), 70b; --train-size training.py's (1b)
#   --max-tokens  tokens per request (64); --prompt-tokens the prefill's length (512)
#   --deadline-s  no configuration starts that would end past this (default 540: one 10-minute call)
#   --ready-s     how long the server may take to start (180), once with CUDA graphs, once without
#   --dry-run     a CPU: gloo, the tiny model, 2 ranks, no Valve, configs alone and timeslice (a CPU
#                 stand-in for training); needs torch, or --fake-engine (no torch: checks the harness)
# GPU runs need root, NVIDIA's open module, PyTorch and transformers, and valvectl in .carry/bin (or
# VALVECTL) for the gate configurations. Every process it starts is stopped on every way out, the
# daemon's channels are resumed (valvectl resume --all), and the tarball is written even after a failure.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
usage() { sed -n 5,21p "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; ""|--*) usage >&2; exit 2 ;; esac
cmdline="hwtests/multigpu/run.sh $*"
out="$1"; shift
dry=0 fake=0 gpus="" load=0.3 seconds="" alone_s="" configs="" size="" train_size=1b arrivals=poisson
max_tokens="" prompt_tokens="" deadline=540 seed=1 ready_s=180 graphs_off=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift; continue ;;
    --fake-engine) fake=1; shift; continue ;;
    -h|--help) usage; exit 0 ;;
    --gpus) gpus="${2-}" ;; --load) load="${2-}" ;; --seconds) seconds="${2-}" ;; --alone-s) alone_s="${2-}" ;;
    --configs) configs="${2-}" ;; --size) size="${2-}" ;; --train-size) train_size="${2-}" ;;
    --arrivals) arrivals="${2-}" ;; --max-tokens) max_tokens="${2-}" ;; --prompt-tokens) prompt_tokens="${2-}" ;;
    --deadline-s) deadline="${2-}" ;; --seed) seed="${2-}" ;; --ready-s) ready_s="${2-}" ;;
    *) echo "run.sh: unknown option $1 (run.sh --help lists them)" >&2; exit 2 ;;
  esac
  [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
  shift 2
done
if [ "$dry" = 1 ]; then
  gpus=${gpus:-2} size=${size:-tiny} seconds=${seconds:-15} alone_s=${alone_s:-3} configs=${configs:-alone,timeslice}
  max_tokens=${max_tokens:-16} prompt_tokens=${prompt_tokens:-16} device=cpu
else
  size=${size:-8b} seconds=${seconds:-60} alone_s=${alone_s:-10} configs=${configs:-alone,timeslice,gate}
  max_tokens=${max_tokens:-64} prompt_tokens=${prompt_tokens:-512} device=cuda
fi
python3 -c 'import sys; sys.exit(0 if 0 < float(sys.argv[1]) < 1 else 1)' "$load" 2>/dev/null \
  || { echo "run.sh: --load $load: give a busy share between 0 and 1, e.g. 0.3" >&2; exit 2; }
[[ "${gpus:-1}" =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: --gpus $gpus: give a whole number of GPUs, e.g. 2" >&2; exit 2; }
[[ "${seconds:-1}" =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: --seconds $seconds: give whole seconds, e.g. 60" >&2; exit 2; }
[[ "${alone_s:-1}" =~ ^[0-9]+$ ]] || { echo "run.sh: --alone-s $alone_s: give whole seconds, e.g. 10" >&2; exit 2; }
[ "$fake" = 1 ] && [ "$dry" = 0 ] && { echo "run.sh: --fake-engine is for --dry-run only" >&2; exit 2; }
for c in ${configs//,/ }; do
  case "$c" in alone|timeslice|gate|gate-serial|gate-parallel) ;;
    *) echo "run.sh: --configs takes alone, timeslice, gate, gate-serial, gate-parallel; not $c" >&2; exit 2 ;; esac
  if [ "$dry" = 1 ] && [ "$c" != alone ] && [ "$c" != timeslice ]; then
    echo "run.sh: a dry run has no Valve: --configs alone,timeslice only (not $c)" >&2; exit 2
  fi
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d /tmp/valve-multigpu.XXXXXX)"
. "$here/lib.sh"

install_cleanup serve multigpu-results

engine=torch
if [ "$dry" = 1 ]; then
  if [ "$fake" = 1 ]; then engine=fake
  elif ! python3 -c 'import torch' 2>/dev/null; then
    die "the dry run needs torch (python3 -c 'import torch' fails): install it, or pass --fake-engine to check the harness without it"
  fi
  device_name="CPU (dry run, engine $engine)"
else
  [ -e /dev/nvidiactl ] || { echo "SKIP: no NVIDIA driver here (/dev/nvidiactl missing); --dry-run runs on a CPU"; exit 0; }
  [ "$(id -u)" = 0 ] || die "the GPU run needs root (the daemon's probes): run it with sudo"
  have=$(nvidia-smi -L | grep -c '^GPU ')
  gpus=${gpus:-$have}
  [ "$gpus" -le "$have" ] || die "--gpus $gpus: this host has $have GPUs"
  device_name="$gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$out/device.txt"
  nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true
  if [[ ",$configs," == *,gate* ]]; then
    valvectl=$(find_valvectl) || die "no valvectl: build it (cargo build --release -p valvectl) into .carry/bin, or set VALVECTL"
  fi
fi
port=$(free_port)
url="raw://127.0.0.1:$port"
rate=""
say "$gpus ranks ($engine, $size on $device), configs $configs, $seconds s each at load $load; results in $out"

# start_training DIR: one offline job per GPU (VALVE_LABEL=batch), each on its GPU alone.
start_training() {
  local d="$1" g
  for g in $(seq 0 $(( gpus - 1 ))); do
    if [ "$dry" = 1 ]; then
      start_bg "train-g$g" "$d/train-g$g.log" env VALVE_LABEL=batch python3 "$here/cpu_train.py" \
        --progress "$d/progress-g$g.txt"
    else
      start_bg "train-g$g" "$d/train-g$g.log" env VALVE_LABEL=batch CUDA_VISIBLE_DEVICES="$g" \
        CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 "$root/hwtests/serving/training.py" \
        --progress "$d/progress-g$g.txt" --size "$train_size" --device cuda --batch 8 --seq 512
    fi
  done
}

wait_training() {
  local g
  for g in $(seq 0 $(( gpus - 1 ))); do wait_ready "train-g$g" "$1/train-g$g.log" 300 || return 1; done
}

server_cmd() { # [extra tp_server flags] -> the array srv
  srv=(python3 "$here/tp_server.py" --gpus "$gpus" --size "$size" --device "$device" --engine "$engine" \
    --port "$port" --prompt-tokens "$prompt_tokens" --max-len $(( prompt_tokens + max_tokens + 8 )) \
    --label online --pid-file "$work/server.pids" "$@")
}

# start_server DIR: the TP server; on CUDA, a server whose graph capture fails (or hangs past
# --ready-s) is started again with --no-graphs, and so are the later configurations' servers.
start_server() {
  local d="$1" mode=graphs
  [ "$device" = cuda ] || mode=eager
  [ "$engine" = fake ] && mode=fake
  if [ "$graphs_off" = 1 ]; then server_cmd --no-graphs; mode=eager; else server_cmd; fi
  start_bg server "$d/server.log" "${srv[@]}"
  if wait_ready server "$d/server.log" "$ready_s"; then echo "$mode" > "$d/server-mode.txt"; return 0; fi
  [ "$device" = cuda ] && [ "$mode" = graphs ] || return 1
  stop_bg server
  say "the server failed with CUDA graphs: starting it again with --no-graphs"
  mv "$d/server.log" "$d/server-graphs-failed.log"
  graphs_off=1
  server_cmd --no-graphs
  start_bg server "$d/server.log" "${srv[@]}"
  wait_ready server "$d/server.log" "$ready_s" && echo eager > "$d/server-mode.txt"
}

# set_rate DIR: the arrival rate for --load from the idle server's service time (once per run).
set_rate() {
  python3 "$here/drive.py" warm --url "$url" --max-tokens "$max_tokens" --prompt-tokens "$prompt_tokens" \
    --out "$1/warm.json"
  [ -n "$rate" ] && return 0
  service_s=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["service_s"])' "$1/warm.json")
  rate=$(python3 -c 'import math, sys; print(-math.log(1 - float(sys.argv[1])) / float(sys.argv[2]))' "$load" "$service_s")
  say "service time $service_s s: $rate requests/s for load $load"
}

# gate_up CONFIG DIR: the gate on the TP ranks (online by label) and the training jobs.
gate_up() {
  local issue=()
  case "$1" in gate-serial) issue=(--issue serial) ;; gate-parallel) issue=(--issue parallel) ;; esac
  "$valvectl" gate start --online-label online --offline-label batch "${issue[@]}" > "$2/gate-start.txt"
  gate_wait "$gpus"
  "$valvectl" --json gate status > "$2/gate-status-start.json"
}

gate_collect() {
  "$valvectl" --json gate status > "$1/gate-status.json" || true
  gate_trace "$1/gate-trace.jsonl"
  "$valvectl" --json profile > "$1/harvest.json" 2>/dev/null || rm -f "$1/harvest.json"
  "$valvectl" --json gate stop > "$1/gate-stop.json" || true
}

# fits CONFIG: whether CONFIG can end before --deadline-s (a setup of 90 s on a GPU, 15 s on a CPU).
fits() {
  local setup=90 need
  [ "$dry" = 1 ] && setup=15
  need=$(( setup + alone_s + ${seconds%.*} + 20 ))
  [ $(( $(date +%s) - t0 + need )) -le "$deadline" ] && return 0
  say "SKIPPED $1: needs about $need s, $(( deadline - $(date +%s) + t0 )) s left of --deadline-s $deadline"
  echo "$1 skipped: needs about $need s" >> "$out/skipped.txt"
  return 1
}

run_config() {
  local cfg="$1" d="$out/$1" a0
  mkdir -p "$d"
  say "config $cfg"
  [[ "$cfg" == gate* ]] && start_daemon "$d/daemon.log" --node-name multigpu --harvest-windows "${seconds%.*}s,900s"
  [ "$cfg" != alone ] && start_training "$d"
  start_server "$d" || die "the TP server did not start: see $d/server.log"
  [ "$cfg" != alone ] && { wait_training "$d" || die "a training job did not start: see $d/train-g*.log"; }
  cp "$work/server.pids" "$d/server.pids"
  set_rate "$d"
  if [ "$cfg" != alone ]; then  # training alone beside the idle server: the harvest's reference
    a0=$(mono_ns); sleep "$alone_s"; write_window "$d/alone-window.json" "$a0" "$(mono_ns)"
  fi
  [[ "$cfg" == gate* ]] && gate_up "$cfg" "$d"
  python3 "$here/drive.py" load --url "$url" --rate "$rate" --seconds "$seconds" --arrivals "$arrivals" \
    --seed "$seed" --max-tokens "$max_tokens" --prompt-tokens "$prompt_tokens" --out "$d" | tee "$d/drive.log"
  [[ "$cfg" == gate* ]] && gate_collect "$d"
  release
  stop_all_but_daemon
  stop_daemon
  say "config $cfg done"
}

write_meta() {
  python3 - "$out/meta.json" <<PY
import json, sys, time
json.dump(dict(kind="serve", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device="$device_name",
               gpus=$gpus, engine="$engine", size="$size", train_size="$train_size", arrivals="$arrivals",
               load=$load, rate=float("${rate:-0}") or None, service_s=float("${service_s:-0}") or None,
               seconds=$seconds, alone_s=$alone_s, max_tokens=$max_tokens, prompt_tokens=$prompt_tokens,
               configs="$configs".split(","), dry_run=bool($dry), command="$cmdline"), open(sys.argv[1], "w"), indent=1)
PY
}

write_meta
for cfg in ${configs//,/ }; do
  fits "$cfg" || continue
  run_config "$cfg"
  write_meta
done
python3 "$here/report.py" serve "$out" | tee "$out/report.txt"
say "done"

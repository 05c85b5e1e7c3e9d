#!/usr/bin/env bash
# The cluster model's alignment term on real GPUs (issue 50, item 2), in one command: two
# single-GPU online services on two GPUs, driven once in step (the same arrival times) and once out
# of step (independent arrivals), under one gate, beside a 2-GPU offline job (DDP training, one rank
# per GPU). After each phase: the daemon's harvest document (its pair's alignment score), the job's
# rate over the same window against its rate alone, and `valve-scheduler predict` on that document.
#
# Usage: sudo hwtests/multigpu/align.sh OUT [--dry-run] [--pair 0,1] [--load L] [--window-s W]
#   OUT           results: OUT/align-results.tar.gz (also unpacked under OUT), OUT/report.md
#   --pair A,B    the two GPUs (default 0,1)
#   --load L      each service's busy share (default 0.3); --size the services' model (3b)
#   --window-s W  the document's window each comparison covers (default 30); a phase lasts W + 15 s
#                 (W + 5 s in a dry run, which reads no document)
#   --phases      in order, any of instep, outstep (default instep,outstep)
#   --alone-s S   the job alone before the first phase and after the last (default 20)
#   --dry-run     a CPU: gloo, the tiny model, no Valve (no document, no prediction); needs torch,
#                 or --fake-engine (no torch: checks the harness)
# GPU runs need root, PyTorch, valvectl and valve-scheduler in .carry/bin (or VALVECTL,
# VALVE_SCHEDULER). Without valve-scheduler the run goes on and the prediction is left out.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
usage() { sed -n 8,19p "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; ""|--*) usage >&2; exit 2 ;; esac
cmdline="hwtests/multigpu/align.sh $*"
out="$1"; shift
dry=0 fake=0 pair=0,1 load=0.3 window="" phases=instep,outstep alone_s="" size="" max_tokens="" prompt_tokens=""
seed=3
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift; continue ;;
    --fake-engine) fake=1; shift; continue ;;
    -h|--help) usage; exit 0 ;;
    --pair) pair="${2-}" ;; --load) load="${2-}" ;; --window-s) window="${2-}" ;; --phases) phases="${2-}" ;;
    --alone-s) alone_s="${2-}" ;; --size) size="${2-}" ;; --max-tokens) max_tokens="${2-}" ;;
    --prompt-tokens) prompt_tokens="${2-}" ;; --seed) seed="${2-}" ;;
    *) echo "align.sh: unknown option $1 (align.sh --help lists them)" >&2; exit 2 ;;
  esac
  [ $# -ge 2 ] || { echo "align.sh: $1 needs a value" >&2; exit 2; }
  shift 2
done
[[ "$pair" =~ ^[0-9]+,[0-9]+$ ]] && [ "${pair%,*}" != "${pair#*,}" ] || { echo "align.sh: --pair takes two different GPUs, e.g. 0,1" >&2; exit 2; }
for p in ${phases//,/ }; do
  case "$p" in instep|outstep) ;; *) echo "align.sh: --phases takes instep and outstep, not $p" >&2; exit 2 ;; esac
done
python3 -c 'import sys; sys.exit(0 if 0 < float(sys.argv[1]) < 1 else 1)' "$load" 2>/dev/null \
  || { echo "align.sh: --load $load: give a busy share between 0 and 1, e.g. 0.3" >&2; exit 2; }
[[ "${window:-1}" =~ ^[1-9][0-9]*$ ]] || { echo "align.sh: --window-s $window: give whole seconds, e.g. 30" >&2; exit 2; }
[[ "${alone_s:-1}" =~ ^[0-9]+$ ]] || { echo "align.sh: --alone-s $alone_s: give whole seconds, e.g. 10" >&2; exit 2; }
[ "$fake" = 1 ] && [ "$dry" = 0 ] && { echo "align.sh: --fake-engine is for --dry-run only" >&2; exit 2; }
if [ "$dry" = 1 ]; then
  window=${window:-10} alone_s=${alone_s:-5} size=${size:-tiny} max_tokens=${max_tokens:-16}
  prompt_tokens=${prompt_tokens:-16} device=cpu job_args=(--hidden 64 --layers 2 --batch 16) phase_extra=5
else
  window=${window:-30} alone_s=${alone_s:-20} size=${size:-3b} max_tokens=${max_tokens:-64}
  prompt_tokens=${prompt_tokens:-512} device=cuda job_args=() phase_extra=15
fi
g0=${pair%,*} g1=${pair#*,}
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d /tmp/valve-align.XXXXXX)"
. "$here/lib.sh"

install_cleanup align align-results

engine=torch scheduler=""
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
  [ "$g0" -lt "$have" ] && [ "$g1" -lt "$have" ] || die "--pair $pair: this host has $have GPUs (0 .. $(( have - 1 )))"
  device_name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), GPUs $pair"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$out/device.txt"
  valvectl=$(find_valvectl) || die "no valvectl: build it (cargo build --release -p valvectl) into .carry/bin, or set VALVECTL"
  scheduler=$(find_scheduler) || say "no valve-scheduler (.carry/bin or VALVE_SCHEDULER): the run goes on, the prediction is left out"
fi
ports=("$(free_port)" "$(free_port)")
urls=(--url "raw://127.0.0.1:${ports[0]}" --url "raw://127.0.0.1:${ports[1]}")
alone_per_s="" rate="" service_s=""
while [ "${ports[0]}" = "${ports[1]}" ]; do ports[1]=$(free_port); urls[3]="raw://127.0.0.1:${ports[1]}"; done

# start_services: one single-GPU online server per GPU of the pair (VALVE_LABEL=online).
start_services() {
  local k gpu
  for k in 0 1; do
    gpu=$([ "$k" = 0 ] && echo "$g0" || echo "$g1")
    # Its GPU alone visible: a context on another GPU would count its busy time there too.
    start_bg "online-$k" "$out/online-$k.log" env CUDA_VISIBLE_DEVICES="$gpu" python3 "$here/tp_server.py" \
      --gpus 1 --devices 0 --size "$size" \
      --device "$device" --engine "$engine" --port "${ports[$k]}" --prompt-tokens "$prompt_tokens" \
      --max-len $(( prompt_tokens + max_tokens + 8 )) --label online
  done
}

# start_job: the 2-GPU DDP job (VALVE_LABEL=batch), reporting to the daemon's progress folder.
start_job() {
  mkdir -p "$work/progress" && chmod 1777 "$work/progress"
  start_bg job "$out/job.log" env VALVE_PROGRESS_DIR="$work/progress" SLURM_JOB_ID=align \
    python3 "$here/ddp_job.py" --gpus 2 --devices "$pair" --device "$device" --engine "$engine" \
    --label batch --progress "$out/progress.txt" "${job_args[@]}"
}

alone_window() { # FILE: the job alone for --alone-s, both services idle and no gate
  local a0
  a0=$(mono_ns); sleep "$alone_s"; write_window "$1" "$a0" "$(mono_ns)"
}

set_rate() {
  python3 "$here/drive.py" warm --url "${urls[1]}" --max-tokens "$max_tokens" --prompt-tokens "$prompt_tokens" \
    --out "$out/warm-0.json"
  python3 "$here/drive.py" warm --url "${urls[3]}" --max-tokens "$max_tokens" --prompt-tokens "$prompt_tokens" \
    --out "$out/warm-1.json"
  service_s=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["service_s"])' "$out/warm-0.json")
  rate=$(python3 -c 'import math, sys; print(-math.log(1 - float(sys.argv[1])) / float(sys.argv[2]))' "$load" "$service_s")
  say "service time $service_s s: $rate requests/s to each service for load $load"
}

# doc_after UNIX_S FILE: the daemon's harvest document once it was made at or after UNIX_S.
doc_after() {
  local i
  for i in $(seq 1 60); do
    "$valvectl" --json profile > "$2.tmp" 2>/dev/null && python3 -c '
import json, sys
sys.exit(0 if json.load(open(sys.argv[1]))["generated_unix_ms"] >= float(sys.argv[2]) * 1000 else 1)' "$2.tmp" "$1" \
      && { mv "$2.tmp" "$2"; return 0; }
    sleep 0.5
  done
  rm -f "$2.tmp"; say "no harvest document made after $1 within 30 s"; return 1
}

predict() { # DIR: valve-scheduler's prediction for the job on DIR's document
  [ -n "$scheduler" ] || return 0
  "$scheduler" --json predict --profile "$out/profile.json" --harvest "$1/harvest.json" --gpus "$pair" \
    --model-window "${window}s" > "$1/prediction.json" 2> "$1/prediction.err" \
    || { say "valve-scheduler predict failed: $(tail -2 "$1/prediction.err")"; rm -f "$1/prediction.json"; }
}

# run_phase NAME: W + 15 s of arrivals to both services; the document read once its window lies
# inside them (made at least W + 3 s after they began), then the prediction on it.
run_phase() {
  local p="$1" d="$out/$1" mode s0
  mode=$([ "$p" = instep ] && echo same || echo independent)
  mkdir -p "$d"
  say "phase $p: $mode arrivals, $rate requests/s to each service"
  s0=$(date +%s)
  start_bg "drive-$p" "$d/drive.log" python3 "$here/drive.py" load "${urls[@]}" --mode "$mode" --rate "$rate" \
    --seconds $(( window + phase_extra )) --seed "$seed" --max-tokens "$max_tokens" --prompt-tokens "$prompt_tokens" --out "$d"
  if [ "$dry" = 0 ]; then
    sleep $(( window + 5 ))
    doc_after $(( s0 + window + 3 )) "$d/harvest.json" && predict "$d"
  fi
  wait_bg "drive-$p" $(( window + 120 ))
  cat "$d/drive.log"
}

write_meta() {
  python3 - "$out/meta.json" <<PY
import json, sys, time
json.dump(dict(kind="align", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device="$device_name",
               gpu_pair=[$g0, $g1], engine="$engine", size="$size", load=$load, rate=float("${rate:-0}") or None,
               service_s=float("${service_s:-0}") or None, window_s=$window, alone_s=$alone_s, job_id="align",
               arrivals="poisson", seconds=$window + $phase_extra, phases="$phases".split(","), dry_run=bool($dry),
               max_tokens=$max_tokens, prompt_tokens=$prompt_tokens, command="$cmdline"), open(sys.argv[1], "w"), indent=1)
PY
}

write_meta
say "pair $pair ($engine, $size on $device), phases $phases, window $window s at load $load; results in $out"
[ "$dry" = 0 ] && start_daemon "$out/daemon.log" --node-name align --harvest-windows "${window}s,900s" \
  --progress-dir "$work/progress"
start_services
start_job
wait_ready online-0 "$out/online-0.log" 400 && wait_ready online-1 "$out/online-1.log" 400 \
  && wait_ready job "$out/job.log" 300 || die "a process did not start (logs in $out)"
set_rate
write_meta
say "the job alone for $alone_s s"
alone_window "$out/alone-window.json"
python3 "$here/report.py" profile "$out"
if [ "$dry" = 0 ]; then
  "$valvectl" gate start --online-label online --offline-label batch > "$out/gate-start.txt"
  gate_wait 2
fi
for p in ${phases//,/ }; do run_phase "$p"; done
if [ "$dry" = 0 ]; then
  "$valvectl" --json gate status > "$out/gate-status.json" || true
  gate_trace "$out/gate-trace.jsonl"
  "$valvectl" --json gate stop > "$out/gate-stop.json" || true
fi
say "the job alone again for $alone_s s"
alone_window "$out/alone-window-end.json"
python3 "$here/report.py" align "$out" | tee "$out/report.txt"
say "done"

#!/usr/bin/env bash
# The real serving benchmark on a GPU host, one command: an online LLM service behind
# HTTP (`transformers serve`, continuous batching, random-weight Llama built here) next to offline
# PyTorch training, alone / time-sliced / under `valvectl gate` on launch edges / on arrivals,
# at two loads. Prints the device and the numbers with pass/fail per target; writes report.md and
# report.json to $OUT (or a temp dir).
#
# Usage: sudo scripts/serving-bench.sh [bench.py options...]   (hwtests/serving/bench.py --help)
#   --server serve|cb|graph|graph-raw
#                             serve: `transformers serve` (default; needs the wheels in .whl/ when
#                             fastapi/uvicorn/pydantic/openai are missing), cb: the same batching
#                             manager behind aiohttp, graph: the GPU-bound CUDA-graph decode loop,
#                             graph-raw: that loop behind plain TCP (hwtests/serving/rawserver.py)
#   --stamp-first-kernel PTX  graph, graph-raw: time each request's first kernel on the GPU
#   --arrivals azure-code|azure-conv
#                             replay Azure's 2023 arrival times (sched/data) instead of Poisson
#   --arrival-seed N          which windows of the trace (hwtests/serving/trace_windows.py counts
#                             each window's idle arrivals)
#   --gate-hold-budget PCT    the gate holds offline for likely arrivals (`gate start --hold-budget`)
#   --configs ...,gate-hold   the gate with the hold (8% unless --gate-hold-budget); peers: mps,
#                             xsched (one per invocation; hwtests/serving/bursty.sh runs them all)
#   --hold-history FILE --port P --nominal-service-s S
#                             start the hold from hwtests/serving/hold_seed.py's history for port P
#   --loads 0.3,0.7           online busy shares to run
#   VALVE_BIN=DIR             prebuilt valvectl (default: .carry/bin, else target/release, else cargo)
# Without an NVIDIA driver it prints SKIP and exits 0. It never loads, unloads or resets anything.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -e /dev/nvidiactl ]; then
  echo "SKIP: no NVIDIA driver here (/dev/nvidiactl missing); run this on a GPU host"
  exit 0
fi

bin="${VALVE_BIN:-}"
if [ -z "$bin" ]; then
  for d in .carry/bin target/release; do
    if [ -x "$d/valvectl" ]; then bin="$d"; break; fi
  done
fi
if [ -z "$bin" ]; then
  echo "no prebuilt valvectl: building with cargo"
  cargo build --release -p valvectl
  bin=target/release
fi

out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"  # bench.log goes there before bench.py makes it
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

server=serve
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --server) server="${args[$((i + 1))]:-}" ;;
    --server=*) server="${args[$i]#--server=}" ;;
  esac
done
if [ "$server" = serve ] && ! python3 -c "import fastapi, uvicorn, pydantic, openai, requests, rich, accelerate" 2>/dev/null; then
  echo "NOTE: transformers serve's extras are not importable (no .whl/?): using --server cb (aiohttp)"
  args+=(--server cb)
elif [ "$server" = serve ]; then
  args+=(--server serve)
fi

echo "== host"
nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader 2>/dev/null || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
set +e
# tee ignores SIGTERM (`timeout` signals the whole process group), so the benchmark's last lines
# still reach the log after it is told to stop.
python3 hwtests/serving/bench.py --valvectl "$bin/valvectl" --out "$out" "${args[@]}" \
  > >(trap '' TERM; exec tee "$out/bench.log") 2>&1 &
pid=$!
# A TERM to this script alone (kill, `timeout --foreground`) must reach python too: the benchmark
# then stops measuring and still writes its report of the runs done.
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
wait "$pid"
rc=$?
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"
  rc=$?
done
set -e
echo "== report: $out/report.md (exit $rc)"
exit "$rc"

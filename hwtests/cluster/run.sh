#!/usr/bin/env bash
# The cluster scheduler's prediction check on a GPU host, in one command: installs the `valve`
# wheel (no network needed) into a scratch folder and runs predict.py with the arguments given.
#
#   hwtests/cluster/run.sh OUTDIR [--offline cb,train] [--loads 0.5,1.5,3] [--window 30]
#
# VALVECTL / VALVE_SCHEDULER (default: .carry/<name>, else target/release/<name>) and VALVE_WHEEL
# (default: .carry/valve_client-*.whl; scripts/build-python-wheel.sh .carry) say what to use.
# Needs root, one NVIDIA GPU, PyTorch, transformers >= 5. Results: OUTDIR/report.md, report.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: $0 OUTDIR [predict.py options]}
shift
find_bin() {
  local c
  for c in ".carry/$1" "target/release/$1"; do [ -x "$c" ] && { echo "$c"; return; }; done
  echo "cluster bench: no $1 binary: cargo build --release, or set the variable" >&2; exit 2
}
valvectl=${VALVECTL:-$(find_bin valvectl)}
scheduler=${VALVE_SCHEDULER:-$(find_bin valve-scheduler)}
wheel=${VALVE_WHEEL:-$(ls .carry/valve_client-*.whl 2>/dev/null | head -1)}
[ -f "${wheel:-}" ] || { echo "cluster bench: no valve wheel: scripts/build-python-wheel.sh .carry, or set VALVE_WHEEL" >&2; exit 2; }
site=$(mktemp -d /tmp/cluster-site.XXXXXX)
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
exec python3 hwtests/cluster/predict.py --valvectl "$valvectl" --scheduler "$scheduler" --out "$out" "$@"

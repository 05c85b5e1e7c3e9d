#!/usr/bin/env bash
# The memory benchmark on a GPU host, in one command: installs the `valve` wheel (no network
# needed) into a scratch folder and runs run.py with the arguments given.
#
#   hwtests/membench/run.sh OUTDIR correctness
#   hwtests/membench/run.sh OUTDIR bench [--configs ...] [--seconds 90]
#   hwtests/membench/run.sh OUTDIR bench --configs alone,static,valve-miad,valve-miad-warm --seconds 90
#     (valve-miad-warm: MIAD's first 90 s after a daemon restart, from a warm start)
#   hwtests/membench/run.sh OUTA bench --configs valve-miad-warm --warm-prime-only --warm-prime-seconds 450 \
#       --seed 12 --online-cuda-graphs        (one device call: a converged first pass, saved state only)
#   hwtests/membench/run.sh OUTB bench --configs alone,static,valve-miad-warm --warm-from OUTA/reservations.json \
#       --seconds 120 --seed 12 --online-cuda-graphs      (the next call, same GPU: the measured pass)
#   hwtests/membench/run.sh OUTDIR bench --configs valve-churn --seconds 90 --seed 12 --online-cuda-graphs \
#       [--churn-gate-every 2] [--churn-flooders 2]
#     (reclaims of up to 1 GiB while the gate restarts and the control socket is flooded)
#   hwtests/membench/run.sh OUTDIR episodes [--sizes 10] [--rates 2,6] [--policies alg1,fifo] [--repeat 4]
#     (offline's loss per reclaimed size x rate x handle choice, as episodes of one fixed workload,
#      no online model; several runs, one per device call, merge into one report:
#      python3 hwtests/membench/episodes.py merge OUT1/report.json OUT2/report.json --out DIR)
#
# VALVECTL (default: .carry/valvectl, else target/release/valvectl) and VALVE_WHEEL (default:
# .carry/valve_client-*.whl; build it with scripts/build-python-wheel.sh) say what to use.
# Results, logs and report.md land in OUTDIR. Needs root, one NVIDIA GPU, PyTorch, transformers >= 5.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: $0 OUTDIR correctness|bench|episodes [options]}
shift
valvectl=${VALVECTL:-}
[ -n "$valvectl" ] || for c in .carry/valvectl target/release/valvectl; do [ -x "$c" ] && valvectl=$c && break; done
[ -x "${valvectl:-}" ] || { echo "membench: no valvectl binary: build it (cargo build --release) or set VALVECTL" >&2; exit 2; }
wheel=${VALVE_WHEEL:-$(ls .carry/valve_client-*.whl 2>/dev/null | head -1)}
[ -f "${wheel:-}" ] || { echo "membench: no valve wheel: scripts/build-python-wheel.sh .carry, or set VALVE_WHEEL" >&2; exit 2; }
site=$(mktemp -d /tmp/membench-site.XXXXXX)
python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel"
# Optional: py-spy (a wheel in .carry/whl) lets the benchmark dump native stacks of a stuck process.
ls .carry/whl/py_spy-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target "$site" .carry/whl/py_spy-*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
exec python3 hwtests/membench/run.py --valvectl "$valvectl" --out "$out" "$@"

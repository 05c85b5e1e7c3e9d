#!/usr/bin/env bash
# CPU self-test of hwtests/multigpu (standard library only): report.py's arithmetic, tp_server.py's
# launcher, control channel and raw front end, drive.py's arrivals, lib.sh's daemon and gate helpers
# (against a stand-in valvectl), and run.sh / align.sh end to end
# with the fake engine (processes stopped, also after a SIGTERM); then the torch dry runs
# (gloo, the tiny model, 2 ranks) where torch is installed.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_report test_tp_server test_drive test_scripts test_lib test_tp_torch 2>&1 | tail -3
if python3 -c 'import torch' 2>/dev/null; then
  out="$(mktemp -d /tmp/multigpu-selftest.XXXXXX)"
  trap 'rm -rf "$out"' EXIT
  ./run.sh "$out/run" --dry-run | tail -12
  ./align.sh "$out/align" --dry-run | tail -8
else
  echo "SKIP: the torch dry runs (run.sh --dry-run, align.sh --dry-run): torch is not installed here"
fi

#!/usr/bin/env bash
# Builds the wheel (scripts/build-python-wheel.sh) into a temp dir, installs it into a temp venv
# and runs tests/test_valve.py there (with pytest if that venv has it, else plainly). No GPU and
# no daemon are needed. Prints SKIP and exits 0 if maturin cannot be installed (no PyPI access).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/valve-py-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

if ! command -v maturin >/dev/null 2>&1; then
  venv=${TMPDIR:-/tmp}/valve-maturin-venv
  if [ ! -x "$venv/bin/maturin" ] && ! { python3 -m venv "$venv" && "$venv/bin/pip" install --quiet 'maturin>=1.5,<2'; } >"$tmp/maturin.log" 2>&1; then
    echo "SKIP ctl/client-py tests: maturin could not be installed (see below)"
    tail -5 "$tmp/maturin.log"
    exit 0
  fi
fi

"$root/scripts/build-python-wheel.sh" "$tmp/wheel"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet --no-index "$tmp"/wheel/valve_client-*.whl
cd "$here/tests"
if "$tmp/venv/bin/python" -c 'import pytest' 2>/dev/null; then
  "$tmp/venv/bin/python" -m pytest -q -s test_valve.py
else
  "$tmp/venv/bin/python" test_valve.py
fi

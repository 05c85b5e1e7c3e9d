#!/usr/bin/env bash
# CPU self-test of the soak's and the freeze probe's arithmetic (standard library only).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_soak 2>&1 | tail -3

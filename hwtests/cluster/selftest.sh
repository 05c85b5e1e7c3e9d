#!/usr/bin/env bash
# CPU self-test of the cluster scheduler's GPU benchmark (trace and report; standard library only).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_predict test_cbrate 2>&1 | tail -3

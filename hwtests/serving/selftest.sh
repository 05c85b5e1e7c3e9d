#!/usr/bin/env bash
# CPU self-test of the serving benchmark's analysis, flags and GPU clock mapping (standard library only; no torch needed).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_analysis test_bench test_gatecost test_stamp 2>&1 | tail -3

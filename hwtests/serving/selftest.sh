#!/usr/bin/env bash
# CPU self-test of the serving benchmark's analysis, flags, GPU clock mapping and raw TCP server (standard library only; the tiny-decoder tests run where torch is installed).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_analysis test_bench test_gatecost test_rawserver test_stamp 2>&1 | tail -3

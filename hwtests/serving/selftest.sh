#!/usr/bin/env bash
# CPU self-test of the serving benchmark's analysis, flags, GPU clock mapping, raw TCP server, the bursty-traffic harness and the hold bound (standard library only; the tiny-decoder tests run where torch is installed), and of the XSched ipc stand-in where g++ is.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m unittest -v test_analysis test_bench test_gatecost test_rawserver test_stamp test_bursty test_hold_bound 2>&1 | tail -3
if command -v g++ >/dev/null; then
  bin="$(mktemp)"
  trap 'rm -f "$bin"' EXIT
  g++ -std=c++17 -Wall -Wextra -Werror -Ixsched_ipc/include xsched_ipc/src/ipc.cpp xsched_ipc/test_ipc.cpp -pthread -o "$bin"
  "$bin"
fi

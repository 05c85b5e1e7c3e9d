#!/usr/bin/env bash
# Applies Valve's one-line lock patch to an open-gpu-kernel-modules source tree (see --help and
# docs/driver-patch.md). Idempotent; --check changes nothing.
set -euo pipefail
command -v python3 >/dev/null || { echo "patch-driver: python3 is required" >&2; exit 2; }
exec python3 "$(cd "$(dirname "$0")/.." && pwd)/driver-patch/patch_driver.py" "$@"

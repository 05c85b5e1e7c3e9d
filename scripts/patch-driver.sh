#!/usr/bin/env bash
# Applies Valve's one-line lock patch to an open-gpu-kernel-modules source tree (see --help and
# docs/driver-patch.md). Idempotent; --check changes nothing.
#   scripts/patch-driver.sh --src DIR [--check] [--flag FLAG] [--emit-patch FILE]
# A thin wrapper around the Rust tool valve-driver-patch (driver-patch/): the arguments go to its
# `patch` command, or to another of its commands when one is named first (check, emit-patch,
# entry-flags FILE, apt-sources). It uses target/release/valve-driver-patch ($CARGO_TARGET_DIR is
# honoured), building it with cargo when it is missing or older than its sources; $VALVE_DRIVER_PATCH
# names a binary to use instead.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="${VALVE_DRIVER_PATCH:-}"
if [ -z "$bin" ]; then
  bin="${CARGO_TARGET_DIR:-$repo/target}/release/valve-driver-patch"
  stale=""
  if [ -x "$bin" ]; then
    stale=$(find "$repo/driver-patch/src" "$repo/driver-patch/Cargo.toml" -newer "$bin" -print -quit 2>/dev/null || true)
  fi
  if [ ! -x "$bin" ] || [ -n "$stale" ]; then
    if command -v cargo >/dev/null; then
      cargo build --release -q --manifest-path "$repo/Cargo.toml" -p valve-driver-patch >&2 \
        || { echo "patch-driver: building valve-driver-patch failed (cargo build --release -p valve-driver-patch)" >&2; exit 2; }
    elif [ ! -x "$bin" ]; then
      echo "patch-driver: no $bin, and no cargo to build it: run 'cargo build --release -p valve-driver-patch' first" >&2
      exit 2
    fi
  fi
fi
case "${1:-}" in
  patch|check|emit-patch|entry-flags|apt-sources|help|-V|--version) ;;
  *) set -- patch "$@" ;;
esac
exec "$bin" "$@"

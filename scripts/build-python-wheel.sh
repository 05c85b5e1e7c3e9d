#!/usr/bin/env bash
# Builds the `valve` Python package (ctl/client-py) as one abi3 wheel for x86-64 Linux:
# CPython 3.8 and later, manylinux_2_34 (glibc 2.34 or newer: Ubuntu 22.04+, Debian 12+, RHEL 9+;
# the GPU hosts run Ubuntu 24.04, glibc 2.39).
#
#   scripts/build-python-wheel.sh OUTDIR
#
# Why not manylinux_2_28: built on this Debian 12 machine (glibc 2.36), Rust's std links
# GLIBC_2.30-2.34 symbol versions, which maturin's check refuses for 2_28. A 2_28 wheel needs a
# manylinux_2_28 container or `pip install maturin[zig]` with `--zig`; set
# VALVE_WHEEL_COMPAT=manylinux_2_28 there. An explicit tag makes a build that links newer symbols
# fail here instead of producing a wheel the hosts cannot install.
#
# Uses `maturin` from PATH, else installs it (PyPI) into a venv under $TMPDIR. The manylinux check
# is maturin's own (it reads the library's glibc symbol versions and links): `auditwheel` is not
# needed. The wheel has no libraries to bundle (libcuda is loaded at run time), so the check is
# all `auditwheel repair` would have done. The wheel lands in OUTDIR as
# valve_client-<version>-cp38-abi3-manylinux_2_34_x86_64.whl.
set -euo pipefail

out=${1:?usage: $0 OUTDIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

if command -v maturin >/dev/null 2>&1; then
  maturin=maturin
else
  venv=${TMPDIR:-/tmp}/valve-maturin-venv
  if [ ! -x "$venv/bin/maturin" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet 'maturin>=1.5,<2'
  fi
  maturin=$venv/bin/maturin
fi

# A target dir of its own, so that a release build does not disturb the workspace's.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target-py}
"$maturin" build --release \
  --manifest-path "$root/ctl/client-py/Cargo.toml" \
  --compatibility "${VALVE_WHEEL_COMPAT:-manylinux_2_34}" \
  --interpreter python3 \
  --strip \
  --out "$out"
ls -l "$out"/valve_client-*.whl

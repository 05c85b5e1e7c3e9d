#!/usr/bin/env bash
# Valve's test command (what CI runs): formatting, clippy, every crate's tests (the driver-patch
# fixtures among them), the CUDA workloads' CPU self-tests and the driver-patch CI proof.
# Hardware tests are scripts/hwtest.sh, on a GPU host.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace

for t in hwtests/cuda/selftest.sh hwtests/serving/selftest.sh hwtests/membench/selftest.sh scripts/ci-driver-patch.sh; do
  if [ -f "$t" ]; then
    echo "== $t"
    bash "$t"
  fi
done
echo "== all tests passed"

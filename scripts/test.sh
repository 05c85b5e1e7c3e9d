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
# The scheduler's end-to-end test starts a real Slurm cluster (scripts/setup-debian.sh installs
# it); here a missing Slurm fails the test instead of skipping it.
export VALVE_REQUIRE_SLURM=${VALVE_REQUIRE_SLURM:-1}
cargo test --workspace
# The launch watcher again with one uprobe link per symbol: what kernels before 6.6 get.
echo "== launch watcher, one link per symbol (VALVE_UPROBE_MULTI=0)"
VALVE_UPROBE_MULTI=0 cargo test -p valve-ebpf --test launch_watch

for t in hwtests/cuda/selftest.sh hwtests/serving/selftest.sh hwtests/membench/selftest.sh hwtests/cluster/selftest.sh hwtests/soak/selftest.sh hwtests/multigpu/selftest.sh \
  hwtests/test_lanes.sh scripts/ci-driver-patch.sh; do
  if [ -f "$t" ]; then
    echo "== $t"
    bash "$t"
  fi
done
echo "== README figures (scripts/figures.py) match their reports"
python3 -m unittest scripts/test_figures.py 2>&1 | tail -1 && python3 scripts/figures.py --check
# The Debian packages: built, installed with dpkg, run from /usr/bin, purged (needs root).
if [ "$(id -u)" -eq 0 ]; then
  echo "== scripts/ci-package.sh"
  bash scripts/ci-package.sh
else
  echo "== scripts/ci-package.sh skipped: it installs packages, which needs root"
fi
echo "== all tests passed"

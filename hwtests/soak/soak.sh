#!/usr/bin/env bash
# Valve's soak on one GPU host (root): preempt/resume cycles of real PyTorch training with every
# freeze checked and the weights compared with an unpreempted twin, online servers restarted
# under a running gate, daemon SIGKILLs while it holds the job frozen, and pool reclaims with
# client kills between them. Results: OUT/soak-results.tar.gz (soak.json, pool/e2e.json, logs).
#
# Usage: sudo hwtests/soak/soak.sh OUT [--part control|pool|all] [soak.py options...]
#   --part control   soak.py's phases (cycles, restarts, kills; --phases picks), about 6 min
#   --part pool      valve-memprobe e2e with --soak-reclaims 1000, about 3 min
#   --part all       both (the default; longer than one 10-minute device call)
# Binaries: .carry/bin/{valvectl,valve-memprobe} (cargo build --release -p valvectl -p
# valve-hwtests), else target/release. Without an NVIDIA driver it prints SKIP and exits 0.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-}"
[ -n "$out" ] && [ "${out#--}" = "$out" ] || { sed -n 7,13p "$0" >&2; exit 2; }
shift
part=all
if [ "${1:-}" = "--part" ]; then part="${2:?--part takes control, pool or all}"; shift 2; fi
case "$part" in control|pool|all) ;; *) echo "soak.sh: --part takes control, pool or all, not $part" >&2; exit 2 ;; esac
if [ ! -e /dev/nvidiactl ]; then
  echo "SKIP: no NVIDIA driver here (/dev/nvidiactl is missing); run soak.sh on a GPU host"
  exit 0
fi
find_bin() {
  for c in "$root/.carry/bin/$1" "$root/target/release/$1"; do [ -x "$c" ] && { echo "$c"; return; }; done
  echo "soak.sh: no $1 binary: cargo build --release -p valvectl -p valve-hwtests" >&2
  exit 1
}
valvectl=$(find_bin valvectl)
mkdir -p "$out"
out="$(cd "$out" && pwd)"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee "$out/device.txt"
status=0
if [ "$part" != pool ]; then
  python3 "$here/soak.py" run --valvectl "$valvectl" --out "$out/control" "$@" || status=$?
fi
if [ "$part" != control ]; then
  memprobe=$(find_bin valve-memprobe)
  bins="$(mktemp -d /tmp/valve-soak-bins.XXXXXX)"
  nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  "$nvcc_bin" -O2 -arch="${CUDA_ARCH:-sm_90}" -ptx -o "$bins/memstream.ptx" "$root/hwtests/cuda/memstream.cu"
  "$memprobe" e2e --ptx "$bins/memstream.ptx" --valvectl "$valvectl" --out "$out/pool" \
    --offline-gib 8 --reclaim-mib 256 --reps 3 --soak-reclaims "${SOAK_RECLAIMS:-1000}" \
    --soak-mib 256 --soak-kill-every 10 2>&1 | tee "$out/pool.log" || status=$?
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee "$out/device-after.txt"
fi
tar -czf "/tmp/soak-results.$$.tar.gz" -C "$out" --exclude '*.progress' . && mv "/tmp/soak-results.$$.tar.gz" "$out/soak-results.tar.gz"
echo "soak.sh: results in $out/soak-results.tar.gz (exit $status)"
exit "$status"

#!/usr/bin/env bash
# Where XSched's CUDA shim fails under PyTorch on this host: the smoke's matrix products under the
# shim in four set-ups, from the shim alone to the full peer, each with its exit and last log lines,
# and a backtrace (cuda-gdb, which also debugs host code) of the first one that crashes.
#
# Usage: hwtests/serving/xsched_diag.sh INSTALL_DIR OUT_DIR
#   INSTALL_DIR  what xsched_build.sh made (bin/xserver, lib/libshimcuda.so)
# Writes OUT_DIR/diag.txt (the summary) and OUT_DIR/<mode>.log; exits 0 whatever the modes did.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 INSTALL_DIR OUT_DIR" >&2; exit 2; }
install="$1"
out="$(mkdir -p "$2" && cd "$2" && pwd)"
[ -e "$install/lib/libshimcuda.so" ] || { echo "xsched_diag: no $install/lib/libshimcuda.so" >&2; exit 1; }
real="$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')"
smoke="import torch; a = torch.randn(512, 512, device='cuda')
for _ in range(50): a = a @ a; a = a / a.norm()
torch.cuda.synchronize(); print('SMOKE-OK', torch.version.cuda)"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
xserver_pid=""
trap '[ -n "$xserver_pid" ] && kill "$xserver_pid" 2>/dev/null' EXIT

# MODE ENV...: the smoke under the shim with ENV; prints one summary line.
run_mode() {
  local mode="$1"; shift
  local rc
  env LD_LIBRARY_PATH="$install/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" XSCHED_CUDA_LIB="$real" \
    XLOG_LEVEL=DEBG "$@" timeout 60 python3 -X faulthandler -c "$smoke" > "$out/$mode.log" 2>&1
  rc=$?
  local ok=no
  grep -q SMOKE-OK "$out/$mode.log" && ok=yes
  # (XSched's Release build compiles its debug log out, so the log holds its INFO lines at most.)
  echo "$mode: exit $rc, smoke ok: $ok; last XSched line: $(grep -m1 -o '\[XSCHED [^]]*\].*' "$out/$mode.log" | tail -1 | cut -c1-120)"
  [ "$ok" = yes ]
}

{
  echo "host: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)"
  echo "driver's libcuda: $real"
  first_bad=""
  run_mode shim-only XSCHED_AUTO_XQUEUE=OFF || first_bad=${first_bad:-shim-only}
  run_mode xqueue-local XSCHED_AUTO_XQUEUE=ON XSCHED_AUTO_XQUEUE_LEVEL=1 XSCHED_POLICY=HPF \
    XSCHED_AUTO_XQUEUE_PRIORITY=1 || first_bad=${first_bad:-xqueue-local}
  env LD_LIBRARY_PATH="$install/lib" "$install/bin/xserver" HPF "$port" > "$out/xserver.log" 2>&1 &
  xserver_pid=$!
  sleep 2
  run_mode xqueue-global XSCHED_AUTO_XQUEUE=ON XSCHED_AUTO_XQUEUE_LEVEL=1 XSCHED_SCHEDULER=GLB \
    XSCHED_AUTO_XQUEUE_PRIORITY=1 || first_bad=${first_bad:-xqueue-global}
  run_mode xqueue-global-quiet XLOG_LEVEL=WARN XSCHED_AUTO_XQUEUE=ON XSCHED_AUTO_XQUEUE_LEVEL=1 \
    XSCHED_SCHEDULER=GLB XSCHED_AUTO_XQUEUE_PRIORITY=1 || first_bad=${first_bad:-xqueue-global-quiet}
  kill "$xserver_pid" 2>/dev/null; wait "$xserver_pid" 2>/dev/null; xserver_pid=""
  if [ -n "$first_bad" ]; then
    echo "backtrace of $first_bad (cuda-gdb): $out/backtrace.txt"
    case "$first_bad" in
      shim-only) extra=(XSCHED_AUTO_XQUEUE=OFF) ;;
      *) extra=(XSCHED_AUTO_XQUEUE=ON XSCHED_AUTO_XQUEUE_LEVEL=1 XSCHED_POLICY=HPF XSCHED_AUTO_XQUEUE_PRIORITY=1) ;;
    esac
    gdb="$(command -v cuda-gdb || echo /usr/local/cuda/bin/cuda-gdb)"
    env LD_LIBRARY_PATH="$install/lib" XSCHED_CUDA_LIB="$real" XLOG_LEVEL=WARN "${extra[@]}" \
      timeout 90 "$gdb" -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -c "$smoke" \
      > "$out/backtrace.txt" 2>&1
    grep -m 25 -E '^#[0-9]+' "$out/backtrace.txt"
  fi
} | tee "$out/diag.txt"
exit 0

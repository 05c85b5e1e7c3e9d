#!/usr/bin/env bash
# CPU test of hwtests/mps/probe.sh's ways out, with stand-ins for nvidia-cuda-mps-control, valvectl
# and the training clients: MPS is told to quit when the daemon never starts and when the probe is
# stopped with SIGTERM while it waits for its clients, and nothing it started is left running.
# Needs root (the probe refuses to run otherwise); elsewhere it says so and skips.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" -ne 0 ] || ! command -v gcc >/dev/null; then
  echo "SKIP: probe.sh needs root and gcc"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
fail() { echo "FAIL: $*"; exit 1; }

cat >"$tmp/bin/nvidia-cuda-mps-control" <<STUB
#!/bin/sh
if [ "\${1:-}" = -d ]; then touch "\$CUDA_MPS_PIPE_DIRECTORY/control"; echo started >>"$tmp/mps.log"; exit 0; fi
read -r cmd; echo "\$cmd" >>"$tmp/mps.log"; rm -f "\$CUDA_MPS_PIPE_DIRECTORY/control"
STUB
# valvectl: "daemon" binds the socket and waits (or fails at once with STUB_DAEMON=fail).
cat >"$tmp/valvectl" <<STUB
#!/bin/sh
sock=\$2; shift 2
case "\$1" in
  daemon) [ "\${STUB_DAEMON:-}" = fail ] && exit 1
          echo \$\$ >"$tmp/daemon.pid"
          exec python3 -c 'import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); time.sleep(600)' "\$sock" ;;
  --json) echo '{"gpus":[]}' ;;
esac
STUB
# python: the probe's own analysis snippets run for real; a training client just waits.
cat >"$tmp/python" <<STUB
#!/bin/sh
case "\${1:-}" in *train.py) echo \$\$ >>"$tmp/clients.pid"; exec sleep 600 ;; esac
exec python3 "\$@"
STUB
chmod +x "$tmp/bin/nvidia-cuda-mps-control" "$tmp/valvectl" "$tmp/python"
probe() {
  PATH="$tmp/bin:$PATH" VALVECTL="$tmp/valvectl" PYTHON="$tmp/python" \
    bash "$here/probe.sh" "$tmp/out" >"$tmp/probe.out" 2>&1
}
gone() { ! kill -0 "$1" 2>/dev/null; }

STUB_DAEMON=fail probe
rc=$?
[ "$rc" = 1 ] || fail "a daemon that does not start: exit $rc, want 1 ($(cat "$tmp/probe.out"))"
grep -qx quit "$tmp/mps.log" || fail "no quit when the daemon did not start"

: >"$tmp/mps.log"
PATH="$tmp/bin:$PATH" VALVECTL="$tmp/valvectl" PYTHON="$tmp/python" \
  bash "$here/probe.sh" "$tmp/out" >"$tmp/probe.out" 2>&1 &
p=$!
for _ in $(seq 100); do
  [ "$(cat "$tmp/clients.pid" 2>/dev/null | wc -l)" -ge 2 ] && break
  sleep 0.1
done
grep -qx started "$tmp/mps.log" || fail "MPS was not started ($(cat "$tmp/probe.out"))"
kill -TERM "$p"
wait "$p"
rc=$?
[ "$rc" = 130 ] || fail "SIGTERM: exit $rc, want 130 ($(cat "$tmp/probe.out"))"
grep -qx quit "$tmp/mps.log" || fail "no quit after SIGTERM"
for pid in $(cat "$tmp/clients.pid") "$(cat "$tmp/daemon.pid")"; do
  gone "$pid" || fail "pid $pid left running"
done
echo "PASS: probe.sh stops MPS and what it started on every way out tried"

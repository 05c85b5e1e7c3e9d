# Shared by run.sh and align.sh (sourced): background processes in sessions of their own, recorded
# so that the exit trap stops every one of them; READY waits; the daemon and valvectl.
# Needs: $work (scratch folder), $out (results folder), $here, $root set by the caller.

t0=$(date +%s)
say() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
mono_ns() { python3 -c 'import time; print(time.monotonic_ns())'; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_bg NAME LOG CMD...: CMD in a session of its own (its pid is its process group), logged.
start_bg() {
  local name="$1" log="$2"; shift 2
  setsid "$@" > "$log" 2>&1 < /dev/null &
  echo "$! $name" >> "$work/procs"
  eval "pid_${name//-/_}=$!"
}

stop_grace_s=${stop_grace_s:-20}
# stop_bg NAME...: SIGTERM to each one's process group at once, SIGKILL to what is left after
# $stop_grace_s s (default 20); forgets them. (Training prints its weights' digest on SIGTERM: seconds each, so not one by one.)
stop_bg() {
  local name pids=()
  for name in "$@"; do
    pids+=($(awk -v n="$name" '$2 == n {print $1}' "$work/procs" 2>/dev/null))
    awk -v n="$name" '$2 != n' "$work/procs" > "$work/procs.new" && mv "$work/procs.new" "$work/procs"
  done
  [ ${#pids[@]} -gt 0 ] && stop_pgids "${pids[@]}"
  return 0
}

stop_pgids() {
  local pid i left
  for pid in "$@"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for i in $(seq 1 $(( stop_grace_s * 5 ))); do
    left=0
    for pid in "$@"; do group_alive "$pid" && left=1; done
    [ "$left" = 0 ] && { reap "$@"; return 0; }
    sleep 0.2
  done
  for pid in "$@"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  reap "$@"
}

# group_alive PGID: whether a process of that group still runs (zombies, which a container's
# PID 1 may leave unreaped, do not count).
group_alive() {
  ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'
}

# reap PID...: waits for those of the group leaders that are this shell's children, so that none
# is left a zombie (a zombie leader keeps `kill -0 -- -PGID` answering as if the group ran).
reap() {
  local pid
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

# stop_all_but_daemon: every recorded process group but the daemon's, all at once.
stop_all_but_daemon() {
  [ -f "$work/procs" ] || return 0
  local names
  names=$(awk '$2 != "daemon" {print $2}' "$work/procs")
  # shellcheck disable=SC2086
  [ -n "$names" ] && stop_bg $names
  return 0
}

# release: the gate stopped and every channel the daemon disabled enabled, while it still runs.
release() {
  grep -q ' daemon$' "$work/procs" 2>/dev/null || return 0
  "$valvectl" gate stop >/dev/null 2>&1 || true
  "$valvectl" resume --all >/dev/null 2>&1 || true
}

# wait_ready NAME LOG TIMEOUT_S: until LOG has a line starting READY; fails (with the log's tail)
# if the process ends first or the time runs out.
wait_ready() {
  local name="$1" log="$2" limit="$3" pid end
  pid=$(awk -v n="$name" '$2 == n {print $1}' "$work/procs" | tail -1)
  end=$(( $(date +%s) + limit ))
  while ! grep -q '^READY' "$log" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -20 "$log" >&2; echo "$(basename "$0"): $name exited before it was ready (log: $log)" >&2; return 1
    fi
    if [ "$(date +%s)" -gt "$end" ]; then
      tail -20 "$log" >&2; echo "$(basename "$0"): $name not ready after $limit s (log: $log)" >&2; return 1
    fi
    sleep 0.5
  done
}

find_valvectl() {
  local c
  for c in "${VALVECTL:-}" "$root/.carry/bin/valvectl" "$root/.carry/valvectl" "$root/target/release/valvectl"; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

find_scheduler() {
  local c
  for c in "${VALVE_SCHEDULER:-}" "$root/.carry/bin/valve-scheduler" "$root/.carry/valve-scheduler" \
           "$root/target/release/valve-scheduler"; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

# start_daemon LOG [daemon flags...]: `valvectl daemon` on the default socket; refuses a daemon
# that already runs (its gate and state are not this script's to touch).
start_daemon() {
  local log="$1" i; shift
  if "$valvectl" status >/dev/null 2>&1; then
    die "a Valve daemon already runs on this host: stop it first (systemctl stop valve, or end its valvectl daemon)"
  fi
  start_bg daemon "$log" "$valvectl" daemon "$@"
  for i in $(seq 1 150); do "$valvectl" status >/dev/null 2>&1 && return 0; sleep 0.2; done
  tail -20 "$log" >&2; die "the daemon did not answer within 30 s (log: $log)"
}

# stop_daemon: the gate stopped and everything resumed, then the daemon ended.
stop_daemon() {
  grep -q ' daemon$' "$work/procs" 2>/dev/null || return 0
  release
  stop_bg daemon
}

# gate_wait N: until the gate's probes are attached and it gates N offline processes (60 s at most).
gate_wait() {
  local want="$1" i
  for i in $(seq 1 120); do
    if "$valvectl" --json gate status 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
sys.exit(0 if s.get("online_probes_attached") and len(s.get("offline_pids") or []) >= int(sys.argv[1]) else 1)' "$want"
    then return 0; fi
    sleep 0.5
  done
  "$valvectl" gate status >&2 || true
  echo "$(basename "$0"): the gate did not attach its probes and gate $want offline processes within 60 s" >&2
  return 1
}

# gate_trace FILE: every record the gate kept, in pages (valvectl gate trace --after SEQ).
gate_trace() {
  local after=0 page
  : > "$1"
  while page=$("$valvectl" --json gate trace --after "$after" 2>/dev/null) && [ -n "$page" ]; do
    printf '%s\n' "$page" >> "$1"
    after=$(printf '%s\n' "$page" | tail -1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["seq"])')
  done
}

# write_window FILE START_NS END_NS
write_window() { printf '{"start_ns": %s, "end_ns": %s}\n' "$2" "$3" > "$1"; }

# pack NAME: OUT/NAME.tar.gz of everything in OUT (built beside, then moved in).
pack() {
  tar -C "$out" --exclude="$1.tar.gz" -czf "$work/$1.tar.gz" . 2>/dev/null || true
  [ -f "$work/$1.tar.gz" ] && mv "$work/$1.tar.gz" "$out/$1.tar.gz" && echo "results: $out/$1.tar.gz"
}

# wait_bg NAME LIMIT_S: until NAME's process has ended (SIGTERM to it after LIMIT_S); forgets it.
wait_bg() {
  local pid end
  pid=$(awk -v n="$1" '$2 == n {print $1}' "$work/procs" | tail -1)
  [ -n "$pid" ] || return 0
  end=$(( $(date +%s) + $2 ))
  while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -le "$end" ]; do sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && say "$1 still ran after $2 s: stopped"
  stop_bg "$1"
}

# install_cleanup REPORT TARBALL: on every exit (a trap, SIGTERM, an error), offline released
# before it is stopped (a frozen job could not finish its SIGTERM), everything stopped, the
# daemon's leftovers resumed (not in a dry run, which has no Valve), report.py REPORT run and
# $out/TARBALL.tar.gz written; the script's exit code kept.
install_cleanup() {
  cleanup_report=$1 cleanup_tarball=$2
  trap cleanup EXIT
  trap 'exit 143' TERM INT HUP
}

cleanup() {
  local rc=$?
  set +e
  release
  stop_all_but_daemon
  stop_daemon
  [ -n "${valvectl:-}" ] && [ "${dry:-0}" = 0 ] && "$valvectl" resume --all > "$out/resume-all.txt" 2>&1
  [ -f "$out/meta.json" ] && python3 "$here/report.py" "$cleanup_report" "$out" > /dev/null 2> "$out/report.err"
  pack "$cleanup_tarball"
  rm -rf "$work"
  exit "$rc"
}

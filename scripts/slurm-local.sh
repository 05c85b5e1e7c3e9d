#!/usr/bin/env bash
# Runs a throwaway multi-node Slurm (22.05) cluster on this one machine, for the scheduler's tests
# and for trying the scheduler without GPUs: one slurmctld and N slurmd "gpu001".. with G fake GPUs
# each, auth/none, all files under DIR; optionally a node agent per node.
#
# Usage:
#   scripts/slurm-local.sh start DIR [--nodes N] [--gpus G] [--cpus C] [--base-port P] [--timeout S]
#                                    [--harvest FILE]
#       N nodes (default 8), G GPUs per node (8), C CPUs per node (4), slurmctld on port P (16800) and
#       slurmd i on P+i, wait at most S seconds (60) for all nodes to be idle. DIR is created; Slurm
#       state left in it by an earlier run is wiped. Prints `export SLURM_CONF=DIR/slurm.conf`.
#       --harvest FILE: also serve each node's harvest document, FILE replayed by one
#       `valve-scheduler agent` per node on port P+N+i, listed in DIR/agents for
#       `valve-scheduler run --agents DIR/agents`; jobs get their GPUs and progress directory from
#       the scheduler's TaskProlog. valve-scheduler is $VALVE_SCHEDULER, else on PATH, else built here.
#   scripts/slurm-local.sh stop DIR      stop everything start started: jobs, agents, daemons (idempotent)
#   scripts/slurm-local.sh status DIR    print sinfo and the agents
#
# Layout of DIR: slurm.conf gres.conf, state/ (slurmctld), spool/gpuNNN/, log/ (slurmctld.log,
# slurmd-gpuNNN.log, agent-gpuNNN.out, supervisor.log), run/ (pid files), dev/ (fake GPU devices:
# links to /dev/null); with --harvest also agents, taskprolog.sh and progress/gpuNNN/.
# The daemons run in the foreground (-D) under one supervisor process that start launches in the
# background; where python3 is present the supervisor is made a child subreaper, so slurmstepd
# processes (which slurmd double-forks) are its children too and stop can find and reap them.
# Needs the Debian packages slurmctld slurmd slurm-client (scripts/setup-debian.sh installs them).
set -euo pipefail

prog=${0##*/}
die() { echo "$prog: $*" >&2; exit 1; }
usage() { sed -n '4,16s/^# \{0,1\}//p' "$0" >&2; exit 2; }

# Prefer Debian's -wlm binaries: slurm-wlm-emulator switches /usr/sbin/slurmctld to a front-end
# build. They must still run with argv[0] "slurmctld"/"slurmd" (exec -a): Slurm 22.05 keeps a
# node's Gres= from slurm.conf only in a program of exactly that name (run_in_daemon()), and as
# "slurmctld-wlm" every node shows Gres=(null) ("gres.conf ... has 8 more configured than expected").
find_bin() {
  local b
  for b in "/usr/sbin/$1-wlm" "/usr/sbin/$1" "$(command -v "$1" 2>/dev/null || true)"; do
    if [ -n "$b" ] && [ -x "$b" ]; then echo "$b"; return 0; fi
  done
  return 1
}

abs_dir() { mkdir -p -- "$1" && (cd -- "$1" && pwd -P); }

abs_file() { (cd -- "$(dirname -- "$1")" && echo "$(pwd -P)/$(basename -- "$1")"); }

# The valve-scheduler program the agents run: $VALVE_SCHEDULER, else on PATH, else this
# checkout's release or debug build.
find_scheduler() {
  local here b
  here=$(cd -- "$(dirname -- "$0")/.." && pwd -P)
  for b in "${VALVE_SCHEDULER:-}" "$(command -v valve-scheduler 2>/dev/null || true)" \
    "$here/target/release/valve-scheduler" "$here/target/debug/valve-scheduler"; do
    if [ -n "$b" ] && [ -x "$b" ]; then abs_file "$b"; return 0; fi
  done
  return 1
}

# pid_alive PID: true while PID runs and is not a zombie (this host's PID 1 may not reap orphans).
pid_alive() {
  local stat rest
  [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] || return 1
  read -r stat 2>/dev/null < "/proc/$1/stat" || return 1
  rest=${stat##*) }
  [ "${rest%% *}" != Z ] && [ "${rest%% *}" != X ]
}

# tree ROOT [SKIP...]: live processes below ROOT, read from /proc (no procps needed), leaving out
# the SKIP pids and what is below them.
tree() {
  local f stat rest pid ppid root=$1 queue out=() p
  local -A kids=() skip=()
  shift
  for p in "$@"; do skip[$p]=1; done
  for f in /proc/[0-9]*/stat; do
    read -r stat 2>/dev/null < "$f" || continue
    pid=${stat%% *}; rest=${stat##*) }; rest=${rest#* }; ppid=${rest%% *}
    kids[$ppid]+=" $pid"
  done
  queue=("$root")
  while [ "${#queue[@]}" -gt 0 ]; do
    p=${queue[0]}; queue=("${queue[@]:1}")
    for f in ${kids[$p]:-}; do
      [ -n "${skip[$f]:-}" ] || { out+=("$f"); queue+=("$f"); }
    done
  done
  echo "${out[@]:-}"
}

# kill_pids SIGNAL PID...: signal those of the PIDs that are alive.
kill_pids() {
  local sig=$1 p; shift
  for p in "$@"; do pid_alive "$p" && kill "-$sig" "$p" 2> /dev/null; done
  return 0
}

# port_listening PORT: true if some TCP socket listens on PORT (from /proc/net, no ss needed).
port_listening() {
  local hex
  hex=$(printf '%04X' "$1")
  awk -v h="$hex" '$4 == "0A" { split($2, a, ":"); if (a[2] == h) found = 1 } END { exit !found }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

node_name() { printf 'gpu%03d' "$1"; }

write_config() { # dir nodes gpus cpus base
  local dir=$1 n=$2 g=$3 c=$4 base=$5 i gres=""
  [ "$g" -gt 0 ] && gres=" Gres=gpu:$g"
  cat > "$dir/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: a local test cluster, not for production.
ClusterName=valvetest
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$base
SlurmdPort=$((base + 1))
AuthType=auth/none
CredType=cred/none
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=30
KillWait=2
MinJobAge=300
EOF
  # One line per node: each slurmd (slurmd -N gpuNNN) listens on its node's own Port.
  for ((i = 1; i <= n; i++)); do
    echo "NodeName=$(node_name "$i") NodeAddr=127.0.0.1 Port=$((base + i)) CPUs=$c RealMemory=4000$gres State=UNKNOWN"
  done >> "$dir/slurm.conf"
  echo "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"
  write_gres "$dir" "$n" "$g"
}

# GRES: each node has G fake GPU device files under DIR/dev, so Slurm tracks GPUs by index
# (CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS in a job, IDX in gres detail). See testdata NOTES.md.
write_gres() { # dir nodes gpus
  local dir=$1 n=$2 g=$3 i
  {
    echo "# Written by scripts/slurm-local.sh: fake GPUs (links to /dev/null), no autodetection."
    echo "AutoDetect=off"
    if [ "$g" -gt 0 ]; then
      echo "NodeName=gpu[001-$(printf '%03d' "$n")] Name=gpu File=$dir/dev/nvidia[0-$((g - 1))]"
    fi
  } > "$dir/gres.conf"
  mkdir -p "$dir/dev"
  # slurmd wants character devices there ("not a valid character or block device"): /dev/null.
  for ((i = 0; i < g; i++)); do ln -sfn /dev/null "$dir/dev/nvidia$i"; done
}

# With --harvest: the agents file (node i's agent on port base+n+i), the scheduler's TaskProlog
# (it gives a job the GPUs the scheduler chose and its node's progress directory), and those
# directories.
write_agents() { # dir nodes base scheduler-bin
  local dir=$1 n=$2 base=$3 bin=$4 i
  for ((i = 1; i <= n; i++)); do
    echo "$(node_name "$i") http://127.0.0.1:$((base + n + i))/v1/harvest"
    mkdir -p "$dir/progress/$(node_name "$i")"
  done > "$dir/agents"
  printf '#!/bin/sh\nexec %s task-prolog --progress-dir %s/progress --per-node\n' "$bin" "$dir" \
    > "$dir/taskprolog.sh"
  chmod +x "$dir/taskprolog.sh"
  echo "TaskProlog=$dir/taskprolog.sh" >> "$dir/slurm.conf"
}

# start_agents DIR NODES BASE BIN HARVEST: one recorded-document agent per node, in the
# background (run by the supervisor, whose pids array they join).
start_agents() {
  local dir=$1 n=$2 base=$3 bin=$4 harvest=$5 i name
  for ((i = 1; i <= n; i++)); do
    name=$(node_name "$i")
    (exec "$bin" agent --node "$name" --harvest "$harvest" --listen "127.0.0.1:$((base + n + i))" \
      --progress-dir "$dir/progress/$name" > "$dir/log/agent-$name.out" 2>&1 < /dev/null) &
    pids+=($!); write_pid "$dir/run/agent-$name.daemon.pid" $!
  done
}

# write_pid FILE PID: atomically, so that a reader never sees an empty file.
write_pid() { echo "$2" > "$1.tmp" && mv -f "$1.tmp" "$1"; }

# The supervisor (run in the background by start): runs the daemons in the foreground as its
# children, slurmctld first, and reaps them and any orphan re-parented to it until they all exit.
supervise() { # dir nodes [base scheduler-bin harvest]
  local dir=$1 n=$2 conf=$1/slurm.conf ctld slurmd i rc pids=()
  ctld=$(find_bin slurmctld) && slurmd=$(find_bin slurmd) || exit 1
  write_pid "$dir/run/supervisor.pid" $$
  trap 'kill_pids TERM "${pids[@]}"' TERM INT HUP
  (exec -a slurmctld "$ctld" -D -i -f "$conf" > "$dir/log/slurmctld.out" 2>&1 < /dev/null) &
  pids+=($!); write_pid "$dir/run/slurmctld.daemon.pid" $!
  for ((i = 0; i < 100; i++)); do # up to 10 s for slurmctld to answer before the slurmds come
    pid_alive "${pids[0]}" || break
    SLURM_CONF=$conf scontrol ping 2>/dev/null | grep -q 'is UP' && break
    sleep 0.1
  done
  for ((i = 1; i <= n; i++)); do
    (exec -a slurmd "$slurmd" -D -N "$(node_name "$i")" -f "$conf" \
      > "$dir/log/slurmd-$(node_name "$i").out" 2>&1 < /dev/null) &
    pids+=($!); write_pid "$dir/run/slurmd-$(node_name "$i").daemon.pid" $!
  done
  [ $# -ge 5 ] && start_agents "$dir" "$n" "$3" "$4" "$5"
  echo "supervisor $$: started ${pids[*]}"
  while :; do # until the daemons have exited; orphans re-parented to us are reaped meanwhile
    wait; rc=$?
    [ "$rc" -le 128 ] && break
  done
  read -r -a pids <<< "$(tree $$)"
  kill_pids KILL "${pids[@]}"
  sleep 0.2
  echo "supervisor $$: daemons exited"
}

# Starts the supervisor as a subreaper (prctl PR_SET_CHILD_SUBREAPER survives exec) if python3 is
# there, detached from our stdin/stdout so that a caller reading our output is not held open.
# It runs a copy of this script: bash reads a script as it goes, so editing this one (a git checkout)
# would break a running supervisor.
launch_supervisor() { # dir nodes [base scheduler-bin harvest]
  local argv=(bash "$1/run/slurm-local.sh" _supervise "$@")
  cp "$0" "$1/run/slurm-local.sh"
  if command -v python3 > /dev/null; then
    argv=(python3 -c 'import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
os.execvp(sys.argv[1], sys.argv[1:])' "${argv[@]}")
  fi
  setsid "${argv[@]}" >> "$1/log/supervisor.log" 2>&1 < /dev/null &
}

# ours PID DIR: true if PID is alive and runs with DIR in its command line (guards against pid
# files that outlived their processes and whose pids were reused).
ours() {
  local c
  pid_alive "$1" && c=" $(tr '\0' ' ' 2>/dev/null < "/proc/$1/cmdline")" && [[ $c == *"$2/"* || $c == *" $2 "* ]]
}

# daemon_pids DIR: live pids of the daemons recorded in DIR/run (not the supervisor).
daemon_pids() {
  local f p
  for f in "$1"/run/*.daemon.pid "$1"/run/slurmctld.pid "$1"/run/slurmd-*.pid; do
    [ -f "$f" ] && read -r p < "$f" && ours "$p" "$1" && echo "$p"
  done 2>/dev/null | sort -u | tr '\n' ' '
}

supervisor_pid() { # dir
  local p
  [ -f "$1/run/supervisor.pid" ] && read -r p < "$1/run/supervisor.pid" && ours "$p" "$1" && echo "$p"
}

# stepd_pids DIR: live slurmstepd processes of this cluster (slurmd puts SLURM_CONF in their
# environment), found even when they were re-parented to PID 1 (no subreaper).
stepd_pids() {
  local f p c
  for f in /proc/[0-9]*/cmdline; do
    p=${f#/proc/}; p=${p%/cmdline}
    read -r -d '' c 2>/dev/null < "$f" || true
    [[ $c == slurmstepd* ]] || continue
    grep -qzxF "SLURM_CONF=$1/slurm.conf" "/proc/$p/environ" 2>/dev/null && echo "$p"
  done | tr '\n' ' '
}

# wait_gone SECONDS PID...: true once none of the PIDs is alive.
wait_gone() {
  local t=$1 p left i; shift
  for ((i = 0; i < t * 10; i++)); do
    left=0
    for p in "$@"; do pid_alive "$p" && left=1; done
    [ "$left" = 0 ] && return 0
    sleep 0.1
  done
  return 1
}

cmd_stop() { # dir
  local dir=$1 p pids=() steps=() sup=() more=()
  [ -d "$dir/run" ] || return 0
  read -r -a sup <<< "$(supervisor_pid "$dir" || true)"
  read -r -a pids <<< "$(daemon_pids "$dir")"
  # Job steps first: slurmstepd (and the job under it) outlives slurmd by design. slurmd
  # double-forks it, so it hangs below the supervisor (a subreaper), not below slurmd.
  [ "${#sup[@]}" -gt 0 ] && read -r -a steps <<< "$(tree "${sup[0]}" "${pids[@]}")"
  for p in $(stepd_pids "$dir"); do steps+=("$p"); read -r -a more <<< "$(tree "$p")"; steps+=("${more[@]}"); done
  kill_pids KILL "${steps[@]}"
  kill_pids TERM "${pids[@]}"
  if ! wait_gone 15 "${pids[@]}"; then
    for p in "${pids[@]}"; do read -r -a steps <<< "$(tree "$p")"; kill_pids KILL "$p" "${steps[@]}"; done
  fi
  # The supervisor exits by itself once its daemons are gone.
  wait_gone 5 "${pids[@]}" "${sup[@]}" || { kill_pids TERM "${sup[@]}"; wait_gone 5 "${pids[@]}" "${sup[@]}"; } || {
    echo "$prog: could not stop pids ${pids[*]} ${sup[*]}" >&2; return 1
  }
  rm -f "$dir"/run/*.pid
}

cmd_status() { # dir
  local dir=$1
  [ -f "$dir/slurm.conf" ] || die "no cluster in $dir (no slurm.conf)"
  SLURM_CONF=$dir/slurm.conf sinfo
  SLURM_CONF=$dir/slurm.conf sinfo -N -o '%N %T %c %G %E'
  if [ -f "$dir/agents" ]; then
    local node url p
    while read -r node url; do
      p=$(cat "$dir/run/agent-$node.daemon.pid" 2>/dev/null || true)
      if [ -n "$p" ] && ours "$p" "$dir"; then echo "agent $node: $url (pid $p)"; else echo "agent $node: not running"; fi
    done < "$dir/agents"
  fi
}

# The errors in the logs (less the noise of the mpi/pmix plugins, whose library is not installed),
# printed when start fails.
show_logs() { # dir
  local f lines
  for f in "$1"/log/supervisor.log "$1"/log/*.out "$1"/log/*.log; do
    [ -s "$f" ] || continue
    lines=$(grep -E 'error|fatal|rror:' "$f" | grep -v -E 'pmix|MPI|state file|Trying backup|MailProg' | tail -n 5 || true)
    [ -n "$lines" ] && printf -- '--- %s\n%s\n' "$f" "$lines"
  done >&2
  return 0
}

fail_start() { # dir message...
  local dir=$1; shift
  echo "$prog: start failed: $*" >&2
  show_logs "$dir"
  cmd_stop "$dir" || true
  exit 1
}

check_start_args() { # dir nodes gpus cpus base harvest
  local dir=$1 n=$2 g=$3 c=$4 base=$5 harvest=$6 p top=$(($5 + $2))
  [[ $dir != *[[:space:]]* ]] || die "DIR must not contain white space: '$dir'"
  for p in "$n" "$g" "$c" "$base"; do [[ $p =~ ^[0-9]+$ ]] || die "not a number: '$p'"; done
  if [ "$n" -lt 1 ] || [ "$n" -gt 999 ]; then die "--nodes must be 1..999"; fi
  [ "$c" -ge 1 ] || die "--cpus must be >= 1"
  if [ -n "$harvest" ]; then
    [ -r "$harvest" ] || die "--harvest $harvest: no such readable file (a harvest document, e.g. sched/scheduler/examples/node.json)"
    find_scheduler > /dev/null || die "--harvest needs valve-scheduler: build it (cargo build --release), install it, or set VALVE_SCHEDULER=PATH"
    top=$((base + 2 * n))
  fi
  if [ "$base" -lt 1024 ] || [ "$top" -gt 65535 ]; then
    die "--base-port $base: the cluster needs ports $base..$top, which must lie in 1024..65535"
  fi
  if ! find_bin slurmctld > /dev/null || ! find_bin slurmd > /dev/null || ! command -v sinfo > /dev/null; then
    die "slurmctld/slurmd/sinfo not installed: run scripts/setup-debian.sh"
  fi
  [ -z "$(daemon_pids "$dir")$(supervisor_pid "$dir" || true)" ] || die "a cluster is already running in $dir: run '$prog stop $dir' first"
  for ((p = base; p <= top; p++)); do
    ! port_listening "$p" || die "port $p is in use (the cluster needs $base..$top): choose another --base-port"
  done
}

# agents_ready DIR NODES BASE: true once every agent listens; fails start if one exited.
agents_ready() {
  local dir=$1 n=$2 base=$3 i name ready=0
  for ((i = 1; i <= n; i++)); do
    name=$(node_name "$i")
    [ -f "$dir/run/agent-$name.daemon.pid" ] || return 1
    ours "$(cat "$dir/run/agent-$name.daemon.pid")" "$dir" \
      || fail_start "$dir" "the agent of $name exited: $(tail -n 3 "$dir/log/agent-$name.out" 2>/dev/null | tr '\n' ' ')"
    port_listening $((base + n + i)) && ready=$((ready + 1))
  done
  [ "$ready" -eq "$n" ]
}

cmd_start() { # dir nodes gpus cpus base timeout [harvest]
  local dir=$1 n=$2 g=$3 c=$4 base=$5 timeout=$6 harvest=${7:-} i idle="" t0=$SECONDS agents=()
  check_start_args "$dir" "$n" "$g" "$c" "$base" "$harvest"
  rm -rf "${dir:?}/state" "${dir:?}/spool" "${dir:?}/log" "${dir:?}/run" "${dir:?}/dev" \
    "${dir:?}/progress" "${dir:?}/agents" "${dir:?}/taskprolog.sh"
  mkdir -p "$dir/state" "$dir/log" "$dir/run"
  for ((i = 1; i <= n; i++)); do mkdir -p "$dir/spool/$(node_name "$i")"; done
  write_config "$dir" "$n" "$g" "$c" "$base"
  if [ -n "$harvest" ]; then
    agents=("$base" "$(find_scheduler)" "$harvest")
    write_agents "$dir" "$n" "$base" "${agents[1]}"
  fi
  launch_supervisor "$dir" "$n" "${agents[@]}"
  export SLURM_CONF=$dir/slurm.conf
  while [ $((SECONDS - t0)) -lt "$timeout" ]; do
    sleep 0.5
    [ -f "$dir/run/supervisor.pid" ] && [ -z "$(supervisor_pid "$dir" || true)" ] \
      && fail_start "$dir" "the daemons exited"
    [ -f "$dir/run/slurmctld.daemon.pid" ] && ! ours "$(cat "$dir/run/slurmctld.daemon.pid")" "$dir" \
      && fail_start "$dir" "slurmctld exited (see $dir/log/slurmctld.log)"
    if grep -qs 'Address already in use' "$dir"/log/*.log "$dir"/log/*.out; then
      i=$(grep -hos 'listen port ([0-9]*)' "$dir"/log/*.log | head -n 1 | tr -dc 0-9 || true)
      fail_start "$dir" "port ${i:-in $base..$((base + n))} is in use: choose another --base-port"
    fi
    idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l || true)
    [ "$idle" -eq "$n" ] || continue
    if [ -n "$harvest" ]; then
      agents_ready "$dir" "$n" "$base" || continue
      echo "# $n agents replaying $harvest: valve-scheduler run --agents $dir/agents"
    fi
    echo "export SLURM_CONF=$dir/slurm.conf"
    return 0
  done
  fail_start "$dir" "only ${idle:-0} of $n nodes idle after ${timeout}s: $(sinfo -h -N -o '%N:%T' 2>&1 | tr '\n' ' ' || true)"
}

main() {
  [ $# -ge 2 ] || usage
  local cmd=$1 dir nodes=8 gpus=8 cpus=4 base=16800 timeout=60 harvest=""
  if [ "$cmd" = start ]; then
    dir=$(abs_dir "$2") || die "cannot create $2"
  elif [ -d "$2" ]; then
    dir=$(cd "$2" && pwd -P)
  else
    [ "$cmd" = stop ] && return 0
    die "no cluster in $2 (no such directory)"
  fi
  shift 2
  case $cmd in
    start)
      while [ $# -gt 0 ]; do
        [ $# -ge 2 ] || usage
        case $1 in
          --nodes) nodes=$2 ;; --gpus) gpus=$2 ;; --cpus) cpus=$2 ;;
          --base-port) base=$2 ;; --timeout) timeout=$2 ;;
          --harvest) harvest=$(abs_file "$2") || die "--harvest $2: no such directory" ;;
          *) usage ;;
        esac
        shift 2
      done
      cmd_start "$dir" "$nodes" "$gpus" "$cpus" "$base" "$timeout" "$harvest" ;;
    stop) [ $# -eq 0 ] || usage; cmd_stop "$dir" ;;
    status) [ $# -eq 0 ] || usage; cmd_status "$dir" ;;
    _supervise) supervise "$dir" "$@" ;;
    *) usage ;;
  esac
}

main "$@"

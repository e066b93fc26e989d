#!/usr/bin/env bash
# slurm.sh -- start/stop a throw-away single-node Slurm cluster for hvdlite's tests (root only).
#
#   tests/cluster/slurm.sh install   Debian's slurmctld/slurmd/slurm-client/munge/libpmix2, if missing
#   tests/cluster/slurm.sh start     install if needed, write the config, start munged, slurmctld and
#                                    slurmd as background daemons, wait until the node is idle, then
#                                    print "export SLURM_CONF=..." (clients need it: no /etc is touched)
#   tests/cluster/slurm.sh stop      cancel the cluster's jobs, stop the three daemons by pid file
#
# Everything lives in $HVDT_SLURM_STATE (default ${TMPDIR:-/tmp}/hvdlite-slurm); all traffic is on
# 127.0.0.1. The node advertises $HVDT_SLURM_CPUS CPUs (default 4, more than the machine may have,
# so 2 x 2 layouts fit on a 2-core box). MpiDefault is none, as on many real clusters: a plain
# `srun -n 2` then starts MPI singletons, which hvdlite must refuse.
set -euo pipefail

STATE=${HVDT_SLURM_STATE:-${TMPDIR:-/tmp}/hvdlite-slurm}
NODE=${HVDT_SLURM_NODE:-$(hostname -s)}
CPUS=${HVDT_SLURM_CPUS:-4}
WAIT_S=${HVDT_SLURM_WAIT_S:-60}
CONF=$STATE/etc/slurm.conf
SOCK=$STATE/munge/munge.socket

say() { echo "[hvdlite slurm.sh] $*" >&2; }
fail() { say "ERROR: $*"; exit 1; }

# ---- shared helpers (also sourced by netns.sh) -------------------------------------------------
# alive PIDFILE NAME: the file holds the pid of a live process called NAME
alive() {
  local p
  [ -s "$1" ] || return 1
  p=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$p" ] && [ -r "/proc/$p/comm" ] && [ "$(cat "/proc/$p/comm")" = "$2" ]
}

# halt PIDFILE NAME: TERM the daemon named in PIDFILE (only if it still is NAME), KILL after 15 s
halt() {
  local p
  if ! alive "$1" "$2"; then rm -f "$1"; return 0; fi
  p=$(cat "$1")
  kill -TERM "$p" 2>/dev/null || true
  for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$p" 2>/dev/null; then say "$2 (pid $p) ignored TERM; KILL"; kill -KILL "$p" 2>/dev/null || true; fi
  rm -f "$1"
  say "stopped $2 (pid $p)"
}

install_slurm() {
  local want=()
  command -v slurmctld >/dev/null 2>&1 || want+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || want+=(slurmd)
  command -v srun >/dev/null 2>&1 || want+=(slurm-client)
  command -v munged >/dev/null 2>&1 || want+=(munge)
  dpkg -s libpmix2 >/dev/null 2>&1 || want+=(libpmix2)
  if [ ${#want[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || fail "Slurm is not installed and there is no apt-get to install: ${want[*]}"
    say "apt-get install ${want[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # the packages' maintainer scripts must not start system daemons: deny it for the install
    local added_policy=0 rc=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && added_policy=1
    fi
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null; } || rc=$?
    [ $added_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ $rc = 0 ] || fail "apt-get install ${want[*]} failed (rc=$rc)"
  fi
  # srun --mpi=pmix dlopen()s .../pmix2/lib/libpmix.so, a link only libpmix-dev ships: make it
  local lib
  lib=$(dpkg -L libpmix2 | grep -m1 '/pmix2/lib/libpmix\.so\.2$' || true)
  [ -n "$lib" ] || fail "libpmix2 has no pmix2/lib/libpmix.so.2"
  [ -e "${lib%.2}" ] || { ln -s libpmix.so.2 "${lib%.2}"; say "linked ${lib%.2}"; }
}

# start_munge DIR LOGDIR: a munged with its own key and socket in DIR
start_munge() {
  local dir=$1 logdir=$2
  mkdir -p "$dir" "$logdir"
  chmod 755 "$dir"
  if [ ! -s "$dir/munge.key" ]; then
    mungekey --create --keyfile="$dir/munge.key" --bits=1024 >/dev/null 2>&1 \
      || dd if=/dev/urandom of="$dir/munge.key" bs=128 count=1 status=none
    chmod 400 "$dir/munge.key"
  fi
  if ! alive "$dir/munged.pid" munged; then
    rm -f "$dir/munge.socket" "$dir/munge.socket.lock"
    munged --key-file="$dir/munge.key" --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
           --log-file="$logdir/munged.log" --seed-file="$dir/munged.seed"
  fi
  munge --socket="$dir/munge.socket" -n | unmunge --socket="$dir/munge.socket" >/dev/null \
    || fail "munge does not work (see $logdir/munged.log)"
}

# common_conf: the slurm.conf lines every test cluster shares (no accounting, no cgroups)
common_conf() {
  cat <<CONF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
CONF
}

# ---- commands -------------------------------------------------------------------------------------
cmd_start() {
  [ "$(id -u)" = 0 ] || fail "must run as root (the daemons run as root)"
  install_slurm
  mkdir -p "$STATE/etc" "$STATE/ctld" "$STATE/spool" "$STATE/run" "$STATE/log"
  chmod 755 "$STATE"
  {
    echo "# written by hvdlite tests/cluster/slurm.sh: one node on 127.0.0.1"
    echo "ClusterName=hvdlite"
    echo "SlurmctldHost=$NODE(127.0.0.1)"
    echo "AuthInfo=socket=$SOCK"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool"
    echo "SlurmctldPidFile=$STATE/run/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/run/slurmd.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE/log/slurmd.log"
    common_conf
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=4000 State=UNKNOWN"
    echo "PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF.new"
  if [ -f "$CONF" ] && ! cmp -s "$CONF" "$CONF.new"; then
    halt "$STATE/run/slurmd.pid" slurmd; halt "$STATE/run/slurmctld.pid" slurmctld
  fi
  mv "$CONF.new" "$CONF"
  export SLURM_CONF=$CONF
  start_munge "$STATE/munge" "$STATE/log"
  if ! alive "$STATE/run/slurmctld.pid" slurmctld; then
    slurmctld -c -f "$CONF"
    for _ in $(seq 50); do alive "$STATE/run/slurmctld.pid" slurmctld && break; sleep 0.1; done
    alive "$STATE/run/slurmctld.pid" slurmctld || { tail -20 "$STATE/log/slurmctld.log" >&2; fail "slurmctld did not start"; }
  fi
  if ! alive "$STATE/run/slurmd.pid" slurmd; then
    slurmd -f "$CONF" -N "$NODE"
    for _ in $(seq 50); do alive "$STATE/run/slurmd.pid" slurmd && break; sleep 0.1; done
    alive "$STATE/run/slurmd.pid" slurmd || { tail -20 "$STATE/log/slurmd.log" >&2; fail "slurmd did not start"; }
  fi
  local st="" resumed=0 end=$((SECONDS + WAIT_S))
  while [ $SECONDS -lt $end ]; do
    st=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1 || true)
    case "$st" in
      idle|mixed|allocated|completing) break ;;
      down*|drain*|fail*) [ $resumed = 1 ] || { scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true; resumed=1; } ;;
    esac
    sleep 0.2
  done
  case "$st" in
    idle|mixed|allocated|completing) ;;
    *) tail -20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2; fail "node $NODE not ready after ${WAIT_S}s ('$st')" ;;
  esac
  say "node $NODE is $st, $CPUS CPUs; $(srun --version)"
  echo "export SLURM_CONF=$CONF"
}

cmd_stop() {
  if [ -f "$CONF" ] && alive "$STATE/run/slurmctld.pid" slurmctld; then
    export SLURM_CONF=$CONF
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  # both at once: each may take seconds to save its state
  halt "$STATE/run/slurmd.pid" slurmd & halt "$STATE/run/slurmctld.pid" slurmctld & wait
  halt "$STATE/munge/munged.pid" munged
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    install) [ "$(id -u)" = 0 ] || fail "must run as root"; install_slurm ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
  esac
fi

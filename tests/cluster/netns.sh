#!/usr/bin/env bash
# netns.sh -- pretend hosts for hvdlite's multi-host tests (root only).
#
# Host hK is a network namespace <prefix>-hK whose interface "hvd0" has $NET.K/24; all hosts hang off a
# bridge in namespace <prefix>-sw, with no route anywhere else. $DIR/nsrsh is an ssh stand-in: it runs a
# command "on" a host, inside its namespace, with the host's own hostname (UTS namespace), /etc/hosts
# naming every pretend host, a /sys of its namespace (so /sys/class/net shows its hvd0), and a /dev/shm of its
# own ($DIR/shm/hK, bound on /dev/shm: what one host keeps there, the others and this machine do not see).
#
#   tests/cluster/netns.sh up N       create h1..hN
#   tests/cluster/netns.sh slurm-up   munged + slurmctld (on h1) + one slurmd per host, wait until idle
#   tests/cluster/netns.sh slurm-down stop those daemons (by pid file)
#   tests/cluster/netns.sh down       slurm-down, then delete the namespaces
#
# Settings: HVDT_NETNS_PREFIX [hvdt], HVDT_NETNS_NET [10.78.0],
#           HVDT_NETNS_DIR [${TMPDIR:-/tmp}/hvdlite-netns], HVDT_NETNS_CPUS per host [2],
#           HVDT_NETNS_GPUS pretend GPUs per host [2].
# $DIR/mpi.env holds the MPI settings for these hosts (TCP over hvd0 only); source it before launching.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm.sh
. "$HERE/slurm.sh"

PFX=${HVDT_NETNS_PREFIX:-hvdt}
NET=${HVDT_NETNS_NET:-10.78.0}
DIR=${HVDT_NETNS_DIR:-${TMPDIR:-/tmp}/hvdlite-netns}
HCPUS=${HVDT_NETNS_CPUS:-2}
HGPUS=${HVDT_NETNS_GPUS:-2}
SL=$DIR/slurm

say() { echo "[hvdlite netns.sh] $*" >&2; }

host_names() { awk '$1 ~ /^h[0-9]+$/ {print $1}' "$DIR/hosts.map"; }

write_nsrsh() {
  cat > "$DIR/nsrsh" <<'NSRSH'
#!/bin/bash
# nsrsh [ssh options] HOST COMMAND...: run COMMAND "on" HOST, a network namespace of hvdlite's tests.
# Like ssh, the words of COMMAND are joined by spaces and run by /bin/sh -c.
DIR=$(cd "$(dirname "$0")" && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-E|-b|-c|-m) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1; shift
read -r ns hn < <(awk -v h="$host" '$1 == h {print $2, $3; exit}' "$DIR/hosts.map")
if [ -z "$ns" ]; then echo "nsrsh: unknown host '$host'" >&2; exit 255; fi
mkdir -p "$DIR/.cg"
mkdir -p "$DIR/shm/$hn" && chmod 1777 "$DIR/shm/$hn"
exec nsenter --net=/run/netns/"$ns" unshare --uts --mount --propagation private /bin/sh -c '
  hn=$1 hosts=$2 cg=$3 shm=$4; shift 4
  mount --bind "$hosts" /etc/hosts
  mount --bind "$shm" /dev/shm
  if mount --rbind /sys/fs/cgroup "$cg" 2>/dev/null; then
    umount -l /sys && mount -t sysfs sysfs /sys && mount --move "$cg" /sys/fs/cgroup
  fi
  hostname "$hn"
  exec /bin/sh -c "$*"' nsrsh "$hn" "$DIR/hosts" "$DIR/.cg" "$DIR/shm/$hn" "$@"
NSRSH
  chmod +x "$DIR/nsrsh"
}

write_mpi_env() {
  cat > "$DIR/mpi.env" <<'ENV'
# MPI between the pretend hosts: TCP on hvd0 only
export HYDRA_IFACE=hvd0
# the hosts share one kernel: without this UCX would use shared memory between them
export UCX_TLS=self,tcp
export UCX_NET_DEVICES=hvd0
export FI_PROVIDER=tcp
export FI_TCP_IFACE=hvd0
# MPICH: OFI's tcp provider, whose addresses are small. UCX's are several KiB, which MPICH puts into
# PMI-2 in 1 KiB pieces; Slurm 22.05's pmi2 plugin at times reads such a request split in two
# ("mpi/pmi2: value not properly terminated in client request") and the job hangs.
export MPIR_CVAR_CH4_NETMOD=ofi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=hvd0 OMPI_MCA_oob_tcp_if_include=hvd0
export OMPI_MCA_coll_han_priority=0
ENV
}

cmd_up() {
  local n=${1:-2} k
  [ "$(id -u)" = 0 ] || fail "must run as root (network namespaces)"
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
    || fail "needs ip (iproute2), nsenter and unshare (util-linux)"
  if ip netns list | grep -qE "^$PFX-(sw|h[0-9]+)( |$)"; then
    say "namespaces $PFX-* exist already: removing them first"; cmd_down
  fi
  mkdir -p "$DIR"
  ip netns add "$PFX-sw"
  ip -n "$PFX-sw" link add br0 type bridge
  ip -n "$PFX-sw" link set br0 up
  : > "$DIR/hosts.map"; printf '127.0.0.1 localhost\n' > "$DIR/hosts"
  for k in $(seq 1 "$n"); do
    ip netns add "$PFX-h$k"
    ip link add name hvd0 netns "$PFX-h$k" type veth peer name "p$k" netns "$PFX-sw"
    ip -n "$PFX-sw" link set "p$k" master br0 up
    ip -n "$PFX-h$k" addr add "$NET.$k/24" dev hvd0
    ip -n "$PFX-h$k" link set lo up
    ip -n "$PFX-h$k" link set hvd0 up
    printf 'h%s %s h%s\n%s %s h%s\n' "$k" "$PFX-h$k" "$k" "$NET.$k" "$PFX-h$k" "$k" >> "$DIR/hosts.map"
    printf '%s h%s\n' "$NET.$k" "$k" >> "$DIR/hosts"
  done
  write_nsrsh
  write_mpi_env
  say "up: $(host_names | tr '\n' ' ')on $NET.0/24"
}

cmd_slurm_up() {
  [ -f "$DIR/hosts.map" ] || fail "no hosts: run '$0 up' first"
  install_slurm
  local h n
  n=$(host_names | wc -l)
  mkdir -p "$SL/etc" "$SL/ctld" "$SL/run" "$SL/log"
  chmod 755 "$SL"
  {
    echo "# written by hvdlite tests/cluster/netns.sh: $n nodes, each a network namespace"
    echo "ClusterName=hvdlitenet"
    echo "SlurmctldHost=h1($NET.1)"
    echo "AuthInfo=socket=$SL/munge/munge.socket"
    echo "StateSaveLocation=$SL/ctld"
    echo "SlurmdSpoolDir=$SL/spool-%n"
    echo "SlurmctldPidFile=$SL/run/slurmctld.pid"
    echo "SlurmdPidFile=$SL/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$SL/log/slurmctld.log"
    echo "SlurmdLogFile=$SL/log/slurmd-%n.log"
    # all "nodes" share /tmp: give each its own TmpFS (the pmix plugin keeps per-node files there)
    echo "TmpFS=$SL/tmp-%n"
    common_conf
    # pretend GPUs (no devices): lets the GPU job templates run unchanged; Slurm sets CUDA_VISIBLE_DEVICES
    echo "GresTypes=gpu"
    for h in $(host_names); do
      echo "NodeName=$h NodeAddr=$(awk -v h="$h" '$2 == h {print $1}' "$DIR/hosts") CPUs=$HCPUS RealMemory=2000 Gres=gpu:$HGPUS State=UNKNOWN"
    done
    echo "PartitionName=net Nodes=$(host_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP"
  } > "$SL/etc/slurm.conf"
  mkdir -p "$SL/dev"; for g in $(seq 0 $((HGPUS - 1))); do : > "$SL/dev/nvidia$g"; done
  echo "Name=gpu File=$SL/dev/nvidia[0-$((HGPUS - 1))]" > "$SL/etc/gres.conf"
  for h in $(host_names); do mkdir -p "$SL/tmp-$h"; done
  start_munge "$SL/munge" "$SL/log"
  alive "$SL/run/slurmctld.pid" slurmctld || "$DIR/nsrsh" h1 "SLURM_CONF=$SL/etc/slurm.conf slurmctld -c -f $SL/etc/slurm.conf"
  for h in $(host_names); do
    alive "$SL/run/slurmd-$h.pid" slurmd || "$DIR/nsrsh" "$h" "SLURM_CONF=$SL/etc/slurm.conf slurmd -f $SL/etc/slurm.conf -N $h"
  done
  local st=""
  for _ in $(seq 300); do
    st=$("$DIR/nsrsh" h1 "SLURM_CONF=$SL/etc/slurm.conf sinfo -h -N -o %t" 2>/dev/null | sort -u | tr '\n' ' ' || true)
    [ "$st" = "idle " ] && break
    sleep 0.2
  done
  [ "$st" = "idle " ] || { tail -n 5 "$SL"/log/*.log >&2; fail "nodes not idle: '$st' (logs in $SL/log)"; }
  say "slurm up: $n nodes idle; clients: nsrsh h1 'SLURM_CONF=$SL/etc/slurm.conf srun ...'"
}

cmd_slurm_down() {
  local f
  if [ -f "$SL/etc/slurm.conf" ] && alive "$SL/run/slurmctld.pid" slurmctld && [ -x "$DIR/nsrsh" ]; then
    "$DIR/nsrsh" h1 "export SLURM_CONF=$SL/etc/slurm.conf; j=\$(squeue -h -o %i); [ -z \"\$j\" ] || scancel \$j; for i in \$(seq 50); do [ -z \"\$(squeue -h -o %i)\" ] && break; sleep 0.2; done" || true
  fi
  for f in "$SL"/run/slurmd-*.pid; do [ -e "$f" ] && halt "$f" slurmd & done
  halt "$SL/run/slurmctld.pid" slurmctld &
  wait
  halt "$SL/munge/munged.pid" munged
}

cmd_down() {
  cmd_slurm_down || true
  local ns pids
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PFX-(sw|h[0-9]+)$" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
      say "killing processes left in $ns: $pids"
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" && say "deleted netns $ns"
  done
  rmdir "$DIR/.cg" 2>/dev/null || true
  rm -rf "$DIR/shm"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  slurm-up) cmd_slurm_up ;;
  slurm-down) cmd_slurm_down ;;
  down) cmd_down ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac

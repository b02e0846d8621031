#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests and for trying the sbatch templates.
#
#   bash slurm/cluster.sh start [--install]   # --install: apt-get the Debian packages if missing
#   bash slurm/cluster.sh status
#   bash slurm/cluster.sh stop
#
# Needs root and Debian's slurmctld, slurmd, slurm-client and munge (--install gets them). It
# writes /etc/slurm/slurm.conf for this machine (hostname, CPUs, memory; one partition "debug")
# unless a slurm.conf not written by this script is there already: a real cluster's config is
# never touched. State and logs go to $ALBATROSS_SLURM_DIR (default /tmp/albatross-slurm).
# Exit codes: 0 ready, 1 failed to start, 3 cannot run here (not root, no packages).
set -euo pipefail

STATE=${ALBATROSS_SLURM_DIR:-/tmp/albatross-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by albatross slurm/cluster.sh"
HOST=$(hostname -s)

die() { echo "slurm/cluster.sh: $*" >&2; exit "${2:-1}"; }

have_packages() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
  && command -v sbatch >/dev/null && command -v munged >/dev/null; }

install_packages() {
  [ "$(id -u)" = 0 ] || die "installing packages needs root" 3
  command -v apt-get >/dev/null || die "no apt-get: install slurmctld slurmd slurm-client munge yourself" 3
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; not touching it" 3
  fi
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
  cat > "$CONF.tmp" <<EOF
$MARK
ClusterName=albatross
SlurmctldHost=$HOST
AuthType=auth/munge
# Requeued jobs may start again after this many seconds (Slurm default 120; a test cluster
# should not idle that long). Slurm holds a requeued job until its old credential expired.
AuthInfo=cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=30
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  mv "$CONF.tmp" "$CONF"
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "munged" || munged --force
  else
    munged --force
  fi
}

wait_ready() {
  for _ in $(seq 1 60); do
    if sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then return 0; fi
    sleep 0.5
  done
  return 1
}

start() {
  if [ "${1:-}" = "--install" ] && ! have_packages; then install_packages; fi
  [ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as any user)" 3
  have_packages || die "Slurm packages missing: run with --install (Debian: slurmctld slurmd slurm-client munge)" 3
  write_conf
  start_munge
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  if ! wait_ready; then
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    wait_ready || die "the node did not become ready; logs in $STATE/log"
  fi
  echo "slurm ready: node $HOST ($(nproc) CPUs), partition debug; logs in $STATE/log"
}

stop() {
  scancel --full --quiet -u "$(id -un)" 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  for _ in $(seq 1 20); do
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break
    sleep 0.5
  done
  echo "slurm stopped"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) sinfo && squeue ;;
  *) die "usage: bash slurm/cluster.sh start [--install] | status | stop" 2 ;;
esac

#!/usr/bin/env bash
# A Slurm cluster of N nodes on this one machine, with accounting: for trying the sbatch
# templates and the Python launcher across nodes on a workstation, and for the tests.
#
#   bash slurm/cluster.sh start [--nodes N] [--install] [--no-accounting]
#   bash slurm/cluster.sh config [--nodes N] [--no-accounting]  # the slurm.conf start would write
#   bash slurm/cluster.sh status              # sinfo, squeue and the last jobs from sacct
#   bash slurm/cluster.sh stop [--purge]      # --purge also deletes the state and the job database
#   bash slurm/cluster.sh kill-node NAME      # a node failure: its slurmd and its job tasks die
#   bash slurm/cluster.sh revive-node NAME    # the node comes back (slurmd restarted, resumed)
#
# Each node is its own slurmd (`slurmd -N <node>`) with its own port and its own loopback address
# (albatross-node1 = 127.0.10.1, albatross-node2 = 127.0.10.2, ...; the names go into /etc/hosts
# between marker lines and are removed by `stop`), so a job's node list, its master address and
# every task's node and local rank are those of a real multi-node job; all traffic stays on
# loopback. One munged and one slurmctld serve them. Accounting: slurmdbd on a MariaDB server of
# its own (data in the state directory, listening on 127.0.0.1 only), so `sacct` and submitit
# see the true job states (COMPLETED, FAILED, PREEMPTED, REQUEUED, NODE_FAIL, ...).
#
# `start` is idempotent: a cluster already running with the same settings is left alone; other
# settings (another --nodes) restart the daemons with the new ones, keeping the job database.
#
# Needs root and Debian's slurmctld, slurmd, slurm-client, munge and (for accounting) slurmdbd
# and mariadb-server; --install gets them with apt-get. It writes /etc/slurm/slurm.conf and
# /etc/slurm/slurmdbd.conf unless a slurm.conf not written by this script is there already: a
# real cluster's configuration is never touched. State and logs go to $ALBATROSS_SLURM_DIR
# (default /tmp/albatross-slurm). Ports (loopback): slurmctld 16817, slurmdbd 16819, MariaDB
# 16306, slurmd 17001.. (one per node).
# Exit codes: 0 ready, 1 failed to start (logs named), 2 usage, 3 cannot run here (not root,
# no packages, another cluster's config).
set -euo pipefail

STATE=${ALBATROSS_SLURM_DIR:-/tmp/albatross-slurm}
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
MARK="# written by albatross slurm/cluster.sh"
HOSTS_BEGIN="# >>> albatross slurm/cluster.sh nodes"
HOSTS_END="# <<< albatross slurm/cluster.sh nodes"
PREFIX=albatross-node
CTLD_PORT=16817
DBD_PORT=16819
DB_PORT=16306
SLURMD_PORT0=17000
DB_SOCKET=$STATE/db-run/mysqld.sock
DB_PASS=albatross-local

die() { echo "slurm/cluster.sh: $*" >&2; exit "${2:-1}"; }
log() { echo "slurm/cluster.sh: $*" >&2; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
  && command -v sbatch >/dev/null && command -v munged >/dev/null; }
have_accounting() { command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null \
  && command -v mariadb-install-db >/dev/null; }

install_packages() {
  [ "$(id -u)" = 0 ] || die "installing packages needs root" 3
  command -v apt-get >/dev/null ||
    die "no apt-get: install slurmctld slurmd slurm-client munge slurmdbd mariadb-server yourself" 3
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge slurmdbd mariadb-server >/dev/null
}

node_names() { local i; for i in $(seq 1 "$1"); do echo "$PREFIX$i"; done; }

# The CPUs this machine gives its processes. GNU nproc answers OMP_NUM_THREADS (and
# OMP_THREAD_LIMIT) when they are set: a shell with OMP_NUM_THREADS=1 would otherwise make
# one-CPU nodes, on which sbatch refuses every job with two tasks per node.
node_cpus() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }

# /etc/hosts: the node names between two marker lines, matched as literal whole lines (awk, never
# a regex: the markers hold a "/"). Before the first edit the file is copied to $STATE/hosts.orig;
# removing the block gives back that copy byte for byte when nothing else in the file changed.
# Earlier versions of this script, whose sed took the "/" for the end of the address, replaced the
# opening marker with the line in HOSTS_GARBAGE: such a line opens a block too, so it is repaired.
HOSTS_FILE=${ALBATROSS_HOSTS_FILE:-/etc/hosts}
HOSTS_GARBAGE='luster.sh nodes$/,/^# <<< albatross slurm/cluster.sh nodes$/d'

hosts_without_block() { # $HOSTS_FILE without our blocks (and old versions' leftovers) -> stdout
  awk -v begin="$HOSTS_BEGIN" -v end="$HOSTS_END" -v garbage="$HOSTS_GARBAGE" '
    $0 == begin || $0 == garbage { if (inside) printf "%s", held; inside = 1; held = ""; next }
    inside && $0 == end { inside = 0; held = ""; next }
    inside { held = held $0 "\n"; next }
    { print }
    END { if (inside) printf "%s", held } # a block never closed: keep what followed its marker
  ' "$HOSTS_FILE"
}

hosts_rewrite() { # stdin -> $HOSTS_FILE, in place (it may be a bind mount), only when it differs
  local tmp
  tmp=$(mktemp)
  cat >"$tmp"
  cmp -s "$tmp" "$HOSTS_FILE" || cat "$tmp" >"$HOSTS_FILE"
  rm -f "$tmp"
}

write_hosts() { # the node names -> 127.0.10.<i>, between the marker lines
  local n=$1 i stripped
  mkdir -p "$STATE"
  if ! grep -qxF -e "$HOSTS_BEGIN" -e "$HOSTS_GARBAGE" "$HOSTS_FILE"; then
    cp -p "$HOSTS_FILE" "$STATE/hosts.orig" # as it was before this script touched it
  fi
  stripped=$(mktemp)
  hosts_without_block >"$stripped"
  {
    cat "$stripped"
    echo "$HOSTS_BEGIN"
    for i in $(seq 1 "$n"); do echo "127.0.10.$i $PREFIX$i"; done
    echo "$HOSTS_END"
  } | hosts_rewrite
  rm -f "$stripped"
}

remove_hosts() { # the block (and old leftovers) out; the original bytes back where they match
  grep -qxF -e "$HOSTS_BEGIN" -e "$HOSTS_GARBAGE" "$HOSTS_FILE" 2>/dev/null || return 0
  local stripped
  stripped=$(mktemp)
  hosts_without_block >"$stripped"
  # awk ends every line with a newline: an original without a final newline compares equal
  # once one is added, and is then restored exactly.
  if [ -f "$STATE/hosts.orig" ] &&
    cmp -s "$stripped" <(cat "$STATE/hosts.orig"; [ -z "$(tail -c1 "$STATE/hosts.orig")" ] || echo); then
    hosts_rewrite <"$STATE/hosts.orig"
  else
    hosts_rewrite <"$stripped"
  fi
  rm -f "$stripped" "$STATE/hosts.orig"
}

check_conf_is_ours() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; not touching it" 3
  fi
}

conf_text() { # conf_text N ACCOUNTING
  local n=$1 accounting=$2 cpus mem host i nodes
  host=$(hostname -s)
  cpus=$(node_cpus)
  mem=$((($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024) / n))
  nodes="$PREFIX[1-$n]"
  cat <<EOF
$MARK (--nodes $n)
ClusterName=albatross
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
# Requeued jobs may start again after this many seconds (Slurm default 120; a test cluster
# should not idle that long). Slurm holds a requeued job until its old credential expired.
AuthInfo=cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# Every node is this machine: take the node sizes below as given.
SlurmdParameters=config_overrides
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
# A node whose slurmd stops answering is declared DOWN after this many seconds (its jobs:
# NODE_FAIL, requeued when they allow it).
SlurmdTimeout=20
EOF
  if [ "$accounting" = 1 ]; then
    cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
EOF
  fi
  for i in $(seq 1 "$n"); do
    echo "NodeName=$PREFIX$i NodeHostname=$host NodeAddr=127.0.10.$i Port=$((SLURMD_PORT0 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
}

dbd_conf_text() {
  cat <<EOF
$MARK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
AuthType=auth/munge
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
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

db_running() { [ -S "$DB_SOCKET" ] && mariadb-admin --socket="$DB_SOCKET" -u root ping >/dev/null 2>&1; }

start_database() {
  if db_running; then return; fi
  if [ ! -d "$STATE/mysql/mysql" ]; then
    rm -rf "$STATE/mysql"
    mkdir -p "$STATE/mysql"
    chown mysql:mysql "$STATE/mysql"
    mariadb-install-db --user=mysql --datadir="$STATE/mysql" --skip-test-db \
      --auth-root-authentication-method=socket >"$STATE/log/mariadb-install.log" 2>&1 ||
      die "MariaDB could not initialise $STATE/mysql; see $STATE/log/mariadb-install.log"
  fi
  chmod o+x "$STATE" # the mysql user reaches its data directory and socket through here
  mkdir -p "$STATE/db-run" && chown mysql:mysql "$STATE/db-run"
  touch "$STATE/log/mariadb.log" && chown mysql:mysql "$STATE/log/mariadb.log"
  # A small server: 16 MB of buffer pool and redo log are plenty for a job table.
  setsid mariadbd --user=mysql --datadir="$STATE/mysql" --socket="$DB_SOCKET" \
    --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$STATE/db-run/mysqld.pid" \
    --log-error="$STATE/log/mariadb.log" --skip-name-resolve --innodb-buffer-pool-size=16M \
    --innodb-log-file-size=16M </dev/null >/dev/null 2>&1 &
  for _ in $(seq 1 120); do
    db_running && break
    sleep 0.25
  done
  db_running || die "MariaDB did not start; see $STATE/log/mariadb.log"
  mariadb --socket="$DB_SOCKET" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the accounting database user; see $STATE/log/mariadb.log"
}

dbd_ready() { timeout 10 sacctmgr -n -P show cluster format=cluster >/dev/null 2>&1; }

start_dbd() {
  if ! pgrep -x slurmdbd >/dev/null; then slurmdbd; fi
  for _ in $(seq 1 80); do
    dbd_ready && break
    sleep 0.25
  done
  dbd_ready || die "slurmdbd did not answer; see $STATE/log/slurmdbd.log"
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx albatross; then
    sacctmgr -i add cluster albatross >/dev/null || die "sacctmgr could not add the cluster"
  fi
}

wait_ready() { # wait_ready N: every node idle/mixed/allocated
  local n=$1
  for _ in $(seq 1 80); do
    if [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)')" -ge "$n" ]; then
      return 0
    fi
    sleep 0.25
  done
  return 1
}

start_slurmd() { # start_slurmd NODE
  local pidfile=$STATE/slurmd-$1.pid
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then return; fi
  mkdir -p "$STATE/d/$1"
  slurmd -N "$1"
}

stop_daemons() { # slurmd + slurmctld + slurmdbd (the database stays)
  local name
  for name in slurmd slurmctld slurmdbd; do pkill -x "$name" 2>/dev/null || true; done
  for _ in $(seq 1 40); do
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || pgrep -x slurmdbd >/dev/null ||
      return 0
    sleep 0.25
  done
  for name in slurmd slurmctld slurmdbd; do pkill -9 -x "$name" 2>/dev/null || true; done
}

parse_options() { # parse_options COMMAND ARGS...: sets n, install and accounting
  local command=$1
  shift
  n=2 install=0 accounting=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) n=${2:?--nodes needs a number}; shift 2 ;;
      --nodes=*) n=${1#--nodes=}; shift ;;
      --install) install=1; shift ;;
      --no-accounting) accounting=0; shift ;;
      *) die "unknown option '$1' ($command [--nodes N] [--install] [--no-accounting])" 2 ;;
    esac
  done
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive number, got '$n'" 2
  [ "$n" -le 64 ] || die "--nodes $n: at most 64 nodes on one machine" 2
}

start() {
  local n install accounting
  parse_options start "$@"
  [ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as any user)" 3
  if [ "$install" = 1 ] && { ! have_slurm || { [ "$accounting" = 1 ] && ! have_accounting; }; }; then
    install_packages
  fi
  have_slurm || die "Slurm packages missing: run with --install (Debian: slurmctld slurmd slurm-client munge)" 3
  if [ "$accounting" = 1 ] && ! have_accounting; then
    die "accounting packages missing: run with --install (Debian: slurmdbd mariadb-server) or use --no-accounting" 3
  fi
  check_conf_is_ours
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
  local new fresh_db=0
  new=$(conf_text "$n" "$accounting")
  if [ -f "$CONF" ] && [ "$new" != "$(cat "$CONF")" ]; then
    log "settings changed: restarting the daemons"
    stop_daemons
    # Node names and the node table change: start the controller with a fresh state, and
    # (since job ids start again at 1) a fresh job database.
    rm -rf "$STATE/ctld" "$STATE/d" && mkdir -p "$STATE/ctld" "$STATE/d"
    fresh_db=1
  fi
  printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  write_hosts "$n"
  start_munge
  if [ "$accounting" = 1 ]; then
    (umask 077 && dbd_conf_text >"$DBD_CONF.tmp") && mv "$DBD_CONF.tmp" "$DBD_CONF"
    start_database
    if [ "$fresh_db" = 1 ]; then
      mariadb --socket="$DB_SOCKET" -u root -e "DROP DATABASE IF EXISTS slurm_acct_db" || true
    fi
    start_dbd
  fi
  pgrep -x slurmctld >/dev/null || slurmctld
  local node
  for node in $(node_names "$n"); do start_slurmd "$node"; done
  if ! wait_ready "$n"; then
    scontrol update nodename="$PREFIX[1-$n]" state=resume >/dev/null 2>&1 || true
    wait_ready "$n" || die "the nodes did not become ready ($(sinfo -h -N -o '%N %T' | tr '\n' ' ')); logs in $STATE/log"
  fi
  local acct="no accounting"
  [ "$accounting" = 1 ] && acct="accounting: slurmdbd + MariaDB (sacct)"
  echo "slurm ready: $n nodes $PREFIX[1-$n] ($(node_cpus) CPUs each), partition debug; $acct; logs in $STATE/log"
}

stop_stepds() { # the job step daemons outlive slurmd and may ignore SIGTERM: SIGKILL after 5 s
  pkill -x slurmstepd 2>/dev/null || return 0
  for _ in $(seq 1 20); do pgrep -x slurmstepd >/dev/null || return 0; sleep 0.25; done
  pkill -9 -x slurmstepd 2>/dev/null || true
}

stop() {
  local purge=0
  [ "${1:-}" = "--purge" ] && purge=1
  scancel --full --quiet -u "$(id -un)" 2>/dev/null || true
  stop_daemons
  if [ -f "$STATE/db-run/mysqld.pid" ]; then
    local pid
    pid=$(cat "$STATE/db-run/mysqld.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 80); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  fi
  stop_stepds
  remove_hosts
  if [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then rm -f "$CONF" "$DBD_CONF"; fi
  if [ "$purge" = 1 ]; then rm -rf "$STATE"; fi
  echo "slurm stopped"
}

node_pids() { # the PIDs of the job tasks and step daemons running on node $1
  local p env
  for p in /proc/[0-9]*; do
    env=$(tr '\0' '\n' <"$p/environ" 2>/dev/null) || continue
    if grep -qx "SLURMD_NODENAME=$1" <<<"$env"; then
      echo "${p#/proc/}"
      cat "$p/stat" 2>/dev/null | awk '{print $4}' # its parent: slurmstepd or the batch shell
    fi
  done | sort -u
}

kill_node() { # slurmd, the node's slurmstepd daemons and its tasks, with SIGKILL
  local node=${1:?kill-node needs a node name}
  local pidfile=$STATE/slurmd-$node.pid pids p
  [ -f "$pidfile" ] || die "no node '$node' running here (no $pidfile)" 2
  kill -9 "$(cat "$pidfile")" 2>/dev/null || true
  pids=$(node_pids "$node")
  for p in $pids; do
    case "$(cat "/proc/$p/comm" 2>/dev/null)" in
      slurmstepd | python* | bash | sh | srun) kill -9 "$p" 2>/dev/null || true ;;
    esac
  done
  echo "node $node killed (slurmd and $(echo "$pids" | grep -c .) job processes)"
}

revive_node() {
  local node=${1:?revive-node needs a node name}
  grep -q "NodeName=$node " "$CONF" 2>/dev/null || die "no node '$node' in $CONF" 2
  start_slurmd "$node"
  scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
  for _ in $(seq 1 80); do
    sinfo -h -n "$node" -o '%T' | grep -qE '^(idle|mixed|allocated)' && break
    sleep 0.25
  done
  echo "node $node: $(sinfo -h -n "$node" -o '%T')"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) shift; stop "$@" ;;
  status)
    sinfo -N && squeue
    if command -v sacct >/dev/null; then sacct -X -a -S now-1hours -o JobID,JobName,NodeList,State,ExitCode 2>/dev/null | tail -20 || true; fi
    ;;
  kill-node) shift; kill_node "$@" ;;
  revive-node) shift; revive_node "$@" ;;
  config) shift; parse_options config "$@"; conf_text "$n" "$accounting" ;;
  # The /etc/hosts edits alone (tests run them on a copy through ALBATROSS_HOSTS_FILE).
  hosts-write) shift; write_hosts "${1:?hosts-write needs a node count}" ;;
  hosts-remove) remove_hosts ;;
  *) die "usage: bash slurm/cluster.sh start [--nodes N] [--install] [--no-accounting] | config [--nodes N] [--no-accounting] | status | stop [--purge] | kill-node NAME | revive-node NAME" 2 ;;
esac

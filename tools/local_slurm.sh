#!/usr/bin/env bash
# A real single-node Slurm on this machine, for trying the cluster path (tools/cluster.py, `report.py run --executor
# slurm`) on a laptop or a CI runner: Debian's slurm-wlm, munge, and slurmdbd on MariaDB for accounting (sacct).
#
#   sudo bash tools/local_slurm.sh start     # installs the packages where missing (apt-get), starts what is not up
#   sudo bash tools/local_slurm.sh status    # sinfo, or why not
#   sudo bash tools/local_slurm.sh stop      # stops what `start` started
#
# The cluster "suite": two slurmd on this host, nodes c1 (16 CPUs, taken first) and c2 (2 CPUs), more than the machine
# has (a job here is a small process that mostly waits). Partitions:
#   debug   (default) c1 and c2; its jobs can be pre-empted, and are then requeued (PreemptMode=REQUEUE)
#   urgent  c2 alone; a higher PriorityTier: its jobs pre-empt debug's jobs on c2
# Idempotent: a second `start` starts only what is down. Its files live under /var/lib/suite-slurm (state, logs, the
# configuration under etc/); it needs root (the daemons, apt-get). Jobs run as the user who submits them.
set -euo pipefail
ACTION="${1:-start}"
BASE="${SUITE_SLURM_DIR:-/var/lib/suite-slurm}"
ETC="$BASE/etc"
export SLURM_CONF="$ETC/slurm.conf"
CLIENT_CONF="${SUITE_SLURM_CLIENT_CONF:-/etc/slurm/slurm.conf}"  # where Slurm's commands look without SLURM_CONF
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

say() { echo "local_slurm: $*"; }
need_root() { [ "$(id -u)" = 0 ] || { say "needs root (daemons, apt-get): sudo bash $0 $ACTION"; exit 2; }; }
# a daemon of ours, by its pid file: running, not a zombie (a killed daemon may linger as one where no init reaps it)
alive() { [ -s "$1" ] && [ -r "/proc/$(cat "$1")/stat" ] && [ "$(cut -d' ' -f3 "/proc/$(cat "$1")/stat")" != Z ]; }

# Slurm's commands read $CLIENT_CONF where no SLURM_CONF is given: `start` makes it a link to ours where the machine
# has none of its own (a site's file or link, even a dangling one, stays as it is; so does a machine without its
# folder), and `stop` removes only a link that `start` made (its mark in $BASE): the machine is left as it was found.
link_conf() {
  [ "$(readlink "$CLIENT_CONF")" = "$SLURM_CONF" ] && return  # ours already, from an earlier start
  if [ -e "$CLIENT_CONF" ] || [ -L "$CLIENT_CONF" ] || [ ! -d "$(dirname "$CLIENT_CONF")" ]; then
    say "$CLIENT_CONF left as the machine has it: Slurm's commands here need SLURM_CONF=$SLURM_CONF"
    return
  fi
  mkdir -p "$BASE"
  ln -s "$SLURM_CONF" "$CLIENT_CONF"
  touch "$BASE/made-client-conf"
}
unlink_conf() {
  if [ -e "$BASE/made-client-conf" ] && [ "$(readlink "$CLIENT_CONF")" = "$SLURM_CONF" ]; then
    rm -f "$CLIENT_CONF"
  fi
  rm -f "$BASE/made-client-conf"
}

install() {
  local missing=()
  for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

configure() {
  mkdir -p "$ETC" "$BASE/log" "$BASE/ctld" "$BASE/spool" /run/munge /var/log/munge
  cat > "$ETC/slurm.conf" <<EOF
ClusterName=suite
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$BASE/ctld
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/slurmctld.pid
SlurmdPidFile=$BASE/slurmd.%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=1
JobRequeue=1
KillWait=10
MinJobAge=300
MaxArraySize=1001
SchedulerParameters=sched_min_interval=100000
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=16819
AccountingStorageEnforce=associations,qos
JobCompType=jobcomp/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=c1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 CPUs=16 RealMemory=8000 Weight=1 State=UNKNOWN
NodeName=c2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002 CPUs=2 RealMemory=2000 Weight=100 State=UNKNOWN
PartitionName=debug Nodes=c1,c2 Default=YES PriorityTier=1 PreemptMode=REQUEUE MaxTime=120 State=UP
PartitionName=urgent Nodes=c2 PriorityTier=10 PreemptMode=OFF MaxTime=120 State=UP
EOF
  cat > "$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=16819
SlurmUser=root
LogFile=$BASE/log/slurmdbd.log
PidFile=$BASE/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=suite
StorageLoc=suite_slurm_acct_db
EOF
  chmod 600 "$ETC/slurmdbd.conf"
}

start() {
  need_root
  install
  configure
  # the nodes' names resolve here (torch.distributed's MASTER_ADDR is a job's first node, as on a real cluster)
  grep -q "suite-slurm" /etc/hosts || echo "127.0.0.1 c1 c2  # suite-slurm" >> /etc/hosts
  if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then  # (a dead munged may linger as a zombie)
    [ -s /etc/munge/munge.key ] || mungekey -c -f >/dev/null
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    runuser -u munge -- munged
    touch "$BASE/started-munged"  # stop stops it: this script started it
  fi
  if ! mariadb -e "select 1" >/dev/null 2>&1; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
    (mariadbd --user=mysql --tmpdir=/tmp >>"$BASE/log/mariadb.log" 2>&1 &)  # not a TMPDIR mysql cannot write
    touch "$BASE/started-mariadbd"
    # ample: a start that fails says why (its log's end) instead of leaving Slurm's tests to err
    for _ in $(seq 360); do mariadb -e "select 1" >/dev/null 2>&1 && break; sleep 0.5; done
    mariadb -e "select 1" >/dev/null 2>&1 || { say "MariaDB did not start in 3 minutes; its log's end:";
                                               tail -5 "$BASE/log/mariadb.log"; exit 1; }
  fi
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'suite';
              GRANT ALL ON suite_slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  if ! alive "$BASE/slurmdbd.pid"; then
    slurmdbd  # reads slurmdbd.conf beside $SLURM_CONF
    for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  sacctmgr -n list cluster format=cluster | grep -qw suite || sacctmgr -i add cluster suite >/dev/null
  alive "$BASE/slurmctld.pid" || slurmctld
  for node in c1 c2; do alive "$BASE/slurmd.$node.pid" || slurmd -N "$node"; done
  for _ in $(seq 120); do
    # a node an earlier session left DOWN or DRAINED (scontrol update ... state=down) is put back
    for node in $(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|drng)/ {print $1}'); do
      scontrol update nodename="$node" state=resume 2>/dev/null || true
    done
    if [ "$(sinfo -h -N -p debug -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = 2 ]; then
      link_conf
      say "up: $(sinfo -h -o '%P %D %t' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
      return
    fi
    sleep 0.5
  done
  say "the nodes did not come up; see $BASE/log/"
  sinfo -N || true
  exit 1
}

stop() {
  need_root
  local pids=()
  for pidfile in "$BASE"/slurmd.*.pid "$BASE/slurmctld.pid" "$BASE/slurmdbd.pid"; do
    alive "$pidfile" && pids+=("$(cat "$pidfile")")
  done
  [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
  for _ in $(seq 40); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.25; done
  for daemon in mariadbd munged; do  # only those this script started: a MariaDB of the machine's own stays
    if [ -e "$BASE/started-$daemon" ]; then
      pkill -x "$daemon" 2>/dev/null || true
      rm -f "$BASE/started-$daemon"
      for _ in $(seq 80); do pgrep -x "$daemon" >/dev/null || break; sleep 0.25; done  # gone before a next start
    fi
  done
  unlink_conf
  if grep -q "# suite-slurm$" /etc/hosts; then  # in place: a container's /etc/hosts cannot be replaced
    grep -v "# suite-slurm$" /etc/hosts > "$BASE/hosts" && cat "$BASE/hosts" > /etc/hosts
  fi
  say "stopped"
}

case "$ACTION" in
  start) start ;;
  stop) stop ;;
  link_conf|unlink_conf) "$ACTION" ;;  # that link alone, as start and stop make and remove it (for the tests)
  status) sinfo 2>/dev/null || { say "not running: bash $0 start"; exit 1; } ;;
  *) say "usage: bash $0 start|status|stop"; exit 2 ;;
esac

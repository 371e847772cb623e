#!/usr/bin/env bash
# A single-node SLURM (slurmctld + slurmd + munged) on this machine, as root, on Debian/Ubuntu: what the SLURM
# tests (tests/test_slurm.py) and CI run xsa-lm under, so `srun`/`sbatch` paths are checked without a cluster.
# `make slurm-up`. Stop it with scripts/slurm_down.sh (`make slurm-down`).
# Idempotent: installs slurm-wlm and munge only if missing, rewrites slurm.conf only if it changed, starts only the
# daemons that are not running, then waits (bounded) until `sinfo` shows this node usable.
#   SLURM_DIR   state, spool, logs, pid files (default /var/tmp/xsa-slurm)
#   SLURM_WAIT  seconds to wait for the node (default 60)
#   SLURM_TASK_PLUGIN  task/affinity (default: each task bound to its --cpus-per-task CPUs, as on a cluster) or task/none
#   SLURM_CRED_EXPIRE  AuthInfo=cred_expire: also how long a requeued job waits before it runs again (default 10)
# Clients need nothing: the config is Debian's default /etc/slurm/slurm.conf.
set -euo pipefail
SLURM_DIR=${SLURM_DIR:-/var/tmp/xsa-slurm}
SLURM_WAIT=${SLURM_WAIT:-60}
SLURM_CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
SLURM_TASK_PLUGIN=${SLURM_TASK_PLUGIN:-task/affinity}
CONF=/etc/slurm/slurm.conf
die() { echo "slurm_up: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# 1. packages (Debian's post-install cannot start services in a container: policy-rc.d; we start them below)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null || die "apt-get install slurm-wlm munge failed"
fi

# 2. munge: a key (1024 random bytes, munge:munge, 0400), then munged as the munge user
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! alive /run/munge/munged.pid; then
  runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/munged.log)"
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null 2>&1 || die "munge does not encode/decode a credential (see /var/log/munge/munged.log)"

# 3. slurm.conf for this node: its CPUs and memory as slurmd sees them
HOST=$(hostname -s)
getent hosts "$HOST" >/dev/null || die "hostname $HOST does not resolve: add '127.0.0.1 $HOST' to /etc/hosts"
NODE=$(slurmd -C 2>/dev/null | head -1)   # NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 ... RealMemory=24105
CPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$NODE"); CPUS=${CPUS:-$(nproc)}
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE"); MEM=${MEM:-$(free -m | awk '/^Mem:/{print $2}')}
MEM=$(( MEM * 9 / 10 ))                     # leave slurmd a margin: a node whose memory shrinks is drained
mkdir -p "$SLURM_DIR"/{state,spool,log,run} /etc/slurm
NEW=$(cat <<CONF
# written by slurm_up.sh: a single-node SLURM, every path under $SLURM_DIR
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire (default 120 s) + 1 before it may start again: 10 s for tests
AuthInfo=cred_expire=$SLURM_CRED_EXPIRE
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=$SLURM_TASK_PLUGIN
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$SLURM_DIR/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
# without it a job that asks no --mem gets all the node's memory, so jobs run one at a time
DefMemPerCPU=$(( MEM / CPUS ))
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
SlurmctldPidFile=$SLURM_DIR/run/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/run/slurmd.pid
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)
CHANGED=0
if [ "$(cat "$CONF" 2>/dev/null)" != "$NEW" ]; then printf '%s\n' "$NEW" >"$CONF"; CHANGED=1; fi
# no cgroup.conf: with proctrack/linuxproc and task/affinity (or task/none) SLURM 22.05 needs none (CgroupPlugin=disabled is 23.02+;
# 22.05 refuses it: "cannot find cgroup plugin for disabled")

# 4. daemons (a changed conf restarts the running ones)
if [ $CHANGED = 1 ]; then
  for d in slurmd slurmctld; do
    if alive "$SLURM_DIR/run/$d.pid"; then kill "$(cat "$SLURM_DIR/run/$d.pid")"; fi
  done
  for _ in $(seq 100); do alive "$SLURM_DIR/run/slurmctld.pid" || alive "$SLURM_DIR/run/slurmd.pid" || break; sleep 0.1; done
fi
alive "$SLURM_DIR/run/slurmctld.pid" || slurmctld || die "slurmctld did not start (see $SLURM_DIR/log/slurmctld.log)"
alive "$SLURM_DIR/run/slurmd.pid" || slurmd || die "slurmd did not start (see $SLURM_DIR/log/slurmd.log)"

# 5. sacct for submitit (no slurmdbd here: the real sacct says "Slurm accounting storage is disabled", submitit's
# job.state stays UNKNOWN and a job that died without a result is never done): a shim over squeue + jobcomp's log
SHIM=$(dirname "$(readlink -f "$0")")/sacct_shim.sh
if [ -f "$SHIM" ] && { [ ! -e /usr/local/bin/sacct ] || grep -q "sacct shim" /usr/local/bin/sacct; }; then
  cmp -s "$SHIM" /usr/local/bin/sacct || install -m 0755 "$SHIM" /usr/local/bin/sacct
fi

# 6. wait until the node takes jobs
state=""
for _ in $(seq $(( SLURM_WAIT * 2 ))); do
  state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1 || true)
  case "$state" in
    idle|mixed|allocated|completing) echo "slurm_up: node $HOST $state (SLURM $(sinfo -V | cut -d' ' -f2), $CPUS CPUs, ${MEM} MB)"; exit 0;;
    down*|drain*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true;;
  esac
  sleep 0.5
done
die "node $HOST not usable after ${SLURM_WAIT}s (sinfo state: '${state:-no answer}'); see $SLURM_DIR/log/slurmctld.log and slurmd.log"

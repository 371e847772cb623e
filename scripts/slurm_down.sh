#!/usr/bin/env bash
# Stop what scripts/slurm_up.sh started: every job (scancel), then slurmd, slurmctld, munged by the pids in their pid
# files (SIGTERM, SIGKILL after 10 s), so the next test starts clean. `make slurm-down`. Safe when nothing runs.
# --purge also removes SLURM_DIR (job state, logs; job ids restart at 1) and the sacct shim. Packages stay installed.
set -uo pipefail
SLURM_DIR=${SLURM_DIR:-/var/tmp/xsa-slurm}
stop() {  # name pidfile
  local pid
  [ -s "$2" ] && pid=$(cat "$2") && kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { echo "slurm_down: stopped $1 ($pid)"; return 0; }; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null; echo "slurm_down: killed $1 ($pid) after 10 s"
}
if command -v scancel >/dev/null && [ -s "$SLURM_DIR/run/slurmctld.pid" ]; then scancel --user=root 2>/dev/null; sleep 1; fi
stop slurmd "$SLURM_DIR/run/slurmd.pid"
stop slurmctld "$SLURM_DIR/run/slurmctld.pid"
stop munged /run/munge/munged.pid
if [ "${1:-}" = --purge ]; then
  rm -rf "$SLURM_DIR" && echo "slurm_down: removed $SLURM_DIR"
  grep -qs "sacct shim" /usr/local/bin/sacct && rm -f /usr/local/bin/sacct && echo "slurm_down: removed /usr/local/bin/sacct (shim)"
fi
exit 0

#!/usr/bin/env bash
# sacct for a SLURM without accounting (no slurmdbd): answers the one query submitit makes,
#   sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
# from squeue (live and recently ended jobs, MinJobAge) and, after that, from jobcomp/filetxt's log (JobCompLoc).
# Why: without slurmdbd the real sacct fails, submitit's job.state stays UNKNOWN and a job that died without a result
# is never done (job.result() waits forever). With accounting configured it hands every call to the real sacct.
# scripts/slurm_up.sh installs it as /usr/local/bin/sacct (before /usr/bin on PATH).
REAL=/usr/bin/sacct
if ! scontrol show config 2>/dev/null | grep -q '^AccountingStorageType *= *accounting_storage/none'; then exec "$REAL" "$@"; fi
ids=(); fields=""
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) IFS=, read -ra more <<<"$2"; ids+=("${more[@]}"); shift 2;;
    -j*) IFS=, read -ra more <<<"${1#-j}"; ids+=("${more[@]}"); shift;;
    --jobs=*) IFS=, read -ra more <<<"${1#--jobs=}"; ids+=("${more[@]}"); shift;;
    -o|--format) fields=$2; shift 2;;
    --format=*) fields=${1#--format=}; shift;;
    --parsable2|-P|-X|--allocations|-n|--noheader) shift;;
    *) echo "sacct shim: only 'sacct -o JobID,State,NodeList --parsable2 -j ID...' is supported (no accounting here)" >&2; exit 1;;
  esac
done
[ "${fields,,}" = "jobid,state,nodelist" ] || { echo "sacct shim: only -o JobID,State,NodeList" >&2; exit 1; }
comp=$(scontrol show config | sed -n 's/^JobCompLoc *= *//p')
echo "JobID|State|NodeList"
for id in "${ids[@]}"; do
  main=${id%%_*}
  live=$(squeue -h -r --states=all -j "$main" -o "%i|%T|%N" 2>/dev/null)
  if [ -n "$live" ]; then echo "$live"; continue; fi
  [ -r "$comp" ] || continue
  # the last record of the job (an array's tasks: one record each, JobId=<task's own id> ArrayJobId=<main> ArrayTaskId=<i>)
  awk -v id="$main" '
    { jid=""; st=""; nl=""; aj=""; at=""
      for (i = 1; i <= NF; i++) { split($i, kv, "="); k = kv[1]; v = substr($i, length(k) + 2)
        if (k == "JobId") jid = v; else if (k == "JobState") st = v; else if (k == "NodeList") nl = v
        else if (k == "ArrayJobId") aj = v; else if (k == "ArrayTaskId") at = v }
      if (aj == id && at != "") last[aj "_" at] = st "|" nl
      else if (jid == id) last[jid] = st "|" nl }
    END { for (k in last) print k "|" last[k] }' "$comp"
done

"""A plain `xsa-lm train --multirun` through Hydra's submitit launcher (hydra/launcher=submitit_slurm|submitit_local):
a run that stopped preempted (SIGUSR2 ahead of the time limit, SIGTERM) requeues its own job, which continues it with
resume=auto. The launcher leaves requeueing to submitit's SIGUSR2 handler, which the run's Preemption callback
replaces so as to stop at a step with a checkpoint; this hands the job back to the queue afterwards, as that handler
would have. A sweep's trial requeues itself (xsa_lm/sweep/jobs.py), so only multiruns are handled here."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from xsa_lm.records import RunSummary


class RequeuePreempted(Callback):
    """configs/train.yaml's hydra.callbacks: after each job of a multirun run as a submitit job."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        executor = os.environ.get("SUBMITIT_EXECUTOR")  # slurm | local: set in a submitit job only
        if executor is None or config.hydra.mode != RunMode.MULTIRUN or config.get("resume") != "auto":
            return  # without resume=auto the requeued job would refuse the run's folder: the run says how to resume
        summary = Path(config.hydra.runtime.output_dir) / "summary.json"
        if not summary.exists() or RunSummary.read(summary).status != "preempted":
            return
        import submitit
        from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

        if executor == "local":
            sys.exit(LOCAL_REQUEUE_RETURN_CODE)  # the local controller starts the task again
        env = submitit.JobEnvironment()
        if env.global_rank == 0:
            requeue = subprocess.run(["scontrol", "requeue", env.job_id], capture_output=True, text=True)
            if requeue.returncode:  # e.g. a job submitted without --requeue where the cluster has JobRequeue=0
                print(f"scontrol requeue {env.job_id}: {requeue.stderr.strip()}", file=sys.stderr, flush=True)
                return
        sys.exit(-1)  # no result: the launcher waits for the requeued job (submitit's own requeue exits so)

"""A trial as a submitit job: the executor of launcher=local|slurm, the job itself (`xsa-lm train` in the job's own
process, one per task), and the job of an earlier sweep process found again from its record."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import submitit
from submitit.local.local import LocalJob

from xsa_lm.errors import UserError
from xsa_lm.records import RunSummary
from xsa_lm.sweep.settings import LauncherSpec


@dataclass(frozen=True)
class TrialJob(submitit.helpers.Checkpointable):
    """`xsa-lm train <args>` in this job's process(es), with resume=auto once the run has a checkpoint; rank 0
    returns its exit code. A run preempted on SLURM (it stopped at a step with a checkpoint) requeues its job while
    max_requeues allows: the requeued job resumes it. SIGUSR2 before training started: submitit's own checkpoint()
    submits the same job again (the run's files say where it resumes)."""

    args: tuple[str, ...]
    run_dir: str
    max_requeues: int

    def __call__(self) -> int | None:
        env = submitit.JobEnvironment()
        if env.num_tasks > 1 and os.environ.get("SUBMITIT_EXECUTOR") == "local":  # SLURM gives Lightning the ranks
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        resume = ["resume=auto"] if (Path(self.run_dir) / "checkpoints" / "last.ckpt").exists() else []
        code = train_in_process([*self.args, *resume])
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", 0))
        slurm = os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
        if slurm and code == 0 and self.preempted() and restarts < self.max_requeues:
            if env.global_rank == 0:  # SIGTERM: SLURM requeues (or cancels) the job itself, and this one fails
                subprocess.run(["scontrol", "requeue", env.job_id], check=False)
            sys.exit(-1)  # no result: the sweep waits for the requeued job (submitit's own requeue exits the same way)
        return code if env.global_rank == 0 else None

    def preempted(self) -> bool:
        summary = Path(self.run_dir) / "summary.json"
        return summary.exists() and RunSummary.read(summary).status == "preempted"


def train_in_process(args: Sequence[str]) -> int:
    """`xsa-lm train *args` as the command line runs it (Hydra's run folder, logging, one-line errors): its exit code.
    In the job's process rather than a child of it: submitit's signals and SLURM's task environment reach the run."""
    from xsa_lm.config.command_line import ARGV_VARIABLE, run_hydra
    from xsa_lm.train import run as train

    sys.argv = [sys.argv[0], "train", *args]
    os.environ[ARGV_VARIABLE] = json.dumps(sys.argv)  # the command line the run records, as the CLI does
    # The ranks Lightning starts for trainer=ddp in one task re-run `python -m <__main__'s module> <sys.argv[1:]>`:
    # the train command's module, not submitit's.
    sys.modules["__main__"].__spec__ = importlib.util.find_spec("xsa_lm.train")
    try:
        run_hydra("train", train.main, list(args))
    except SystemExit as e:  # a refusal (2), an interrupted run (130)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


def executor(launch: LauncherSpec, folder: Path, name: str, gpus: Sequence[int] = ()) -> submitit.Executor:
    """The executor of one trial's jobs, its files in folder; gpus: the local slot's devices."""
    if launch.kind == "local":
        local = submitit.LocalExecutor(folder, max_num_timeout=launch.max_requeues)
        local.update_parameters(
            timeout_min=launch.timeout_min,
            signal_delay_s=launch.signal_delay_s,
            tasks_per_node=launch.tasks,
            gpus_per_node=len(gpus),  # none: CUDA_VISIBLE_DEVICES="" (submitit hides every GPU from a job without)
            visible_gpus=tuple(gpus),
            stderr_to_stdout=True,
        )
        return local
    slurm = submitit.SlurmExecutor(folder, max_num_timeout=launch.max_requeues)
    settings = {
        "job_name": name,
        "time": launch.timeout_min,
        "nodes": launch.nodes,
        "ntasks_per_node": launch.tasks,
        "gpus_per_node": launch.gpus_per_node or None,
        "cpus_per_task": launch.cpus_per_task,
        "mem": f"{launch.mem_gb:g}GB" if launch.mem_gb else None,
        "partition": launch.partition,
        "account": launch.account,
        "qos": launch.qos,
        "signal_delay_s": launch.signal_delay_s,
        "additional_parameters": dict(launch.additional_parameters),
        "setup": list(launch.setup),
        "stderr_to_stdout": True,
    }
    slurm.update_parameters(**{key: value for key, value in settings.items() if value is not None})
    return slurm


@contextlib.contextmanager
def submitting(extra_env: dict[str, str]) -> Iterator[None]:
    """Around a submission: no SLURM or rendezvous variables of the sweep's own allocation (they would make Lightning
    take a local trial for a SLURM task), extra_env set, and Ctrl-C ignored by a local job's controller, which would
    otherwise kill the trial without a checkpoint (the sweep's handler stops it at a step instead)."""
    saved = {key: os.environ.get(key) for key in extra_env}
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the processes started now
    try:
        with submitit.helpers.clean_env():
            os.environ.update(extra_env)
            yield
    finally:
        signal.signal(signal.SIGINT, previous)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def submit(launch: LauncherSpec, folder: Path, name: str, job: TrialJob, gpus: Sequence[int], env: dict[str, str]):
    """The trial's job, submitted; a submission SLURM refuses (a partition, account or flag) in one line."""
    with submitting(env):
        try:
            return executor(launch, folder, name, gpus).submit(job)
        except submitit.core.utils.FailedSubmissionError as e:
            lines = [line for line in str(e).splitlines() if line.strip()]
            raise UserError(f"launcher=slurm: sbatch refused the trial's job: {lines[-1] if lines else e}") from None


def attached(executor_kind: str, folder: Path, job_id: str) -> submitit.Job | None:
    """The job of an earlier sweep process if it still runs (it is waited for, never submitted twice) or left its
    result (read, not trained again); None: it ended without one."""
    if executor_kind == "slurm":
        job: submitit.Job = submitit.SlurmJob(folder=folder, job_id=job_id)
        alive = not job.done(force_check=True)
    else:  # a LocalJob found again has no process to poll (its done() is True at once): the controller's pid says
        job, alive = LocalJob(folder=folder, job_id=job_id), controller_alive(job_id, folder)
    return job if alive or job.paths.result_pickle.exists() else None


def controller_alive(job_id: str, folder: Path) -> bool:
    """Whether the local job's controller (pid job_id) runs, and is this job's (not a new process of that pid)."""
    try:
        cmdline = Path(f"/proc/{int(job_id)}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return False
    return "submitit.local._local" in cmdline and str(folder) in cmdline


def children(pid: int) -> list[int]:
    """A process's children (Linux), for stopping a local job's tasks with its controller."""
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []

"""xsa-lm under a real SLURM: the single node scripts/slurm_up.sh starts (apt installs slurm-wlm and munge when they
are missing). `xsa-lm train` as one 2-task srun step trains on both ranks, which Lightning's SLURMEnvironment gives
(gloo on CPU), and the sacct shim answers submitit's one query where no slurmdbd runs. Skipped only without root or
without apt and the packages; on a machine that has them a SLURM that does not come up fails the tests."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, cli_env

pytestmark = [pytest.mark.long, pytest.mark.slurm]


def slurm_env(data_cache: Path) -> dict[str, str]:
    """The CLI's test environment without the SLURM_ variables of any job pytest itself runs in: srun then makes its
    own allocation instead of a step of that job."""
    return {k: v for k, v in cli_env(data_cache).items() if not k.startswith("SLURM_")}


def test_a_2_task_srun_trains_one_run_on_both_ranks(slurm: str, data_cache: Path, tmp_path: Path):
    """One srun step of 2 tasks, one CPU each: SLURMEnvironment gives ranks 0 and 1 of a world of 2, both train the
    same 4 steps (the gradient accumulation halved for 2 devices), and both exit 0. Lightning refuses `--ntasks`
    alone ("Use --ntasks-per-node"), hence both."""
    run_dir = tmp_path / "run"
    srun = ["srun", "--label", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"]
    train = [*FAST, "trainer.max_steps=4", "val_every_steps=4", "trainer.devices=2", "trainer.strategy=ddp"]
    command = [*srun, f"--chdir={tmp_path}", sys.executable, "-m", "xsa_lm.cli", "train", *train, "micro_batch_size=4"]
    out = subprocess.run(
        [*command, f"hydra.run.dir={run_dir}"], env=slurm_env(data_cache), capture_output=True, text=True, timeout=600
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]  # srun's status is the highest of its tasks'
    for rank in (0, 1):  # --label: each line starts with the task's rank
        assert re.search(rf"^ *{rank}: Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2$", log, re.M)
        assert re.search(rf"^ *{rank}: SLURM auto-requeueing enabled", log, re.M), log[-4000:]  # SLURMEnvironment
    assert "x 2 accumulation x 2 device(s) (cpu), 4 steps" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["tokens_seen"]) == ("completed", 4, 4 * 1024)


def wait_for_state(job_id: str, timeout: float = 60) -> str:
    """The job's state as submitit asks for it, once it is final."""
    deadline = time.monotonic() + timeout
    while True:
        query = ["sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job_id]
        out = subprocess.run(query, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr  # the real sacct: "Slurm accounting storage is disabled"
        lines = out.stdout.splitlines()
        assert lines[0] == "JobID|State|NodeList", lines
        state = lines[1].split("|")[1] if len(lines) > 1 else "(none)"
        if state not in ("PENDING", "RUNNING", "COMPLETING", "(none)") or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


@pytest.mark.parametrize(("wrap", "state"), [("true", "COMPLETED"), ("exit 3", "FAILED")])
def test_the_sacct_shim_gives_submitit_a_final_state_without_accounting(slurm: str, tmp_path: Path, wrap, state):
    """No slurmdbd here: the real sacct fails and submitit would never see a job that died without a result end."""
    submit = ["sbatch", "--parsable", f"--chdir={tmp_path}", "--output=/dev/null", "--wrap", wrap]
    job_id = subprocess.run(submit, capture_output=True, text=True, check=True).stdout.strip()
    assert wait_for_state(job_id) == state


# A run of seconds: one layer, 4 steps of 1024 tokens, 8 validation windows.
TINY = [*FAST, "model.n_layer=1", "model.d_model=32", "model.head_dim=16", "trainer.max_steps=4", "val_every_steps=2"]
TINY += ["data.val_windows=8"]


def start_multirun(launcher: str, sweep: Path, overrides: list[str], data_cache: Path) -> subprocess.Popen:
    """`xsa-lm train --multirun hydra/launcher=<launcher> <overrides>` in the background."""
    args = ["train", "--multirun", f"hydra/launcher={launcher}", *overrides]
    return subprocess.Popen(
        [sys.executable, "-m", "xsa_lm.cli", *args, f"hydra.sweep.dir={sweep}"], cwd=sweep.parent,
        env=slurm_env(data_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def summaries(sweep: Path, runs: tuple[str, ...] = ("0_sa", "1_xsa")) -> dict[str, dict]:
    return {run: json.loads((sweep / run / "summary.json").read_text()) for run in runs}


def test_hydra_submitit_slurm_runs_a_multirun_as_one_array_and_requeues_a_preempted_run(
    slurm: str, data_cache: Path, tmp_path: Path
):
    """`xsa-lm train --multirun hydra/launcher=submitit_slurm`: the 2 runs are one job array; the XSA run's task,
    sent SIGUSR2 (SLURM's warning before the time limit) once it has a checkpoint, stops at the next step with a
    checkpoint, requeues its job (--requeue reaches sbatch; configs/train.yaml's hydra callback) and continues from
    that step (resume=auto) to the end."""
    sweep = tmp_path / "multi"
    launcher = ["hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]
    launcher += ["+hydra.launcher.additional_parameters.requeue=true"]
    steps = [*TINY, "trainer.max_steps=200", "val_every_steps=20", "resume=auto"]  # seconds: time to preempt it
    proc = start_multirun("submitit_slurm", sweep, [*launcher, *steps, "attention=sa,xsa"], data_cache)
    deadline = time.monotonic() + 300
    while not (sweep / "1_xsa" / "checkpoints" / "last.ckpt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    (array,) = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    subprocess.run(["scancel", "--signal=USR2", f"{array}_1"], check=True)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    jobs = sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir())
    assert jobs == [array, f"{array}_0", f"{array}_1"], jobs  # one array: one task per run
    (script,) = (sweep / ".submitit").glob(".submission_file_*.sh")
    assert "#SBATCH --requeue" in script.read_text().splitlines()
    for run, summary in summaries(sweep).items():
        assert (summary["status"], summary["steps"]) == ("completed", 200), run
    log = "".join((sweep / ".submitit" / f"{array}_1" / f"{array}_1_0_log.{out}").read_text() for out in ("out", "err"))
    assert "SIGUSR2 received: checkpoint at step" in log and "DUE TO JOB REQUEUE" in log, log[-3000:]
    resumes = (sweep / "1_xsa" / "resumes.jsonl").read_text().splitlines()
    assert len(resumes) == 1 and 20 < json.loads(resumes[0])["from_step"] < 200, resumes  # from where it stopped
    assert not (sweep / "0_sa" / "resumes.jsonl").exists()


def test_hydra_submitit_local_runs_a_multirun_as_local_jobs(slurm: str, data_cache: Path, tmp_path: Path):
    """`hydra/launcher=submitit_local`: a multirun's run as a submitit job on this machine."""
    sweep = tmp_path / "multi"
    overrides = ["hydra.launcher.cpus_per_task=1", *TINY, "attention=xsa"]
    proc = start_multirun("submitit_local", sweep, overrides, data_cache)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    summary = summaries(sweep, ("0_xsa",))["0_xsa"]
    assert (summary["status"], summary["steps"]) == ("completed", 4)
    jobs = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 1, jobs  # a local job's id: its controller's pid

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


@pytest.mark.parametrize(
    ("launcher", "settings"),
    [
        pytest.param("submitit_slurm", ["hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1",
                     "hydra.launcher.mem_gb=2", "+hydra.launcher.additional_parameters.requeue=true"], id="slurm"),
        pytest.param("submitit_local", ["hydra.launcher.cpus_per_task=1"], id="local"),
    ],
)  # fmt: skip
def test_hydra_submitit_launcher_runs_a_multirun_as_jobs(
    slurm: str, data_cache: Path, tmp_path: Path, launcher, settings
):
    """`xsa-lm train --multirun hydra/launcher=submitit_slurm`: hydra's submitit launcher submits the 2 runs as one
    job array (locally: 2 jobs), each trains to the end in its own folder, and --requeue reaches sbatch."""
    sweep = tmp_path / "multi"
    args = ["train", "--multirun", f"hydra/launcher={launcher}", *settings, *TINY, "attention=sa,xsa"]
    out = subprocess.run(
        [sys.executable, "-m", "xsa_lm.cli", *args, f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=slurm_env(data_cache), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for run_dir, attention in ((sweep / "0_sa", "sa"), (sweep / "1_xsa", "xsa")):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["status"], summary["attention"], summary["steps"]) == ("completed", attention, 4)
    jobs = sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir())
    if launcher == "submitit_slurm":
        array = jobs[0]  # the array's own folder, then one per task: <id>_0, <id>_1
        assert jobs == [array, f"{array}_0", f"{array}_1"], jobs
        (script,) = (sweep / ".submitit").glob(".submission_file_*.sh")
        assert "#SBATCH --requeue" in script.read_text().splitlines()
    else:
        assert len([j for j in jobs if j.isdigit()]) == 2, jobs  # a local job's id: its controller's pid

"""A sweep whose trials are SLURM jobs (launcher=slurm) on the single-node SLURM of scripts/slurm_up.sh: one trial's
job, sent SIGUSR2 mid-run (what SLURM sends before a time limit), checkpoints, requeues itself and resumes, and the
sweep's results equal those of the same sweep with launcher=local."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, cli_env

pytestmark = [pytest.mark.long, pytest.mark.slurm]

# A demo-size sweep: one LR, SA searched on seed 0, SA and XSA compared on seed 1 (3 trials); 160 steps of 20-100 ms,
# a checkpoint every 20, so the search trial is still training seconds after its first checkpoint appears.
SWEEP = [o for o in FAST if not o.startswith(("optim.lr=", "progress_bar="))]
SWEEP += ["trainer.max_steps=160", "val_every_steps=20", "data.val_windows=16", "sweep.lrs=[3e-3]", "sweep.seeds=[1]"]
SLURM = ["launcher=slurm", "launcher.partition=debug", "launcher.cpus_per_task=1", "launcher.mem_gb=2"]
PREEMPTED = "sa_lr0.003_s0"  # the search trial: the compare phase must wait for its requeued job


def sweep_env(data_cache: Path) -> dict[str, str]:
    """The CLI's test environment without the SLURM_ variables of a job pytest itself may run in."""
    return {k: v for k, v in cli_env(data_cache).items() if not k.startswith("SLURM_")}


def start_sweep(overrides: list[str], sweep_dir: Path, data_cache: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "xsa_lm.cli", "sweep", *SWEEP, *overrides, f"hydra.run.dir={sweep_dir}"]
    return subprocess.Popen(
        command, cwd=sweep_dir.parent, env=sweep_env(data_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def finished(proc: subprocess.Popen) -> str:
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-4000:]
    return out


# Where, when and by which job a trial ran: all that may differ between the two launchers.
CIRCUMSTANCES = {"sweep_dir", "sweep_id", "run_dir", "log", "config", "checkpoints", "job_id", "executor", "job_folder"}
CIRCUMSTANCES |= {"started", "finished", "wall_time_s", "tokens_per_s", "attempt", "resumed_from_checkpoint"}


def found(value: object) -> object:
    """results.json without CIRCUMSTANCES: the selection, the comparison, every trial's losses and steps."""
    if isinstance(value, dict):
        return {key: found(v) for key, v in value.items() if key not in CIRCUMSTANCES}
    if isinstance(value, list):
        return [found(v) for v in value]
    return value


def test_a_sweep_on_slurm_requeues_a_preempted_trial_and_equals_the_local_launchers_results(
    slurm: str, data_cache: Path, tmp_path: Path
):
    """The search trial's job, sent SIGUSR2 once it has a checkpoint, stops at the next step with a checkpoint,
    requeues itself (the same job id) and resumes from that step; the compare phase waits for it; results.json
    holds the numbers of the same sweep under launcher=local (run beside it, on the same cores)."""
    on_slurm, local = tmp_path / "slurm", tmp_path / "local"
    proc = start_sweep(SLURM, on_slurm, data_cache)
    beside = start_sweep(["launcher=local"], local, data_cache)
    checkpoint, records = on_slurm / "runs" / PREEMPTED / "checkpoints" / "last.ckpt", on_slurm / "trials"
    deadline = time.monotonic() + 300
    while not checkpoint.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.1)
    job_id = json.loads((records / f"{PREEMPTED}.json").read_text())["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    out = finished(proc)
    finished(beside)

    trial = json.loads((records / f"{PREEMPTED}.json").read_text())
    assert (trial["status"], trial["job_id"], trial["executor"]) == ("completed", job_id, "slurm")  # the same job
    log = (Path(trial["job_folder"]) / f"{job_id}_0_log.out").read_text()
    assert "DUE TO JOB REQUEUE" in log, log[-4000:]  # SLURM put the job back in the queue, and ran it again
    resumes = (on_slurm / "runs" / PREEMPTED / "resumes.jsonl").read_text().splitlines()
    assert len(resumes) == 1 and 20 < json.loads(resumes[0])["from_step"] < 160, resumes  # from where it stopped
    for other in ("sa_lr0.003_s1", "xsa_lr0.003_s1"):  # the compare phase started after the search trial's result
        assert json.loads((records / f"{other}.json").read_text())["started"] > trial["finished"]
    assert "## 2. SA vs XSA" in out
    results = [json.loads((folder / "results.json").read_text()) for folder in (on_slurm, local)]
    assert json.dumps(found(results[0])) == json.dumps(found(results[1]))  # NaN equals NaN as text

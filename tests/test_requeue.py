"""configs/train.yaml's hydra callback (xsa_lm/train/requeue.py): after a multirun job under Hydra's submitit launcher,
a run that ended preempted requeues its job (SLURM: `scontrol requeue`, then exit without a result; local: exit 144,
which submitit's controller restarts); in every other case it does nothing. End to end on SLURM: test_slurm.py."""

import json
import os
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn
from hydra.types import RunMode
from omegaconf import OmegaConf

from xsa_lm.records import RunSummary
from xsa_lm.train.requeue import RequeuePreempted

MULTIRUN = dict(executor="slurm", mode=RunMode.MULTIRUN, resume="auto", status="preempted")


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in `scontrol` on PATH that records its arguments (and fails for job 13)."""
    calls = tmp_path / "scontrol.calls"
    stub = tmp_path / "bin" / "scontrol"
    stub.parent.mkdir()
    stub.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$2" != 13 ] || {{ echo "disabled for job 13" >&2; exit 1; }}\n'
    )
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}:{os.environ['PATH']}")
    return calls


def job_end(tmp_path: Path, monkeypatch, executor, mode, resume, status, job_id: str = "42") -> int | None:
    """The callback after one job: the exit code it ends the job with, or None when it returns."""
    for name in [n for n in os.environ if n.startswith(("SUBMITIT_", "SLURM_"))]:
        monkeypatch.delenv(name)
    if executor is not None:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", executor)
        env = {"SLURM_JOB_ID": job_id, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
    run_dir = tmp_path / "0_xsa"
    run_dir.mkdir(exist_ok=True)
    if status is not None:
        summary = RunSummary(status=status, attention="xsa", model="tiny", lr=1e-3, seed=0, steps=21, tokens_seen=1,
                             run_dir=str(run_dir), model_config={})  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary.to_json()))
    config = OmegaConf.create({"resume": resume, "hydra": {"mode": mode, "runtime": {"output_dir": str(run_dir)}}})
    try:
        RequeuePreempted().on_job_end(config=config, job_return=JobReturn())
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return None


@pytest.mark.parametrize(
    ("case", "exit_code", "requeued"),
    [
        (dict(MULTIRUN), -1, "requeue 42"),  # no result: hydra's launcher waits for the requeued job
        (dict(MULTIRUN, executor="local"), 144, None),  # submitit's LOCAL_REQUEUE_RETURN_CODE
        (dict(MULTIRUN, executor=None), None, None),  # a multirun on this machine (Hydra's basic launcher)
        (dict(MULTIRUN, mode=RunMode.RUN), None, None),  # `xsa-lm train` in a sweep's trial job: it requeues itself
        (dict(MULTIRUN, resume=None), None, None),  # the requeued job would refuse the run's folder
        (dict(MULTIRUN, status="completed"), None, None),
        (dict(MULTIRUN, status=None), None, None),  # refused before training: no summary.json
    ],
)
def test_a_preempted_multirun_job_requeues_and_nothing_else_does(
    tmp_path, monkeypatch, scontrol, case, exit_code, requeued
):
    assert job_end(tmp_path, monkeypatch, **case) == exit_code
    assert (scontrol.read_text().strip() if scontrol.exists() else None) == requeued


def test_a_refused_requeue_ends_the_job_with_the_preempted_run(tmp_path, monkeypatch, scontrol, capsys):
    """A job SLURM will not requeue (no --requeue where the cluster has JobRequeue=0): one line, and the job ends
    normally with the run `preempted` (the same command with resume=auto continues it)."""
    assert job_end(tmp_path, monkeypatch, **MULTIRUN, job_id="13") is None
    assert capsys.readouterr().err == "scontrol requeue 13: disabled for job 13\n"

"""The launcher's decisions: a preempted trial requeued, a lost job submitted again, a job of an earlier sweep process
waited for (never submitted twice), and no LR selected on a partial grid. The jobs run in this process (submitit's
DebugExecutor) with a stand-in for training; real jobs on this machine and on SLURM: test_sweep.py, test_slurm.py."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import submitit
from hydra import compose, initialize_config_module

from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.files import write_json
from xsa_lm.records import RunSummary
from xsa_lm.sweep import jobs
from xsa_lm.sweep import run as sweep_run
from xsa_lm.sweep.protocol import Trial
from xsa_lm.sweep.settings import LauncherSpec, SweepSpec
from xsa_lm.sweep.trials import Launcher, TrialRecord, TrialStore


class Training:
    """Stands in for `xsa-lm train`: each run ends as its trial's next planned status (default completed)."""

    def __init__(self) -> None:
        self.plan: dict[str, list[str]] = {}  # trial id -> the statuses of its next runs
        self.submitted: list[str] = []  # trial ids, one per job submitted

    def __call__(self, args: list[str]) -> int:
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        status = (self.plan.get(run_dir.name) or ["completed"]).pop(0)
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
        write_json(run_dir / "summary.json", summary(status, str(run_dir)).to_json())
        return 0


def summary(status: str, run_dir: str, loss: float = 4.0) -> RunSummary:
    rest = dict(attention="sa", model="tiny", lr=1e-3, seed=0, steps=10, tokens_seen=640, run_dir=run_dir)
    final = loss if status == "completed" else None
    return RunSummary(status=status, final_val_loss=final, model_config={"vocab_size": 512}, **rest)


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch) -> Iterator[Training]:
    train = Training()

    def debug_executor(launch: LauncherSpec, folder: Path, name: str, gpus) -> submitit.Executor:
        train.submitted.append(name)
        return submitit.DebugExecutor(folder)

    monkeypatch.setattr(jobs, "executor", debug_executor)
    monkeypatch.setattr(jobs, "train_in_process", train)
    monkeypatch.setattr(sweep_run, "stop_on_signals", lambda stop, command: None)  # no handlers left in pytest
    yield train


def sweep_job(tmp_path: Path, *overrides: str) -> sweep_run.SweepJob:
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        cfg = compose(config_name="sweep", overrides=["sweep.lrs=[1e-3,3e-3]", "sweep.seeds=[1]", *overrides])
        config = cast(dict, sweep_run.OmegaConf.to_container(cfg, resolve=True))
        train, spec = parse(TrainSpec, cfg), parse(SweepSpec, cfg.sweep, at="sweep.")
    return replace(sweep_run.check_sweep(train, spec, None, config), wandb=None)


@pytest.mark.parametrize("requeues", [0, 1])
def test_a_preempted_search_trial_is_requeued_or_no_lr_is_selected_on_the_partial_grid(
    tmp_path: Path, training: Training, monkeypatch: pytest.MonkeyPatch, requeues: int
) -> None:
    """Preempted once: with a requeue left it continues from its checkpoint and the sweep goes on; without, no LR is
    selected, the compare phase never starts, and the sweep's last line names the trial."""
    training.plan["sa_lr0.003_s0"] = ["preempted"]
    monkeypatch.setattr(sweep_run.report, "write_report", lambda results, folder: "")  # plots: seconds
    job = sweep_job(tmp_path, f"launcher.max_requeues={requeues}")
    results, _ = sweep_run.run_sweep(job, tmp_path / "sweep")
    record = cast(TrialRecord, TrialStore(tmp_path / "sweep").load(Trial("sa", 3e-3, 0)))
    if requeues:
        assert record.status == "completed" and record.attempt == 2 and record.resumed_from_checkpoint
        assert results.selected_lr is not None and sweep_run.sweep_problem(results) is None
        assert training.submitted.count("sa_lr0.003_s0") == 2 and len(training.submitted) == 5  # +compare pair
        return
    assert record.status == "preempted" and results.selected_lr is None
    assert training.submitted == ["sa_lr0.001_s0", "sa_lr0.003_s0"]  # no compare trial
    problem = str(sweep_run.sweep_problem(results))
    assert problem.startswith("search trial(s) sa_lr0.003_s0 did not finish, so no LR was selected"), problem


def fake_controller(folder: Path, result: bool) -> subprocess.Popen:
    """A process that passes for a local job's controller (its command line) and ends a second later, with a result
    of exit code 0 or none."""
    folder.mkdir(parents=True, exist_ok=True)
    write = f"pickle.dump(('success', 0), open(r'{folder}/' + str(os.getpid()) + '_0_result.pkl', 'wb'))"
    code = f"import os, pickle, time; time.sleep(1); {write if result else 'pass'}"
    return subprocess.Popen([sys.executable, "-c", code, "submitit.local._local", str(folder)])


@pytest.mark.parametrize(
    ("result", "retries", "status", "submitted"),
    [(True, 1, "completed", 0), (False, 1, "completed", 1), (False, 0, "failed", 0)],
    ids=["its result read", "lost, submitted again", "lost, no retry left"],
)
def test_a_running_job_of_an_earlier_sweep_process_is_waited_for_never_submitted_twice(
    tmp_path: Path, training: Training, result: bool, retries: int, status: str, submitted: int
) -> None:
    """A sweep killed while a local trial ran: the rerun waits for that job (its controller still runs); if the job
    ends without a result, the trial is submitted again while launcher.max_retries allows, else recorded failed."""
    store, trial = TrialStore(tmp_path / "sweep"), Trial("sa", 1e-3, 0)
    launcher = Launcher(store, [], sweep_job(tmp_path).spec, LauncherSpec(kind="local", max_retries=retries))
    folder = store.jobs / trial.id
    controller = fake_controller(folder, result)
    time.sleep(0.2)  # its command line readable
    store.run_dir(trial).mkdir(parents=True)
    write_json(store.run_dir(trial) / "summary.json", summary("completed", str(store.run_dir(trial))).to_json())
    running = replace(TrialRecord.missing(trial, "search"), status="running", attempt=1, started=time.time())
    store.save(replace(running, job_id=str(controller.pid), executor="local", job_folder=str(folder)))
    launcher.run([trial], "search", "lr-search")
    controller.wait()
    record = cast(TrialRecord, store.load(trial))
    assert (record.status, len(training.submitted)) == (status, submitted), record
    assert record.attempt == 1 + submitted
    if status == "failed":
        assert f"its local job {controller.pid} ended without a result" in str(record.error)


def test_launcher_slurm_without_sbatch_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(UserError, match="launcher=slurm submits each trial with sbatch, which is not on PATH here"):
        sweep_job(tmp_path, "launcher=slurm")
    assert not any(tmp_path.iterdir())


def test_a_record_names_its_job_and_the_job_its_log(tmp_path: Path, training: Training) -> None:
    store, trial = TrialStore(tmp_path / "sweep"), Trial("xsa", 1e-3, 2)
    Launcher(store, ["model=tiny"], sweep_job(tmp_path).spec).run([trial], "compare", "compare")
    record = json.loads((store.records / f"{trial.id}.json").read_text())
    assert record["executor"] == "local" and record["job_id"].startswith("DEBUG_")
    assert Path(record["job_folder"]) == store.jobs / trial.id and Path(record["log"]).parent == store.jobs / trial.id
    assert "pid" not in record and "command" not in record


def test_submitits_preemption_signal_stops_the_run_at_a_step_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGUSR2 (what SLURM sends signal_delay_s before the limit, through submitit) is the run's own clean stop, not
    submitit's handler that checkpoints and exits in the middle of a step."""
    from types import SimpleNamespace

    from xsa_lm.train.callbacks import Preemption

    preemption = Preemption(tmp_path / "last.ckpt", val_every_steps=10)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    try:
        preemption.on_train_start(cast(Any, SimpleNamespace(global_step=3)), cast(Any, None))
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)  # delivered between bytecodes
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert preemption.received == "SIGUSR2"

"""Trials as child processes, and one record per trial in the sweep directory:
  trials/<id>.json   the record of a trial: its command, status, metrics and run directory (written atomically)
  runs/<id>/         the trial's run directory (config.yaml, metrics.csv, checkpoints/, summary.json, wandb/)
  logs/<id>.log      the trial's terminal output, appended across attempts
A `completed` or `diverged` record is final: a rerun reuses it. Anything else is tried again, from the run's last
checkpoint if any, else afresh (the attempt kept in runs/<id>.attempt<N>)."""

import contextlib
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from xsa_lm.errors import UserError
from xsa_lm.files import write_json
from xsa_lm.records import Record, RunSummary
from xsa_lm.sweep.protocol import FINISHED, NULL, Trial, null_init_seed
from xsa_lm.sweep.settings import SweepSpec
from xsa_lm.train.devices import usable_cpus


@dataclass(frozen=True, kw_only=True)
class TrialRecord(Record):
    """trials/<id>.json: a trial's command, status, metrics (from its summary.json) and files."""

    id: str
    phase: str
    attention: str
    lr: float
    seed: int
    status: str  # running, completed, diverged, failed, interrupted; missing: no record yet
    attempt: int = 0
    resumed_from_checkpoint: bool = False
    pid: int | None = None
    started: float | None = None
    command: list[str] = field(default_factory=list)
    run_dir: str | None = None
    log: str | None = None
    config: str | None = None
    error: str | None = None
    final_val_loss: float | None = None
    final_val_ppl: float | None = None
    best_val_loss: float | None = None
    final_val_bpb: float | None = None
    final_val_loss_by_position: list[float | None] = field(default_factory=list)
    steps: int | None = None
    data_epochs: float | None = None
    tokens_seen: int | None = None
    tokens_per_s: float | None = None
    wall_time_s: float | None = None
    diverged_at_step: int | None = None
    val_history: list[dict] = field(default_factory=list)
    checkpoints: dict[str, str | None] | None = None
    returncode: int | None = None
    finished: float | None = None
    reused: bool = False  # in a sweep's results.json: a run of another phase that this phase reuses
    schema: int = 1

    def ended(self, outcome: "Outcome", returncode: int) -> "TrialRecord":
        """The record of the finished process: its outcome, and the metrics of its summary.json if it wrote one."""
        metrics = {name: getattr(outcome.summary, name) for name in SUMMARY_METRICS} if outcome.summary else {}
        return replace(
            self, status=outcome.status, error=outcome.error, returncode=returncode, finished=time.time(), **metrics
        )

    @classmethod
    def missing(cls, trial: Trial, phase: str) -> "TrialRecord":
        return cls(id=trial.id, phase=phase, attention=trial.attention, lr=trial.lr, seed=trial.seed, status="missing")


# A trial's record cut short (a full disk, an edit): the sweep runs the trial again without it.
RETRY_DAMAGED = "move it out of trials/ and run the sweep again: it reruns the trial, from its last checkpoint if any"


class TrialStore:
    def __init__(self, sweep_dir: Path) -> None:
        self.records, self.runs, self.logs = (sweep_dir / d for d in ("trials", "runs", "logs"))

    def run_dir(self, trial: Trial) -> Path:
        return self.runs / trial.id

    def load(self, trial: Trial) -> TrialRecord | None:
        path = self.records / f"{trial.id}.json"
        if not path.exists():
            return None
        record = TrialRecord.read(path, then=RETRY_DAMAGED)
        if not math.isclose(record.lr, trial.lr, rel_tol=1e-9):  # an earlier grid's LR of the same 3 digits
            raise UserError(
                f"{path} records {trial.id} at LR {record.lr:g}, and this sweep asks for LR {trial.lr:g} under that "
                f"name (runs are named by 3 significant digits of the LR): use LR {record.lr:g}, or another "
                "hydra.run.dir"
            )
        return record

    def save(self, record: TrialRecord) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        write_json(self.records / f"{record.id}.json", record.to_json())  # a kill mid-write leaves the old one whole

    def is_final(self, trial: Trial) -> bool:
        record = self.load(trial)
        return record is not None and record.status in FINISHED


@dataclass(frozen=True)
class Outcome:
    status: str
    error: str | None
    summary: RunSummary | None = None


# What a trial's record copies from its summary.json: the fields they share but its identity, outcome and files.
SUMMARY_METRICS = [
    name
    for name in RunSummary.__dataclass_fields__
    if name in TrialRecord.__dataclass_fields__
    and name not in ("status", "error", "run_dir", "schema", *Trial.__dataclass_fields__)
]


def divergence_bound(summary: RunSummary, diverge_above: float | None) -> float:
    """sweep.diverge_above, else ln(V): a final val loss worse than a uniform guess."""
    return float(diverge_above) if diverge_above is not None else math.log(summary.model_config["vocab_size"])


def outcome(returncode: int, summary: RunSummary | None, log_tail: str, diverge_above: float | None) -> Outcome:
    if summary is None and returncode < 0:
        return Outcome("failed", f"killed by signal {signal.Signals(-returncode).name} (out of memory?)")
    if summary is None:
        return Outcome("failed", log_tail or f"exited with code {returncode} before writing summary.json")
    if returncode != 0 and summary.status != "failed":
        return Outcome("failed", log_tail or f"exited with code {returncode}", summary)
    loss = summary.final_val_loss
    bound = divergence_bound(summary, diverge_above)
    if summary.status == "completed" and (loss is None or not math.isfinite(loss) or loss > bound):
        return Outcome("diverged", f"final val loss {loss} is above the divergence bound {bound:.3f}", summary)
    if summary.status == "diverged":
        return Outcome("diverged", f"NaN/inf training loss at step {summary.diverged_at_step}", summary)
    return Outcome(summary.status, summary.error, summary)


def run_logged(cmd: list[str], log: Path) -> str | None:
    """Run cmd, its output appended to log; None, or the line it printed last that says what went wrong."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        returncode = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    return last_error_line(log) if returncode != 0 else None


def last_error_line(log: Path) -> str:
    """The last line of a log that says what went wrong (`xsa-lm: error: ...`, an exception)."""
    if not log.exists():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()[-200:] if line.strip()]
    for line in reversed(lines):
        if line.startswith("xsa-lm:") or "Error" in line.split(":")[0]:
            return line
    return lines[-1] if lines else ""


def gpu_slots(max_parallel: int, launch_prefix: Sequence[str]) -> list[str | None]:
    """Each parallel slot's share of the visible GPUs; None (inherit) for one trial, no GPU, or a launch prefix."""
    if max_parallel <= 1 or launch_prefix:
        return [None] * max_parallel
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        import torch

        env = ",".join(map(str, range(torch.cuda.device_count())))
    visible = [d for d in env.split(",") if d.strip()]
    if not visible:
        return [None] * max_parallel
    if len(visible) < max_parallel:
        raise UserError(
            f"sweep.max_parallel={max_parallel} trials at once but {len(visible)} visible GPU(s): lower max_parallel"
        )
    per_slot = len(visible) // max_parallel
    return [",".join(visible[i * per_slot : (i + 1) * per_slot]) for i in range(max_parallel)]


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the sweep dies, even by SIGKILL, so no orphan trial writes on."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the sweep's signal handlers still stop children
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def trial_settings(trial: Trial, baseline: str) -> list[str]:
    """The training keys the sweep sets for a trial (run.py SET_BY_SWEEP): its arm's attention option; the null arm
    is the baseline from other initial weights."""
    null = trial.attention == NULL
    arm = [f"attention={baseline if null else trial.attention}"]
    arm += [f"init_seed={null_init_seed(trial.seed)}"] if null else []
    return [*arm, f"optim.lr={trial.lr!r}", f"seed={trial.seed}", "progress_bar=false"]


class Launcher:
    """Runs trials as `xsa-lm train` processes, at most max_parallel at once, and records each outcome."""

    def __init__(
        self, store: TrialStore, train_overrides: Sequence[str], spec: SweepSpec, wandb_group: str | None = None
    ) -> None:
        self.store, self.train_overrides, self.wandb_group = store, list(train_overrides), wandb_group
        self.launch_prefix, self.diverge_above = spec.launch_prefix or [], spec.diverge_above
        self.baseline = spec.baseline
        self.slots = gpu_slots(spec.max_parallel, self.launch_prefix)
        # Trials at once share the cores, as torchrun does (more threads than cores spin and wait).
        shared = spec.max_parallel > 1 and not self.launch_prefix and "OMP_NUM_THREADS" not in os.environ
        self.threads = max(1, usable_cpus() // spec.max_parallel) if shared else None
        self.running: dict[subprocess.Popen, tuple[Trial, int, float, dict[str, str]]] = {}

    def command(self, trial: Trial, job_type: str, resume: bool) -> list[str]:
        set_by_sweep = [*trial_settings(trial, self.baseline), f"hydra.run.dir={self.store.run_dir(trial)}"]
        cmd = [*self.launch_prefix, sys.executable, "-m", "xsa_lm.cli", "train", *self.train_overrides, *set_by_sweep]
        if self.wandb_group is not None:
            cmd += [f"logger.wandb.group={self.wandb_group}", f"logger.wandb.job_type={job_type}"]
        return cmd + (["resume=auto"] if resume else [])

    def run(self, trials: Sequence[Trial], phase: str, job_type: str) -> None:
        """Run every trial that has no final record yet; returns when all have finished."""
        todo = [t for t in dict.fromkeys(trials) if not self.store.is_final(t)]
        for trial in [t for t in dict.fromkeys(trials) if t not in todo]:  # final: it has a record
            print(f"  {phase}: {trial.id} already {self.judged_again(trial).status} (reused)")
        free = list(range(len(self.slots)))
        while todo or self.running:
            while todo and free:
                self._start(todo.pop(0), free.pop(0), phase, job_type)
            time.sleep(0.2)
            for proc in [p for p in self.running if p.poll() is not None]:
                trial, slot, started, _ = self.running.pop(proc)
                free.append(slot)
                self._finish(trial, proc.returncode, started, phase)

    def judged_again(self, trial: Trial) -> TrialRecord:
        """A final trial's record judged again under this run's divergence bound; saved, and said, if it changes."""
        record = cast(TrialRecord, self.store.load(trial))
        run_dir = self.store.run_dir(trial)
        summary_file = run_dir / "summary.json"
        if not summary_file.exists():
            return record
        summary = RunSummary.read(
            summary_file, then=f"write it again with `xsa-lm train hydra.run.dir={run_dir} resume=auto`, then the sweep"
        )
        judged = outcome(record.returncode or 0, summary, "", self.diverge_above)
        if judged.status == record.status:
            return record
        bound = f"{divergence_bound(summary, self.diverge_above):.3f}"
        bound += " (sweep.diverge_above)" if self.diverge_above is not None else " (ln of the vocabulary size)"
        print(
            f"  {trial.id}: {record.status} -> {judged.status} under this run's divergence bound {bound}: "
            f"final val loss {summary.final_val_loss}"
        )
        record = replace(record, status=judged.status, error=judged.error)
        self.store.save(record)
        return record

    def trial_env(self, slot: int) -> dict[str, str]:
        """Its own rendezvous port (else trials join one process group), GPUs, threads; SLURM's own MASTER_ADDR."""
        taken = {int(e["MASTER_PORT"]) for _, _, _, e in self.running.values()}
        port = next(port for port in iter(free_port, None) if port not in taken)
        env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(port))
        if "SLURM_JOB_ID" in env:
            env.pop("MASTER_ADDR", None)
        else:
            env["MASTER_ADDR"] = "127.0.0.1"
        gpus = self.slots[slot]
        env |= {"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}
        return env | ({"OMP_NUM_THREADS": str(self.threads)} if self.threads is not None else {})

    def _start(self, trial: Trial, slot: int, phase: str, job_type: str) -> None:
        run_dir, log = self.store.run_dir(trial), self.store.logs / f"{trial.id}.log"
        previous = self.store.load(trial)
        attempt = (previous.attempt if previous is not None else 0) + 1
        resume = (run_dir / "checkpoints" / "last.ckpt").exists()
        if run_dir.exists() and not resume:  # an attempt that left no checkpoint: keep it aside, start afresh
            run_dir.rename(run_dir.with_name(f"{trial.id}.attempt{attempt - 1}"))
        cmd = self.command(trial, job_type, resume)
        log.parent.mkdir(parents=True, exist_ok=True)
        env = self.trial_env(slot)
        with open(log, "a") as out:
            out.write(f"\n=== attempt {attempt} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=die_with_parent
            )
        started = time.time()
        self.running[proc] = (trial, slot, started, env)
        record = replace(  # a sweep killed now leaves it `running`: a rerun tries the trial again
            TrialRecord.missing(trial, phase),
            status="running",
            attempt=attempt,
            resumed_from_checkpoint=resume,
            pid=proc.pid,
            started=started,
            command=cmd,
            run_dir=str(run_dir),
            log=str(log),
            config=str(run_dir / "config.yaml"),
        )
        self.store.save(record)
        how = " (resuming from its last checkpoint)" if resume else ""
        print(f"  {phase}: {trial.id} started{how}; log {log}")

    def _finish(self, trial: Trial, returncode: int, started: float, phase: str) -> None:
        summary_file = self.store.run_dir(trial) / "summary.json"
        # An earlier attempt's summary is not this one's, unless this one had nothing left to train (exit code 0).
        fresh = summary_file.exists() and (summary_file.stat().st_mtime >= started - 1 or returncode == 0)
        summary = RunSummary.read(summary_file) if fresh else None
        result = outcome(returncode, summary, last_error_line(self.store.logs / f"{trial.id}.log"), self.diverge_above)
        record = (self.store.load(trial) or TrialRecord.missing(trial, phase)).ended(result, returncode)
        self.store.save(record)
        loss = record.final_val_loss
        finished = loss is not None and record.status == "completed"
        detail = f"final val loss {loss:.4f}" if finished else record.error
        print(f"  {phase}: {trial.id} {record.status} in {time.time() - started:.0f} s: {detail}")

    def stop(self) -> None:
        """Terminate the trials in flight (the sweep was interrupted); their records say `interrupted`."""
        for proc in self.running:
            proc.terminate()
        for proc, (trial, *_) in list(self.running.items()):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            record = self.store.load(trial) or TrialRecord.missing(trial, "")
            self.store.save(replace(record, status="interrupted", finished=time.time()))
        self.running.clear()

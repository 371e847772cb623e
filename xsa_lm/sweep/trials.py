"""Trials as submitit jobs (jobs.py), and one record per trial in the sweep directory:
  trials/<id>.json   the record of a trial: its status, job, metrics and run directory (written atomically)
  runs/<id>/         the trial's run directory (config.yaml, metrics.csv, checkpoints/, summary.json, wandb/)
  jobs/<id>/         its jobs' files: <job id>_0_log.out, the trial's terminal output, and submitit's pickles
A `completed` or `diverged` record is final: a rerun reuses it. A `running` one whose job still runs is waited for.
Anything else is tried again, from the run's last checkpoint if any, else afresh (the attempt kept in
runs/<id>.attempt<N>)."""

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import submitit
from submitit.local.local import LocalJob

from xsa_lm.config.command_line import override, pasteable
from xsa_lm.errors import UserError
from xsa_lm.files import write_json
from xsa_lm.records import CodeVersion, Record, RunInfo, RunSummary
from xsa_lm.sweep import jobs
from xsa_lm.sweep.protocol import FINISHED, NULL, PLACEBO, Trial, null_init_seed
from xsa_lm.sweep.settings import LauncherSpec, SweepSpec
from xsa_lm.train.devices import usable_cpus


@dataclass(frozen=True, kw_only=True)
class TrialRecord(Record):
    """trials/<id>.json: a trial's status, job, metrics (from its summary.json) and files."""

    id: str
    phase: str
    attention: str
    lr: float
    seed: int
    status: str  # running, completed, diverged, failed, interrupted; missing: no record yet
    attempt: int = 0
    resumed_from_checkpoint: bool = False
    job_id: str | None = None  # of its latest job: SLURM's job id, or the local job's controller pid
    executor: str | None = None  # local, slurm
    job_folder: str | None = None  # submitit's files of its jobs (its log among them)
    started: float | None = None
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
    code: CodeVersion | None = None  # what trained it (its summary.json's); None: a run from before it was recorded
    schema: int = 1

    def ended(self, outcome: "Outcome", returncode: int | None) -> "TrialRecord":
        """The record of the finished job: its outcome, and the metrics of its summary.json if it wrote one."""
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
        self.records, self.runs, self.logs, self.jobs = (sweep_dir / d for d in ("trials", "runs", "logs", "jobs"))

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


def trial_records(folder: Path) -> list[TrialRecord]:
    """The trial records of a sweep's or a study's folder (trials/*.json at any depth)."""
    return [TrialRecord.read(path, then=RETRY_DAMAGED) for path in sorted(folder.glob("**/trials/*.json"))]


def finished_records(folder: Path) -> list[TrialRecord]:
    """The final trial records of a sweep's or a study's folder: the runs a rerun reuses."""
    return [record for record in trial_records(folder) if record.status in FINISHED]


def resumed_records(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The unfinished trials that a rerun resumes from their last checkpoint, each with the code that started its run
    (run_info.json's `code`; None: a run from before it was recorded)."""
    resumed = []
    for record in records:
        run = Path(record.run_dir) if record.run_dir else None
        if record.status in FINISHED or run is None or not (run / "checkpoints" / "last.ckpt").exists():
            continue
        info = RunInfo.read(run / "run_info.json") if (run / "run_info.json").is_file() else RunInfo()
        resumed.append(replace(record, code=info.code))
    return resumed


@dataclass(frozen=True, kw_only=True)
class CodeRuns(Record):
    """The trials one code version trained (None: trained before xsa-lm recorded it): a report's row."""

    code: CodeVersion | None
    trials: list[str]


def runs_by_code(records: Sequence[TrialRecord], root: Path | None = None) -> list[CodeRuns]:
    """The trials by the code that trained them, the version with most runs first; each run once (a reused trial is
    one run), named by its id, or by its run folder under `root` where ids repeat (a study's budgets)."""
    groups: dict[tuple[str, str] | None, list[TrialRecord]] = {}
    runs = {r.run_dir or r.id: r for r in records}.values()
    for record in runs:
        groups.setdefault(record.code.identity if record.code else None, []).append(record)
    ids_repeat = len({r.id for r in runs}) < len(runs)

    def name(record: TrialRecord) -> str:
        return os.path.relpath(record.run_dir, root) if ids_repeat and root and record.run_dir else record.id

    rows = [CodeRuns(code=runs[0].code, trials=sorted(map(name, runs))) for runs in groups.values()]
    return sorted(rows, key=lambda row: -len(row.trials))


def refuse_other_code(folder: Path, allow_mixed_code: bool, running: CodeVersion) -> None:
    """A rerun reuses the folder's finished trials and resumes its unfinished ones: one trained by other code than
    `running` (another source or torch, or none recorded) is refused before anything starts, unless
    sweep.allow_mixed_code."""
    records = trial_records(folder)
    finished = [record for record in records if record.status in FINISHED]
    rows = runs_by_code(finished + resumed_records(records), folder)
    other = [row for row in rows if row.code is None or row.code.identity != running.identity]
    if allow_mixed_code or not other:
        return
    ids = [trial for row in other for trial in row.trials]
    named = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
    versions = "; ".join(str(row.code) if row.code else "no recorded code version" for row in other[:2])
    versions += "; ..." if len(other) > 2 else ""
    raise UserError(
        f"{folder} holds {len(ids)} run(s) that this rerun would reuse or resume, trained by other code: {named} by "
        f"{versions}; this is {running}: use another hydra.run.dir, or mix them with "
        "sweep.allow_mixed_code=true (the report lists the runs by code version)"
    )


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


def gpu_slots(max_parallel: int) -> list[list[int]]:
    """Each parallel trial's share of the visible GPUs (none on a CPU machine)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        import torch

        env = ",".join(map(str, range(torch.cuda.device_count())))
    visible = [d.strip() for d in env.split(",") if d.strip()]
    if not visible:
        return [[] for _ in range(max_parallel)]
    if not all(d.isdigit() for d in visible):
        raise UserError(
            f"CUDA_VISIBLE_DEVICES={env}: launcher=local places trials by GPU index; list the GPUs by index (0,1,..)"
        )
    if len(visible) < max_parallel:
        raise UserError(
            f"launcher.max_parallel={max_parallel} trials at once but {len(visible)} visible GPU(s): lower max_parallel"
        )
    per_slot = len(visible) // max_parallel
    return [[int(d) for d in visible[i * per_slot : (i + 1) * per_slot]] for i in range(max_parallel)]


def trial_settings(trial: Trial, spec: SweepSpec) -> list[str]:
    """The training keys the sweep sets for a trial (run.py SET_BY_SWEEP): its arm's attention option; the init null
    is the baseline from other initial weights, the placebo the baseline from its own, perturbed."""
    null = {NULL: f"init_seed={null_init_seed(trial.seed)}", PLACEBO: f"init_perturbation={spec.placebo_scale!r}"}
    arm = [f"attention={spec.baseline if trial.attention in null else trial.attention}"]
    arm += [null[trial.attention]] if trial.attention in null else []
    return [*arm, f"optim.lr={trial.lr!r}", f"seed={trial.seed}", "progress_bar=false"]


@dataclass
class Running:
    """A trial's job in flight: its GPU slot (launcher=local), when and in which phase it started."""

    trial: Trial
    job: submitit.Job
    slot: int | None
    started: float
    phase: str
    job_type: str


POLL_S = {"local": 0.2, "slurm": 1.0}  # SLURM: submitit's watcher asks sacct for every job at once, cached


class Launcher:
    """Runs trials as submitit jobs (launcher=local: at most max_parallel at once on this machine, each with its own
    GPUs; launcher=slurm: SLURM queues them), finds again the jobs an earlier sweep process left running, requeues a
    preempted trial and submits again one whose job ended without a result (both bounded), and records each outcome."""

    def __init__(
        self,
        store: TrialStore,
        train_overrides: Sequence[str],
        spec: SweepSpec,
        launch: LauncherSpec | None = None,
        wandb_group: str | None = None,
    ) -> None:
        self.store, self.train_overrides, self.wandb_group = store, list(train_overrides), wandb_group
        self.launch = launch or LauncherSpec(kind="local")
        self.diverge_above, self.spec = spec.diverge_above, spec
        local = self.launch.kind == "local"
        self.capacity = self.launch.max_parallel or sys.maxsize
        self.slots = gpu_slots(self.capacity) if local else []
        self.free = list(range(len(self.slots)))
        # Local trials at once share the cores, as torchrun does (more threads than cores spin and wait).
        shared = local and self.capacity > 1 and "OMP_NUM_THREADS" not in os.environ
        self.threads = max(1, usable_cpus() // self.capacity) if shared else None
        self.running: dict[Trial, Running] = {}
        self.requeues: Counter[Trial] = Counter()  # launcher=local: preempted, submitted again from its checkpoint
        self.retries: Counter[Trial] = Counter()  # its job ended without a result, submitted again

    def command(self, trial: Trial, job_type: str, resume: bool) -> list[str]:
        """The `xsa-lm train` command a trial's job runs (in the job's own process)."""
        args = [
            *self.train_overrides,
            *trial_settings(trial, self.spec),
            override("hydra.run.dir", self.store.run_dir(trial)),
        ]
        if self.wandb_group is not None:
            args += [f"logger.wandb.group={self.wandb_group}", f"logger.wandb.job_type={job_type}"]
        return ["xsa-lm", "train", *args, *(["resume=auto"] if resume else [])]

    def run(self, trials: Sequence[Trial], phase: str, job_type: str) -> None:
        """Run every trial that has no final record yet; returns when all have finished."""
        todo = [t for t in dict.fromkeys(trials) if not self.store.is_final(t)]
        for trial in [t for t in dict.fromkeys(trials) if t not in todo]:  # final: it has a record
            print(f"  {phase}: {trial.id} already {self.judged_again(trial).status} (reused)")
        for trial in [t for t in todo if self._attach(t, phase, job_type)]:
            todo.remove(trial)
        while todo or self.running:
            while todo and len(self.running) < self.capacity:
                self._start(todo.pop(0), phase, job_type)
            time.sleep(POLL_S[self.launch.kind])
            for run in [r for r in self.running.values() if self._ended(r)]:
                del self.running[run.trial]
                if run.slot is not None:
                    self.free.append(run.slot)
                if self._finish(run):
                    todo.insert(0, run.trial)  # requeued or retried: before the trials not started yet

    def judged_again(self, trial: Trial) -> TrialRecord:
        """A final trial's record judged again under this run's divergence bound; saved, and said, if it changes."""
        record = cast(TrialRecord, self.store.load(trial))
        run_dir = self.store.run_dir(trial)
        summary_file = run_dir / "summary.json"
        if not summary_file.exists():
            return record
        again = f"xsa-lm train {pasteable('hydra.run.dir', run_dir)} resume=auto"
        summary = RunSummary.read(summary_file, then=f"write it again with `{again}`, then the sweep")
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

    def _attach(self, trial: Trial, phase: str, job_type: str) -> bool:
        """Wait for the job an earlier sweep process submitted for this trial, if it still runs."""
        record = self.store.load(trial)
        if record is None or record.status != "running" or not (record.job_id and record.job_folder):
            return False
        job = jobs.attached(record.executor or "local", Path(record.job_folder), record.job_id)
        if job is None:
            return False
        slot = self.free.pop(0) if self.free else None
        self.running[trial] = Running(trial, job, slot, record.started or time.time(), phase, job_type)
        earlier = f"its {record.executor} job {record.job_id} of an earlier run"
        print(f"  {phase}: {trial.id} re-attached to {earlier}; log {record.log}")
        return True

    def _start(self, trial: Trial, phase: str, job_type: str) -> None:
        run_dir = self.store.run_dir(trial)
        previous = self.store.load(trial)
        attempt = (previous.attempt if previous is not None else 0) + 1
        resume = (run_dir / "checkpoints" / "last.ckpt").exists()
        if run_dir.exists() and not resume:  # an attempt that left no checkpoint: keep it aside, start afresh
            run_dir.rename(run_dir.with_name(f"{trial.id}.attempt{attempt - 1}"))
        slot = self.free.pop(0) if self.slots else None
        folder = self.store.jobs / trial.id
        job = jobs.submit(
            self.launch,
            folder,
            name=trial.id,
            job=jobs.TrialJob(
                tuple(self.command(trial, job_type, resume=False)[2:]), str(run_dir), self.launch.max_requeues
            ),
            gpus=self.slots[slot] if slot is not None else [],
            env={"OMP_NUM_THREADS": str(self.threads)} if self.threads is not None else {},
        )
        started = time.time()
        self.running[trial] = Running(trial, job, slot, started, phase, job_type)
        record = replace(  # a sweep killed now leaves it `running`: a rerun waits for the job, or tries again
            TrialRecord.missing(trial, phase),
            status="running",
            attempt=attempt,
            resumed_from_checkpoint=resume,
            job_id=job.job_id,
            executor=self.launch.kind,
            job_folder=str(folder),
            started=started,
            run_dir=str(run_dir),
            log=str(job.paths.stdout),
            config=str(run_dir / "config.yaml"),
        )
        self.store.save(record)
        how = " (resuming from its last checkpoint)" if resume else ""
        print(f"  {phase}: {trial.id} started as {self.launch.kind} job {job.job_id}{how}; log {job.paths.stdout}")

    def _ended(self, run: Running) -> bool:
        if isinstance(run.job, LocalJob) and run.job._process is None:  # found again: done() cannot tell
            return not jobs.controller_alive(run.job.job_id, run.job.paths.folder)
        return run.job.done()

    def _result(self, run: Running) -> tuple[int | None, str | None]:
        """The trial's exit code (None: its job ended without one: killed, cancelled) and the error it raised."""
        if isinstance(run.job, LocalJob) and not run.job.paths.result_pickle.exists():
            return None, None  # on this machine no file system lags behind: none now is none
        try:
            return run.job.results()[0], None  # rank 0's (a job of several tasks has one result per task)
        except submitit.core.utils.FailedJobError as e:  # an exception in the job, outside the run's own handling
            lines = [line for line in str(e).splitlines() if line.strip() and not line.startswith(" ")]
            return 1, lines[-1] if lines else str(e)
        except submitit.core.utils.UncompletedJobError:
            return None, None

    def _finish(self, run: Running) -> bool:
        """Record a trial's ended job; True: submit it again (preempted locally, or its job lost)."""
        trial, log = run.trial, Path(str(run.job.paths.stdout))
        returncode, error = self._result(run)
        if returncode is None:
            state = run.job.state if self.launch.kind == "slurm" else "no result"
            lost = f"its {self.launch.kind} job {run.job.job_id} ended without a result ({state}: killed, cancelled?)"
            if self.retries[trial] < self.launch.max_retries:
                self.retries[trial] += 1
                print(f"  {run.phase}: {trial.id}: {lost}: submitted again (launcher.max_retries)")
                return True
            result = Outcome("failed", f"{lost}; see {log}")
        else:
            summary_file = self.store.run_dir(trial) / "summary.json"
            # An earlier attempt's summary is not this one's, unless this one had nothing left to train (exit 0).
            fresh = summary_file.exists() and (summary_file.stat().st_mtime >= run.started - 1 or returncode == 0)
            summary = RunSummary.read(summary_file) if fresh else None
            result = outcome(returncode, summary, error or last_error_line(log), self.diverge_above)
        record = self.store.load(trial) or TrialRecord.missing(trial, run.phase)
        record = record.ended(result, returncode)
        self.store.save(record)
        local = self.launch.kind == "local"  # a SLURM job requeues itself (TrialJob); a local one is submitted again
        if result.status == "preempted" and local and self.requeues[trial] < self.launch.max_requeues:
            self.requeues[trial] += 1
            print(f"  {run.phase}: {trial.id} preempted: continues from its checkpoint (launcher.max_requeues)")
            return True
        loss = record.final_val_loss
        finished = loss is not None and record.status == "completed"
        detail = f"final val loss {loss:.4f}" if finished else record.error or "stopped at a step with a checkpoint"
        print(f"  {run.phase}: {trial.id} {record.status} in {time.time() - run.started:.0f} s: {detail}")
        return False

    def stop(self) -> str:
        """The sweep was interrupted: local trials stop at their next step with a checkpoint (recorded `interrupted`);
        SLURM jobs run on, and the next run of the sweep re-attaches to them. Says what it left running."""
        local = [r for r in self.running.values() if isinstance(r.job, LocalJob)]
        for run in local:  # the controller passes SIGTERM on to the trial's tasks
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(run.job.job_id), signal.SIGTERM)
        deadline = time.time() + 30
        for run in local:
            while jobs.controller_alive(run.job.job_id, run.job.paths.folder) and time.time() < deadline:
                time.sleep(0.2)
            for pid in [*jobs.children(int(run.job.job_id)), int(run.job.job_id)]:  # still there: killed
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process = cast(LocalJob, run.job)._process
            if process is not None:  # reaped
                process.wait()
            record = self.store.load(run.trial) or TrialRecord.missing(run.trial, run.phase)
            self.store.save(replace(record, status="interrupted", finished=time.time()))
        left = [r.job.job_id for r in self.running.values() if r not in local]
        self.running.clear()
        if not left:
            return ""
        return f"; SLURM job(s) {', '.join(left)} keep running, and the same command re-attaches to them"

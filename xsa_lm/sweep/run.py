"""`xsa-lm sweep`: the paper's protocol in one command, over arms named by attention option (sweep.baseline: SA,
sweep.candidates: [XSA] by default).
1. search:  the baseline at every LR of the grid x every seed of sweep.search_seeds (sweep.tune_xsa: the candidates too)
2. select:  the LR with the lowest median final val loss of the baseline over the search seeds (diverged never win)
3. compare: every arm at that LR for every seed of sweep.seeds (no search seed: the search's winner was lucky)
4. report:  each candidate against the baseline: results.json, report.md, the plots, and a W&B report run
Every trial is a submitit job running `xsa-lm train` (launcher=local|slurm); its record makes the same command
resume, or wait for the job still running (trials.py)."""

import itertools
import json
import math
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar, cast

import hydra
from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from xsa_lm.config import command_line
from xsa_lm.config.command_line import full_command_line
from xsa_lm.config.spec import TrainSpec, WandbSpec, parse
from xsa_lm.errors import UserError, one_line_errors, remove_empty_run_dir
from xsa_lm.files import write_json, write_text
from xsa_lm.locking import hold_directory
from xsa_lm.reporting import ReportRunSettings
from xsa_lm.stats.paired import POWER, min_detectable_difference
from xsa_lm.sweep import protocol, report
from xsa_lm.sweep.protocol import Look, Selection, SequentialRule, SequentialSummary, Trial
from xsa_lm.sweep.report import SweepResult
from xsa_lm.sweep.settings import LauncherSpec, SweepSpec, null_arms
from xsa_lm.sweep.trials import (
    RETRY_DAMAGED,
    Launcher,
    TrialRecord,
    TrialStore,
    gpu_slots,
    refuse_other_code,
    run_logged,
    trial_settings,
)
from xsa_lm.train.plan import gpu_hours_table, run_compute
from xsa_lm.train.runinfo import code_version

SET_BY_SWEEP = {  # training keys each trial gets from the sweep, and where the user sets them instead
    "attention": "the sweep trains each arm: choose them with sweep.baseline and sweep.candidates",
    "optim.lr": "set the grid with sweep.lrs=[...] or sweep.lr_range",
    "seed": "set the seeds with sweep.search_seeds=[...] and sweep.seeds=[...]",
    "init_seed": "the sweep's init null sets it (sweep.null_arm=init): every other trial's weights come from its seed",
    "init_perturbation": "the sweep's placebo sets it (sweep.null_arm=placebo): set its size with sweep.placebo_scale",
    "resume": "running the same sweep command again resumes it",
    "progress_bar": "trials write their output to their job logs in the sweep's jobs/ folder",
}


def passed_on(task_overrides: list[str], group: str, set_by: dict[str, str], setter: str) -> list[str]:
    """The command line's overrides for the child processes, but `group`.*; a key of set_by (-> why) is refused."""
    kept = []
    for override in task_overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == group or key.startswith(f"{group}."):
            continue
        if key in set_by:
            raise UserError(f"{override}: {key} is set by {setter}; {set_by[key]}")
        kept.append(override)
    return kept


def train_overrides(task_overrides: list[str]) -> list[str]:
    """The command line's training overrides, passed on to every trial (sweep.* and launcher.* stay with the sweep),
    and the user's config folders, where a lab's arms and other options live."""
    set_by = {**SET_BY_SWEEP, "attention.name": SET_BY_SWEEP["attention"]}
    trials = passed_on(task_overrides, "launcher", {}, setter="")
    return passed_on(trials, "sweep", set_by, setter="the sweep for each trial") + searchpath_overrides()


def searchpath_overrides() -> list[str]:
    """This command's --config-dir and hydra.searchpath folders as an override of every trial's search path."""
    if not HydraConfig.initialized():
        return []
    given = ("command-line", "hydra.searchpath in command-line")
    sources = [s for s in HydraConfig.get().runtime.config_sources if s.provider in given]
    paths = [f"file://{Path(s.path).resolve()}" if s.schema == "file" else f"{s.schema}://{s.path}" for s in sources]
    return [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []


def report_run_settings(wandb: WandbSpec) -> ReportRunSettings:
    return ReportRunSettings(**wandb.model_dump(include={"project", "entity", "mode", "init_timeout_s"}))


def open_state(
    state_file: Path, overrides: list[str], group: str | None, *, id_key: str, overrides_key: str, holds: str
) -> str:
    """A sweep's or study's id (the W&B group, else the folder's name) and overrides, which a rerun must keep."""
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if sorted(state[overrides_key]) != sorted(overrides):
            raise UserError(
                f"{state_file.parent} holds {holds} {state[overrides_key]}, not {overrides}: rerun it with the same "
                "overrides to resume it, or choose a new hydra.run.dir"
            )
        return state[id_key]
    state = {
        id_key: group or state_file.parent.name,
        overrides_key: overrides,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(full_command_line()),  # as typed: `xsa-lm sweep ...`
    }
    write_json(state_file, state)
    return state[id_key]


def stop_on_signals(stop: Callable[[], str | None], command: str) -> None:
    """On SIGTERM or SIGINT: stop the trials (stop() says what it left running), say how to resume, and exit with
    128 + the signal."""

    def handler(signum, frame):
        left = stop() or ""
        name = signal.Signals(signum).name
        print(f"\nxsa-lm {command}: interrupted ({name}); run the same command to resume{left}", file=sys.stderr)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


Result = TypeVar("Result")


def run_exclusive(
    command: str, overrides_of: Callable[[list[str]], list[str]], run: Callable[[Path, list[str]], Result]
) -> tuple[Path, Result]:
    """run(directory, overrides for the child processes) in Hydra's output directory, held locked."""
    directory = Path(HydraConfig.get().runtime.output_dir)
    overrides = overrides_of(list(HydraConfig.get().overrides.task))
    with hold_directory(directory, f"{command}.lock", f"xsa-lm {command}"):
        return directory, run(directory, overrides)


# The sweep settings that change what the report says besides its statistics' own, each with the value it had in a
# plan recorded before the plan held it.
REPORTED = {
    "baseline": "sa",
    "candidates": ["xsa"],
    "null_arm": [],
    "placebo_scale": 1e-6,
    "tune_xsa": False,
    "reuse_search_run": False,
    "diverge_above": None,
    "eval_tasks": None,
    "eval_limit": None,
}


def comparison_plan(spec: SweepSpec, seeds: list[int]) -> dict[str, Any]:
    """What decides the report, fixed at the first run (sweep.json's `plan`): the statistics and REPORTED."""
    cap = spec.seeds_until_significant
    looks = SequentialRule.plan(len(seeds), cap).looks if cap is not None else 1
    plan = {"search_seeds": spec.search_seeds, "seeds": seeds, "seeds_until_significant": cap, "alpha": protocol.ALPHA}
    statistics = {"planned_looks": looks, "stall": spec.stall, "margin": spec.margin}
    return plan | statistics | spec.model_dump(include=set(REPORTED))


def keep_plan(
    state_file: Path, plan: Mapping[str, object], grid: list[float], earlier: Mapping[str, object] = REPORTED
) -> None:
    """The first run's plan, which a rerun must keep (fixed compare seeds as a set); the grid may grow. A key the
    recorded plan lacks had the value `earlier` gives."""
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    recorded = state.get("plan")
    if recorded is not None:
        recorded = {**{k: v for k, v in earlier.items() if k in plan}, **recorded}

    def compared(p: Mapping[str, Any]) -> dict[str, Any]:
        fixed = "seeds" in p and p.get("seeds_until_significant") is None  # a set of seeds (scale's size axis: none)
        p = {**p, "null_arm": null_arms(p["null_arm"])} if "null_arm" in p else p  # a plan's `true` is [init]
        return {**p, "seeds": sorted(p["seeds"] or [])} if fixed else dict(p)

    if recorded is not None and compared(recorded) != compared(plan):
        changed = ", ".join(f"{k} {recorded.get(k)!r} -> {plan[k]!r}" for k in plan if recorded.get(k) != plan[k])
        raise UserError(
            f"{state_file.parent} was planned with other settings ({changed}): a plan changed after results exist "
            "rewrites its report and spends the significance level again; rerun with the first plan, or start a new "
            "study (a new hydra.run.dir)"
        )
    state["plan"] = plan if recorded is None else recorded  # the first run's (its seeds' order, too)
    state.setdefault("history", []).append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "grid": grid})
    write_json(state_file, state)


def phase_records(store: TrialStore, trials: list[Trial], phase: str) -> list[TrialRecord]:
    records = [store.load(trial) or TrialRecord.missing(trial, phase) for trial in trials]
    return [replace(record, phase=phase, reused=record.phase != phase) for record in records]


def search(launcher: Launcher, grid: list[float], seeds: list[int], arms: list[str], phase: str) -> list[Selection]:
    """Every LR of the grid x the seeds, for each arm at once; each arm's selection, none on a partial grid (a trial
    failed, or preempted past launcher.max_requeues: the compare phase would start on the LRs that happened to end)."""
    trials = {arm: protocol.search_trials(grid, seeds, [arm]) for arm in arms}
    launcher.run([t for arm in arms for t in trials[arm]], phase, "lr-search")
    selections = []
    for arm in arms:
        runs: dict[float, list[tuple[str | None, float | None]]] = {lr: [] for lr in grid}
        for trial in trials[arm]:
            record = launcher.store.load(trial)
            runs[trial.lr].append((record.status, record.final_val_loss) if record else (None, None))
        selection = protocol.select_lr(runs)
        unfinished = [t.id for t in trials[arm] if not launcher.store.is_final(t)]
        if unfinished:
            partial = f"no LR selected on a partial grid: {', '.join(unfinished)} did not finish"
            selection = replace(selection, lr=None, warnings=[*selection.warnings, partial])
        selections.append(selection)
    return selections


def earlier_comparisons(store: TrialStore, selected_lr: float | None, arms: list[str]) -> list[str]:
    """A warning per LR besides the selected one that this folder already compared at (an earlier grid chose it)."""
    completed: dict[float, list[str]] = {}
    for record in (TrialRecord.read(p, then=RETRY_DAMAGED) for p in sorted(store.records.glob("*.json"))):
        at_selected = selected_lr is not None and math.isclose(record.lr, selected_lr, rel_tol=1e-9)
        if record.phase == "compare" and record.status == "completed" and not at_selected:
            completed.setdefault(record.lr, []).append(record.id)
    now, compared = f"LR {selected_lr:g}" if selected_lr is not None else "no LR", " and ".join(a.upper() for a in arms)
    return [
        f"this sweep folder already compared {compared} at LR {lr:g} ({len(ids)} completed compare run(s): "
        f"{', '.join(ids)}; records in {store.records}, runs in {store.runs}) before this run's grid selected {now}: "
        "the verdict shown was reached after that comparison was seen, which spends the significance level again "
        "(the grids run are in sweep.json's history)"
        for lr, ids in sorted(completed.items())
    ]


@dataclass(frozen=True)
class SweepJob:
    """A checked sweep: settings, grid, compare seeds, the trials' overrides and W&B settings, config.yaml's config."""

    spec: SweepSpec
    grid: list[float]
    seeds: list[int]
    overrides: list[str]
    wandb: WandbSpec | None = None
    config: dict = field(default_factory=dict)

    @cached_property
    def launch(self) -> LauncherSpec:
        """How the trials run: config.yaml's `launcher` (the command's launcher group), else on this machine."""
        launcher = self.config.get("launcher")
        return parse(LauncherSpec, launcher, at="launcher.") if launcher else LauncherSpec(kind="local")

    def launcher(self, store: TrialStore, group: str | None, command: str) -> Launcher:
        launcher = Launcher(store, self.overrides, self.spec, self.launch, group if self.wandb else None)
        stop_on_signals(launcher.stop, command)
        return launcher


NULL_MEANS = {protocol.NULL: "from other initial weights", protocol.PLACEBO: "from its initial weights, perturbed"}


def null_trial_arms(spec: SweepSpec) -> list[str]:
    """The arm names of sweep.null_arm's trials (null, placebo)."""
    return [protocol.NULL_TRIALS[arm] for arm in spec.null_arm]


def check_arms(spec: SweepSpec, overrides: list[str], trained: list[str], lr: float) -> None:
    """Each arm an option of the attention group (the package's or a --config-dir's), named by its own name; the
    trained arms' trial configs parsed once here, not in every trial."""
    options = GlobalHydra.instance().config_loader().get_group_options("attention")
    if unknown := [arm for arm in spec.arms if arm not in options]:
        raise UserError(
            f"sweep.baseline/sweep.candidates name {', '.join(unknown)}, which is no attention option (available: "
            f"{', '.join(options)}): add attention/<name>.yaml to a folder given with --config-dir, or fix the name"
        )
    for arm in trained:
        trial = Trial(arm, lr, spec.search_seeds[0])
        cfg = compose(config_name="train", overrides=[*overrides, *trial_settings(trial, spec)])
        parse(TrainSpec, cfg).refuse_idle_options(overrides)  # as each trial's `xsa-lm train` will
        named = arm in protocol.NULL_TRIALS.values() or cfg.attention.name == arm
        if not named:  # trials, records and reports go by the arm's name
            raise UserError(
                f"the attention option {arm} has name: {cfg.attention.name}: an arm's name must be its option's name; "
                f"set name: {arm} in attention/{arm}.yaml"
            )


def grid_and_seeds(spec: SweepSpec, model: str) -> tuple[list[float], list[int]]:
    """The LR grid (sweep.lrs, else sweep.lr_range, else the model's in sweep.lr_grids) and the compare seeds."""
    grids = spec.lr_grids or {}
    grid = protocol.lr_grid(spec.lrs, spec.lr_range, grids.get(model, grids.get("default")))
    return grid, protocol.check_seeds(spec.seeds, spec.search_seeds, spec.reuse_search_run)


def check_sweep(train: TrainSpec, spec: SweepSpec, overrides: list[str] | None, config: dict | None = None) -> SweepJob:
    """Every sweep setting and kind of trial, checked before anything is written (no overrides: `train` alone)."""
    grid, seeds = grid_and_seeds(spec, train.model.name)
    spec.idle_settings(seeds)
    if spec.seeds_until_significant is not None:
        protocol.seed_sequence(seeds, spec.search_seeds, spec.seeds_until_significant)
    if spec.eval_tasks:
        from xsa_lm.eval.run import require_harness, resolve_tasks, task_manager

        require_harness(needed_by="sweep.eval_tasks")  # now, not after hours of training
        try:
            task_manager(*resolve_tasks(spec.eval_tasks))  # names, task files
        except UserError as e:
            raise UserError(f"sweep.eval_tasks: {str(e).removeprefix('tasks: ')}") from None
    if overrides is not None:  # the candidates train only in the comparison, unless they are tuned too
        trained = spec.arms if seeds or spec.tune_xsa else [spec.baseline]
        check_arms(spec, overrides, trained + (null_trial_arms(spec) if seeds else []), grid[0])
    job = SweepJob(spec, grid, seeds, overrides or [], train.logger.wandb, config or {})
    if job.launch.kind == "local":
        gpu_slots(job.launch.max_parallel or 1)  # enough GPUs for the trials at once
    elif shutil.which("sbatch") is None:
        raise UserError(
            "launcher=slurm submits each trial with sbatch, which is not on PATH here: run the sweep where SLURM's "
            "commands are (a login node, or inside a job), or use launcher=local"
        )
    return job


@dataclass(frozen=True)
class Phase:
    """A phase's trials as planned: every arm x LR x seed."""

    name: str
    arms: list[str]
    lrs: list[float] | None  # None: the LR the search selects
    seeds: list[int]
    at_most: bool = False  # sweep.seeds_until_significant: seeds added until significant, up to these

    @property
    def runs(self) -> int:
        return len(self.arms) * len(self.lrs or [0]) * len(self.seeds)

    def __str__(self) -> str:
        lrs = f"LRs {', '.join(f'{lr:g}' for lr in self.lrs)}" if self.lrs else "the selected LR"
        runs, seeds = f"{'up to ' * self.at_most}{self.runs} runs", ", ".join(map(str, self.seeds))
        return f"{self.name}: {runs} = {', '.join(self.arms)} x {lrs} x seeds {seeds}"


def study_phases(spec: SweepSpec, grid: list[float], seeds: list[int]) -> list[Phase]:
    """The sweep's trials by phase, as planned before any runs: the search, then the comparison and the null arm at
    the LR it selects (all of sweep.seeds_until_significant's seeds where it caps them)."""
    cap = spec.seeds_until_significant
    compared = protocol.seed_sequence(seeds, spec.search_seeds, cap) if cap is not None else seeds
    phases = [Phase("search", spec.arms if spec.tune_xsa else [spec.baseline], grid, spec.search_seeds)]
    if compared:
        phases.append(Phase("compare", spec.arms, None, compared, at_most=cap is not None))
    nulls = null_trial_arms(spec) if compared else []  # each null arm its own phase, named by its trials
    return phases + [Phase(arm, [arm], None, compared, at_most=cap is not None) for arm in nulls]


def detectable_effect(spec: SweepSpec, seeds: list[int]) -> str:
    """The smallest difference from the baseline that the compare seeds detect at 80% power, from the paired sd a
    pilot measured (sweep.expected_sd)."""
    pairs, contrast = f"{len(seeds)} seed pairs", f"{'/'.join(spec.candidates)} - {spec.baseline}"
    if spec.expected_sd is None:
        return (
            f"detectable effect of {contrast} over {pairs}: unknown until its sd is measured (sweep.expected_sd=null): "
            "set it to a pilot's sd of the difference (results.json: comparison.diff_std)"
        )
    smallest = min_detectable_difference(spec.expected_sd, len(seeds))
    detects = f"{smallest:.3g} nats" if smallest is not None else "nothing (a paired test needs 2 seeds)"
    return (
        f"detectable effect of {contrast} over {pairs}: {detects} at {POWER:.0%} power (paired t, two-sided 5%, sd "
        f"{spec.expected_sd:g}: sweep.expected_sd); the plan's margin is {spec.margin:g} nats"
    )


def dry_run(job: SweepJob, train: TrainSpec) -> None:
    """The trials, their GPU-hours and the detectable effect, printed; nothing trained or written."""
    spec, phases = job.spec, study_phases(job.spec, job.grid, job.seeds)
    print(f"xsa-lm sweep (dry run) | {spec.baseline} vs {', '.join(spec.candidates)} | {train.model.name}")
    print("\n".join(f"  {phase}" for phase in phases))
    print(gpu_hours_table(run_compute(train), {phase.name: phase.runs for phase in phases}))
    if job.seeds:
        print(detectable_effect(spec, job.seeds))
    print("dry run: nothing trained or written (sweep.dry_run=true)")


def compare_phase(
    launcher: Launcher, lr: float, seeds: list[int], spec: SweepSpec
) -> tuple[list[Trial], SequentialSummary | None]:
    """Every arm at the selected LR over sweep.seeds; with a cap (one candidate), a seed pair more per look until
    significant."""
    arms, cap = spec.arms, spec.seeds_until_significant
    print(f"phase 2: selected LR {lr:g}\nphase 3: {' vs '.join(a.upper() for a in arms)} at LR {lr:g}")
    if cap is None:
        compare = protocol.compare_trials(lr, seeds, arms)
        launcher.run(compare, "compare", "compare")
        return compare, None
    (candidate,) = spec.candidates  # SweepSpec refuses a cap with several
    contrast = f"{candidate.upper()} - {spec.baseline.upper()}"
    rule = SequentialRule.plan(len(seeds), cap, contrast)
    order = protocol.seed_sequence(seeds, spec.search_seeds, cap)
    looks: list[Look] = []
    trials: list[Trial] = []
    n = rule.first_look
    while True:
        added = protocol.compare_trials(lr, order[len(trials) // len(arms) : n], arms)  # the earlier pairs are final
        trials += added
        launcher.run(added, "compare", "compare")
        if not all(launcher.store.is_final(t) for t in trials):  # a failed or interrupted run: the look waits
            return trials, rule.summary(looks, "incomplete")
        records = phase_records(launcher.store, trials, "compare")
        looks.append(rule.look(n, report.comparison_of(records, spec.baseline, candidate).diffs))
        stopped = rule.stopped(looks[-1])
        outcome = f"stop ({stopped})" if stopped else "one more seed"
        ci = f"{1 - rule.alpha_per_look:.2%} CI {report.ci_text(looks[-1].ci)}"
        print(f"  look {len(looks)} of at most {rule.looks}: {n} seeds, {ci}: {outcome}")
        if stopped:
            return trials, rule.summary(looks, stopped)
        n += 1


@dataclass(frozen=True)
class Evaluation:
    result: dict | None  # eval.json; None without eval tasks or compare runs, or when it failed
    warnings: list[str]
    error: str | None


def downstream_evaluation(
    tasks: str | list[str] | None,
    limit: float | None,
    store: TrialStore,
    compare: list[Trial],
    sweep_dir: Path,
    *,
    baseline: str,
) -> Evaluation:
    """`xsa-lm eval` of the compare runs' last checkpoints into eval/: reused if the same, else kept aside."""
    from xsa_lm.eval.run import resolve_tasks, task_file_digests

    if not (tasks and compare):
        return Evaluation(result=None, warnings=[], error=None)
    completed = [t for t in compare if (record := store.load(t)) is not None and record.status == "completed"]
    ckpts = [str(store.run_dir(t) / "checkpoints" / "last.ckpt") for t in completed]
    out, warnings = sweep_dir / "eval", []
    if (out / "eval.json").exists():
        previous = json.loads((out / "eval.json").read_text())
        evaluated = [sorted(r["checkpoint"] for r in previous["rows"]), sorted(previous["tasks"]), previous["limit"]]
        evaluated.append(previous.get("task_files", {}))
        if evaluated == [sorted(ckpts), sorted(resolve_tasks(tasks)[0]), limit, task_file_digests(tasks)]:
            return Evaluation(result=previous, warnings=[], error=None)
        n = next(n for n in itertools.count(1) if not out.with_name(f"eval.earlier{n}").exists())
        kept = out.rename(out.with_name(f"eval.earlier{n}"))
        warnings.append(
            f"the earlier downstream evaluation ({len(previous['rows'])} checkpoints, tasks {previous['tasks']}, "
            f"limit {previous['limit']}) was of other checkpoints, tasks, task files or limit than this run's: it is "
            f"kept in {kept}, and the table shown is this run's evaluation in {out}"
        )
    listed = f"[{','.join(map(str, tasks))}]" if isinstance(tasks, list) else str(tasks)
    cmd = [sys.executable, "-m", "xsa_lm.cli", "eval", command_line.override("ckpts", ckpts), f"tasks={listed}"]
    cmd += [f"baseline={baseline}", command_line.override("hydra.run.dir", out)] + ([f"limit={limit}"] if limit else [])
    print(f"phase 4: downstream evaluation of {len(ckpts)} checkpoints ({listed})")
    failed = run_logged(cmd, store.logs / "eval.log")
    if failed is not None:
        error = f"downstream evaluation failed: {failed} (see logs/eval.log)"
        return Evaluation(result=None, warnings=[*warnings, error], error=error)
    return Evaluation(result=json.loads((out / "eval.json").read_text()), warnings=warnings, error=None)


def run_sweep(job: SweepJob, sweep_dir: Path, command: str = "sweep") -> tuple[SweepResult, str]:
    """The sweep's phases in sweep_dir, its identity and plan kept in sweep.json; the results and the report."""
    spec, grid, seeds, cap = job.spec, job.grid, job.seeds, job.spec.seeds_until_significant
    group = job.wandb.group if job.wandb else None
    state = sweep_dir / "sweep.json"
    holds = "a sweep with the training overrides"
    sweep_id = open_state(state, job.overrides, group, id_key="sweep_id", overrides_key="train_overrides", holds=holds)
    keep_plan(state, comparison_plan(spec, seeds), grid)
    config_name = "config.yaml" if not (sweep_dir / "config.yaml").exists() else f"config.rerun-{int(time.time())}.yaml"
    write_text(sweep_dir / config_name, OmegaConf.to_yaml(job.config))
    launcher = job.launcher(TrialStore(sweep_dir), sweep_id, command)
    store = launcher.store
    searched_arms = spec.arms if spec.tune_xsa else [spec.baseline]
    planned = f"compare seeds {seeds}" + (f", then more up to {cap} until significant" if cap is not None else "")
    phases = study_phases(spec, grid, seeds)
    trial_counts = " + ".join(f"{'up to ' * p.at_most}{p.runs} {p.name}" for p in phases) + " trials"
    threads = "" if launcher.threads is None else f" | OMP_NUM_THREADS={launcher.threads} per trial"
    arms = f"{spec.baseline} vs {', '.join(spec.candidates)}"
    threads += f" | launcher={launcher.launch.kind}"
    print(
        f"xsa-lm sweep | {sweep_dir} | W&B group {sweep_id} | arms {arms} | LR grid {[f'{lr:g}' for lr in grid]}, "
        f"search seeds {spec.search_seeds}, {planned} | {trial_counts}{threads}"
    )
    if seeds:
        print(detectable_effect(spec, seeds))
    # The baseline's runs select the LR; the candidates' (sweep.tune_xsa) say where their own optimum lies
    print("phase 1: LR search")
    selection, *own = search(launcher, grid, spec.search_seeds, searched_arms, "search")
    compare: list[Trial] = []
    sequential = None
    if selection.lr is not None and seeds:
        compare, sequential = compare_phase(launcher, selection.lr, seeds, spec)
        if sequential is not None:
            seeds = list(dict.fromkeys(trial.seed for trial in compare))  # the seeds it ran, in order
    lr = selection.lr
    nulls = {arm: [Trial(arm, lr, s) for s in seeds] for arm in null_trial_arms(spec)} if lr is not None else {}
    for arm, null in nulls.items():
        print(f"phase 3b: the {arm} arm, {spec.baseline.upper()} again ({NULL_MEANS[arm]}) at seeds {seeds}")
        launcher.run(null, arm, arm)
    evaluation = downstream_evaluation(
        spec.eval_tasks, spec.eval_limit, store, compare, sweep_dir, baseline=spec.baseline
    )
    searched = protocol.search_trials(grid, spec.search_seeds, searched_arms)
    results = report.build_results(
        sweep_dir,
        sweep_id=sweep_id,
        grid=grid,
        seeds=seeds,
        train_overrides=job.overrides,
        trials=phase_records(store, searched, "search")
        + phase_records(store, compare, "compare")
        + [record for arm, null in nulls.items() for record in phase_records(store, null, arm)],
        arms=spec.arms,
        selection=selection,
        tuned=dict(zip(spec.candidates, own, strict=False)),  # empty unless sweep.tune_xsa
        search_seeds=spec.search_seeds,
        sequential=sequential,
        stall_rule=spec.stall_rule,
        margin=spec.margin,
    )
    warnings = earlier_comparisons(store, selection.lr, spec.arms) + evaluation.warnings
    results = report.with_outcome(results, evaluation=evaluation.result, eval_error=evaluation.error, warnings=warnings)
    markdown = report.write_report(results, sweep_dir)
    if job.wandb and spec.wandb_report:
        report.log_to_wandb(results, sweep_dir, report_run_settings(job.wandb))
    return results, markdown


def incomplete(results: SweepResult) -> str | None:
    """Why a sweep did not finish (a trial to retry, no usable LR), or None."""
    unfinished = [t.id for t in results.trials if t.status not in protocol.FINISHED]
    search = [t.id for t in results.trials if t.status not in protocol.FINISHED and t.phase == "search"]
    if search:  # search() selected nothing: the compare phase did not start
        return (
            f"search trial(s) {', '.join(search)} did not finish, so no LR was selected on the partial grid and the "
            "compare phase did not start: run the same command again to retry them"
        )
    if unfinished:
        retry = "run the same command again to retry them"
        return f"{len(unfinished)} trial(s) did not finish ({', '.join(unfinished)}): {retry}"
    return "no usable LR in the grid (see the report's warnings)" if results.selected_lr is None else None


def sweep_problem(results: SweepResult) -> str | None:
    """Why `xsa-lm sweep` exits with 1 (incomplete, or a failed downstream evaluation), or None."""
    problem = incomplete(results)
    if problem is None and results.eval_error:  # the training finished: only the evaluation is retried
        problem = f"{results.eval_error}: run the same command again to retry it"
    return problem


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="sweep")
@one_line_errors
def main(cfg: DictConfig) -> None:
    def sweep(sweep_dir: Path, overrides: list[str]) -> tuple[SweepResult, str]:
        config = cast(dict, OmegaConf.to_container(cfg, resolve=True))
        refuse_other_code(sweep_dir, spec.allow_mixed_code, code_version())
        return run_sweep(check_sweep(train, spec, overrides, config), sweep_dir)

    train, spec = parse(TrainSpec, cfg), parse(SweepSpec, cfg.sweep, at="sweep.")
    if spec.dry_run:  # before the sweep folder's lock: Hydra's empty run folder goes again
        dry_run(check_sweep(train, spec, train_overrides(list(HydraConfig.get().overrides.task))), train)
        remove_empty_run_dir()
        return
    sweep_dir, (results, markdown) = run_exclusive("sweep", train_overrides, sweep)
    print(f"\n{markdown}\n\nreport: {sweep_dir / 'report.md'} | results: {sweep_dir / 'results.json'}")
    problem = sweep_problem(results)
    if problem:
        print(f"xsa-lm sweep: {problem}", file=sys.stderr)
        sys.exit(1)

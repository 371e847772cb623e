"""`xsa-lm scale`: the candidate arm's effective-compute multiplier k over the baseline (sweep.baseline and the one
of sweep.candidates; SA and XSA by default), the sweep's phases run as a library at several model sizes.
- scale.axis=size: the sweep at each size (sizes/<model>/), one k for the ladder from a shared fit of loss vs compute.
- scale.axis=tokens: the baseline at several token budgets (x B = scale.tokens_per_param x the non-embedding
  parameters, scale.sa_budgets) and the candidate at some of them (scale.xsa_budgets); k per size and candidate budget
  from the baseline's own tokens-to-loss curve, pooled.
A wall-clock k divides by `xsa-lm bench`'s candidate/baseline step time. A rerun resumes: scale.json keeps the plan."""

import io
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, TextIO, cast

import hydra
import numpy as np
import scipy.stats
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from xsa_lm.config.spec import LoggerSpec, TrainSpec, parse
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import write_json, write_text
from xsa_lm.locking import hold_directory
from xsa_lm.records import JsonObject, RunSummary
from xsa_lm.scale import fit, report, token_axis
from xsa_lm.stats.decision import clustered_test, margin_verdict
from xsa_lm.stats.paired import holm, paired_stats, position_differences, sign_test_p
from xsa_lm.sweep import run as sweeps
from xsa_lm.sweep.protocol import FINISHED, NULL, Selection, Trial, check_seeds
from xsa_lm.sweep.report import SweepResult, bpb_stats
from xsa_lm.sweep.settings import ScaleSpec, SweepSpec
from xsa_lm.sweep.trials import (
    Launcher,
    TrialRecord,
    TrialStore,
    finished_records,
    refuse_other_code,
    run_logged,
    runs_by_code,
)
from xsa_lm.train.runinfo import code_version

SIZE_KEYS = ("n_layer", "d_model", "n_head", "head_dim", "n_kv_head", "mlp_ratio")  # what makes the sizes differ
PRESET_SETS_IT = "each size's model preset sets it (one value for all would make the sizes one model); set the sizes"
SET_BY_SCALE = {  # other model.* keys apply to every size (e.g. model.block_size)
    "model": "set the sizes with scale.models=[...]",
    **{f"model.{key}": f"{PRESET_SETS_IT} with scale.models=[...]" for key in SIZE_KEYS},
    "hydra.run.dir": "each size's sweep goes to <study dir>/sizes/<model>",
}
# What a study's plan holds beside its seeds and budgets, with the value each had in a plan recorded before it did:
# the size axis's fit, intervals and bench; the token axis's arms, wall-clock k and intervals.
PLAN_EARLIER = {"fit": "auto", "bootstrap_resamples": 1000, "bootstrap_seed": 0, "bench": None}
PLAN_EARLIER |= {"arms": asdict(report.PAPER_ARMS), "measure_throughput": True}
MIN_STEPS = 2  # a token-axis run's fewest steps
SET_BY_TOKEN_AXIS = {
    "scheduler.warmup_steps": "set each run's warmup with scale.warmup_fraction (null: the recipe's)",
    "trainer.max_steps": "each run's steps come from scale.tokens_per_param and the budgets",
    "val_every_steps": "each run validates at half and at the end",
}


def sweep_overrides(task_overrides: list[str]) -> list[str]:
    """The command line's overrides passed on to every size's sweep or runs (scale.* stays with the study), which a
    rerun must keep; but sweep.allow_mixed_code, which a rerun may switch (the study reads it)."""
    switched = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") != "sweep.allow_mixed_code"]
    return sweeps.passed_on(switched, "scale", SET_BY_SCALE, setter="xsa-lm scale for each size")


@dataclass(frozen=True)
class StudyIdentity:
    """The study's folder, its id (scale.json's) and the overrides of its runs."""

    study_dir: str
    study_id: str
    overrides: list[str]


Study = Callable[[StudyIdentity, str | None], list[str]]  # runs a checked study: its identity, the W&B group


def size_config(
    overrides: list[str], model: str, seeds: list[int] | None
) -> tuple[TrainSpec, SweepSpec, list[str], dict]:
    """One size as `xsa-lm sweep model=<model>` (seeds as sweep.seeds): its specs, trial overrides and config."""
    listed = [] if seeds is None else [f"sweep.seeds=[{','.join(map(str, seeds))}]"]
    cfg = compose(config_name="sweep", overrides=[*overrides, f"model={model}", *listed])
    runs = sweeps.train_overrides([*overrides, f"model={model}"])
    config = cast(dict, OmegaConf.to_container(cfg, resolve=True))
    return parse(TrainSpec, cfg), parse(SweepSpec, cfg.sweep, at="sweep."), runs, config


def arms_of(sweep: SweepSpec) -> report.Arms:
    """The baseline and the one candidate a study compares (its k is one arm's over the baseline)."""
    if len(sweep.candidates) != 1:
        raise UserError(
            f"sweep.candidates=[{','.join(sweep.candidates)}]: xsa-lm scale compares the baseline with one "
            "candidate; give one, e.g. sweep.candidates=[xsa]"
        )
    return report.Arms(sweep.baseline, sweep.candidates[0])


def load_bench(
    path: Path | str | None, key: str = "scale.bench", arms: report.Arms = report.PAPER_ARMS
) -> report.BenchRatio | None:
    """The candidate/baseline step time (median, interval) of an `xsa-lm bench` results.json."""
    if path is None:
        return None
    if not Path(path).is_file():
        raise UserError(f"{key}={path}: no such file; give the results.json an `xsa-lm bench` run wrote")
    try:
        bench = json.loads(Path(path).read_text())
        ratio = bench["ratios"][arms.bench_ratio]
        ratio["median"]  # noqa: B018  # a step time, not only a dict
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        steps = "{1}/{0} step time".format(*arms.labels)
        raise UserError(f"{key}={path}: no {steps} in it (ratios.{arms.bench_ratio})") from None
    return report.BenchRatio(source=str(path), model=bench.get("model"), xsa_over_sa_step_time=ratio)


def wallclock(
    k: float, ci: Sequence[float | None], ratio: float, interval: Sequence[float] | None
) -> tuple[float, list[float | None] | None]:
    """k over `xsa-lm bench`'s candidate/baseline step time (the trials' tokens/s vary with whatever else the machine
    ran)."""
    if not interval:
        return k / ratio, None
    lo, hi = ci
    return k / ratio, [lo / interval[1] if lo is not None else None, hi / interval[0] if hi is not None else None]


class SizeOutput(io.TextIOBase):
    """A size's sweep output: whole in logs/<model>.log, and on the terminal line by line, named by its size."""

    def __init__(self, model: str, log: TextIO, terminal: TextIO) -> None:
        self.model, self.log, self.terminal, self.pending = model, log, terminal, ""

    def write(self, text: str) -> int:
        print(text, end="", file=self.log, flush=True)
        *lines, self.pending = (self.pending + text).split("\n")
        for line in filter(str.strip, lines):
            print(f"[{self.model}] {line}", file=self.terminal, flush=True)
        return len(text)


def run_size(model: str, job: sweeps.SweepJob, *, study_dir: Path, group: str | None) -> report.SizeResult:
    """One size's sweep in sizes/<model>/, held as `xsa-lm sweep` holds its folder, in the study's W&B group."""
    sweep_dir, log = study_dir / "sizes" / model, study_dir / "logs" / f"{model}.log"
    if job.wandb is not None and group is not None:
        job = replace(job, wandb=job.wandb.model_copy(update={"group": group}))
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"size {model}: its sweep into {sweep_dir}")
    with open(log, "a") as out, hold_directory(sweep_dir, "sweep.lock", "xsa-lm sweep"):
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: xsa-lm sweep {' '.join(job.overrides)}\n")
        with redirect_stdout(SizeOutput(model, out, sys.stdout)):
            try:
                results, _ = sweeps.run_sweep(job, sweep_dir, command="scale")
            except UserError as e:
                raise UserError(f"the sweep of {model} was refused: {e}") from None
    return size_result(model, sweep_dir, arms_of(job.spec), finished=sweeps.incomplete(results) is None)


def size_result(
    model: str, sweep_dir: Path, arms: report.Arms = report.PAPER_ARMS, *, finished: bool
) -> report.SizeResult:
    """What the fit needs from a size's results.json: the paired final losses, throughput, training compute."""
    import torch

    from xsa_lm.model.config import GPTConfig
    from xsa_lm.model.gpt import GPT

    sweep = SweepResult.read(sweep_dir / "results.json")
    compare = sweep.comparison
    size = report.SizeResult(
        model=model,
        sweep_dir=str(sweep_dir),
        sweep_returncode=0 if finished else 1,
        selected_lr=sweep.selected_lr,
        lr_grid=sweep.grid,
        sweep_warnings=sweep.warnings,
        sa_runs=compare.sa,
        xsa_runs=compare.xsa,
        **{key: getattr(compare, key) for key in ("seeds", "sa_mean", "xsa_mean", "diff_ci95")},  # the same names
    )
    runs = [t for t in sweep.trials if t.phase == "compare" and t.seed in compare.seeds]
    if not runs:
        return replace(size, error="no seed has both a {} and a {} result (see the size's report)".format(*arms.labels))
    summary = RunSummary.read(Path(str(runs[0].run_dir)) / "summary.json")
    with torch.device("meta"):  # the FLOPs formula needs the shapes only
        flops_per_token = GPT(GPTConfig(**summary.model_config)).flops_per_token()
    base, cand = ([t.tokens_per_s for t in runs if t.attention == a and t.tokens_per_s] for a in arms.names)
    return replace(
        size,
        non_embedding_params=summary.non_embedding_params,
        tokens=summary.tokens_seen,
        compute=flops_per_token * summary.tokens_seen,
        sa_tokens_per_s=statistics.fmean(base) if base else None,
        xsa_tokens_per_s=statistics.fmean(cand) if cand else None,
    )


def not_falling(ladder: list[report.SizeResult], means: list[float]) -> list[str]:
    pairs = range(len(ladder) - 1)
    return [f"{ladder[i].model} -> {ladder[i + 1].model}" for i in pairs if means[i + 1] >= means[i]]


def ladder_flags(
    ladder: list[report.SizeResult], sa_fit: fit.Fit, lack: fit.LackOfFit, shared: fit.SharedFit, arms: report.Arms
) -> dict[str, str]:
    """Every reason this ladder cannot turn the candidate's loss gap into compute (flag -> its one-line why); sa_fit:
    the baseline's fit."""
    flags: dict[str, str] = {}
    base, cand = arms.labels
    compute = [cast(float, s.compute) for s in ladder]
    sa_means, xsa_means = [cast(float, s.sa_mean) for s in ladder], [cast(float, s.xsa_mean) for s in ladder]
    if lack.p is None:
        no_dof = f"{len(ladder)} sizes for {fit.FORMS[sa_fit.form]} parameters leave no degree of freedom"
        why = "a size has fewer than 2 seeds (no standard error)" if lack.dof > 0 else no_dof
        flags["lack_of_fit"] = f"no lack-of-fit test possible: {why}"
    elif lack.p < 0.05:
        flags["lack_of_fit"] = (
            f"chi^2 = {lack.chi2:.1f} on {lack.dof} dof (p = {lack.p:.2g}): the {base} curve misses the {base} "
            "means by more than their seed noise (each size's standard error over seeds)"
        )
    # One step of the ladder beyond its ends is allowed: the candidate winning at the largest size always reads the
    # baseline's curve a little past it, which is what k means there.
    step = (max(compute) / min(compute)) ** (1 / (len(compute) - 1))
    outside = []
    for s, sa_mean, xsa_mean in zip(ladder, sa_means, xsa_means, strict=True):
        for arm, mean in ((base, sa_mean), (cand, xsa_mean)):
            needed = sa_fit.compute_for(mean)
            if not math.isfinite(needed) or needed > max(compute) * step:
                outside.append(f"{s.model} {arm} ({needed / max(compute):.3g}x the largest)")
            elif needed < min(compute) / step:
                outside.append(f"{s.model} {arm} ({min(compute) / needed:.3g}x below the smallest)")
    if outside:
        flags["extrapolation"] = (
            f"the {base} fit needs compute beyond the measured range (by more than one ladder step, "
            f"{step:.2f}x) to reach the means of {', '.join(outside)}"
        )
    span = max(compute) / min(compute)
    if span < 10:
        flags["compute_span"] = f"the ladder spans {span:.3g}x in compute, under 10x"
    bounds = [f"shared fit: {b}" for b in shared.at_bounds()]
    if sa_fit.form == "power_law_offset" and sa_fit.E <= 1e-6:
        bounds.insert(0, f"{base} fit: E at its lower bound 0")
    if sa_fit.form == "power_law_offset" and sa_fit.E >= min(sa_means) - 1e-6:
        bounds.insert(0, f"{base} fit: E at its upper bound, the lowest {base} mean")
    if sa_fit.alpha <= 1e-6 or sa_fit.alpha >= 10 - 1e-6:
        bounds.insert(0, f"{base} fit: alpha = {sa_fit.alpha:.4f} at a bound (0 or 10)")
    if bounds:
        flags["parameter_at_bound"] = "; ".join(bounds) + ": the data do not identify it"
    rises = not_falling(ladder, xsa_means)
    trend = scipy.stats.linregress(np.log(compute), xsa_means) if len(ladder) > 2 else None
    if rises or trend is None or trend.slope >= 0 or trend.pvalue > 0.05:
        why = f"it rises ({', '.join(rises)})" if rises else "its fall is not significant"
        why += f"; slope vs ln C {trend.slope:+.4f} (p = {trend.pvalue:.2g})" if trend else "; two sizes cannot test it"
        flags["xsa_flat_or_not_monotone"] = f"{cand}'s mean loss does not fall with compute: {why}"
    rises = not_falling(ladder, sa_means)
    if rises:
        flags["sa_not_monotone"] = f"{base}'s mean loss does not fall as compute grows ({', '.join(rises)})"
    edges = [  # the selected LR at an edge of its grid, as the grid or the size's sweep says
        f"{s.model} (LR {s.selected_lr:g})"
        for s in ladder
        if (s.lr_grid and (len(s.lr_grid) == 1 or s.selected_lr in (min(s.lr_grid), max(s.lr_grid))))
        or any("of the grid" in w or "grid holds one LR" in w for w in s.sweep_warnings)
    ]
    if edges:
        flags["lr_at_grid_edge"] = f"the selected LR is at an edge of its grid at {', '.join(edges)}: extend it"
    return flags


def losses_by_seed(ladder: list[report.SizeResult]) -> tuple[np.ndarray, np.ndarray]:
    """Each arm's final losses as [size, seed] over every seed of the ladder (NaN: no pair at that size)."""
    seeds = sorted({seed for size in ladder for seed in size.seeds})

    def table(arm: str) -> np.ndarray:
        by_size = (dict(zip(s.seeds, getattr(s, arm), strict=True)) for s in ladder)
        return np.array([[losses.get(seed, np.nan) for seed in seeds] for losses in by_size])

    return table("sa_runs"), table("xsa_runs")


@dataclass(frozen=True)
class LadderAnalysis:
    fit: JsonObject  # the baseline's fit, the shared fit, the flags, and k when no flag is up
    across_sizes: JsonObject  # the pooled sign test and the test by seed
    warnings: list[str]
    sizes: list[report.SizeResult]  # each with its paired tests


def analyse(
    sizes: list[report.SizeResult],
    fit_form: str,
    resamples: int,
    seed: int,
    bench: report.BenchRatio | None = None,
    arms: report.Arms = report.PAPER_ARMS,
) -> LadderAnalysis:
    """The baseline's and shared fits, k with its bootstrap CI, the flags (k then under not_results), the tests."""
    warnings = [f"{s.model}: left out of the fit: {s.error}" for s in sizes if not s.usable]
    warnings += [f"{s.model}: {w}" for s in sizes for w in s.sweep_warnings]  # e.g. a grid edge
    ladder = sorted((s for s in sizes if s.usable), key=lambda s: cast(float, s.compute))
    compute = [cast(float, s.compute) for s in ladder]
    sa_means, xsa_means = [cast(float, s.sa_mean) for s in ladder], [cast(float, s.xsa_mean) for s in ladder]
    runs = ([s.sa_runs for s in ladder], [s.xsa_runs for s in ladder])
    sa_fit = fit.fit_loss_vs_compute(compute, sa_means, fit_form)
    sa_se, xsa_se = ([statistics.stdev(r) / math.sqrt(len(r)) if len(r) > 1 else math.nan for r in arm] for arm in runs)
    lack = fit.lack_of_fit(sa_fit.residuals, sa_se, fit.FORMS[sa_fit.form])
    f_scale = fit.huber_scale(sa_means + xsa_means, sa_se + xsa_se)
    shared = fit.fit_shared(compute, sa_means, xsa_means, offset=sa_fit.form == "power_law_offset", f_scale=f_scale)
    se = [e if math.isfinite(e) else 0.0 for e in sa_se + xsa_se]  # known
    lof = fit.lack_of_fit_variance(shared.residuals, se, shared.parameters)
    k = shared.multiplier
    sa_runs, xsa_runs = losses_by_seed(ladder)
    ci = list(
        fit.ladder_bootstrap(
            shared, compute, sa_runs, xsa_runs, lof_variance=lof, f_scale=f_scale, n_resamples=resamples, seed=seed
        )
    )
    flags = ladder_flags(ladder, sa_fit, lack, shared, arms)
    shared_fit = {**shared.as_dict(arms.labels), "huber_f_scale": f_scale, "lack_of_fit_sd": math.sqrt(lof)}
    found = [{"flag": flag, "reason": reason} for flag, reason in flags.items()]
    summary = {**sa_fit.as_dict(), "lack_of_fit": asdict(lack), "shared": shared_fit, "flags": found}
    note = "wall-clock k: measure throughput with xsa-lm bench"
    clock: dict[str, Any] = {"multiplier": None, "ci": None, "note": note}
    if bench:
        ratio = bench.xsa_over_sa_step_time
        clock["multiplier"], clock["ci"] = wallclock(k, ci, ratio["median"], ratio.get("interval"))
        clock["note"] = "{1}/{0} step time from xsa-lm bench".format(*arms.labels) + f" ({bench.source})"
    if flags:
        summary["not_results"] = {"why": list(flags), "multiplier": k, "ci": ci, "wallclock": clock}
        warnings.insert(0, "the ladder is flagged (see the flags): no multiplier is reported")
    else:
        summary |= {"multiplier": k, "multiplier_ci": ci, "wallclock": clock}
    tested, across = size_tests(sizes)
    return LadderAnalysis(fit=summary, across_sizes=across, warnings=warnings, sizes=tested)


def size_tests(sizes: list[report.SizeResult]) -> tuple[list[report.SizeResult], dict[str, Any]]:
    """Each size's paired tests (t p-values Holm-adjusted); across sizes, the pooled sign test and the one by seed."""
    tested = [s for s in sizes if s.compute is not None]
    paired = [paired_stats(s.sa_runs, s.xsa_runs) for s in tested]
    holm_p = holm([t.t_p for t in paired])
    stats = [t.to_json() | {"t_p_holm": p} for t, p in zip(paired, holm_p, strict=True)]
    diffs = [x - s for size in tested for s, x in zip(size.sa_runs, size.xsa_runs, strict=True)]
    pooled = {"pairs": len(diffs), "xsa_lower": sum(d < 0 for d in diffs), "p": sign_test_p(diffs)}
    across: dict[str, Any] = {"pooled_sign": pooled}
    seeds = [seed for size in tested for seed in size.seeds]
    if len(seeds) == len(diffs):  # seed s at every size shares its data order: the pairs of one seed are one cluster
        across["by_seed"] = clustered_test(diffs, seeds).to_json()
    tests = iter(stats)
    return [replace(s, tests=next(tests)) if s.compute is not None else s for s in sizes], across


@dataclass(frozen=True)
class TokenJob:
    """One size of the token axis: its folder, its sweep (grid, trial settings), its budget B and its steps."""

    model: str
    dir: Path
    sweep: sweeps.SweepJob  # its overrides: the study's training overrides with model=<size>
    params: int  # non-embedding, as its runs build the model
    batch_tokens: int
    block_size: int  # model.block_size: the bench's micro-batch holds batch_tokens
    scale: ScaleSpec

    @property
    def tokens(self) -> float:
        return self.scale.tokens_per_param * self.params  # B

    def steps(self, fraction: float) -> int:
        return round(fraction * self.tokens / self.batch_tokens)

    def overrides(self, fraction: float) -> list[str]:
        steps = self.steps(fraction)
        settings = [f"trainer.max_steps={steps}", f"val_every_steps={max(1, -(-steps // 2))}"]
        if self.scale.warmup_fraction is not None:  # a fixed warmup: half of the shortest run, a sliver of the longest
            settings.append(f"scheduler.warmup_steps={max(1, round(self.scale.warmup_fraction * steps))}")
        return [*self.sweep.overrides, *settings]

    def launcher(self, phase: str, fraction: float, group: str | None) -> Launcher:
        budget = replace(self.sweep, overrides=self.overrides(fraction))
        return budget.launcher(TrialStore(self.dir / phase), group, "scale")


def non_embedding_params(train: TrainSpec) -> int:
    """A size's measure: the sizes of a study run and are reported smallest first, in whatever order they are listed."""
    import torch

    from xsa_lm.model.gpt import GPT

    with torch.device("meta"):  # the count needs the shapes only
        return GPT(train.gpt_config(train.model.vocab_size or 64)).num_params(non_embedding=True)


def token_job(study_dir: Path, overrides: list[str], model: str, scale: ScaleSpec, seeds: list[int]) -> TokenJob:
    """A size of the token axis, its runs checked, and its largest SA budget against the data (repeats flatten SA)."""
    from xsa_lm.data.run import prepare_data

    train, spec, runs, config = size_config(overrides, model, seeds)
    sweep = sweeps.SweepJob(spec, [], seeds, runs, train.logger.wandb, config)
    params = non_embedding_params(train)
    batch = train.global_batch_tokens
    size = TokenJob(model, study_dir / "sizes" / model, sweep, params, batch, train.model.block_size, scale)
    budgets = sorted({*scale.sa_budgets, *scale.xsa_budgets})
    steps = [size.steps(f) for f in budgets]
    if steps[0] < MIN_STEPS or len(set(steps)) < len(steps):  # one step count for two budgets: one budget twice
        raise UserError(
            f"scale.tokens_per_param={scale.tokens_per_param:g}: {model}'s B is {size.tokens:,.0f} tokens, so the "
            f"budgets {[float(f'{f:g}') for f in budgets]} B train {steps} steps of global_batch_tokens={batch}: each "
            f"budget needs steps of its own, {MIN_STEPS} or more (a run validates at half and at the end); raise "
            "scale.tokens_per_param or lower global_batch_tokens"
        )
    size = replace(size, sweep=replace(sweep, grid=sweeps.check_sweep(train, spec, size.overrides(1.0), config).grid))
    top = max(scale.sa_budgets)
    if not scale.allow_repeated_data:
        data = parse(TrainSpec, compose(config_name="train", overrides=size.overrides(top)))
        train_tokens = int(prepare_data(data.data, data.tokenizer).meta["train_tokens"])
        epochs = size.steps(top) * size.batch_tokens / train_tokens
        if epochs > 1:
            raise UserError(
                f"{model}: SA at {top:g} B would train {epochs:.2f} epochs of the {train_tokens:,} training tokens: "
                "lower scale.tokens_per_param or the largest of scale.sa_budgets, use a larger corpus, or allow it "
                "with scale.allow_repeated_data=true (the report then names the repetition)"
            )
    return size


def run_token_size(size: TokenJob, plan: report.TokenPlan, group: str | None) -> report.TokenSize:
    """One size's LR searches and budget runs, each budget at the baseline's LR of B (lr_per_budget: of that
    budget)."""
    arms = plan.arms
    print(
        f"size {size.model}: {size.params:,} non-embedding parameters, B = {size.tokens:,.0f} tokens "
        f"({size.steps(1.0)} steps)"
    )

    def search_at(fraction: float, arm: str) -> Selection:
        print(f"size {size.model}: {arm.upper()} LR search at {fraction:g} B ({size.steps(fraction)} steps)")
        phase = "search" if fraction == 1.0 else f"search_{fraction:g}"
        launcher = size.launcher(phase, fraction, group)
        return sweeps.search(launcher, size.sweep.grid, plan.search_seeds, [arm], phase)[0]

    by_budget = plan.sa_budgets if plan.lr_per_budget else [1.0]
    selections = {f"{f:g}": search_at(f, arms.baseline) for f in sorted(by_budget, key=lambda f: f != 1.0)}  # B first
    searches = {at: {f"{lr:g}": loss for lr, loss in s.losses.items()} for at, s in selections.items()}
    lrs = {at: s.lr for at, s in selections.items()}
    warnings = [f"at {at} B: {w}" if len(by_budget) > 1 else w for at, s in selections.items() for w in s.warnings]
    entry = report.TokenSize(
        model=size.model,
        non_embedding_params=size.params,
        tokens_B=size.tokens,
        search=searches["1"],
        selected_lr=lrs["1"],
        searches=searches,
        selected_lrs=lrs,
        warnings=warnings,
        grid=size.sweep.grid,
    )
    if plan.tune_xsa:
        own = search_at(1.0, arms.candidate)
        entry = replace(entry, xsa_search={f"{lr:g}": loss for lr, loss in own.losses.items()}, xsa_selected_lr=own.lr)
    chosen = {f: lrs.get(f"{f:g}", lrs["1"]) for f in sorted(set(plan.sa_budgets) | set(plan.xsa_budgets))}
    if any(lr is None for lr in chosen.values()):
        return entry
    runs: dict[str, dict[str, list[report.TokenRun]]] = {arms.baseline: {}, arms.candidate: {}}
    kept = [f.name for f in fields(report.TokenRun)]
    arms_by_budget = [(arms.baseline, plan.sa_budgets), (arms.candidate, plan.xsa_budgets)]
    arms_by_budget += [(NULL, plan.xsa_budgets)] if plan.null_arm else []
    for fraction, lr in cast(dict[float, float], chosen).items():
        trained = [a for a, budgets in arms_by_budget if fraction in budgets]
        names, seeds = " and ".join(a.upper() for a in trained), plan.seeds
        print(f"size {size.model}: {names} at {fraction:g} B ({size.steps(fraction)} steps), LR {lr:g}, seeds {seeds}")
        trials = [Trial(arm, lr, seed) for seed in seeds for arm in trained]
        launcher = size.launcher(f"budget_{fraction:g}", fraction, group)
        launcher.run(trials, f"budget_{fraction:g}", "budget")
        for arm in trained:  # each run as its trial record has it (report.TokenRun's fields are some of the record's)
            records = [launcher.store.load(t) or TrialRecord.missing(t, "") for t in trials if t.attention == arm]
            runs.setdefault(arm, {})[f"{fraction:g}"] = [
                report.TokenRun(**{k: getattr(r, k) for k in kept}) for r in records
            ]
    return replace(entry, runs=runs, seeds=plan.seeds)


def run_bench(study_dir: Path, size: TokenJob, overrides: list[str], arms: report.Arms) -> report.SizeBench | None:
    """`xsa-lm bench` of the candidate vs the baseline at this size (its own process; reused when its JSON exists)."""
    out = study_dir / "bench" / f"{size.model}.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        model_keys = [o for o in overrides if o.split("=", 1)[0].startswith(("model.", "attention."))]
        cmd = [sys.executable, "-m", "xsa_lm.cli", "bench", *config_dirs(), f"model={size.model}", *model_keys]
        cmd += [f"attention={arms.candidate}", f"attention@baseline={arms.baseline}"]
        cmd += [f"micro_batch={max(1, size.batch_tokens // size.block_size)}", "comparisons=[attention_over_baseline]"]
        cmd += ["backends=train", f"rounds={size.scale.bench_rounds}", f"out={out}"]  # the runs' kernel
        error = run_logged(cmd, study_dir / "logs" / f"bench_{size.model}.log")
        if error is not None:
            print(f"size {size.model}: xsa-lm bench failed: {error} (no wall-clock multiplier)")
            return None
    ratio = cast(report.BenchRatio, load_bench(out, "bench", arms)).xsa_over_sa_step_time
    return report.SizeBench(
        xsa_over_sa_step_time=ratio["median"], interval=ratio["interval"], rounds=len(ratio["rounds"]), file=str(out)
    )


def config_dirs() -> list[str]:
    """This command's --config-dir flags, for a child command to find the same attention options."""
    if not HydraConfig.initialized():
        return []
    sources = HydraConfig.get().runtime.config_sources
    return [arg for s in sources if s.provider == "command-line" for arg in ("--config-dir", s.path)]


def paired_losses(
    entry: report.TokenSize, sa_budgets: list[float], fraction: float, arm: str, baseline: str
) -> tuple[list[list[float]], list[float], list[int]]:
    """The baseline's losses per budget, `arm`'s at `fraction`, and the seeds where all of them completed."""
    of = entry.runs or {}
    runs = [*(of[baseline][f"{f:g}"] for f in sa_budgets), of[arm][f"{fraction:g}"]]
    usable = [i for i in range(len(entry.seeds)) if all(r[i].status == "completed" for r in runs)]
    losses = [[cast(float, r[i].final_val_loss) for i in usable] for r in runs]
    return losses[:-1], losses[-1], [entry.seeds[i] for i in usable]


def same_budget(
    entry: report.TokenSize, fraction: float, arm: str, margin: float | None, baseline: str
) -> tuple[JsonObject | None, JsonObject | None]:
    """`arm` - the baseline at one budget over the seeds where both completed: paired tests, margin, bpb, positions."""
    runs, budget = entry.runs or {}, f"{fraction:g}"
    both = zip(runs.get(baseline, {}).get(budget, []), runs.get(arm, {}).get(budget, []), strict=False)
    pairs = [(a, b) for a, b in both if a.status == b.status == "completed"]
    if not pairs:
        return None, None
    sa, other = [cast(float, a.final_val_loss) for a, _ in pairs], [cast(float, b.final_val_loss) for _, b in pairs]
    diffs = [b - a for a, b in zip(sa, other, strict=True)]
    details: JsonObject = {"margin": margin_verdict(diffs, margin).to_json() if margin is not None else None}
    if all(a.final_val_bpb is not None and b.final_val_bpb is not None for a, b in pairs):
        sa_bpb = [cast(float, a.final_val_bpb) for a, _ in pairs]
        details["bpb"] = bpb_stats(sa_bpb, [cast(float, b.final_val_bpb) for _, b in pairs]).to_json()
    positions = position_differences(
        [a.final_val_loss_by_position or [] for a, _ in pairs], [b.final_val_loss_by_position or [] for _, b in pairs]
    )
    details["positions"] = positions.to_json() if positions else None
    return paired_stats(sa, other).to_json(), details


def null_cell(
    entry: report.TokenSize, sa_budgets: list[float], sa_tokens: list[float], fraction: float, baseline: str
) -> JsonObject | None:
    """k of the null arm (the baseline from other initial weights), read as the candidate's is: its spread is the
    yardstick's noise."""
    if fraction not in [float(f) for f in (entry.runs or {}).get(NULL, {})]:
        return None
    sa, null, seeds = paired_losses(entry, sa_budgets, fraction, NULL, baseline)
    if len(seeds) < 2:
        return None
    budget = tokens_of(entry, NULL, fraction)
    cell = token_axis.cell_estimate(sa, sa_tokens, null, budget)
    return {**cell.as_dict(), "paired_seeds": seeds, "per_seed_k": token_axis.per_seed_k(sa, sa_tokens, null, budget)}


def tokens_of(entry: report.TokenSize, arm: str, fraction: float) -> float:
    seen = [r.tokens_seen for r in (entry.runs or {})[arm][f"{fraction:g}"] if r.tokens_seen]
    return float(seen[0]) if seen else fraction * entry.tokens_B


@dataclass(frozen=True)
class TokenAnalysis:
    cells: list[JsonObject]  # one per size and candidate budget: the Cell, its tests, the null's, per-seed k, stalls
    pooled: token_axis.PooledK | None
    warnings: list[str]


def analyse_tokens(
    sizes: list[report.TokenSize],
    sa_budgets: list[float],
    xsa_budgets: list[float],
    seed: int = 0,
    margin: float | None = None,
    arms: report.Arms = report.PAPER_ARMS,
) -> TokenAnalysis:
    """k per (size, candidate budget) with its intervals and same-budget tests, the pooled k, and the warnings."""
    cells, estimates = [], []
    (base, cand), baseline = arms.labels, arms.baseline
    warnings = [f"{s.model}: {w}" for s in sizes for w in s.warnings]
    for entry in sizes:
        if entry.runs is None:
            warnings.append(f"{entry.model}: no LR selected, so no budget runs")
            continue
        for arm, budgets in entry.runs.items():  # a warning per arm and budget that saw its data more than once
            for at, runs in budgets.items():
                epochs = max((r.data_epochs or 0.0 for r in runs), default=0.0)
                if epochs > 1:
                    warnings.append(
                        f"{entry.model} {arm.upper()} at {at} B: {epochs:.2f} epochs of the training data (it "
                        f"repeats, which flattens {base}'s curve where k is read: use a larger corpus or a smaller B)"
                    )
        sa_tokens = [tokens_of(entry, baseline, f) for f in sa_budgets]
        for fraction in xsa_budgets:
            sa, xsa, seeds = paired_losses(entry, sa_budgets, fraction, arms.candidate, baseline)
            left_out = len(entry.seeds) - len(seeds)
            if left_out:
                warnings.append(
                    f"{entry.model} {cand} at {fraction:g} B: {left_out} seed(s) left out (a run did not "
                    "complete: diverged, failed or missing; rerun the same command to retry failures)"
                )
            if len(seeds) < 2:
                warnings.append(f"{entry.model} {cand} at {fraction:g} B: fewer than 2 complete seeds, no estimate")
                continue
            budget = tokens_of(entry, arms.candidate, fraction)
            cell = token_axis.cell_estimate(sa, sa_tokens, xsa, budget)
            if not all(a > b for a, b in zip(cell.sa_means, cell.sa_means[1:], strict=False)):
                warnings.append(
                    f"{entry.model}: {base}'s mean loss does not fall with every doubling of tokens "
                    f"({', '.join(f'{m:.4f}' for m in cell.sa_means)}): the curve is not a tokens-to-loss map"
                )
            row = {"model": entry.model, "fraction": fraction, **cell.as_dict(), "paired_seeds": seeds}
            tests = same_budget(entry, fraction, arms.candidate, margin, baseline)
            row["same_budget"], row["same_budget_details"] = tests
            row["null"] = null_cell(entry, sa_budgets, sa_tokens, fraction, baseline)
            row["null_same_budget"], row["null_same_budget_details"] = same_budget(
                entry, fraction, NULL, margin, baseline
            )
            row["bootstrap_ci95"] = token_axis.bootstrap_interval(sa, sa_tokens, xsa, budget, seed=seed)
            row["per_seed_k"] = token_axis.per_seed_k(sa, sa_tokens, xsa, budget)
            row["sa_stalled"] = sa_stalled = [token_axis.stalled(losses) for losses in sa]  # per baseline budget
            row["xsa_stalled"] = xsa_stalled = token_axis.stalled(xsa)
            if (any(sa_stalled) or xsa_stalled) and len(seeds) < token_axis.STALL_SAFE_SEEDS:
                warnings.append(
                    f"{entry.model} {cand} at {fraction:g} B: stalled seeds among {len(seeds)}, and k is read off the "
                    f"mean curves: a stall shifts k, and simulated studies with 30% of {base} seeds stalled gave the "
                    f"95% interval 81% coverage at 5 seeds, 91-93% at 10-20 (tests/test_token_axis.py); read the "
                    f"per-seed k, or use {token_axis.STALL_SAFE_SEEDS} seeds or more"
                )
            bench = entry.bench
            if bench and cell.k is not None and bench.interval:
                ratio, interval = bench.xsa_over_sa_step_time, bench.interval
                row["wallclock_k"], row["wallclock_ci"] = wallclock(cell.k, cell.ci, ratio, interval)
            cells.append(row)
            estimates.append(cell)
    return TokenAnalysis(cells=cells, pooled=token_axis.pool(estimates), warnings=warnings)


def unfinished(results: report.TokenStudyResult) -> list[str]:
    """The runs a rerun retries, e.g. `m sa 2 B seed 2 (failed: killed by signal SIGKILL ...; log <path>)`."""
    missing = []
    for size in results.sizes:
        for arm, budgets in (size.runs or {}).items():
            for fraction, runs in budgets.items():
                for run in (r for r in runs if r.status not in FINISHED):
                    error = (run.error or "").strip().splitlines()
                    why = f"{run.status}: {error[0][:200]}" if error else run.status
                    why += f"; log {run.log}" if run.log else ""
                    missing.append(f"{size.model} {arm} {fraction} B seed {run.seed} ({why})")
    return missing


def reanalyse(
    saved: report.ScaleStudyResult | report.TokenStudyResult | JsonObject,
    *,
    fit_form: str = "auto",
    resamples: int = 1000,
    seed: int = 0,
    when: str | None = None,
) -> report.ScaleStudyResult | report.TokenStudyResult:
    """A saved study of either axis analysed again from its raw data, no run repeated; `reanalysed` says when."""
    if isinstance(saved, dict):
        kind = report.TokenStudyResult if "plan" in saved else report.ScaleStudyResult
        saved = kind.from_json(saved, source="the study's results.json")
    when = when or time.strftime("%Y-%m-%d")
    if isinstance(saved, report.TokenStudyResult):
        plan = saved.plan
        budgets = plan.sa_budgets, plan.xsa_budgets
        tokens = analyse_tokens(saved.sizes, *budgets, seed=seed, margin=plan.margin, arms=plan.arms)
        return replace(saved, reanalysed=when, **vars(tokens))
    sizes = [replace(s, tests=None) for s in saved.sizes]
    analysis = analyse(sizes, fit_form, resamples, seed, saved.bench, saved.arms)
    return replace(saved, reanalysed=when, **vars(analysis))


def check_study(
    scale: ScaleSpec, sweep: SweepSpec, study_dir: Path, overrides: list[str]
) -> tuple[dict[str, Any], Study]:
    """The study's plan (what its report says, kept in scale.json) and the study, checked with each size's sweep or
    runs before its folder gets anything."""
    name, listed = ("scale.seeds", scale.seeds) if scale.seeds is not None else ("sweep.seeds", sweep.seeds)
    seeds, arms = check_seeds(listed, sweep.search_seeds, sweep.reuse_search_run, name=name), arms_of(sweep)
    if not seeds:
        compared = "the study compares {} and {} at every size".format(*arms.labels)
        raise UserError(f"{name}=[]: {compared}, which needs compare seeds")
    if scale.axis == "size":
        bench = load_bench(scale.bench, arms=arms)
        configs = {model: size_config(overrides, model, scale.seeds) for model in scale.models}
        jobs = {
            m: sweeps.check_sweep(*configs[m])
            for m in sorted(configs, key=lambda m: non_embedding_params(configs[m][0]))
        }
        planned = scale.model_dump(include=set(PLAN_EARLIER) - {"arms", "measure_throughput"})
        return planned, partial(run_size_axis, scale=scale, jobs=jobs, bench=bench, arms=arms)
    sweeps.passed_on(overrides, "scale", SET_BY_TOKEN_AXIS, setter="scale.axis=tokens")
    if len(seeds) < 2:
        raise UserError(f"scale.axis=tokens needs 2+ compare seeds for an interval (scale.seeds), got {seeds}")
    of_scale = scale.model_dump(
        include={"tokens_per_param", "lr_per_budget", "warmup_fraction", "allow_repeated_data"}
        | {"measure_throughput", "bootstrap_seed"}
    )
    if "placebo" in sweep.null_arm:  # its k beside the init null's would need a table of its own in the report
        raise UserError(
            "sweep.null_arm=placebo: scale.axis=tokens reads the init null's k off SA's curve (sweep.null_arm=init); "
            "the placebo runs in `xsa-lm sweep` and on scale.axis=size"
        )
    of_sweep = sweep.model_dump(include={"search_seeds", "margin"}) | {"null_arm": bool(sweep.null_arm)}
    budgets = sorted(scale.sa_budgets), sorted(scale.xsa_budgets)
    plan = report.TokenPlan(
        axis="tokens",
        seeds=seeds,
        sa_budgets=budgets[0],
        xsa_budgets=budgets[1],
        tune_xsa=sweep.tune_xsa,
        arms=arms,
        **of_scale,
        **of_sweep,
    )
    sizes = sorted(
        (token_job(study_dir, overrides, model, scale, seeds) for model in scale.models), key=lambda s: s.params
    )
    return plan.to_json(), partial(run_token_axis, scale=scale, plan=plan, sizes=sizes)


def run_size_axis(
    identity: StudyIdentity,
    group: str | None,
    *,
    scale: ScaleSpec,
    jobs: dict[str, sweeps.SweepJob],
    bench: report.BenchRatio | None,
    arms: report.Arms,
) -> list[str]:
    """Each size's sweep, the analysis and the report; returns the sizes whose sweep did not finish."""
    study_dir = Path(identity.study_dir)
    sweeps.stop_on_signals(lambda: None, "scale")  # within a size, its sweep's handler stops the trials
    print(f"xsa-lm scale | {study_dir} | W&B group {identity.study_id} | sizes {list(jobs)}")
    sizes = [run_size(model, job, study_dir=study_dir, group=group) for model, job in jobs.items()]
    analysis = analyse(sizes, scale.fit, scale.bootstrap_resamples, scale.bootstrap_seed, bench, arms)
    results = report.ScaleStudyResult(
        **vars(identity),
        models=list(jobs),
        seeds=scale.seeds,
        bench=bench,
        arms=arms,
        code=runs_by_code(finished_records(study_dir), study_dir),
        **vars(analysis),
    )
    report.write_report(results, study_dir)
    wandb = next(iter(jobs.values())).wandb
    if group is not None and wandb is not None and scale.wandb_report:
        report.log_to_wandb(results, study_dir, sweeps.report_run_settings(wandb))
    return [s.model for s in results.sizes if s.sweep_returncode != 0]


def run_token_axis(
    identity: StudyIdentity, group: str | None, *, scale: ScaleSpec, plan: report.TokenPlan, sizes: list[TokenJob]
) -> list[str]:
    """The plan kept in scale.json, each size's runs and bench, the analysis and report; the runs left unfinished."""
    study_dir = Path(identity.study_dir)
    entries = []
    for size in sizes:
        entry = run_token_size(size, plan, group)
        bench = run_bench(study_dir, size, identity.overrides, plan.arms) if scale.measure_throughput else None
        entries.append(replace(entry, bench=bench))
    budgets = plan.sa_budgets, plan.xsa_budgets
    analysis = analyse_tokens(entries, *budgets, seed=scale.bootstrap_seed, margin=plan.margin, arms=plan.arms)
    code = runs_by_code(finished_records(study_dir), study_dir)
    results = report.TokenStudyResult(**vars(identity), plan=plan, sizes=entries, code=code, **vars(analysis))
    report.write_report(results, study_dir)
    return unfinished(results)


def keep_sizes(state_file: Path, models: list[str]) -> None:
    """A rerun may add sizes, not leave one out (a ladder chosen after seeing its results); scale.json lists them."""
    state = json.loads(state_file.read_text())
    earlier = state.get("models", [])
    left_out = [m for m in earlier if m not in models]
    if left_out:
        raise UserError(
            f"scale.models: {state_file.parent} holds a study of {earlier}, and scale.models={models} leaves out "
            f"{left_out}: give every size it has run (new ones may be added), or choose a new hydra.run.dir"
        )
    write_json(state_file, {**state, "models": earlier + [m for m in models if m not in earlier]})


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="scale")
@one_line_errors
def main(cfg: DictConfig) -> None:
    def study(study_dir: Path, overrides: list[str]) -> list[str]:
        scale, sweep = parse(ScaleSpec, cfg.scale, at="scale."), parse(SweepSpec, cfg.sweep, at="sweep.")
        scale.refuse_other_axis(HydraConfig.get().overrides.task)
        if sweep.dry_run:  # the sweep's alone: a scale study would train
            raise UserError("sweep.dry_run=true: xsa-lm scale has no dry run (xsa-lm sweep has one); leave it out")
        wandb = parse(LoggerSpec, cfg.logger, at="logger.").wandb if cfg.logger else None
        refuse_other_code(study_dir, sweep.allow_mixed_code, code_version())
        plan, run = check_study(scale, sweep, study_dir, overrides)
        state, holds = study_dir / "scale.json", "a scaling study with the overrides"
        group = wandb.group if wandb else None
        study_id = sweeps.open_state(state, overrides, group, id_key="study_id", overrides_key="overrides", holds=holds)
        sweeps.keep_plan(state, plan, grid=[], earlier=PLAN_EARLIER)
        keep_sizes(state, scale.models)
        write_text(study_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        return run(StudyIdentity(str(study_dir), study_id, overrides), study_id if wandb else None)

    study_dir, unfinished_runs = sweeps.run_exclusive("scale", sweep_overrides, study)
    print(f"\n{(study_dir / 'report.md').read_text()}")
    print(f"report: {study_dir / 'report.md'} | results: {study_dir / 'results.json'}")
    if unfinished_runs:
        retry = "did not finish: run the same command again to retry"
        print(f"xsa-lm scale: {', '.join(unfinished_runs)} {retry}", file=sys.stderr)
        sys.exit(1)

"""`xsa-lm scale`: the sweep's protocol at several model sizes, and XSA's effective-compute multiplier.

1. for every model preset of scale.models, the sweep's protocol in DIR/sizes/<model>/, run in this process (LR
   search on SA, then SA vs XSA at the selected LR over the compare seeds): resumable, its trials reused when the
   same command runs again
2. fit SA's losses against training compute and both arms with a shared curve (fit.py): one multiplier k for the
   ladder with a parametric-bootstrap CI, reported only when no flag is up (lack of fit, extrapolation, a short
   compute span, a parameter at a bound, an arm not falling with compute, an LR at its grid's edge); per size and
   across sizes, the paired tests (xsa_lm.stats); a wall-clock k only from `xsa-lm bench` (scale.bench)
3. results.json, report.md, loss_vs_compute.png, multiplier.png, and a report run in the study's W&B group
"""

import importlib.resources
import io
import json
import math
import statistics
import sys
import time
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TextIO, cast

import hydra
import numpy as np
import scipy.stats
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import write_json, write_text
from xsa_lm.locking import hold_directory
from xsa_lm.records import JsonObject, RunSummary
from xsa_lm.scale.fit import (
    FORMS,
    Fit,
    LackOfFit,
    SharedFit,
    fit_loss_vs_compute,
    fit_shared,
    huber_scale,
    lack_of_fit,
    lack_of_fit_variance,
    ladder_bootstrap,
)
from xsa_lm.scale.report import BenchRatio, ScaleStudyResult, SizeResult, log_to_wandb, write_report
from xsa_lm.scale.study import Study, StudyIdentity, compare_seeds
from xsa_lm.stats.decision import clustered_test
from xsa_lm.stats.paired import holm, paired_stats, sign_test_p
from xsa_lm.sweep.report import SweepResult
from xsa_lm.sweep.run import (
    check_sweep,
    incomplete,
    open_state,
    passed_on,
    report_run_settings,
    run_exclusive,
    run_sweep,
    stop_on_signals,
    train_overrides,
    wandb_settings,
)
from xsa_lm.sweep.settings import ScaleSpec, SweepSpec, parse, plain

SIZE_KEYS = ("n_layer", "d_model", "n_head", "head_dim", "n_kv_head", "mlp_ratio")  # what makes the sizes differ
SET_BY_SCALE = {  # other model.* keys apply to every size (e.g. model.block_size)
    "model": "set the sizes with scale.models=[...]",
    **{
        f"model.{key}": "each size's model preset sets it (one value for all would make the sizes one model); set "
        "the sizes with scale.models=[...]"
        for key in SIZE_KEYS
    },
    "hydra.run.dir": "each size's sweep goes to <study dir>/sizes/<model>",
}


def sweep_overrides(task_overrides: list[str]) -> list[str]:
    """The command line's overrides passed on to every size's sweep or runs (scale.* stays with the study); what
    each sweep would refuse (attention=, optim.lr=, seed=) is refused with the study's checks (train_overrides)."""
    return passed_on(task_overrides, "scale", SET_BY_SCALE, setter="xsa-lm scale for each size")


def check_models(models: Any, at_least: int) -> list[str]:
    """The sizes: distinct presets that exist; a fit across sizes needs two, the token axis one."""
    names = [str(m) for m in models or []] if OmegaConf.is_list(models) or isinstance(models, list) else []
    if len(names) < at_least or len(set(names)) != len(names):
        need = "at least two distinct model presets, smallest first" if at_least > 1 else "distinct model presets"
        raise UserError(
            f"scale.models needs {need}, got {models!r}; e.g. scale.models=[tiny_d32,tiny_d64,tiny_d96,tiny]"
        )
    presets = importlib.resources.files("xsa_lm.configs") / "model"
    available = {p.name.removesuffix(".yaml") for p in presets.iterdir() if p.name.endswith(".yaml")}
    unknown = [m for m in names if m not in available]
    if unknown:
        known = ", ".join(sorted(available))
        raise UserError(f"scale.models: no model preset {', '.join(unknown)}; available: {known}")
    return names


class SizeOutput(io.TextIOBase):
    """A size's sweep output: whole in logs/<model>.log, and on the terminal line by line, named by its size."""

    def __init__(self, model: str, log: TextIO, terminal: TextIO) -> None:
        self.model, self.log, self.terminal, self.pending = model, log, terminal, ""

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        *lines, self.pending = (self.pending + text).split("\n")
        for line in filter(str.strip, lines):
            print(f"[{self.model}] {line}", file=self.terminal, flush=True)
        return len(text)


def run_size(model: str, overrides: list[str], *, study_dir: Path, group: str | None) -> SizeResult:
    """One size's sweep with its overrides, in this process, in sizes/<model>/ (held as `xsa-lm sweep` holds its
    folder)."""
    sweep_dir = study_dir / "sizes" / model
    size = overrides + ([f"logger.wandb.group={group}"] if group is not None else [])
    log = study_dir / "logs" / f"{model}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"size {model}: its sweep into {sweep_dir}")
    with open(log, "a") as out, hold_directory(sweep_dir, "sweep.lock", "xsa-lm sweep"):
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: xsa-lm sweep {' '.join(size)}\n")
        with redirect_stdout(SizeOutput(model, out, sys.stdout)):
            try:
                cfg = compose(config_name="sweep", overrides=size)
                results, _ = run_sweep(cfg, sweep_dir, train_overrides(size), command="scale")
            except UserError as e:
                raise UserError(f"the sweep of {model} was refused: {e}") from None
    return size_result(model, sweep_dir, finished=incomplete(results) is None)


def size_result(model: str, sweep_dir: Path, *, finished: bool) -> SizeResult:
    """What the fit needs from one size's sweep (its results.json): the paired final losses, throughput and the
    training FLOPs of a run, compute (the model's FLOPs per token, GPT.flops_per_token, times the tokens it trained
    on)."""
    import torch

    from xsa_lm.model.config import GPTConfig
    from xsa_lm.model.gpt import GPT

    sweep = SweepResult.read(sweep_dir / "results.json")
    compare = sweep.comparison
    size = SizeResult(
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
        return replace(size, error="no seed has both an SA and an XSA result (see the size's report)")
    summary = RunSummary.read(Path(str(runs[0].run_dir)) / "summary.json")
    with torch.device("meta"):  # the FLOPs formula needs the shapes only
        flops_per_token = GPT(GPTConfig(**summary.model_config)).flops_per_token()
    speeds = {a: [t.tokens_per_s for t in runs if t.attention == a and t.tokens_per_s] for a in ("sa", "xsa")}
    return replace(
        size,
        non_embedding_params=summary.non_embedding_params,
        tokens=summary.tokens_seen,
        compute=flops_per_token * summary.tokens_seen,
        sa_tokens_per_s=statistics.fmean(speeds["sa"]) if speeds["sa"] else None,
        xsa_tokens_per_s=statistics.fmean(speeds["xsa"]) if speeds["xsa"] else None,
    )


def standard_error(runs: list[float]) -> float:
    """The standard error of a size's mean over its seeds; nan with one seed."""
    return statistics.stdev(runs) / math.sqrt(len(runs)) if len(runs) > 1 else math.nan


@dataclass(frozen=True)
class Flag:
    """A reason the ladder cannot turn XSA's loss gap into compute."""

    flag: str
    reason: str


def not_falling(ladder: list[SizeResult], means: list[float]) -> list[str]:
    pairs = range(len(ladder) - 1)
    return [f"{ladder[i].model} -> {ladder[i + 1].model}" for i in pairs if means[i + 1] >= means[i]]


def ladder_flags(ladder: list[SizeResult], sa_fit: Fit, lack: LackOfFit, shared: SharedFit) -> list[Flag]:
    """Every reason this ladder cannot turn XSA's loss gap into compute, each with its one-line why."""
    flags: dict[str, str] = {}
    compute = [cast(float, s.compute) for s in ladder]
    sa_means, xsa_means = [cast(float, s.sa_mean) for s in ladder], [cast(float, s.xsa_mean) for s in ladder]
    if lack.p is None:
        why = (
            "a size has fewer than 2 seeds (no standard error)"
            if lack.dof > 0
            else f"{len(ladder)} sizes for {FORMS[sa_fit.form]} parameters leave no degree of freedom"
        )
        flags["lack_of_fit"] = f"no lack-of-fit test possible: {why}"
    elif lack.p < 0.05:
        flags["lack_of_fit"] = (
            f"chi^2 = {lack.chi2:.1f} on {lack.dof} dof (p = {lack.p:.2g}): the SA curve misses the SA "
            "means by more than their seed noise (each size's standard error over seeds)"
        )
    # One step of the ladder beyond its ends is allowed: XSA winning at the largest size always reads SA's curve
    # a little past it, which is what k means there.
    step = (max(compute) / min(compute)) ** (1 / (len(compute) - 1))
    outside = []
    for s, sa_mean, xsa_mean in zip(ladder, sa_means, xsa_means, strict=True):
        for arm, mean in (("sa", sa_mean), ("xsa", xsa_mean)):
            needed = sa_fit.compute_for(mean)
            if not math.isfinite(needed) or needed > max(compute) * step:
                outside.append(f"{s.model} {arm.upper()} ({needed / max(compute):.3g}x the largest)")
            elif needed < min(compute) / step:
                outside.append(f"{s.model} {arm.upper()} ({min(compute) / needed:.3g}x below the smallest)")
    if outside:
        flags["extrapolation"] = (
            "the SA fit needs compute beyond the measured range (by more than one ladder step, "
            f"{step:.2f}x) to reach the means of {', '.join(outside)}"
        )
    span = max(compute) / min(compute)
    if span < 10:
        flags["compute_span"] = f"the ladder spans {span:.3g}x in compute, under 10x"
    bounds = [f"shared fit: {b}" for b in shared.at_bounds()]
    if sa_fit.form == "power_law_offset" and sa_fit.E <= 1e-6:
        bounds.insert(0, "SA fit: E at its lower bound 0")
    if sa_fit.form == "power_law_offset" and sa_fit.E >= min(sa_means) - 1e-6:
        bounds.insert(0, "SA fit: E at its upper bound, the lowest SA mean")
    if sa_fit.alpha <= 1e-6 or sa_fit.alpha >= 10 - 1e-6:
        bounds.insert(0, f"SA fit: alpha = {sa_fit.alpha:.4f} at a bound (0 or 10)")
    if bounds:
        flags["parameter_at_bound"] = "; ".join(bounds) + ": the data do not identify it"
    rises = not_falling(ladder, xsa_means)
    trend = scipy.stats.linregress(np.log(compute), xsa_means) if len(ladder) > 2 else None
    if rises or trend is None or trend.slope >= 0 or trend.pvalue > 0.05:
        why = f"it rises ({', '.join(rises)})" if rises else "its fall is not significant"
        if trend is not None:
            why += f"; slope vs ln C {trend.slope:+.4f} (p = {trend.pvalue:.2g})"
        else:
            why += "; two sizes cannot test its slope"
        flags["xsa_flat_or_not_monotone"] = f"XSA's mean loss does not fall with compute: {why}"
    rises = not_falling(ladder, sa_means)
    if rises:
        flags["sa_not_monotone"] = f"SA's mean loss does not fall as compute grows ({', '.join(rises)})"
    edges = [  # the selected LR at an edge of its grid, as the grid or the size's sweep says
        f"{s.model} (LR {s.selected_lr:g})"
        for s in ladder
        if (s.lr_grid and (len(s.lr_grid) == 1 or s.selected_lr in (min(s.lr_grid), max(s.lr_grid))))
        or any("of the grid" in w or "grid holds one LR" in w for w in s.sweep_warnings)
    ]
    if edges:
        flags["lr_at_grid_edge"] = f"the selected LR is at an edge of its grid at {', '.join(edges)}: extend it"
    return [Flag(flag=name, reason=reason) for name, reason in flags.items()]


@dataclass(frozen=True)
class WallClock:
    multiplier: float | None
    ci: list[float] | None
    note: str  # where the step times come from


def wallclock(k: float, ci: list[float], bench: BenchRatio | None) -> WallClock:
    """k in wall-clock time, only from `xsa-lm bench`'s XSA/SA step time (its median and 95% interval, both arms
    timed in alternating rounds; trial tokens/s vary with whatever else the machine ran): a slower XSA gives back
    part of k. The interval combines the ends conservatively (k's low end over the ratio's high end, and the
    reverse)."""
    if not bench:
        return WallClock(multiplier=None, ci=None, note="wall-clock k: measure throughput with xsa-lm bench")
    ratio = bench.xsa_over_sa_step_time
    interval = ratio.get("interval")
    return WallClock(
        multiplier=k / ratio["median"],
        ci=[ci[0] / interval[1], ci[1] / interval[0]] if interval else None,
        note=f"XSA/SA step time from xsa-lm bench ({bench.source})",
    )


@dataclass(frozen=True)
class LadderAnalysis:
    fit: JsonObject  # the SA fit, the shared fit, the flags, and k when no flag is up
    across_sizes: JsonObject  # the pooled sign test and the test by seed
    warnings: list[str]
    sizes: list[SizeResult]  # each with its paired tests


def analyse(
    sizes: list[SizeResult], fit_form: str, resamples: int, seed: int, bench: BenchRatio | None = None
) -> LadderAnalysis:
    """The SA fit (lack of fit, extrapolation), the shared fit and its ladder k with a parametric-bootstrap CI,
    the flags, and the paired tests per size (the sizes returned with them) and across sizes. A flagged ladder keeps
    k only under not_results."""
    warnings = [f"{s.model}: left out of the fit: {s.error}" for s in sizes if not s.usable]
    warnings += [f"{s.model}: {w}" for s in sizes for w in s.sweep_warnings]  # e.g. a grid edge
    ladder = sorted((s for s in sizes if s.usable), key=lambda s: cast(float, s.compute))
    compute = [cast(float, s.compute) for s in ladder]
    sa_means, xsa_means = [cast(float, s.sa_mean) for s in ladder], [cast(float, s.xsa_mean) for s in ladder]
    sa_fit = fit_loss_vs_compute(compute, sa_means, fit_form)
    sa_se = [standard_error(s.sa_runs) for s in ladder]
    xsa_se = [standard_error(s.xsa_runs) for s in ladder]
    lack = lack_of_fit(sa_fit.residuals, sa_se, FORMS[sa_fit.form])
    f_scale = huber_scale(sa_means + xsa_means, sa_se + xsa_se)
    shared = fit_shared(compute, sa_means, xsa_means, offset=sa_fit.form == "power_law_offset", f_scale=f_scale)
    known_se = [e if math.isfinite(e) else 0.0 for e in sa_se + xsa_se]
    lof_variance = lack_of_fit_variance(shared.residuals, known_se, shared.parameters)
    k = shared.multiplier
    ci = ladder_bootstrap(
        shared, compute, known_se, lof_variance=lof_variance, f_scale=f_scale, n_resamples=resamples, seed=seed
    )
    flags = ladder_flags(ladder, sa_fit, lack, shared)
    fit = {
        **sa_fit.as_dict(),
        "lack_of_fit": asdict(lack),
        "shared": {**shared.as_dict(), "huber_f_scale": f_scale, "lack_of_fit_sd": math.sqrt(lof_variance)},
        "flags": [asdict(f) for f in flags],
    }
    estimate = {"multiplier": k, "ci": list(ci), "wallclock": asdict(wallclock(k, list(ci), bench))}
    if flags:
        fit["not_results"] = {"why": [f.flag for f in flags], **estimate}
        warnings.insert(0, "the ladder is flagged (see the flags): no multiplier is reported")
    else:
        fit |= {"multiplier": k, "multiplier_ci": list(ci), "wallclock": estimate["wallclock"]}
    tested, across = size_tests(sizes)
    return LadderAnalysis(fit=fit, across_sizes=across, warnings=warnings, sizes=tested)


def size_tests(sizes: list[SizeResult]) -> tuple[list[SizeResult], dict[str, Any]]:
    """The sizes, each with a result given XSA - SA (paired_stats under `tests`, its t p-value Holm-adjusted across
    the sizes); and across sizes the sign test over every pair of every size, and the test by seed (a seed's pairs
    at every size share its data order, so they are not independent)."""
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


def reanalyse(
    saved: ScaleStudyResult | JsonObject,
    *,
    fit_form: str = "auto",
    resamples: int = 1000,
    seed: int = 0,
    when: str | None = None,
) -> ScaleStudyResult:
    """A saved study (its results.json, as json.load or ScaleStudyResult.read gives it) analysed again from its sizes'
    raw data (the tests and multipliers of an older analysis dropped); `reanalysed` says when."""
    if not isinstance(saved, ScaleStudyResult):
        saved = ScaleStudyResult.from_json(saved, source="the study's results.json")
    sizes = [replace(s, tests=None) for s in saved.sizes]
    analysis = analyse(sizes, fit_form, resamples, seed, saved.bench)
    return replace(saved, reanalysed=when or time.strftime("%Y-%m-%d"), **vars(analysis))


def load_bench(path: Any) -> BenchRatio | None:
    """XSA/SA step time from an `xsa-lm bench` results.json (scale.bench), for the wall-clock k."""
    if path is None:
        return None
    file = Path(str(path))
    if not file.is_file():
        raise UserError(f"scale.bench={path}: no such file; give the results.json an `xsa-lm bench` run wrote")
    try:
        bench = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        bench = None
    ratios = bench.get("ratios") if isinstance(bench, dict) else None
    ratio = ratios.get("xsa_over_sa_step_time") if isinstance(ratios, dict) else None
    if not isinstance(ratio, dict) or "median" not in ratio:
        raise UserError(f"scale.bench={path}: no XSA/SA step time in it (ratios.xsa_over_sa_step_time)")
    return BenchRatio(source=str(file), model=bench.get("model"), xsa_over_sa_step_time=ratio)


def check_size_axis(cfg: DictConfig, overrides: list[str], models: list[str]) -> Study:
    """Every setting of the size axis and what each size will run: each size's sweep config composed and checked
    as that sweep will check it, its trials included (check_sweep). Returns the study, ready to run."""
    bench = load_bench(cfg.scale.bench)
    compare_seeds(parse(ScaleSpec, cfg.scale, "scale"), parse(SweepSpec, cfg.sweep, "sweep"))
    seeds = cast(list[int] | None, plain(cfg.scale.seeds))  # None: each size's sweep.seeds
    as_sweep = [] if seeds is None else [f"sweep.seeds=[{','.join(map(str, seeds))}]"]
    sweeps = {model: [*overrides, f"model={model}", *as_sweep] for model in models}
    for size in sweeps.values():
        check_sweep(compose(config_name="sweep", overrides=size), train_overrides(size))
    return partial(run_size_axis, cfg, sweeps=sweeps, seeds=seeds, bench=bench)


def run_size_axis(
    cfg: DictConfig,
    identity: StudyIdentity,
    group: str | None,
    *,
    sweeps: dict[str, list[str]],
    seeds: list[int] | None,
    bench: BenchRatio | None,
) -> list[str]:
    """Each size's sweep, the analysis and the report; returns the sizes whose sweep did not finish."""
    study_dir = Path(identity.study_dir)
    stop_on_signals(lambda: None, "scale")  # within a size, its sweep's handler stops the trials
    print(f"xsa-lm scale | {study_dir} | W&B group {identity.study_id} | sizes {list(sweeps)}")
    sizes = [run_size(model, overrides, study_dir=study_dir, group=group) for model, overrides in sweeps.items()]
    analysis = analyse(sizes, cfg.scale.fit, cfg.scale.bootstrap_resamples, cfg.scale.bootstrap_seed, bench)
    results = ScaleStudyResult(**vars(identity), models=list(sweeps), seeds=seeds, bench=bench, **vars(analysis))
    write_report(results, study_dir)
    if group is not None and cfg.scale.wandb_report:
        log_to_wandb(results, study_dir, report_run_settings(cast(DictConfig, wandb_settings(cfg))))
    return [s.model for s in results.sizes if s.sweep_returncode != 0]


def keep_sizes(state_file: Path, models: list[str]) -> None:
    """A rerun may add sizes to a study, not leave one out: its report would drop a size already trained (a ladder
    chosen after seeing its results). scale.json records every size the study has run."""
    state = json.loads(state_file.read_text())
    earlier = state.get("models", [])  # none recorded: a study started before this was kept
    left_out = [m for m in earlier if m not in models]
    if left_out:
        raise UserError(
            f"scale.models: {state_file.parent} holds a study of {earlier}, and scale.models={models} leaves out "
            f"{left_out}: give every size it has run (new ones may be added), or choose a new hydra.run.dir"
        )
    write_json(state_file, {**state, "models": earlier + [m for m in models if m not in earlier]})


def run_study(cfg: DictConfig, study_dir: Path, overrides: list[str]) -> list[str]:
    """Either axis: every setting and what each size will run checked before the study directory gets anything, then
    the study's identity (scale.json: a rerun must train what the first run trained; sizes and seeds may be added),
    its config.yaml and its runs, in the study's W&B group. Returns what did not finish."""
    parse(ScaleSpec, cfg.scale, "scale")  # first: the rules after them rely on their types
    parse(SweepSpec, cfg.sweep, "sweep")  # each size's search and launcher
    tokens = cfg.scale.axis == "tokens"
    models = check_models(cfg.scale.models, at_least=1 if tokens else 2)
    if tokens:
        from xsa_lm.scale.tokens import check_token_axis

        study = check_token_axis(cfg, study_dir, overrides, models)
    else:
        study = check_size_axis(cfg, overrides, models)
    wandb_cfg = wandb_settings(cfg)
    study_id = open_state(
        study_dir / "scale.json",
        overrides,
        wandb_cfg.group if wandb_cfg else None,
        id_key="study_id",
        overrides_key="overrides",
        holds="a scaling study with the overrides",
    )
    keep_sizes(study_dir / "scale.json", models)
    write_text(study_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    identity = StudyIdentity(study_dir=str(study_dir), study_id=study_id, overrides=overrides)
    return study(identity, study_id if wandb_cfg else None)


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="scale")
@one_line_errors
def main(cfg: DictConfig) -> None:
    study_dir, incomplete = run_exclusive("scale", sweep_overrides, partial(run_study, cfg))
    print("\n" + (study_dir / "report.md").read_text())
    print(f"report: {study_dir / 'report.md'} | results: {study_dir / 'results.json'}")
    if incomplete:
        print(
            f"xsa-lm scale: {', '.join(incomplete)} did not finish: run the same command again to retry",
            file=sys.stderr,
        )
        sys.exit(1)

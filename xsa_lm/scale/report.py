"""The scaling study's outputs: results.json, report.md, loss_vs_compute.png, multiplier.png (XSA - SA by size; the
ladder's k in its title only when no flag is up) and a W&B report run."""

from dataclasses import dataclass, field
from pathlib import Path

from xsa_lm.records import JsonObject, Record
from xsa_lm.reporting import (
    PAIRED_ALIGN,
    PAIRED_HEADER,
    ReportRunSettings,
    interval,
    log_report_run,
    markdown_table,
    num,
    paired_cells,
    saved_figure,
    section,
    warning_lines,
    write_report_files,
)
from xsa_lm.scale.fit import Fit
from xsa_lm.stats.decision import ClusteredTest
from xsa_lm.stats.paired import PairedStats
from xsa_lm.sweep.report import clustered_line


@dataclass(frozen=True, kw_only=True)
class BenchRatio(Record):
    """scale.bench: the XSA/SA step time an `xsa-lm bench` run measured (its median, interval and rounds)."""

    source: str
    model: str | None
    xsa_over_sa_step_time: JsonObject


@dataclass(frozen=True, kw_only=True)
class SizeResult(Record):
    """One size of a scaling study, as its results.json keeps it: what its sweep gave (the raw data a reanalysis starts
    from; `error` says why a size has none) and, once analysed, its paired tests."""

    model: str
    sweep_dir: str | None = None
    sweep_returncode: int | None = None
    error: str | None = None
    selected_lr: float | None = None
    lr_grid: list[float] | None = None
    seeds: list[int] = field(default_factory=list)
    sa_runs: list[float] = field(default_factory=list)
    xsa_runs: list[float] = field(default_factory=list)
    sa_mean: float | None = None
    xsa_mean: float | None = None
    diff_ci95: tuple[float, float] | None = None
    sweep_warnings: list[str] = field(default_factory=list)
    non_embedding_params: int | None = None
    tokens: int | None = None
    compute: float | None = None  # training FLOPs of a run (size_result); None: left out of the fit
    sa_tokens_per_s: float | None = None
    xsa_tokens_per_s: float | None = None
    tests: dict | None = None  # PairedStats.to_json() and t_p_holm (analyse)
    schema: int = 1

    @property
    def usable(self) -> bool:
        return self.compute is not None and self.error is None


@dataclass(frozen=True, kw_only=True)
class ScaleStudyResult(Record):
    """A scaling study's results.json (scale.axis=size): its sizes and their analysis (scale.run.analyse)."""

    study_dir: str
    study_id: str
    overrides: list[str]
    models: list[str]
    seeds: list[int] | None = None  # scale.seeds; None: each size's sweep.seeds
    reanalysed: str | None = None  # the day a saved study was analysed again (scale.run.reanalyse)
    fit: dict  # the SA fit, the shared fit, the flags, and k when no flag is up
    across_sizes: dict  # the pooled sign test and the test by seed
    warnings: list[str] = field(default_factory=list)
    sizes: list[SizeResult]
    bench: BenchRatio | None = None  # scale.bench's XSA/SA step time
    schema: int = 1


def fit_of(results: ScaleStudyResult) -> Fit:
    fit = results.fit
    return Fit(form=fit["form"], E=fit["E"], A=fit["A"], alpha=fit["alpha"], c_ref=1.0, residuals=fit["residuals"])


def fit_lines(results: ScaleStudyResult) -> list[str]:
    """The SA fit of loss vs compute, its lack-of-fit test, the shared fit, and each size against the SA fit."""
    fit, lack = results.fit, results.fit["lack_of_fit"]
    test = f"no test ({lack['dof']} dof or a size with one seed)"
    if lack["p"] is not None:
        test = f"chi^2 = {lack['chi2']:.1f} on {lack['dof']} dof, p = {lack['p']:.2g}"
    lines = section(
        "## SA loss vs training compute",
        f"SA fit over the SA mean final losses ({fit['points']} sizes, {fit['parameters']} parameters, least "
        f"squares): **{fit['formula']}** (C: training FLOPs). RMS residual {fit['rms_residual']:.4f}. Lack of fit "
        f"against each size's standard error over seeds: {test}.",
        f"Shared fit of both arms (one E and one alpha, Huber loss on log-loss residuals): "
        f"**{fit['shared']['formula']}**; size-level deviation beyond seed noise: "
        f"{fit['shared']['lack_of_fit_sd']:.4f} sd.",
    )
    model, rows = fit_of(results), []
    for size in results.sizes:
        if size.compute is None or size.sa_mean is None:
            rows.append([size.model, "-", "-", "-", "-", "-", "left out"])
            continue
        predicted = model.loss(size.compute)
        rows.append([size.model, f"{size.non_embedding_params:,}", f"{size.selected_lr:g}", f"{size.compute:.3g}"])
        rows[-1] += [num(size.sa_mean), num(predicted), f"{size.sa_mean - predicted:+.4f}"]
    header = ["model", "non-embedding params", "selected LR", "compute (FLOPs)", "SA mean", "SA fit", "residual"]
    return lines + markdown_table(header, rows, align="lrrrrrr")


def size_test_lines(results: ScaleStudyResult) -> list[str]:
    """XSA - SA at each size with the paired t, exact Wilcoxon and exact sign tests, Holm across sizes."""
    lines = section(
        "## XSA vs SA at each size",
        "Paired over seeds, two-sided; Holm: the t p-values adjusted for testing every size.",
    )
    rows = []
    for size in results.sizes:
        if (t := size.tests) is not None:
            stats = PairedStats.from_json({k: v for k, v in t.items() if k != "t_p_holm"})
            rows.append([size.model, num(size.sa_mean), num(size.xsa_mean), *paired_cells(stats)])
            rows[-1].append(num(t["t_p_holm"], ".3g"))
    header = ["model", "SA mean", "XSA mean", *PAIRED_HEADER, "Holm p"]
    lines += markdown_table(header, rows, align="lrr" + PAIRED_ALIGN + "r")
    pooled = results.across_sizes["pooled_sign"]
    lines += [
        "",
        f"Pooled over every pair of every size: XSA lower in {pooled['xsa_lower']} of {pooled['pairs']} (exact sign "
        f"test p = {num(pooled['p'], '.3g')}; a size's pairs share its LR and curve: the direction, not a size).",
    ]
    if "by_seed" in results.across_sizes:
        by_seed = ClusteredTest.from_json(results.across_sizes["by_seed"])
        lines.append(clustered_line(by_seed, shares="its data order at every size"))
    return lines


def multiplier_lines(results: ScaleStudyResult) -> list[str]:
    """The ladder's one multiplier, only when no flag is up."""
    fit = results.fit
    lines = ["", "## XSA's effective-compute multiplier (the ladder)", ""]
    if fit.get("flags"):
        return lines + [
            f"Not reported: the ladder is flagged ({', '.join(f['flag'] for f in fit['flags'])}): a multiplier off a "
            "curve that does not describe the data means nothing. results.json keeps it under `fit.not_results`, "
            "for diagnosis only.",
            "",
            "wall-clock k: measure throughput with xsa-lm bench",
        ]
    wall = fit["wallclock"]
    wall_line = wall["note"]
    if wall["multiplier"] is not None:
        wall_line = f"wall-clock k: {wall['multiplier']:.3f}, 95% CI {interval(wall['ci'], '.3f')} ({wall['note']})"
    return lines + [
        f"k = **{num(fit['multiplier'], '.3f')}**, 95% CI {interval(fit['multiplier_ci'], '.3f')}: k = (A_SA / "
        "A_XSA)^(1/alpha) of the shared fit, the compute SA needs to reach XSA's loss (k > 1: XSA is worth k x the "
        "compute). Interval: a parametric bootstrap of the shared fit (each size's seed noise and the size-level "
        "deviations beyond it).",
        "",
        wall_line,
    ]


def render_markdown(results: ScaleStudyResult) -> str:
    lines = ["# SA vs XSA across model sizes: effective-compute multiplier", ""]
    if results.reanalysed:
        lines.append(f"- re-analysed on {results.reanalysed} from the saved sizes with the current analysis")
    lines += [
        f"- study directory: `{results.study_dir}` (W&B group `{results.study_id}`)",
        f"- overrides: `{' '.join(results.overrides) or '(defaults)'}`",
        f"- sizes: {', '.join(results.models)}; each size: LR search on SA, then SA vs XSA at its selected LR "
        "(its own sweep under `sizes/`)",
    ]
    if flags := results.fit.get("flags", []):
        lines += [
            "",
            "## Flags: this ladder gives no multiplier",
            "",
            *(f"- **{f['flag']}**: {f['reason']}" for f in flags),
        ]
    lines += warning_lines(results.warnings) + fit_lines(results) + size_test_lines(results) + multiplier_lines(results)
    lines += [
        "",
        "The fits run along this ladder of sizes at a fixed token budget, not a compute-optimal frontier: the "
        "multiplier is the compute SA would need on this ladder. Each size's LR, selected on SA, is reused for XSA.",
    ]
    return "\n".join(lines) + "\n"


def plot_loss_vs_compute(results: ScaleStudyResult, path: Path) -> None:
    import numpy as np
    from matplotlib.ticker import NullFormatter

    sizes = [s for s in results.sizes if s.compute is not None]
    compute = [float(s.compute or 0.0) for s in sizes]
    model, shared = fit_of(results), results.fit["shared"]
    grid = np.geomspace(min(compute) / 1.5, max(compute) * 1.5, 100)
    with saved_figure(path) as ax:
        for attention, color in (("sa", "tab:blue"), ("xsa", "tab:orange")):
            runs = [s.sa_runs if attention == "sa" else s.xsa_runs for s in sizes]
            means = [float(np.mean(r)) for r in runs]
            spread = [float(np.std(r, ddof=1)) if len(r) > 1 else 0.0 for r in runs]
            label = f"{attention.upper()} (mean ± sd over seeds)"
            ax.errorbar(compute, means, yerr=spread, fmt="o", color=color, capsize=3, label=label)
        label = f"SA fit: {model.describe()}"
        ax.plot(grid, [model.loss(c) for c in grid], "-", color="tab:blue", alpha=0.6, label=label)
        for arm, color in (("sa", "tab:blue"), ("xsa", "tab:orange")):
            curve = shared["E"] + shared[f"A_{arm}"] * grid ** -shared["alpha"]
            ax.plot(grid, curve, ":", color=color, alpha=0.8, label=f"shared fit, {arm.upper()}")
        for s in sizes:
            ax.annotate(s.model, (s.compute, s.sa_mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(xscale="log", xlabel="training compute (FLOPs)", ylabel="final validation loss")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis overlap
        flagged = " (fit flagged: see the report)" if results.fit.get("flags") else ""
        ax.set_title("Loss vs compute" + flagged, fontsize=10)
        ax.legend(fontsize=7, loc="best")


def plot_multiplier(results: ScaleStudyResult, path: Path) -> None:
    """XSA - SA at each size with its paired 95% interval; the ladder's k in the title only when no flag is up."""
    from matplotlib.ticker import NullFormatter

    fit = results.fit
    title = "XSA - SA by size (ladder flagged: no multiplier)"
    if not fit.get("flags"):
        title = f"XSA - SA by size; ladder k = {fit['multiplier']:.3g} {interval(fit['multiplier_ci'], '.3f')}"
    with saved_figure(path) as ax:
        ax.axhline(0.0, color="gray", linestyle="--", label="no difference")
        for x, tests in ((float(s.non_embedding_params or 0), s.tests) for s in results.sizes if s.tests):
            diff, (low, high) = tests["mean_diff"], tests["t_ci95"] or [tests["mean_diff"]] * 2
            ax.errorbar([x], [diff], yerr=[[diff - low], [high - diff]], fmt="o", color="tab:orange", capsize=4)
        ax.set(xscale="log", xlabel="non-embedding parameters", ylabel="XSA - SA final loss (paired 95% CI)")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)


def write_report(results: ScaleStudyResult, study_dir: Path) -> str:
    plots = {"loss_vs_compute.png": lambda path: plot_loss_vs_compute(results, path)}
    plots["multiplier.png"] = lambda path: plot_multiplier(results, path)
    return write_report_files(study_dir, results, render_markdown(results), plots)


def log_to_wandb(results: ScaleStudyResult, study_dir: Path, wandb_cfg: ReportRunSettings) -> None:
    """A `scale-report` run in the study's W&B group: the sizes table, both plots, and the report's files
    (results.json, report.md, the plots) as its artifact <study_id>-scale-report."""
    columns = "model non_embedding_params selected_lr compute sa_mean xsa_mean".split()
    tests = "mean_diff t_p t_p_holm wilcoxon_p sign_p".split()
    rows = [[getattr(s, c) for c in columns] + [s.tests[t] for t in tests] for s in results.sizes if s.tests]
    fit = results.fit
    summary = {
        "fit": fit["formula"],
        "fit_rms_residual": fit["rms_residual"],
        "flags": [f["flag"] for f in fit["flags"]],
    }
    if not fit["flags"]:  # a flagged ladder's k stays out of every summary
        summary |= {"multiplier": fit["multiplier"], "multiplier_ci": fit["multiplier_ci"]}
    log_report_run(
        study_dir,
        wandb_cfg,
        name=f"{results.study_id}-scale-report",
        group=results.study_id,
        job_type="scale-report",
        artifact_type="scale-report",
        config={"models": results.models, "seeds": results.seeds, "overrides": results.overrides},
        table=("scale/sizes", columns + tests, rows),
        plots={f"scale/{p}": f"{p}.png" for p in ("loss_vs_compute", "multiplier")},
        summary=summary,
    )

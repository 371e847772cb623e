"""A scaling study's results.json, report.md and plots: scale.axis=size (the ladder's fit and k, loss_vs_compute.png,
multiplier.png, a W&B report run) or scale.axis=tokens (k at a fixed size, loss_vs_tokens.png, multiplier.png)."""

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xsa_lm.records import JsonObject, Record
from xsa_lm.reporting import ReportRunSettings, interval, log_report_run, render, saved_figure, write_report_files
from xsa_lm.scale.token_axis import STALL_MARGIN, PooledK
from xsa_lm.sweep.protocol import NULL
from xsa_lm.sweep.trials import CodeRuns


@dataclass(frozen=True)
class Arms:
    """The two arms a study compares, by attention option name (sweep.baseline and its one candidate). The records'
    sa_*/xsa_* keys hold the baseline's and the candidate's values (their names from before arms had names)."""

    baseline: str = "sa"
    candidate: str = "xsa"

    @property
    def names(self) -> tuple[str, str]:
        return self.baseline, self.candidate

    @property
    def labels(self) -> tuple[str, str]:
        """As the report names them, e.g. (SA, XSA)."""
        return self.baseline.upper(), self.candidate.upper()

    @property
    def bench_ratio(self) -> str:
        """`xsa-lm bench`'s key of the candidate's step time over the baseline's."""
        return f"{self.candidate}_over_{self.baseline}_step_time"


PAPER_ARMS = Arms()  # the configs' defaults: SA, and XSA compared with it


@dataclass(frozen=True, kw_only=True)
class BenchRatio(Record):
    """scale.bench: the candidate/baseline step time an `xsa-lm bench` run measured (median, interval and rounds)."""

    source: str
    model: str | None
    xsa_over_sa_step_time: JsonObject


@dataclass(frozen=True, kw_only=True)
class SizeResult(Record):
    """One size of a scaling study: what its sweep gave (a reanalysis starts from it; `error`: why none), its tests."""

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
    bench: BenchRatio | None = None  # scale.bench's candidate/baseline step time
    arms: Arms = field(default_factory=Arms)
    code: list[CodeRuns] = field(default_factory=list)  # the runs by the code that trained them
    schema: int = 1


@dataclass(frozen=True, kw_only=True)
class SizeBench(Record):
    """The candidate/baseline step time at one size, from `xsa-lm bench`: its median, 95% interval and rounds."""

    xsa_over_sa_step_time: float
    interval: list[float]
    rounds: int
    file: str


@dataclass(frozen=True, kw_only=True)
class TokenPlan(Record):
    """The token axis's plan, fixed at the study's first run (scale.json)."""

    axis: str
    tokens_per_param: float
    sa_budgets: list[float]
    xsa_budgets: list[float]
    search_seeds: list[int]
    seeds: list[int]
    lr_per_budget: bool
    warmup_fraction: float | None  # None: the recipe's warmup
    tune_xsa: bool
    null_arm: bool
    allow_repeated_data: bool
    margin: float | None  # None: no margin verdict
    arms: Arms = field(default_factory=Arms)
    measure_throughput: bool = True  # the wall-clock k
    bootstrap_seed: int = 0


@dataclass(frozen=True, kw_only=True)
class TokenRun(Record):
    """One run at one budget: what its trial record says of it."""

    seed: int
    status: str
    error: str | None = None
    log: str | None = None
    final_val_loss: float | None = None
    final_val_bpb: float | None = None
    final_val_loss_by_position: list[float] | None = None
    tokens_seen: int | None = None
    data_epochs: float | None = None  # passes over the training split (None: a run from before it was recorded)
    tokens_per_s: float | None = None
    val_history: list[dict] = field(default_factory=list)
    run_dir: str | None = None


@dataclass(frozen=True, kw_only=True)
class TokenSize(Record):
    """One size of a token-axis study: its budget B, its LR search, and its runs by arm and budget (None: no LR)."""

    model: str
    non_embedding_params: int | None = None
    tokens_B: float
    search: dict[str, float | None] = field(default_factory=dict)  # LR -> median SA loss at B
    selected_lr: float | None = None  # SA's at B
    searches: dict[str, dict[str, float | None]] = field(default_factory=dict)  # budget -> LR -> median SA loss
    selected_lrs: dict[str, float | None] = field(default_factory=dict)  # budget -> SA's LR (every budget's runs)
    xsa_search: dict[str, float | None] = field(default_factory=dict)  # sweep.tune_xsa: LR -> median XSA loss at B
    xsa_selected_lr: float | None = None
    warnings: list[str] = field(default_factory=list)
    runs: dict[str, dict[str, list[TokenRun]]] | None = None  # arm -> budget (in B) -> a run per seed
    seeds: list[int] = field(default_factory=list)
    grid: list[float] = field(default_factory=list)
    bench: SizeBench | None = None


@dataclass(frozen=True, kw_only=True)
class TokenStudyResult(Record):
    """A token-axis study's results.json."""

    axis: str = "tokens"
    study_dir: str
    study_id: str
    overrides: list[str]
    plan: TokenPlan
    sizes: list[TokenSize]
    cells: list[dict]  # analyse_tokens: k per (size, XSA budget)
    pooled: PooledK | None = None
    warnings: list[str] = field(default_factory=list)
    reanalysed: str | None = None  # the day a saved study was analysed again (scale.run.reanalyse)
    code: list[CodeRuns] = field(default_factory=list)  # the runs by the code that trained them
    schema: int = 1


def by_budget(budgets: dict[str, Any]) -> list[tuple[str, Any]]:
    """A size's budgets (fractions of B as text: "0.5", "1", ...), smallest first."""
    return sorted(budgets.items(), key=lambda item: float(item[0]))


def render_markdown(results: ScaleStudyResult | TokenStudyResult) -> str:
    """report.md of a study along either axis (xsa_lm/templates/tokens.md.j2 or scale.md.j2)."""
    if isinstance(results, TokenStudyResult):
        return render("tokens.md.j2", r=results, by_budget=by_budget, STALL_MARGIN=STALL_MARGIN)
    return render("scale.md.j2", r=results)


def plot_loss_vs_compute(results: ScaleStudyResult, path: Path) -> None:
    import numpy as np
    from matplotlib.ticker import NullFormatter

    sizes = [s for s in results.sizes if s.compute is not None]
    compute = [float(s.compute or 0.0) for s in sizes]
    fit, shared = results.fit, results.fit["shared"]
    grid = np.geomspace(min(compute) / 1.5, max(compute) * 1.5, 100)
    (base, cand), colors = results.arms.labels, ("tab:blue", "tab:orange")
    with saved_figure(path) as ax:
        arms = ((base, [s.sa_runs for s in sizes], "baseline"), (cand, [s.xsa_runs for s in sizes], "candidate"))
        for (name, runs, _), color in zip(arms, colors, strict=True):
            means = [float(np.mean(r)) for r in runs]
            spread = [float(np.std(r, ddof=1)) if len(r) > 1 else 0.0 for r in runs]
            label = f"{name} (mean ± sd over seeds)"
            ax.errorbar(compute, means, yerr=spread, fmt="o", color=color, capsize=3, label=label)
        base_curve = fit["E"] + fit["A"] * grid ** -fit["alpha"]
        ax.plot(grid, base_curve, "-", color="tab:blue", alpha=0.6, label=f"{base} fit: {fit['formula']}")
        for (name, _, role), color in zip(arms, colors, strict=True):
            curve = shared["E"] + shared[f"A_{role}"] * grid ** -shared["alpha"]
            ax.plot(grid, curve, ":", color=color, alpha=0.8, label=f"shared fit, {name}")
        for s in sizes:
            ax.annotate(s.model, (s.compute, s.sa_mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(xscale="log", xlabel="training compute (FLOPs)", ylabel="final validation loss")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis overlap
        flagged = " (fit flagged: see the report)" if fit.get("flags") else ""
        ax.set_title("Loss vs compute" + flagged, fontsize=10)
        ax.legend(fontsize=7, loc="best")


def plot_multiplier(results: ScaleStudyResult, path: Path) -> None:
    """Candidate - baseline at each size with its paired 95% interval; the ladder's k in the title if no flag is up."""
    from matplotlib.ticker import NullFormatter

    fit, difference = results.fit, "{1} - {0}".format(*results.arms.labels)
    title = f"{difference} by size (ladder flagged: no multiplier)"
    if not fit.get("flags"):
        title = f"{difference} by size; ladder k = {fit['multiplier']:.3g} {interval(fit['multiplier_ci'], '.3f')}"
    with saved_figure(path) as ax:
        ax.axhline(0.0, color="gray", linestyle="--", label="no difference")
        for x, tests in ((float(s.non_embedding_params or 0), s.tests) for s in results.sizes if s.tests):
            diff, (low, high) = tests["mean_diff"], tests["t_ci95"] or [tests["mean_diff"]] * 2
            ax.errorbar([x], [diff], yerr=[[diff - low], [high - diff]], fmt="o", color="tab:orange", capsize=4)
        ax.set(xscale="log", xlabel="non-embedding parameters", ylabel=f"{difference} final loss (paired 95% CI)")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)


def plot_loss_vs_tokens(results: TokenStudyResult, path: Path) -> None:
    sizes = [s for s in results.sizes if s.runs is not None]
    columns = max(1, len(sizes))
    with saved_figure(path, ncols=columns, figsize=(5 * columns, 4), squeeze=False) as axes:
        for ax, size in zip(axes[0], sizes, strict=False):
            plot_size(ax, size, results.plan.arms)


def plot_size(ax: Any, size: TokenSize, arms: Arms) -> None:
    """One size's final losses against its tokens: every run and each arm's mean per budget."""
    for arm, color in ((arms.baseline, "tab:blue"), (arms.candidate, "tab:orange"), (NULL, "tab:gray")):
        done = [[r for r in runs if r.status == "completed"] for runs in (size.runs or {}).get(arm, {}).values()]
        for runs in done:
            ax.plot([r.tokens_seen for r in runs], [r.final_val_loss for r in runs], ".", color=color, alpha=0.4)
        means = sorted((r[0].tokens_seen, statistics.fmean(x.final_val_loss or 0.0 for x in r)) for r in done if r)
        label = f"{arm.upper()} mean" if arm != NULL else f"null ({arms.labels[0]}, other weights) mean"
        if means:
            ax.plot(*zip(*means, strict=True), "o-", color=color, label=label)
    lr = "per budget" if len(size.selected_lrs) > 1 else f"{size.selected_lr:g}"
    ax.set(xscale="log", xlabel="training tokens", ylabel="final validation loss", title=f"{size.model} (LR {lr})")
    ax.legend()


def plot_multipliers(results: TokenStudyResult, path: Path) -> None:
    import matplotlib.ticker

    base, cand = results.plan.arms.labels
    with saved_figure(path) as ax:
        labels = []
        for i, cell in enumerate(results.cells):
            labels.append(f"{cell['model']}\n{cand} at {cell['fraction']:g} B")
            lo_edge, hi_edge = min(cell["sa_budgets"]) / cell["budget"], max(cell["sa_budgets"]) / cell["budget"]
            lo, hi = cell["ci95"]
            lo, hi = lo if lo is not None else lo_edge, hi if hi is not None else hi_edge
            ax.plot([i, i], [lo, hi], "-", color="tab:orange", linewidth=3, alpha=0.6)
            ax.hlines([lo_edge, hi_edge], i - 0.2, i + 0.2, linestyles=":", color="gray")
            if cell["k"] is not None:
                ax.plot(i, cell["k"], "o", color="tab:orange")
            else:
                ax.annotate(cell["bound"], (i, hi if ">" in (cell["bound"] or "") else lo), ha="center")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels)
        ax.set(yscale="log", ylabel=f"k (tokens {base} needs / {cand}'s tokens)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([0.5, 1, 2, 4])
        ax.set_title(f"{cand}'s token multiplier, 95% CI (dotted: {base}'s measured range)")


def write_report(results: ScaleStudyResult | TokenStudyResult, study_dir: Path) -> str:
    """results.json, report.md and the study's plots in its directory; returns the markdown."""
    plots: dict[str, Callable[..., None]]  # file name -> what draws the results there
    if isinstance(results, TokenStudyResult):
        plots = {"loss_vs_tokens.png": plot_loss_vs_tokens, "multiplier.png": plot_multipliers}
    else:
        plots = {"loss_vs_compute.png": plot_loss_vs_compute, "multiplier.png": plot_multiplier}
    return write_report_files(study_dir, results, render_markdown(results), plots)


def log_to_wandb(results: ScaleStudyResult, study_dir: Path, wandb_cfg: ReportRunSettings) -> None:
    """A `scale-report` run in the study's W&B group: the sizes table, the plots and the report's files (artifact)."""
    columns = "model non_embedding_params selected_lr compute sa_mean xsa_mean".split()
    tests = "mean_diff t_p t_p_holm wilcoxon_p sign_p".split()
    rows = [[getattr(s, c) for c in columns] + [s.tests[t] for t in tests] for s in results.sizes if s.tests]
    fit = results.fit
    flags = [f["flag"] for f in fit["flags"]]
    summary = {"fit": fit["formula"], "fit_rms_residual": fit["rms_residual"], "flags": flags}
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

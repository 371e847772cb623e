"""A scaling study's outputs along either axis: results.json, report.md and its plots (scale.axis=size: the ladder's
fit and one multiplier, loss_vs_compute.png, multiplier.png with the ladder's k in its title only when no flag is up,
and a W&B report run; scale.axis=tokens: k at fixed size, loss_vs_tokens.png and multiplier.png)."""

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    render,
    saved_figure,
    section,
    warning_lines,
    write_report_files,
)
from xsa_lm.scale.fit import Fit
from xsa_lm.scale.token_axis import STALL_MARGIN, PooledK
from xsa_lm.stats.paired import PairedStats
from xsa_lm.stats.positions import PositionDifferences
from xsa_lm.sweep.report import BpbStats, position_lines


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


@dataclass(frozen=True, kw_only=True)
class SizeBench(Record):
    """XSA/SA step time at one size, from `xsa-lm bench`: its median, 95% interval and rounds."""

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
    """One size of a token-axis study: its budget B, its LR search, and its runs by arm and budget (none when no LR
    was selected)."""

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
    bench: SizeBench | None = None  # bench_size


@dataclass(frozen=True, kw_only=True)
class TokenStudyResult(Record):
    """A token-axis study's results.json."""

    axis: str = "tokens"
    study_dir: str
    study_id: str
    overrides: list[str]
    plan: TokenPlan  # check_token_study
    sizes: list[TokenSize]
    cells: list[dict]  # analyse_tokens: k per (size, XSA budget)
    pooled: PooledK | None = None
    warnings: list[str] = field(default_factory=list)
    reanalysed: str | None = None  # the day a saved study was analysed again (scale.tokens.reanalyse_tokens)
    schema: int = 1


def fit_of(results: ScaleStudyResult) -> Fit:
    fit = results.fit
    return Fit(form=fit["form"], E=fit["E"], A=fit["A"], alpha=fit["alpha"], c_ref=1.0, residuals=fit["residuals"])


def render_ladder(results: ScaleStudyResult) -> str:
    """report.md of the size axis (xsa_lm/templates/scale.md.j2)."""
    tests = [(size, size.tests) for size in results.sizes if size.tests is not None]
    size_tests = [(size, PairedStats.from_json({k: v for k, v in t.items() if k != "t_p_holm"})) for size, t in tests]
    return render("scale.md.j2", r=results, model=fit_of(results), size_tests=size_tests)


def protocol_text(plan: TokenPlan) -> str:
    """How the study chose its LRs and warmup, in one paragraph."""
    seeds = plan.search_seeds
    if plan.lr_per_budget:
        lr = f"SA's LR is searched at every SA budget (the lowest median SA loss over the search seeds {seeds}), and "
        lr += "XSA and the null arm train at SA's LR of their budget"
    else:
        lr = f"the LR is the one with the lowest median SA loss at B over the search seeds {seeds}, used at every "
        lr += "budget and for both arms"
    warmup = plan.warmup_fraction
    warmup_text = f"each run warms up for {warmup:.0%} of its steps" if warmup is not None else "the recipe's warmup"
    return (
        f"B = {plan.tokens_per_param:g} tokens per non-embedding parameter. SA at {plan.sa_budgets} x B, XSA at "
        f"{plan.xsa_budgets} x B, seeds {plan.seeds} (paired); {lr}; {warmup_text}."
    )


def grid_text(search: dict[str, float | None]) -> str:
    return ", ".join(f"{lr}: {num(loss)}" for lr, loss in search.items())


def size_lines(results: TokenStudyResult) -> list[str]:
    """Each size's LR search per budget, XSA's own search (sweep.tune_xsa), and every run's final loss."""
    searches, own, runs = [], [], []
    for size in results.sizes:
        params = f"{size.non_embedding_params:,}" if size.non_embedding_params is not None else "-"
        for fraction, search in sorted((size.searches or {"1": size.search}).items(), key=lambda i: float(i[0])):
            chosen = size.selected_lrs.get(fraction, size.selected_lr if fraction == "1" else None)
            searches.append([size.model, params, f"{size.tokens_B:,.0f}", f"{fraction} B", grid_text(search)])
            searches[-1].append(num(chosen, "g") if chosen is not None else "none")
        if size.xsa_search:
            best = num(size.xsa_selected_lr, "g") if size.xsa_selected_lr is not None else "none"
            own.append([size.model, grid_text(size.xsa_search), best, num(size.selected_lr, "g")])
        for arm, budgets in (size.runs or {}).items():
            for fraction, done in budgets.items():
                losses = [r.final_val_loss for r in done if r.status == "completed" and r.final_val_loss is not None]
                cells = ", ".join(f"{r.final_val_loss:.4f}" if r.status == "completed" else r.status for r in done)
                epochs = max((r.data_epochs for r in done if r.data_epochs is not None), default=None)
                lr = num(size.selected_lrs.get(fraction, size.selected_lr), "g")
                mean = sum(losses) / len(losses) if losses else None
                runs.append([size.model, arm.upper(), f"{fraction} B", lr, num(epochs, ".3f"), cells, num(mean)])
    header = ["model", "non-embedding params", "B (tokens)", "budget", "LR grid: median SA loss", "SA's LR"]
    lines = section("## Sizes, budgets and the LR", protocol_text(results.plan))
    lines += markdown_table(header, searches, align="lrrrlr")
    if own:  # XSA's runs use SA's LR, the paper's protocol
        header = ["model", "XSA's own LR search at B: median XSA loss", "XSA's best LR", "SA's LR"]
        lines += ["", *markdown_table(header, own, align="llrr")]
    header = ["model", "arm", "budget", "LR", "data epochs", "final val loss per seed", "mean"]
    return lines + ["", *markdown_table(header, runs, align="llrrrlr")]


def k_cells(cell: dict) -> list[str]:
    """k (or its bound) and its interval, an unbounded end a bound at SA's range."""
    (lo, hi), top, bottom = cell["ci95"], max(cell["sa_budgets"]), min(cell["sa_budgets"])
    lo_text = f"{lo:.3f}" if lo is not None else f"<= {bottom / cell['budget']:.3g}"
    hi_text = f"{hi:.3f}" if hi is not None else f">= {top / cell['budget']:.3g}"
    k = f"{cell['k']:.3f}" if cell["k"] is not None else cell["bound"] or "-"
    return [k, f"[{lo_text}, {hi_text}]"]


def stalls(cell: dict) -> list[tuple[int, float]]:
    return list(zip(cell["sa_stalled"], cell["sa_budgets"], strict=True))


def token_k_lines(results: TokenStudyResult) -> list[str]:
    lines = section(
        "## XSA's multiplier along the token axis",
        "k = the tokens SA needs to reach XSA's mean loss (SA's means interpolated linearly in ln tokens) / XSA's "
        "tokens. 95% CI: Fieller's (test inversion over the paired per-seed values); an end at SA's range is a bound "
        "(<= or >=), never an extrapolation. Bootstrap: seeds resampled within the cell. Wall-clock k: k over the "
        "XSA/SA step time of `xsa-lm bench` at that size (ends combined conservatively).",
    )
    rows = []
    for cell in results.cells:
        wall = cell.get("wallclock_k")
        rows.append(
            [cell["model"], f"{cell['fraction']:g} B", cell["seeds"], ", ".join(f"{m:.4f}" for m in cell["sa_means"])]
            + [f"{cell['xsa_mean']:.4f}", *k_cells(cell), interval(cell.get("bootstrap_ci95"), ".3f")]
            + [f"{wall:.3f} {interval(cell['wallclock_ci'], '.3f')}" if wall is not None else "-"]
        )
    header = ["model", "XSA budget", "seeds", "SA means (per budget)", "XSA mean", "k", "95% CI", "bootstrap CI"]
    lines += markdown_table(header + ["wall-clock k"], rows, align="lrrlrrlll")
    if per_seed := [c for c in results.cells if c.get("per_seed_k") is not None]:
        lines += [
            "",
            f"Per seed: k on that seed's own SA curve, and the seeds more than {STALL_MARGIN:g} nats above the median "
            "of their arm and budget (stalled): a mean k over stalled and healthy seeds is a mixture.",
            "",
        ]
        rows = [
            [c["model"], f"{c['fraction']:g} B", ", ".join(map(str, c["paired_seeds"])), ", ".join(c["per_seed_k"])]
            + [", ".join(f"{n} at {b / c['budget'] * c['fraction']:.3g} B" for n, b in stalls(c))]
            + [c["xsa_stalled"]]
            for c in per_seed
        ]
        header = ["model", "XSA budget", "seeds", "k per seed", "SA stalled per budget", "XSA stalled"]
        lines += markdown_table(header, rows, align="lrlllr")
    if pooled := results.pooled:
        q_p = f" (p = {pooled.q_p_value:.3g}), I^2 = {pooled.i2:.0%}" if pooled.q_p_value is not None else ""
        lines += [
            "",
            f"Pooled over {pooled.cells} cell(s) with a point estimate (inverse variance on ln k, Student's t on the "
            f"fewest seeds; {pooled.left_out} bound(s) left out): **k = {pooled.k:.3f}, 95% CI "
            f"{interval(pooled.ci95, '.3f')}**. Cochran's Q = {pooled.cochran_q:.2f} on {pooled.q_dof} dof{q_p}. "
            "The budgets of one size share SA's runs, so this interval is too narrow: read the cells' first.",
        ]
    return lines


def token_null_lines(results: TokenStudyResult) -> list[str]:
    """The null arm's k (sweep.null_arm): SA from other initial weights read off SA's curve as XSA is."""
    if not (cells := [c for c in results.cells if c.get("null")]):
        return []
    lines = section(
        "## The null along the token axis (sweep.null_arm)",
        "SA again at XSA's budgets from other initial weights (the same data order), its k read off SA's curve as "
        "XSA's is. Its true k is 1: how far its point and interval stray is the yardstick's own noise.",
    )
    rows = [
        [c["model"], f"{c['fraction']:g} B", len(c["null"]["paired_seeds"]), *k_cells(c), *k_cells(c["null"])]
        + [", ".join(c["null"]["per_seed_k"])]
        for c in cells
    ]
    header = ["model", "budget", "seeds", "XSA's k", "XSA's 95% CI", "null k", "null 95% CI", "null k per seed"]
    return lines + markdown_table(header, rows, align="lrrrlrll")


def same_budget_lines(results: TokenStudyResult) -> list[str]:
    """XSA - SA (and null - SA, and XSA - SA in bits per byte) at each XSA budget SA also trained at: the paired
    tests, the verdict against the plan's margin, and XSA - SA along the window."""
    rows, positions = [], []
    for arm, key in (("XSA", "same_budget"), ("null", "null_same_budget")):
        for c in (c for c in results.cells if c.get(key)):
            details = c.get(f"{key}_details") or {}
            verdict = (details.get("margin") or {}).get("verdict", "-")
            rows.append(
                [c["model"], f"{c['fraction']:g} B", arm, *paired_cells(PairedStats.from_json(c[key])), verdict]
            )
            if arm == "XSA" and details.get("bpb"):
                bpb = BpbStats.from_json(details["bpb"])
                label = f"XSA, bits per byte (SA {bpb.sa_mean:.4f}, XSA {bpb.xsa_mean:.4f})"
                rows.append([c["model"], f"{c['fraction']:g} B", label, *paired_cells(bpb), "-"])
            if arm == "XSA" and details.get("positions"):
                heading = f"### {c['model']} at {c['fraction']:g} B: XSA - SA along the window"
                positions += position_lines(PositionDifferences.from_json(details["positions"]), heading)
    if not rows:
        return []
    margin = results.plan.margin
    lines = section(
        "## XSA vs SA at the same budget",
        "Paired over seeds, two-sided"
        + (
            f"; the verdict reads the one-sided 95% bounds against the plan's margin of {margin:g} nats"
            if margin
            else ""
        )
        + ". The null rows (SA from other initial weights - SA) are what the tests say when there is no effect.",
    )
    header = ["model", "budget", "arm - SA", *PAIRED_HEADER, "verdict"]
    return lines + markdown_table(header, rows, align="lrl" + PAIRED_ALIGN + "l") + positions


def render_tokens(results: TokenStudyResult) -> str:
    lines = [
        "# SA vs XSA along the token axis: XSA's multiplier at fixed model size",
        "",
        f"- study directory: `{results.study_dir}` (W&B group `{results.study_id}`)",
        f"- overrides: `{' '.join(results.overrides) or '(defaults)'}`",
    ]
    if results.reanalysed:
        lines.append(f"- re-analysed on {results.reanalysed} from the saved runs with the current analysis")
    lines += warning_lines(results.warnings)
    lines += size_lines(results) + token_k_lines(results) + token_null_lines(results) + same_budget_lines(results)
    return "\n".join([*lines, "", "![loss vs tokens](loss_vs_tokens.png)", "", "![multiplier](multiplier.png)", ""])


def render_markdown(results: ScaleStudyResult | TokenStudyResult) -> str:
    """report.md of a study along either axis."""
    return render_tokens(results) if isinstance(results, TokenStudyResult) else render_ladder(results)


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


def plot_loss_vs_tokens(results: TokenStudyResult, path: Path) -> None:
    sizes = [s for s in results.sizes if s.runs is not None]
    columns = max(1, len(sizes))
    with saved_figure(path, ncols=columns, figsize=(5 * columns, 4), squeeze=False) as axes:
        for ax, size in zip(axes[0], sizes, strict=False):
            plot_size(ax, size)


def plot_size(ax: Any, size: TokenSize) -> None:
    """One size's final losses against its tokens: every run and each arm's mean per budget."""
    for arm, color in (("sa", "tab:blue"), ("xsa", "tab:orange"), ("null", "tab:gray")):
        done = [[r for r in runs if r.status == "completed"] for runs in (size.runs or {}).get(arm, {}).values()]
        for runs in done:
            ax.plot([r.tokens_seen for r in runs], [r.final_val_loss for r in runs], ".", color=color, alpha=0.4)
        means = sorted((r[0].tokens_seen, statistics.fmean(x.final_val_loss or 0.0 for x in r)) for r in done if r)
        label = f"{arm.upper()} mean" if arm != "null" else "null (SA, other weights) mean"
        if means:
            ax.plot(*zip(*means, strict=True), "o-", color=color, label=label)
    lr = "per budget" if len(size.selected_lrs) > 1 else f"{size.selected_lr:g}"
    ax.set(xscale="log", xlabel="training tokens", ylabel="final validation loss", title=f"{size.model} (LR {lr})")
    ax.legend()


def plot_multipliers(results: TokenStudyResult, path: Path) -> None:
    import matplotlib.ticker

    with saved_figure(path) as ax:
        labels = []
        for i, cell in enumerate(results.cells):
            labels.append(f"{cell['model']}\nXSA at {cell['fraction']:g} B")
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
        ax.set(yscale="log", ylabel="k (tokens SA needs / XSA's tokens)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([0.5, 1, 2, 4])
        ax.set_title("XSA's token multiplier, 95% CI (dotted: SA's measured range)")


def write_report(results: ScaleStudyResult | TokenStudyResult, study_dir: Path) -> str:
    """results.json, report.md and the study's plots in its directory; returns the markdown."""
    if isinstance(results, TokenStudyResult):
        plots = {"loss_vs_tokens.png": lambda path: plot_loss_vs_tokens(results, path)}
        plots["multiplier.png"] = lambda path: plot_multipliers(results, path)
    else:
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

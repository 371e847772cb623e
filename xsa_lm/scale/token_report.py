"""The token-axis study's outputs: results.json, report.md, loss_vs_tokens.png and multiplier.png."""

from dataclasses import dataclass, field
from pathlib import Path

from xsa_lm.files import write_json, write_text
from xsa_lm.records import Record
from xsa_lm.scale.token_axis import STALL_MARGIN, ci_text, k_text


@dataclass(frozen=True, kw_only=True)
class TokenRun(Record):
    """One run at one budget: what its trial record says of it."""

    seed: int
    status: str
    error: str | None = None
    log: str | None = None
    final_val_loss: float | None = None
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
    selected_lr: float | None = None
    warnings: list[str] = field(default_factory=list)
    runs: dict[str, dict[str, list[TokenRun]]] | None = None  # arm -> budget (in B) -> a run per seed
    seeds: list[int] = field(default_factory=list)
    grid: list[float] = field(default_factory=list)
    bench: dict | None = None  # bench_size
    schema: int = 1


@dataclass(frozen=True, kw_only=True)
class TokenStudyResult(Record):
    """A token-axis study's results.json."""

    axis: str = "tokens"
    study_dir: str
    study_id: str
    overrides: list[str]
    plan: dict  # check_token_study
    sizes: list[TokenSize]
    cells: list[dict]  # analyse_tokens: k per (size, XSA budget)
    pooled: dict | None = None
    warnings: list[str] = field(default_factory=list)
    reanalysed: str | None = None  # the day a saved study was analysed again (scale.tokens.reanalyse_tokens)
    schema: int = 1


def _num(value: float | None, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def size_lines(results: TokenStudyResult) -> list[str]:
    plan = results.plan
    lines = [
        "",
        "## Sizes, budgets and the LR",
        "",
        f"B = {plan['tokens_per_param']:g} tokens per non-embedding parameter. SA at {plan['sa_budgets']} x B, XSA at "
        f"{plan['xsa_budgets']} x B, seeds {plan['seeds']} (paired); the LR is the one with the lowest median SA "
        f"loss at B over the search seeds {plan['search_seeds']}, used at every budget and for both arms.",
        "",
        "| model | non-embedding params | B (tokens) | LR grid: median SA loss at B | selected LR |",
        "|---|---:|---:|---|---:|",
    ]
    for size in results.sizes:
        grid = ", ".join(f"{lr}: {_num(loss)}" for lr, loss in size.search.items())
        lr = f"{size.selected_lr:g}" if size.selected_lr is not None else "none"
        lines.append(f"| {size.model} | {size.non_embedding_params:,} | {size.tokens_B:,.0f} | {grid} | {lr} |")
    lines += ["", "| model | arm | budget | final val loss per seed | mean |", "|---|---|---:|---|---:|"]
    for size in results.sizes:
        for arm, budgets in (size.runs or {}).items():
            for fraction, runs in budgets.items():
                losses = [r.final_val_loss for r in runs if r.status == "completed" and r.final_val_loss is not None]
                cells = ", ".join(f"{r.final_val_loss:.4f}" if r.status == "completed" else r.status for r in runs)
                mean = sum(losses) / len(losses) if losses else None
                lines.append(f"| {size.model} | {arm.upper()} | {fraction} B | {cells} | {_num(mean)} |")
    return lines


def per_seed_lines(cells: list[dict]) -> list[str]:
    """Each seed's own k and the stalled seeds per budget: a mean k over seeds where some SA runs stalled is a
    mixture, and these show it (studies analysed before xsa-lm had them lack them)."""
    rows = [c for c in cells if c.get("per_seed_k") is not None]
    if not rows:
        return []
    lines = [
        "",
        f"Per seed: k from that seed's own SA curve, and the seeds whose final loss lies more than {STALL_MARGIN:g} "
        "nats above the median of their arm and budget (stalled).",
        "",
        "| model | XSA budget | seeds | k per seed | SA stalled per budget | XSA stalled |",
        "|---|---:|---|---|---|---:|",
    ]
    for c in rows:
        stalls = ", ".join(
            f"{n} at {b / c['budget'] * c['fraction']:.3g} B"
            for n, b in zip(c["sa_stalled"], c["sa_budgets"], strict=True)
        )
        lines.append(
            f"| {c['model']} | {c['fraction']:g} B | {', '.join(map(str, c['paired_seeds']))} | "
            f"{', '.join(c['per_seed_k'])} | {stalls} | {c['xsa_stalled']} |"
        )
    return lines


def multiplier_lines(results: TokenStudyResult) -> list[str]:
    lines = [
        "",
        "## XSA's multiplier along the token axis",
        "",
        "k = the tokens SA needs to reach XSA's mean loss (SA's mean losses interpolated linearly in ln tokens between "
        "the budgets that bracket it) / XSA's tokens. 95% CI: Fieller's interval for that crossing (test inversion "
        "over the paired per-seed values); an end at SA's range is a bound (<= or >=), never an extrapolation. "
        "Bootstrap: seeds resampled within the cell, a check of the interval. Wall-clock k: k over XSA's step-time "
        "ratio from `xsa-lm bench` at that size (ends combined conservatively).",
        "",
        "| model | XSA budget | seeds | SA means (per budget) | XSA mean | k | 95% CI | bootstrap CI | wall-clock k |",
        "|---|---:|---:|---|---:|---:|---|---|---|",
    ]
    for cell in results.cells:
        boot = cell.get("bootstrap_ci95")
        boot_text = f"[{boot[0]:.3f}, {boot[1]:.3f}]" if boot else "-"
        wall = cell.get("wallclock_k")
        wall_text = "-"
        if wall is not None:
            lo, hi = cell["wallclock_ci"]
            wall_text = f"{wall:.3f} [{_num(lo, 3) if lo else 'unbounded'}, {_num(hi, 3) if hi else 'unbounded'}]"
        lines.append(
            f"| {cell['model']} | {cell['fraction']:g} B | {cell['seeds']} | "
            f"{', '.join(f'{m:.4f}' for m in cell['sa_means'])} | {cell['xsa_mean']:.4f} | {k_text(cell)} | "
            f"{ci_text(cell)} | {boot_text} | {wall_text} |"
        )
    lines += per_seed_lines(results.cells)
    pooled = results.pooled
    if pooled:
        q_p = pooled["q_p_value"]
        lines += [
            "",
            f"Pooled over {pooled['cells']} cell(s) with a point estimate (inverse variance on ln k, Student's t on "
            f"the fewest seeds; "
            f"{pooled['left_out']} bound(s) left out): **k = {pooled['k']:.3f}, 95% CI "
            f"[{pooled['ci95'][0]:.3f}, {pooled['ci95'][1]:.3f}]**. "
            f"Heterogeneity: Cochran's Q = {pooled['cochran_q']:.2f} on {pooled['q_dof']} dof"
            + (f" (p = {q_p:.3g}), I^2 = {pooled['i2']:.0%}" if q_p is not None else "")
            + ". The two budgets of one size share SA's runs, so the cells are not independent and the pooled "
            "interval is narrower than it should be: read the per-cell intervals first.",
        ]
    return lines


def _p(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "-"


def same_budget_lines(results: TokenStudyResult) -> list[str]:
    """XSA - SA at each XSA budget SA also trained at, with the paired tests (results of earlier releases lack it)."""
    cells = [c for c in results.cells if c.get("same_budget")]
    if not cells:
        return []
    lines = [
        "",
        "## XSA vs SA at the same budget",
        "",
        "Paired over seeds: Student's paired t, the exact Wilcoxon signed-rank and exact sign tests (two-sided).",
        "",
        "| model | budget | seeds | XSA - SA | 95% CI (t) | t p | Wilcoxon p | sign p | XSA lower |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for cell in cells:
        t = cell["same_budget"]
        ci = f"[{t['t_ci95'][0]:+.4f}, {t['t_ci95'][1]:+.4f}]" if t["t_ci95"] else "-"
        lines.append(
            f"| {cell['model']} | {cell['fraction']:g} B | {t['pairs']} | {t['mean_diff']:+.4f} | {ci} | "
            f"{_p(t['t_p'])} | {_p(t['wilcoxon_p'])} | {_p(t['sign_p'])} | {t['xsa_lower']}/{t['pairs']} |"
        )
    return lines


def render_markdown(results: TokenStudyResult) -> str:
    lines = [
        "# SA vs XSA along the token axis: XSA's multiplier at fixed model size",
        "",
        f"- study directory: `{results.study_dir}` (W&B group `{results.study_id}`)",
        f"- overrides: `{' '.join(results.overrides) or '(defaults)'}`",
    ]
    if results.reanalysed:
        lines.append(f"- re-analysed on {results.reanalysed} from the saved runs with the current analysis")
    if results.warnings:
        lines += ["", "## Warnings", ""] + [f"- **{w}**" for w in results.warnings]
    lines += size_lines(results) + multiplier_lines(results) + same_budget_lines(results)
    lines += ["", "![loss vs tokens](loss_vs_tokens.png)", "", "![multiplier](multiplier.png)", ""]
    return "\n".join(lines)


def plot_loss_vs_tokens(results: TokenStudyResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s for s in results.sizes if s.runs is not None]
    fig, axes = plt.subplots(1, max(1, len(sizes)), figsize=(5 * max(1, len(sizes)), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=False):
        for arm, color in (("sa", "tab:blue"), ("xsa", "tab:orange")):
            points = []
            for runs in (size.runs or {})[arm].values():
                done = [r for r in runs if r.status == "completed"]
                ax.plot([r.tokens_seen for r in done], [r.final_val_loss for r in done], ".", color=color, alpha=0.4)
                if done:
                    mean = sum(r.final_val_loss or 0.0 for r in done) / len(done)
                    points.append((done[0].tokens_seen, mean))
            if points:
                ax.plot(*zip(*sorted(points), strict=True), "o-", color=color, label=f"{arm.upper()} mean")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{size.model} (LR {size.selected_lr:g})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_multipliers(results: TokenStudyResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = []
    for i, cell in enumerate(results.cells):
        labels.append(f"{cell['model']}\nXSA at {cell['fraction']:g} B")
        lo_edge, hi_edge = min(cell["sa_budgets"]) / cell["budget"], max(cell["sa_budgets"]) / cell["budget"]
        lo, hi = cell["ci95"]
        lo, hi = lo if lo is not None else lo_edge, hi if hi is not None else hi_edge
        ax.plot([i, i], [lo, hi], "-", color="tab:orange", linewidth=3, alpha=0.6)
        ax.plot([i - 0.2, i + 0.2], [lo_edge, lo_edge], ":", color="gray")
        ax.plot([i - 0.2, i + 0.2], [hi_edge, hi_edge], ":", color="gray")
        if cell["k"] is not None:
            ax.plot(i, cell["k"], "o", color="tab:orange")
        else:
            ax.annotate(cell["bound"], (i, hi if ">" in (cell["bound"] or "") else lo), ha="center")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks([0.5, 1, 2, 4])
    ax.set_ylabel("k (tokens SA needs / XSA's tokens)")
    ax.set_title("XSA's token multiplier, 95% CI (dotted: SA's measured range)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: TokenStudyResult, study_dir: Path) -> str:
    write_json(study_dir / "results.json", results.to_json())
    plot_loss_vs_tokens(results, study_dir / "loss_vs_tokens.png")
    plot_multipliers(results, study_dir / "multiplier.png")
    markdown = render_markdown(results)
    write_text(study_dir / "report.md", markdown)
    return markdown

"""The sweep's outputs: results.json (the SweepResult record), report.md (rendered from that record), the plots, and a
W&B report run in the sweep's group. The statistics decide (records with their verdict fields); the renderer only
words the decision."""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from xsa_lm.records import Record
from xsa_lm.reporting import (
    PAIRED_ALIGN,
    PAIRED_HEADER,
    ReportRunSettings,
    interval,
    log_report_run,
    markdown_table,
    num,
    paired_cells,
    render_lines,
    saved_figure,
    section,
    warning_lines,
    write_report_files,
)
from xsa_lm.stats.decision import ClusteredTest, MarginVerdict, NullRates, margin_verdict, null_rates, null_study_sizes
from xsa_lm.stats.paired import ALPHA, POWER, PairedStats, min_detectable_difference, paired_stats
from xsa_lm.stats.positions import PositionDifferences, position_differences
from xsa_lm.sweep.protocol import NULL, Comparison, Selection, SequentialSummary, mean_std
from xsa_lm.sweep.stalls import StallRule, StallStudy, stall_study
from xsa_lm.sweep.trials import TrialRecord


def ci_text(ci: Sequence[float] | None) -> str:
    return interval(ci, none="(none below two pairs)")


def arms_by_seed(trials: Sequence[TrialRecord], *phases: str) -> dict[int, dict[str, TrialRecord]]:
    """The trials of `phases` by seed, ascending, then by arm (attention)."""
    by_seed: dict[int, dict[str, TrialRecord]] = {}
    for trial in sorted((t for t in trials if t.phase in phases), key=lambda t: t.seed):
        by_seed.setdefault(trial.seed, {})[trial.attention] = trial
    return by_seed


def completed_pairs(trials: Sequence[TrialRecord], arm: str = "xsa") -> list[tuple[TrialRecord, TrialRecord]]:
    """(SA, XSA) compare trials of each seed where both finished, by seed; (SA, null) with arm=NULL."""
    by_seed = arms_by_seed(trials, "compare", NULL).values()
    both = [t for t in by_seed if all(a in t and t[a].status == "completed" for a in ("sa", arm))]
    return [(t["sa"], t[arm]) for t in both]


def comparison_of(trials: Sequence[TrialRecord], arm: str = "xsa") -> Comparison:
    """Seeds where both SA and XSA (or `arm`) finished at the shared LR (a diverged or failed side drops the pair,
    and dropped_seeds says so)."""
    pairs = completed_pairs(trials, arm)
    return Comparison(
        seeds=[sa.seed for sa, _ in pairs],
        sa=[cast(float, sa.final_val_loss) for sa, _ in pairs],  # a completed run has its loss
        xsa=[cast(float, other.final_val_loss) for _, other in pairs],
    )


@dataclass(frozen=True, kw_only=True)
class BpbStats(PairedStats):
    """Each arm's mean bits per byte and the paired tests of XSA - SA on them."""

    sa_mean: float
    xsa_mean: float


def bpb_stats(sa: list[float], xsa: list[float]) -> BpbStats:
    return BpbStats(sa_mean=statistics.fmean(sa), xsa_mean=statistics.fmean(xsa), **vars(paired_stats(sa, xsa)))


def bits_per_byte(pairs: list[tuple[TrialRecord, TrialRecord]]) -> BpbStats | None:
    """The final validation loss in bits per byte (tokenizer-independent) of each arm, and the paired tests of XSA -
    SA on it; None without it on every run."""
    if not pairs or any(t.final_val_bpb is None for pair in pairs for t in pair):
        return None
    sa, xsa = ([cast(float, t.final_val_bpb) for t in arm] for arm in zip(*pairs, strict=True))
    return bpb_stats(sa, xsa)


@dataclass(frozen=True, kw_only=True)
class NullComparison(PairedStats):
    """The A/A null against SA: per seed, the paired tests, the margin verdict and the false-positive rates."""

    seeds: list[int]
    sa: list[float]
    null: list[float]
    diff: list[float]
    margin: MarginVerdict | None
    rates: list[NullRates]


def null_comparison(trials: Sequence[TrialRecord], margin: float | None) -> NullComparison | None:
    """The A/A null (sweep.null_arm) analysed as XSA is, with how often studies of its pairs claim an effect."""
    pairs = comparison_of(trials, arm=NULL)
    if not pairs.seeds:
        return None
    diffs, sizes = pairs.diffs, null_study_sizes(len(pairs.diffs)) if margin is not None else []
    return NullComparison(
        **vars(paired_stats(pairs.sa, pairs.xsa)),
        seeds=pairs.seeds,
        sa=pairs.sa,
        null=pairs.xsa,  # the null arm's losses
        diff=diffs,
        margin=margin_verdict(diffs, margin) if margin is not None else None,
        rates=[r for size in sizes if (r := null_rates(diffs, size, cast(float, margin)))],
    )


def dropped_seeds(trials: Sequence[TrialRecord]) -> list[dict]:
    """The compare seeds left out of the statistics, each with what happened to which side."""
    dropped = []
    for seed, arms in arms_by_seed(trials, "compare").items():
        sides = {a: arms[a].status if a in arms else "missing" for a in ("sa", "xsa")}
        if any(status != "completed" for status in sides.values()):
            dropped.append({"seed": seed, **sides})
    return dropped


def dropped_warning(drop: dict) -> str:
    what = {"diverged": "diverged", "failed": "failed", "missing": "did not run"}
    sides = [f"{a.upper()} {what.get(drop[a], 'did not finish')}" for a in ("sa", "xsa") if drop[a] != "completed"]
    warning = f"seed {drop['seed']} is left out of the mean, the confidence interval and the count of seeds where XSA "
    warning += f"is lower: {' and '.join(sides)}"
    if "diverged" in (drop["sa"], drop["xsa"]):
        warning += "; a divergence at the shared LR is a result in itself, not noise: weigh it beside the verdict"
    if any(drop[a] not in ("completed", "diverged") for a in ("sa", "xsa")):
        warning += "; run the same sweep command again to retry it"
    return warning


@dataclass(frozen=True, kw_only=True)
class XsaTuning(Record):
    """sweep.tune_xsa: XSA's own best LR and loss, and its loss at the LR selected on SA."""

    selected_lr: float | None
    loss_at_own_lr: float | None
    loss_at_shared_lr: float | None


# What the paired t interval of XSA - SA says (ComparisonStats.significance).
SIGNIFICANCE = ("no pairs", "one seed", "no spread", "xsa lower", "xsa higher", "not significant")
RESULTS_NAMES = {  # PairedStats' field -> its name in results.json's comparison
    "mean_diff": "diff_mean",
    "sd_diff": "diff_std",
    "t": "diff_t",
    "t_p": "diff_p_value",
    "t_ci95": "diff_ci95",
    "wilcoxon_p": "wilcoxon_p_value",
    "sign_p": "sign_test_p_value",
    "xsa_lower": "xsa_better_in",
}


@dataclass(frozen=True, kw_only=True)
class ComparisonStats(Record):
    """The comparison of results.json: each arm's mean and std over seeds, and the paired tests (paired_stats) under
    the key names results.json has always had (docs/sweep.md)."""

    seeds: list[int]
    sa: list[float]
    xsa: list[float]
    diff: list[float]
    sa_mean: float | None = None
    sa_std: float | None = None
    xsa_mean: float | None = None
    xsa_std: float | None = None
    diff_mean: float | None = None
    diff_std: float | None = None
    diff_ci95: tuple[float, float] | None = None
    xsa_better_in: int = 0
    wilcoxon_p_value: float | None = None
    sign_test_p_value: float | None = None
    diff_t: float | None = None
    diff_p_value: float | None = None
    dof: int | None = None
    min_detectable_diff: float | None = None
    power: float = POWER
    alpha: float = ALPHA
    dropped_seeds: list[dict] = field(default_factory=list)  # seed, and the status of sa and xsa
    margin: MarginVerdict | None = None  # against sweep.margin

    @classmethod
    def of(cls, comparison: Comparison, dropped: list[dict], margin: float | None) -> "ComparisonStats":
        (sa_mean, sa_std), (xsa_mean, xsa_std) = mean_std(comparison.sa), mean_std(comparison.xsa)
        paired = paired_stats(comparison.sa, comparison.xsa)
        return cls(
            **{name: getattr(paired, key) for key, name in RESULTS_NAMES.items()},
            seeds=comparison.seeds,
            sa=comparison.sa,
            xsa=comparison.xsa,
            diff=comparison.diffs,
            sa_mean=sa_mean,
            sa_std=sa_std,
            xsa_mean=xsa_mean,
            xsa_std=xsa_std,
            dof=paired.pairs - 1 if paired.pairs > 1 else None,
            min_detectable_diff=min_detectable_difference(paired.sd_diff, paired.pairs),
            dropped_seeds=dropped,
            margin=margin_verdict(comparison.diffs, margin) if margin is not None else None,
        )

    @property
    def paired(self) -> PairedStats:
        return PairedStats(pairs=len(self.seeds), **{key: getattr(self, name) for key, name in RESULTS_NAMES.items()})

    @property
    def significance(self) -> str:
        """What the paired 95% t interval says at the 5% level: one of SIGNIFICANCE."""
        if not self.seeds:
            return "no pairs"
        if self.diff_ci95 is None:
            return "one seed" if len(self.seeds) == 1 else "no spread"
        low, high = self.diff_ci95
        return "xsa lower" if high < 0 else "xsa higher" if low > 0 else "not significant"


@dataclass(frozen=True, kw_only=True)
class SearchPoint(Record):
    """One LR of the search for one arm: the median final loss over the search seeds and each run."""

    lr: float
    median: float | None
    runs: list[TrialRecord]


@dataclass(frozen=True, kw_only=True)
class SweepResult(Record):
    """A sweep's results.json (build_results makes it, `xsa-lm scale` reads it)."""

    sweep_dir: str
    sweep_id: str
    train_overrides: list[str]
    grid: list[float]
    seeds: list[int]
    search_seeds: list[int]
    reuse_search_run: bool = False
    selected_lr: float | None
    warnings: list[str] = field(default_factory=list)
    search: dict[str, dict[str, SearchPoint]] = field(default_factory=dict)  # arm -> LR (as "g") -> its point
    comparison: ComparisonStats
    compare_table: list[dict] = field(default_factory=list)  # per seed: sa, xsa, diff as the report prints them
    xsa_tuning: XsaTuning | None = None
    sequential: SequentialSummary | None = None
    stalls: StallStudy | None = None
    trials: list[TrialRecord] = field(default_factory=list)
    eval: dict | None = None  # xsa-lm eval of the compare runs (sweep.eval_tasks)
    eval_error: str | None = None  # why that evaluation failed
    bpb: BpbStats | None = None  # bits_per_byte of the compare runs
    positions: PositionDifferences | None = None  # XSA - SA per span of window positions
    null: NullComparison | None = None  # the A/A null of sweep.null_arm
    schema: int = 1


def compare_table(trials: Sequence[TrialRecord], seeds: list[int]) -> list[dict]:
    """A row per compare seed that ran: each side's final val loss (or its status) and XSA - SA."""
    rows, by_seed = [], arms_by_seed(trials, "compare")
    for seed in (s for s in seeds if s in by_seed):
        pair = by_seed[seed]
        cell = {a: num(t.final_val_loss) if t.status == "completed" else t.status for a, t in pair.items()}
        both = len(pair) == 2 and all(t.status == "completed" for t in pair.values())
        losses = [cast(float, pair[a].final_val_loss) for a in ("sa", "xsa")] if both else []
        diff = f"{losses[1] - losses[0]:+.4f}" if both else "-"
        rows.append({"seed": seed, "sa": cell.get("sa", "-"), "xsa": cell.get("xsa", "-"), "diff": diff})
    return rows


def build_results(
    sweep_dir: Path,
    *,
    sweep_id: str,
    grid: list[float],
    seeds: list[int],
    train_overrides: list[str],
    trials: list[TrialRecord],
    selection: Selection,
    xsa_selection: Selection | None,
    search_seeds: Sequence[int] = (0,),
    sequential: SequentialSummary | None = None,
    stall_rule: StallRule | None = None,
    margin: float | None = None,
) -> SweepResult:
    """Everything the report shows, from the trial records of every phase; the stall table needs two search seeds."""
    search: dict[str, dict[str, SearchPoint]] = {}
    medians = {"sa": selection.losses, "xsa": xsa_selection.losses if xsa_selection else {}}
    searched = [t for t in trials if t.phase == "search"]
    for arm, lr in dict.fromkeys((t.attention, t.lr) for t in searched):
        runs = [t for t in searched if (t.attention, t.lr) == (arm, lr)]
        search.setdefault(arm, {})[f"{lr:g}"] = SearchPoint(lr=lr, median=medians[arm].get(lr), runs=runs)
    tuning = None
    if xsa_selection is not None:
        shared = search.get("xsa", {}).get(f"{selection.lr:g}") if selection.lr is not None else None
        own = xsa_selection.losses.get(xsa_selection.lr) if xsa_selection.lr is not None else None
        tuning = XsaTuning(
            selected_lr=xsa_selection.lr, loss_at_own_lr=own, loss_at_shared_lr=shared.median if shared else None
        )
    warnings = selection.warnings + [f"XSA search: {w}" for w in (xsa_selection.warnings if xsa_selection else [])]
    shared_seeds = [s for s in seeds if s in search_seeds]  # allowed only with sweep.reuse_search_run=true
    if reused := selection.lr is not None and bool(shared_seeds):
        warnings.append(
            f"the comparison at seed(s) {shared_seeds} reuses the search's winning SA runs "
            "(sweep.reuse_search_run=true), selected partly for their luck while XSA's were not: it is biased against "
            f"XSA; for an unbiased one use compare seeds without {shared_seeds} (sweep.seeds)"
        )
    dropped, pairs = dropped_seeds(trials), completed_pairs(trials)
    warnings += [dropped_warning(drop) for drop in dropped]
    stalls = stall_rule is not None and len(search_seeds) >= 2
    return SweepResult(
        sweep_dir=str(sweep_dir),
        sweep_id=sweep_id,
        train_overrides=train_overrides,
        grid=grid,
        seeds=seeds,
        search_seeds=list(search_seeds),
        reuse_search_run=reused,
        selected_lr=selection.lr,
        warnings=warnings,
        search=search,
        comparison=ComparisonStats.of(comparison_of(trials), dropped, margin),
        compare_table=compare_table(trials, seeds),
        bpb=bits_per_byte(pairs),
        null=null_comparison(trials, margin),
        positions=position_differences(
            [sa.final_val_loss_by_position for sa, _ in pairs], [xsa.final_val_loss_by_position for _, xsa in pairs]
        ),
        xsa_tuning=tuning,
        sequential=sequential,
        stalls=stall_study(searched, stall_rule) if stall_rule is not None and stalls else None,
        trials=trials,
    )


# --- report.md ------------------------------------------------------------------------------------------------

MEANING = {  # ComparisonStats.significance in words
    "xsa lower": "the interval excludes 0: XSA's lower loss is significant at the 5% level",
    "xsa higher": "the interval excludes 0: XSA's higher loss is significant at the 5% level",
    "not significant": "the interval includes 0: the difference is not significant at the 5% level",
    "one seed": "one seed gives no confidence interval: add seeds (sweep.seeds) for a significance statement",
    "no spread": "the differences are all equal: no spread, so Student's t gives no interval",
}
STOPPED = {
    "significant": "the corrected CI excludes 0",
    "cap": "the cap was reached without the corrected CI excluding 0",
    "incomplete": "a compare run did not finish; run the same sweep command again to continue",
}


def header_lines(results: SweepResult) -> list[str]:
    """The title, what the sweep ran, and its warnings."""
    return [
        "# SA vs XSA: LR search on SA, comparison at the shared LR",
        "",
        f"- sweep directory: `{results.sweep_dir}` (W&B group `{results.sweep_id}`)",
        f"- training overrides: `{' '.join(results.train_overrides) or '(defaults)'}`",
        f"- LR grid: {', '.join(f'{lr:g}' for lr in results.grid)}; search seeds {results.search_seeds} (each "
        f"LR scored by the median final loss over them), compare seeds {results.seeds or 'none (search only)'}",
        *warning_lines(results.warnings),
    ]


def search_lines(results: SweepResult) -> list[str]:
    """Section 1: each LR's median final val loss over the search seeds and every run's, the selected LR marked."""
    attentions = ["sa", "xsa"] if results.xsa_tuning else ["sa"]
    rows = []
    for lr in results.grid:
        cells = [f"{lr:g}" + (" **(selected)**" if lr == results.selected_lr else "")]
        for attention in attentions:
            point = results.search.get(attention, {}).get(f"{lr:g}")
            per_seed = (
                [num(r.final_val_loss) if r.status == "completed" else r.status for r in point.runs] if point else []
            )
            cells += [num(point.median if point else None), ", ".join(per_seed) or "missing"]
        rows.append(cells)
    header = ["LR"] + [f"{a.upper()} {what}" for a in attentions for what in ("median", "per seed")]
    lines = section(f"## 1. LR search (seeds {', '.join(map(str, results.search_seeds))}, final validation loss)")
    lines += markdown_table(header, rows, align="r" + "rl" * len(attentions))
    return lines + (stall_lines(results.stalls) if results.stalls else [])


def clustered_line(test: ClusteredTest, shares: str = "its initialisation and data order") -> str:
    """The test by seed (a seed's pairs share `shares`, so they are one observation)."""
    floor = (
        f"; with {test.clusters} seeds no p can be below {2 / 2**test.clusters:.3g}" if 0 < test.clusters < 11 else ""
    )
    return (
        f"By seed (each seed's pairs share {shares}, so they are one observation): XSA's mean difference is lower "
        f"in {test.xsa_lower} of {test.clusters} seeds, sign-flip permutation p = {num(test.sign_flip_p, '.3g')}"
        f"{floor}."
    )


def stall_lines(study: StallStudy) -> list[str]:
    """The stall section: the rule, the table per LR and arm, the stratified test, the paired final losses."""
    return render_lines("stalls.md.j2", study=study)


def compare_lines(results: SweepResult) -> list[str]:
    """Section 2: SA vs XSA per seed at the shared LR, the paired tests, the verdict and the sequential rule."""
    lines = section("## 2. SA vs XSA at the shared LR")
    if results.selected_lr is None:
        return lines + ["Not run: the search selected no LR (see the warnings)."]
    if not results.seeds:
        return lines + ["Not run: a search-only sweep (sweep.seeds=[]); the search's grid is the study."]
    compare, search_seeds = results.comparison, ", ".join(map(str, results.search_seeds))
    design = f"The compare runs use seeds disjoint from the search's (seeds {search_seeds}): none won the search."
    if results.reuse_search_run:
        design = "It reuses the search's winning SA run: the comparison is biased against XSA (see the warnings)."
    lines += [f"LR {results.selected_lr:g}, selected on SA and reused unchanged for XSA. {design}", ""]
    rows = [[row["seed"], row["sa"], row["xsa"], row["diff"]] for row in results.compare_table]
    if compare.seeds:
        rows.append(["mean ± std"] + [mean_std_cell(compare, name) for name in ("sa", "xsa", "diff")])
    lines += markdown_table(["seed", "SA val loss", "XSA val loss", "XSA - SA"], rows, align="rrrr")
    lines += verdict_lines(results)
    lines += sequential_lines(results.sequential) if results.sequential else []
    lines += null_lines(results.null) if results.null else []
    return lines + position_lines(results.positions)


def mean_std_cell(compare: ComparisonStats, name: str) -> str:
    """A table cell: mean ± std over seeds; the mean alone below two seeds (signed for the difference)."""
    mean, std = getattr(compare, f"{name}_mean"), getattr(compare, f"{name}_std")
    return f"{mean:.4f} ± {std:.4f}" if std is not None else format(mean, "+.4f" if name == "diff" else ".4f")


def verdict_lines(results: SweepResult) -> list[str]:
    """The paired tests of XSA - SA (and of the null and in bits per byte), what the interval decides, the verdict
    against the plan's margin and the smallest difference the study could detect."""
    stats, null, bpb, sequential = results.comparison, results.null, results.bpb, results.sequential is not None
    n, dropped = len(stats.seeds), len(stats.dropped_seeds)
    left_out = f" ({dropped} seed(s) left out: see the warnings)" if dropped else ""
    if not n:
        return ["", f"No seed has both an SA and an XSA result: nothing to compare{left_out}."]
    rows = [["XSA - SA", num(stats.sa_mean), num(stats.xsa_mean), *paired_cells(stats.paired)]]
    rows[0].append(stats.margin.verdict if stats.margin else "-")
    if null:
        rows.append(
            ["null - SA", num(statistics.fmean(null.sa)), num(statistics.fmean(null.null)), *paired_cells(null)]
        )
        rows[-1].append(null.margin.verdict if null.margin else "-")
    if bpb:
        rows.append(["In bits per byte: XSA - SA", num(bpb.sa_mean), num(bpb.xsa_mean), *paired_cells(bpb), "-"])
    header = ["", "SA mean", "arm mean", *PAIRED_HEADER, "verdict"]
    lines = ["", *markdown_table(header, rows, align="lrr" + PAIRED_ALIGN + "l"), ""]
    meaning = MEANING[stats.significance]
    if sequential and stats.diff_ci95:  # seeds added until significant: the plain 5% level no longer holds
        meaning += " if no seeds had been added on sight of the results; the sequential rule below decides"
    text = f"XSA is lower in {stats.xsa_better_in} of {n} seed(s){left_out}. Student's t, 95% CI"
    text += f" ({n - 1} dof, p = {stats.diff_p_value:.3g}): " if stats.diff_p_value is not None else ": "
    text += meaning + "."
    if margin := stats.margin:
        caveat = " (its level assumes no seeds were added on sight of the results)" if sequential else ""
        text += f" Verdict against the plan's margin of {margin.margin:g} nats: **{margin.verdict}**{caveat}: "
        text += f"{margin.why}."
    if n >= 2:
        text += (
            f" With {n} seeds this study could detect differences larger than {num(stats.min_detectable_diff)} "
            f"({stats.power:.0%} power, two-sided {stats.alpha:.0%} level"
            + ("; the closed form is optimistic below 4 seeds" if n < 4 else "")
            + "): a smaller true difference may well come out not significant."
        )
    if bpb:
        text += " Bits per byte: the loss over the UTF-8 bytes its tokens stand for, comparable across tokenizers."
    return lines + [text]


def sequential_lines(sequential: SequentialSummary) -> list[str]:
    """The stopping rule of sweep.seeds_until_significant, its correction, each look and why it stopped."""
    s, per_look = sequential, sequential.alpha_per_look
    lines = section(
        "### Sequential stopping (sweep.seeds_until_significant)",
        f"Rule: {s.rule}. Each look uses a Bonferroni-corrected level: {s.alpha:.0%} / {s.planned_looks} planned "
        f"looks = {per_look:.4g}, a {1 - per_look:.2%} CI (Student's t), so the chance that any look declares a "
        f"difference where there is none stays at most {s.alpha:.0%}.",
    )
    if not s.looks:
        return lines + [f"No look yet: {STOPPED[s.stopped]}."]
    looks = [
        [i, look.seeds, look.pairs, num(look.mean, "+.4f"), ci_text(look.ci), num(look.p_value, ".3g")]
        for i, look in enumerate(s.looks, start=1)
    ]
    lines += markdown_table(["look", "seeds", "pairs", "mean XSA - SA", "corrected CI", "p"], looks, align="rrrrrr")
    p = f", p = {s.p_value:.3g} against {per_look:.4g}." if s.p_value is not None else "."
    return lines + [
        "",
        f"Stopped after {s.n_looks} of at most {s.planned_looks} looks, at {s.seeds} seeds: {STOPPED[s.stopped]}. "
        f"Corrected CI {ci_text(s.ci)}{p}",
    ]


def null_lines(null: NullComparison) -> list[str]:
    """The A/A null beside the comparison: what the same analysis claims when there is no effect."""
    lines = section(
        "### The null: SA against SA (sweep.null_arm)",
        "SA again at each compare seed from other initial weights (the same data order), its row above: there is no "
        "effect, so a verdict of better or worse, or an interval that excludes 0, is a false positive.",
    )
    if not null.rates:
        return lines[:-1]
    lines += [
        f"How often studies of these {null.rates[0].pairs} null pairs claim an effect, by study size: over every "
        "study of that size (they overlap: jackknife 95% CI over pairs), and over disjoint studies (exact binomial "
        f"95% CI). A normal noise makes the t interval exclude 0 in 5%; the verdict claims better or worse than "
        f"the {null.rates[0].margin:g}-nat margin.",
        "",
    ]
    rows = [
        [r.study_size, f"{r.ci_excludes_0:.1%} {interval(r.ci_excludes_0_ci95, '.1%')}"]
        + [f"{r.verdict_claims_effect:.1%} {interval(r.verdict_claims_effect_ci95, '.1%')}"]
        + [f"{r.disjoint_claims} of {r.disjoint_studies} {interval(r.disjoint_claims_ci95, '.1%')}"]
        for r in null.rates
    ]
    header = ["study size", "t CI excludes 0", "verdict claims an effect", "disjoint studies claiming"]
    return lines + markdown_table(header, rows, align="rlll")


def position_lines(
    positions: PositionDifferences | None,
    heading: str = "### XSA - SA along the window (does the gain grow with context?)",
) -> list[str]:
    """XSA - SA per span of window positions and the trend across spans (xsa_lm.stats.positions)."""
    if not positions:
        return []
    lines = section(
        heading,
        "The validation loss per equal span of window positions (`val_position_buckets`, earliest first), paired "
        f"over {positions.seeds} seed(s).",
    )
    rows = [[f"{i} of {positions.spans}", *paired_cells(s)] for i, s in enumerate(positions.per_span, start=1)]
    lines += markdown_table(["span", *PAIRED_HEADER], rows, align="r" + PAIRED_ALIGN)
    if positions.slope_mean is None:
        return lines
    return lines + [
        "",
        f"Trend: XSA - SA changes by {positions.slope_mean:+.5f} nats per span, the mean of one slope per seed (95% "
        f"CI {interval(positions.slope_ci95, '+.5f')}, t p = {num(positions.slope_t_p, '.3g')}); negative: XSA's "
        "gain grows later in the window.",
    ]


def tuning_lines(results: SweepResult) -> list[str]:
    """Section 3 (sweep.tune_xsa): XSA at its own best LR against XSA at the LR selected on SA."""
    if not (tuning := results.xsa_tuning):
        return []
    lines = section("## 3. XSA at its own best LR (sweep.tune_xsa)")
    if tuning.selected_lr is None:
        return lines + ["No usable XSA search run."]
    if tuning.selected_lr == results.selected_lr:
        meaning = "sharing the SA-tuned LR costs XSA nothing here"
    else:
        meaning = "the shared LR is not XSA's optimum: the paper's protocol is conservative for XSA here"
    return lines + [
        f"XSA's own best LR is {tuning.selected_lr:g} (median val loss {num(tuning.loss_at_own_lr)}, seeds "
        f"{results.search_seeds}); at the SA-tuned LR {results.selected_lr or float('nan'):g} XSA reaches "
        f"{num(tuning.loss_at_shared_lr)}: {meaning}."
    ]


def render_markdown(results: SweepResult) -> str:
    """report.md of a sweep's results."""
    lines = header_lines(results) + search_lines(results) + compare_lines(results) + tuning_lines(results)
    if results.eval:
        from xsa_lm.eval.run import EvalResult, render

        lines += section("## 4. Downstream evaluation (lm-evaluation-harness, zero-shot)") + [
            render(EvalResult.from_json(results.eval, source="eval/eval.json"))
        ]
    lines += ["", "![LR sweep](lr_sweep.png)", "", "![Validation curves](curves.png)", ""]
    if results.positions:
        lines += ["![XSA - SA along the window](positions.png)", ""]
    return "\n".join(lines)


# --- the plots, the files and the W&B run ---------------------------------------------------------------------


def plot_lr_sweep(results: SweepResult, path: Path) -> None:
    with saved_figure(path) as ax:
        for attention, color in (("sa", "tab:blue"), ("xsa", "tab:orange")):
            points = results.search.get(attention, {}).values()
            medians = sorted((p.lr, p.median) for p in points if p.median is not None)
            if medians:
                ax.plot(*zip(*medians, strict=True), "-", color=color, label=f"{attention.upper()} median")
            runs = [r for p in points for r in p.runs]
            ok = [(r.lr, r.final_val_loss) for r in runs if r.status == "completed"]
            if ok:
                ax.plot(*zip(*ok, strict=True), "o", color=color, alpha=0.6, markersize=4)
            bad = [r.lr for r in runs if r.status != "completed"]
            if bad:
                top = max((loss or 0 for _, loss in ok), default=1.0)
                label = f"{attention.upper()} diverged/failed"
                ax.plot(bad, [top] * len(bad), "x", color=color, markersize=10, label=label)
        if results.selected_lr is not None:
            ax.axvline(results.selected_lr, color="gray", linestyle="--", label=f"selected {results.selected_lr:g}")
        ax.set(xscale="log", xlabel="learning rate", ylabel="final validation loss")
        ax.set_title(f"LR search (seeds {', '.join(map(str, results.search_seeds))}: each run and the median)")
        ax.legend()


def plot_curves(trials: Sequence[TrialRecord], path: Path, selected_lr: float | None = None) -> None:
    """The validation curves of the compare runs; of a search-only sweep, the search runs at the selected LR."""
    styles = ["-", "--", ":", "-."]
    search_only = not any(t.phase == "compare" for t in trials)
    with saved_figure(path) as ax:
        for trial in trials:
            shown = trial.phase == "compare" or (search_only and trial.lr == selected_lr)
            if not shown or not trial.val_history:
                continue
            color = "tab:blue" if trial.attention == "sa" else "tab:orange"
            tokens, losses = [h["tokens"] for h in trial.val_history], [h["val_loss"] for h in trial.val_history]
            style = styles[trial.seed % 4]
            label = f"{trial.attention.upper()} seed {trial.seed}"
            ax.plot(tokens, losses, style, color=color, marker="o", markersize=3, label=label)
        ax.set(xlabel="tokens", ylabel="validation loss")
        ax.set_title(
            "SA vs XSA at the shared LR" + (f" ({selected_lr:g}, search runs)" if search_only and selected_lr else "")
        )
        if ax.lines:
            ax.legend()


def plot_positions(positions: PositionDifferences, path: Path) -> None:
    """XSA - SA per span of window positions: the mean over seeds with its 95% interval, and each seed."""
    spans = list(range(1, positions.spans + 1))
    means = [s.mean_diff or 0.0 for s in positions.per_span]
    cis = [s.t_ci95 or (m, m) for s, m in zip(positions.per_span, means, strict=True)]
    with saved_figure(path) as ax:
        ax.fill_between(spans, [c[0] for c in cis], [c[1] for c in cis], color="tab:orange", alpha=0.25, label="95% CI")
        ax.plot(spans, means, "o-", color="tab:orange", label="mean over seeds")
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set(xlabel="span of window positions (earliest first)", ylabel="XSA - SA val loss (nats)")
        ax.legend()


def write_report(results: SweepResult, sweep_dir: Path) -> str:
    """results.json, report.md and the plots in the sweep directory; returns the markdown."""
    plots = {"lr_sweep.png": lambda path: plot_lr_sweep(results, path)}
    plots["curves.png"] = lambda path: plot_curves(results.trials, path, results.selected_lr)
    if results.positions:
        plots["positions.png"] = lambda path: plot_positions(cast(PositionDifferences, results.positions), path)
    return write_report_files(sweep_dir, results, render_markdown(results), plots)


def log_to_wandb(results: SweepResult, sweep_dir: Path, wandb_cfg: ReportRunSettings) -> None:
    """A `report` run in the sweep's W&B group: the trials table, the comparison, the plots, and the report's files
    (results.json, report.md, the plots) as its artifact <sweep_id>-report."""
    columns = ["phase", "attention", "lr", "seed", "status", "final_val_loss", "tokens_seen", "run_dir"]
    names = ["lr_sweep", "curves"] + (["positions"] if results.positions else [])
    compare = results.comparison
    low, high = compare.diff_ci95 or (None, None)
    keys = ["sa_mean", "xsa_mean", "diff_mean", "diff_p_value", "wilcoxon_p_value", "sign_test_p_value"]
    keys += ["min_detectable_diff", "sa_std", "xsa_std"]
    log_report_run(
        sweep_dir,
        wandb_cfg,
        name=f"{results.sweep_id}-report",
        group=results.sweep_id,
        job_type="report",
        artifact_type="sweep-report",
        config={k: getattr(results, k) for k in ("grid", "seeds", "search_seeds", "train_overrides", "selected_lr")},
        table=("report/trials", columns, [[getattr(t, c) for c in columns] for t in results.trials]),
        plots={f"report/{name}": f"{name}.png" for name in names},
        summary={key: getattr(compare, key) for key in keys}
        | {
            "selected_lr": results.selected_lr,
            "diff_ci95_low": low,
            "diff_ci95_high": high,
            "significance": compare.significance,
            "reuse_search_run": results.reuse_search_run,
            "sequential_stopped": results.sequential.stopped if results.sequential else None,
            "margin_verdict": compare.margin.verdict if compare.margin else None,
            "bpb_diff_mean": results.bpb.mean_diff if results.bpb else None,
            "position_slope_mean": results.positions.slope_mean if results.positions else None,
        },
    )


def with_outcome(
    results: SweepResult, *, evaluation: dict | None, eval_error: str | None, warnings: list[str]
) -> SweepResult:
    """The results with the downstream evaluation and the warnings found after the analysis."""
    return replace(results, eval=evaluation, eval_error=eval_error, warnings=results.warnings + warnings)

"""A sweep's outputs: results.json (SweepResult), report.md (templates/sweep.md.j2), the plots and a W&B report run.
Each candidate is compared with the baseline under their names (the arms: sweep.baseline, sweep.candidates)."""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from xsa_lm.records import Record
from xsa_lm.reporting import ReportRunSettings, interval, log_report_run, num, render, saved_figure, write_report_files
from xsa_lm.stats.decision import (
    EXACT_STUDIES,
    MarginVerdict,
    NullRates,
    margin_verdict,
    null_rates,
    null_study_sizes,
)
from xsa_lm.stats.paired import (
    ALPHA,
    POWER,
    PairedStats,
    PositionDifferences,
    min_detectable_difference,
    paired_stats,
    position_differences,
)
from xsa_lm.sweep.protocol import FINISHED, NULL, PLACEBO, Comparison, Selection, SequentialSummary, mean_std
from xsa_lm.sweep.settings import StallRule
from xsa_lm.sweep.stalls import StallStudy, stall_study
from xsa_lm.sweep.trials import CodeRuns, TrialRecord, runs_by_code


def ci_text(ci: Sequence[float] | None) -> str:
    return interval(ci, none="(none below two pairs)")


def arms_by_seed(trials: Sequence[TrialRecord], *phases: str) -> dict[int, dict[str, TrialRecord]]:
    """The trials of `phases` by seed, ascending, then by arm (attention)."""
    by_seed: dict[int, dict[str, TrialRecord]] = {}
    for trial in sorted((t for t in trials if t.phase in phases), key=lambda t: t.seed):
        by_seed.setdefault(trial.seed, {})[trial.attention] = trial
    return by_seed


def completed_pairs(trials: Sequence[TrialRecord], baseline: str, arm: str) -> list[tuple[TrialRecord, TrialRecord]]:
    """The (baseline, `arm`) compare trials of each seed where both completed, by seed."""
    by_seed = arms_by_seed(trials, "compare", NULL, PLACEBO).values()
    return [
        (t[baseline], t[arm]) for t in by_seed if all(a in t and t[a].status == "completed" for a in (baseline, arm))
    ]


def comparison_of(trials: Sequence[TrialRecord], baseline: str, arm: str) -> Comparison:
    """The final losses of the seeds where the baseline and `arm` both completed (a diverged or failed side drops the
    pair)."""
    pairs = completed_pairs(trials, baseline, arm)
    loss = lambda t: cast(float, t.final_val_loss)  # a completed run has its loss
    return Comparison(seeds=[s.seed for s, _ in pairs], sa=[loss(s) for s, _ in pairs], xsa=[loss(x) for _, x in pairs])


@dataclass(frozen=True, kw_only=True)
class BpbStats(PairedStats):
    """Each arm's mean bits per byte (tokenizer-independent) and the paired tests of candidate - baseline on them."""

    sa_mean: float
    xsa_mean: float


def bpb_stats(sa: list[float], xsa: list[float]) -> BpbStats:
    return BpbStats(sa_mean=statistics.fmean(sa), xsa_mean=statistics.fmean(xsa), **vars(paired_stats(sa, xsa)))


def seed_correlation(sa: list[float], arm: list[float]) -> float | None:
    """Pearson's r of an arm's and the baseline's losses over the seeds: how much of a seed's luck the two share,
    which sets the paired difference's spread (None below 3 pairs, where it is +-1 anyway, or without spread)."""
    if len(sa) < 3 or len(set(sa)) < 2 or len(set(arm)) < 2:
        return None
    return statistics.correlation(sa, arm)


@dataclass(frozen=True, kw_only=True)
class NullComparison(PairedStats):
    """A null arm of sweep.null_arm (init or placebo) against the baseline: the paired tests, the verdict, how often
    studies claim an effect (`sa`: the baseline's losses, `null`: the null arm's)."""

    seeds: list[int]
    sa: list[float]
    null: list[float]
    diff: list[float]
    margin: MarginVerdict | None
    rates: list[NullRates]
    corr: float | None = None  # seed_correlation(sa, null); a results.json written before it: computed on reading

    def __post_init__(self) -> None:
        if self.corr is None:
            object.__setattr__(self, "corr", seed_correlation(self.sa, self.null))


def null_comparison(
    trials: Sequence[TrialRecord], margin: float | None, baseline: str, arm: str = NULL
) -> NullComparison | None:
    pairs = comparison_of(trials, baseline, arm)
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


def dropped_warning(seed: int, sides: dict[str, str]) -> str:
    """Why a compare seed is left out of the statistics (`sides`: the status of each arm's run, the baseline first)."""
    what = {"diverged": "diverged", "failed": "failed", "missing": "did not run"}
    failed = (f"{a.upper()} {what.get(s, 'did not finish')}" for a, s in sides.items() if s != "completed")
    lower = " or ".join(a.upper() for a in list(sides)[1:])
    left_out = f"the mean, the confidence interval and the count of seeds where {lower} is lower"
    warning = f"seed {seed} is left out of {left_out}: " + " and ".join(failed)
    if "diverged" in sides.values():
        warning += "; a divergence at the shared LR is a result in itself, not noise: weigh it beside the verdict"
    if any(status not in ("completed", "diverged") for status in sides.values()):
        warning += "; run the same sweep command again to retry it"
    return warning


@dataclass(frozen=True, kw_only=True)
class Tuning(Record):
    """sweep.tune_xsa: a candidate's own best LR and loss, and its loss at the LR selected on the baseline."""

    selected_lr: float | None
    loss_at_own_lr: float | None
    loss_at_shared_lr: float | None


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
    """results.json's comparison: each arm's mean and std, and paired_stats under the key names of docs/sweep.md
    (sa: the baseline, xsa: the candidate, whatever their names: the keys of the two-arm protocol's results)."""

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
    corr: float | None = None  # seed_correlation(sa, xsa); a results.json written before it: computed on reading

    def __post_init__(self) -> None:
        if self.corr is None:
            object.__setattr__(self, "corr", seed_correlation(self.sa, self.xsa))

    @classmethod
    def of(cls, comparison: Comparison, dropped: list[dict], margin: float | None, arm: str) -> "ComparisonStats":
        """`arm`: the candidate's name in the verdict's reason."""
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
            margin=margin_verdict(comparison.diffs, margin, arm) if margin is not None else None,
        )

    @property
    def paired(self) -> PairedStats:
        return PairedStats(pairs=len(self.seeds), **{key: getattr(self, name) for key, name in RESULTS_NAMES.items()})

    @property
    def significance(self) -> str:
        """What the paired 95% t interval says at the 5% level."""
        if not self.seeds:
            return "no pairs"
        if self.diff_ci95 is None:
            return "one seed" if len(self.seeds) == 1 else "no spread"
        low, high = self.diff_ci95
        return "xsa lower" if high < 0 else "xsa higher" if low > 0 else "not significant"  # the candidate's


@dataclass(frozen=True, kw_only=True)
class CandidateResult(Record):
    """One candidate against the baseline: the comparison at the shared LR, per seed, in bits per byte, along the
    window; its own LR (sweep.tune_xsa) and the stalls of the search."""

    candidate: str
    comparison: ComparisonStats
    compare_table: list[dict] = field(default_factory=list)  # per seed: each arm's loss (or status), the difference
    bpb: BpbStats | None = None
    positions: PositionDifferences | None = None
    tuning: Tuning | None = None
    stalls: StallStudy | None = None


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
    baseline: str = "sa"  # results written before the arms had names compared SA with XSA
    candidates: list[str] = field(default_factory=lambda: ["xsa"])
    warnings: list[str] = field(default_factory=list)
    search: dict[str, dict[str, SearchPoint]] = field(default_factory=dict)  # arm -> LR (as "g") -> its point
    # The first candidate's results (the two-arm protocol's keys); the others' in more_candidates
    comparison: ComparisonStats
    compare_table: list[dict] = field(default_factory=list)  # per seed: each arm's loss and diff as the report prints
    xsa_tuning: Tuning | None = None
    sequential: SequentialSummary | None = None
    stalls: StallStudy | None = None
    trials: list[TrialRecord] = field(default_factory=list)
    eval: dict | None = None  # xsa-lm eval of the compare runs (sweep.eval_tasks)
    eval_error: str | None = None  # why that evaluation failed
    bpb: BpbStats | None = None  # bits per byte of the compare runs
    positions: PositionDifferences | None = None  # XSA - SA per span of window positions
    null: NullComparison | None = None  # the init null of sweep.null_arm: the baseline from other initial weights
    placebo: NullComparison | None = None  # its placebo: the baseline from its own initial weights, perturbed
    more_candidates: list[CandidateResult] = field(default_factory=list)  # the candidates after the first
    code: list[CodeRuns] = field(default_factory=list)  # the finished runs by the code that trained them
    schema: int = 1

    @property
    def by_candidate(self) -> list[CandidateResult]:
        """Every candidate's results, in sweep.candidates' order."""
        first = CandidateResult(
            candidate=self.candidates[0],
            comparison=self.comparison,
            compare_table=self.compare_table,
            bpb=self.bpb,
            positions=self.positions,
            tuning=self.xsa_tuning,
            stalls=self.stalls,
        )
        return [first, *self.more_candidates]


def build_results(
    sweep_dir: Path,
    *,
    sweep_id: str,
    grid: list[float],
    seeds: list[int],
    train_overrides: list[str],
    trials: list[TrialRecord],
    arms: Sequence[str],
    selection: Selection,
    tuned: dict[str, Selection] | None = None,
    search_seeds: Sequence[int] = (0,),
    sequential: SequentialSummary | None = None,
    stall_rule: StallRule | None = None,
    margin: float | None = None,
) -> SweepResult:
    """Everything the report shows, from the trial records of every phase (arms: the baseline, then the candidates;
    tuned: the candidates' own LR selections); the stall table needs two search seeds."""
    baseline, candidates, tuned = arms[0], list(arms[1:]), tuned or {}
    search: dict[str, dict[str, SearchPoint]] = {}
    medians = {baseline: selection.losses} | {arm: own.losses for arm, own in tuned.items()}
    searched = [t for t in trials if t.phase == "search"]
    for arm, lr in dict.fromkeys((t.attention, t.lr) for t in searched):
        runs = [t for t in searched if (t.attention, t.lr) == (arm, lr)]
        search.setdefault(arm, {})[f"{lr:g}"] = SearchPoint(lr=lr, median=medians[arm].get(lr), runs=runs)
    warnings = selection.warnings + [f"{arm.upper()} search: {w}" for arm, own in tuned.items() for w in own.warnings]
    shared_seeds = [s for s in seeds if s in search_seeds]  # allowed only with sweep.reuse_search_run=true
    if reused := selection.lr is not None and bool(shared_seeds):
        name, others = baseline.upper(), " and ".join(c.upper() for c in candidates)
        warnings.append(
            f"the comparison at seed(s) {shared_seeds} reuses the search's winning {name} runs "
            f"(sweep.reuse_search_run=true), selected partly for their luck while {others}'s were not: it is biased "
            f"against {others}; for an unbiased one use compare seeds without {shared_seeds} (sweep.seeds)"
        )
    for seed, by_arm in arms_by_seed(trials, "compare").items():
        sides = {a: by_arm[a].status if a in by_arm else "missing" for a in arms}
        if any(status != "completed" for status in sides.values()):
            warnings.append(dropped_warning(seed, sides))
    first, *more = (
        candidate_result(trials, baseline, candidate, seeds, margin, tuned.get(candidate), selection.lr)
        for candidate in candidates
    )
    if stall_rule is not None and len(search_seeds) >= 2:  # the first candidate's stalls whether it was searched or not
        study = lambda c: stall_study([t for t in searched if t.attention in (baseline, c)], stall_rule, baseline, c)
        first = replace(first, stalls=study(first.candidate))
        more = [replace(c, stalls=study(c.candidate)) if c.candidate in search else c for c in more]
    return SweepResult(
        sweep_dir=str(sweep_dir),
        sweep_id=sweep_id,
        train_overrides=train_overrides,
        grid=grid,
        seeds=seeds,
        search_seeds=list(search_seeds),
        reuse_search_run=reused,
        selected_lr=selection.lr,
        baseline=baseline,
        candidates=candidates,
        warnings=warnings,
        search=search,
        comparison=first.comparison,
        compare_table=first.compare_table,
        bpb=first.bpb,
        null=null_comparison(trials, margin, baseline),
        placebo=null_comparison(trials, margin, baseline, PLACEBO),
        positions=first.positions,
        xsa_tuning=first.tuning,
        sequential=sequential,
        stalls=first.stalls,
        trials=trials,
        more_candidates=more,
        code=runs_by_code([t for t in trials if t.status in FINISHED]),
    )


def candidate_result(
    trials: Sequence[TrialRecord],
    baseline: str,
    candidate: str,
    seeds: list[int],
    margin: float | None,
    own: Selection | None,
    shared_lr: float | None,
) -> CandidateResult:
    """One candidate against the baseline at the shared LR (own: its own LR selection, sweep.tune_xsa)."""
    rows, dropped = [], []  # per compare seed that ran: each side's loss (or status) and the difference; left out
    for seed, by_arm in arms_by_seed(trials, "compare").items():
        pair = {a: by_arm[a] for a in (baseline, candidate) if a in by_arm}
        sides = {a: pair[a].status if a in pair else "missing" for a in (baseline, candidate)}
        done = all(status == "completed" for status in sides.values())
        if not done:
            dropped.append({"seed": seed, **sides})
        if seed in seeds:
            cell = {a: num(t.final_val_loss) if t.status == "completed" else t.status for a, t in pair.items()}
            loss = {a: cast(float, t.final_val_loss) for a, t in pair.items()}  # completed: it has its loss
            diff = loss[candidate] - loss[baseline] if done else None
            row = {"seed": seed, baseline: cell.get(baseline, "-"), candidate: cell.get(candidate, "-")}
            rows.append(row | {"diff": num(diff, "+.4f")})
    pairs = completed_pairs(trials, baseline, candidate)
    bpb = [[t.final_val_bpb for t in arm] for arm in zip(*pairs, strict=True)]
    tuning = None
    if own is not None:
        shared = own.losses.get(shared_lr) if shared_lr is not None else None
        own_loss = own.losses.get(own.lr) if own.lr is not None else None
        tuning = Tuning(selected_lr=own.lr, loss_at_own_lr=own_loss, loss_at_shared_lr=shared)
    return CandidateResult(
        candidate=candidate,
        comparison=ComparisonStats.of(comparison_of(trials, baseline, candidate), dropped, margin, candidate.upper()),
        compare_table=sorted(rows, key=lambda row: seeds.index(row["seed"])),
        bpb=bpb_stats(*cast(list[list[float]], bpb)) if bpb and None not in bpb[0] + bpb[1] else None,
        positions=position_differences(
            [b.final_val_loss_by_position for b, _ in pairs], [c.final_val_loss_by_position for _, c in pairs]
        ),
        tuning=tuning,
    )


def render_markdown(results: SweepResult) -> str:
    """report.md of a sweep's results (xsa_lm/templates/sweep.md.j2)."""
    evaluation = None
    if results.eval:
        from xsa_lm.eval.run import EvalResult
        from xsa_lm.eval.run import render as render_eval

        evaluation = render_eval(EvalResult.from_json(results.eval, source="eval/eval.json"))
    return render("sweep.md.j2", r=results, evaluation=evaluation, EXACT_STUDIES=EXACT_STUDIES)


def arm_colors(results: SweepResult) -> dict[str, str]:
    """Each arm's color in every plot: matplotlib's cycle, the baseline first (SA blue, XSA orange by default), the
    null arms that ran last."""
    nulls = [t.attention for t in results.trials if t.phase not in ("search", "compare")]
    arms = dict.fromkeys([results.baseline, *results.candidates, *nulls])
    return {arm: f"C{i}" for i, arm in enumerate(arms)}


def plot_lr_sweep(results: SweepResult, path: Path) -> None:
    with saved_figure(path) as ax:
        for attention, color in arm_colors(results).items():
            points = results.search.get(attention, {}).values()
            medians = sorted((p.lr, p.median) for p in points if p.median is not None)
            if medians:
                ax.plot(*zip(*medians, strict=True), "-", color=color, label=f"{attention.upper()} median")
            runs = [r for p in points for r in p.runs]
            ok = [(r.lr, r.final_val_loss) for r in runs if r.status == "completed"]
            if ok:
                ax.plot(*zip(*ok, strict=True), "o", color=color, alpha=0.6, markersize=4)
            if bad := [r.lr for r in runs if r.status != "completed"]:
                top = max((loss or 0 for _, loss in ok), default=1.0)
                label = f"{attention.upper()} diverged/failed"
                ax.plot(bad, [top] * len(bad), "x", color=color, markersize=10, label=label)
        if results.selected_lr is not None:
            ax.axvline(results.selected_lr, color="gray", linestyle="--", label=f"selected {results.selected_lr:g}")
        ax.set(xscale="log", xlabel="learning rate", ylabel="final validation loss")
        ax.set_title(f"LR search (seeds {', '.join(map(str, results.search_seeds))}: each run and the median)")
        ax.legend()


RUNS_IN_LEGEND = 8  # more curves than this: each arm's median and band in the legend, its runs faint and unnamed


def plot_curves(results: SweepResult, path: Path) -> None:
    """The validation curves of the compare runs and the null arms' (of a search-only sweep, the search runs at the
    selected LR): each run in the legend, or over RUNS_IN_LEGEND runs each arm's median and 10-90% band over seeds."""
    import pandas as pd  # type: ignore[import-untyped]  # no stubs in use

    search_only, selected_lr = not any(t.phase == "compare" for t in results.trials), results.selected_lr
    shown = [
        t for t in results.trials if t.val_history and (t.lr == selected_lr if search_only else t.phase != "search")
    ]
    summary, colors = len(shown) > RUNS_IN_LEGEND, arm_colors(results)
    with saved_figure(path) as ax:
        for t in shown:
            tokens, losses = zip(*((h["tokens"], h["val_loss"]) for h in t.val_history), strict=True)
            color = colors.get(t.attention, "gray")
            if summary:
                ax.plot(tokens, losses, "-", color=color, alpha=0.2, linewidth=0.7)
            else:
                style = ["-", "--", ":", "-."][t.seed % 4]
                label = f"{t.attention.upper()} seed {t.seed}"
                ax.plot(tokens, losses, style, color=color, marker="o", markersize=3, label=label)
        for arm, color in colors.items() if summary else ():
            runs = [t for t in shown if t.attention == arm]
            curves = pd.DataFrame({t.seed: {h["tokens"]: h["val_loss"] for h in t.val_history} for t in runs})
            if curves.empty:
                continue
            curves = curves.sort_index()  # runs cut short leave their later points empty (NaN, skipped below)
            low, high = curves.quantile(0.1, axis=1), curves.quantile(0.9, axis=1)
            ax.fill_between(curves.index, low, high, color=color, alpha=0.25, linewidth=0)
            label = f"{arm.upper()} median, 10-90% band ({len(runs)} seeds)"
            ax.plot(curves.index, curves.median(axis=1), "-", color=color, linewidth=2, label=label)
        ax.set(xlabel="tokens", ylabel="validation loss")
        search = f" ({selected_lr:g}, search runs)" if search_only and selected_lr else ""
        ax.set_title(f"{' vs '.join(a.upper() for a in colors)} at the shared LR" + search)
        if ax.lines:
            ax.legend()


def plot_positions(results: SweepResult, path: Path) -> None:
    """Each candidate - baseline per span of window positions: the mean over seeds with its 95% interval."""
    colors, several = arm_colors(results), len(results.candidates) > 1
    with saved_figure(path) as ax:
        for candidate in results.by_candidate:
            if (positions := candidate.positions) is None:
                continue
            name, color = f"{candidate.candidate.upper()}: " if several else "", colors[candidate.candidate]
            spans = list(range(1, positions.spans + 1))
            means = [s.mean_diff or 0.0 for s in positions.per_span]
            cis = [s.t_ci95 or (m, m) for s, m in zip(positions.per_span, means, strict=True)]
            ax.fill_between(spans, *zip(*cis, strict=True), color=color, alpha=0.25, label=f"{name}95% CI")
            ax.plot(spans, means, "o-", color=color, label=f"{name}mean over seeds")
        ax.axhline(0, color="gray", linewidth=0.8)
        contrast = "candidate" if several else results.candidates[0].upper()
        ax.set(
            xlabel="span of window positions (earliest first)",
            ylabel=f"{contrast} - {results.baseline.upper()} val loss (nats)",
        )
        ax.legend()


def write_report(results: SweepResult, sweep_dir: Path) -> str:
    """results.json, report.md and the plots in the sweep directory; returns the markdown."""
    plots = {"lr_sweep.png": plot_lr_sweep, "curves.png": plot_curves}
    plots |= {"positions.png": plot_positions} if any(c.positions for c in results.by_candidate) else {}
    return write_report_files(sweep_dir, results, render_markdown(results), plots)


def log_to_wandb(results: SweepResult, sweep_dir: Path, wandb_cfg: ReportRunSettings) -> None:
    """A `report` run in the sweep's W&B group: the trials table, the comparison, the plots and the report's files."""
    columns = ["phase", "attention", "lr", "seed", "status", "final_val_loss", "tokens_seen", "run_dir"]
    positions = any(c.positions for c in results.by_candidate)
    compare, names = results.comparison, ["lr_sweep", "curves"] + (["positions"] if positions else [])
    low, high = compare.diff_ci95 or (None, None)
    keys = "sa_mean xsa_mean diff_mean diff_p_value wilcoxon_p_value sign_test_p_value min_detectable_diff".split()
    others = {  # the candidates after the first under their names (the first's keep the two-arm protocol's)
        f"{c.candidate}/{key}": value
        for c in results.more_candidates
        for key, value in [(k, getattr(c.comparison, k)) for k in keys] + [("significance", c.comparison.significance)]
    }
    nulls = {  # each null arm beside the comparison, as the report has it
        f"{arm}/{key}": value
        for arm, null in (("null", results.null), ("placebo", results.placebo))
        if null is not None
        for key, value in [
            ("diff_mean", null.mean_diff),
            ("sign_p", null.sign_p),
            ("corr", null.corr),
            ("margin_verdict", null.margin.verdict if null.margin else None),
        ]
    }
    log_report_run(
        sweep_dir,
        wandb_cfg,
        name=f"{results.sweep_id}-report",
        group=results.sweep_id,
        job_type="report",
        artifact_type="sweep-report",
        config={
            k: getattr(results, k)
            for k in ("grid", "seeds", "search_seeds", "train_overrides", "selected_lr", "baseline", "candidates")
        },
        table=("report/trials", columns, [[getattr(t, c) for c in columns] for t in results.trials]),
        plots={f"report/{name}": f"{name}.png" for name in names},
        summary={key: getattr(compare, key) for key in [*keys, "sa_std", "xsa_std"]}
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
            "diff_corr": compare.corr,
            "code": "; ".join(str(row.code) if row.code else "not recorded" for row in results.code) or None,
        }
        | nulls
        | others,
    )


def with_outcome(
    results: SweepResult, *, evaluation: dict | None, eval_error: str | None, warnings: list[str]
) -> SweepResult:
    """The results with the downstream evaluation and the warnings found after the analysis."""
    return replace(results, eval=evaluation, eval_error=eval_error, warnings=results.warnings + warnings)

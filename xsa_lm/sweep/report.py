"""The sweep's outputs: results.json (machine-readable), report.md (tables a paper can use), lr_sweep.png and
curves.png, and a W&B report run in the sweep's group."""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from xsa_lm.files import write_json, write_text
from xsa_lm.records import JsonObject, Record
from xsa_lm.reporting import ReportRunSettings, interval, log_report_run, markdown_table, num, saved_figure, section
from xsa_lm.stats.decision import NullRates, margin_verdict, null_rates, null_study_sizes
from xsa_lm.stats.paired import ALPHA, POWER, PairedJson, min_detectable_difference, paired_stats
from xsa_lm.stats.positions import PositionDifferences, position_differences
from xsa_lm.sweep.protocol import NULL, Comparison, Selection, SequentialSummary, mean_std
from xsa_lm.sweep.stalls import StallRule, StallStudy, stall_lines, stall_study
from xsa_lm.sweep.trials import TrialRecord


def ci_text(ci: Sequence[float] | None) -> str:
    return interval(ci, none="(none below two pairs)")


def comparison_of(trials: list[dict], arm: str = "xsa") -> Comparison:
    """Seeds where both SA and XSA (or `arm`) finished at the shared LR (a diverged or failed side drops the pair,
    and dropped_seeds says so)."""
    pairs = completed_pairs(trials, arm)
    sa, xsa = [p[0]["final_val_loss"] for p in pairs], [p[1]["final_val_loss"] for p in pairs]
    return Comparison(seeds=[p[0]["seed"] for p in pairs], sa=sa, xsa=xsa)


def arms_by_seed(trials: list[dict], *phases: str) -> dict[int, dict[str, dict]]:
    """The trials of `phases` by seed, ascending, then by arm (attention)."""
    by_seed: dict[int, dict[str, dict]] = {}
    for trial in sorted((t for t in trials if t["phase"] in phases), key=lambda t: t["seed"]):
        by_seed.setdefault(trial["seed"], {})[trial["attention"]] = trial
    return by_seed


def completed_pairs(trials: list[dict], arm: str = "xsa") -> list[tuple[dict, dict]]:
    """(SA, XSA) compare trials of each seed where both finished, by seed; (SA, null) with arm=NULL."""
    both = ("sa", arm)
    by_seed = arms_by_seed(trials, "compare", NULL).values()
    return [(t["sa"], t[arm]) for t in by_seed if all(t.get(a, {}).get("status") == "completed" for a in both)]


class BpbStats(PairedJson):
    """Each arm's mean bits per byte and the paired tests of XSA - SA on them."""

    sa_mean: float
    xsa_mean: float


def bits_per_byte(pairs: list[tuple[dict, dict]]) -> BpbStats | None:
    """The final validation loss in bits per byte (tokenizer-independent) of each arm, and the paired tests of XSA -
    SA on it; None when a run predates it."""
    if not pairs or any(t.get("final_val_bpb") is None for pair in pairs for t in pair):
        return None
    return bpb_stats([float(p[0]["final_val_bpb"]) for p in pairs], [float(p[1]["final_val_bpb"]) for p in pairs])


def bpb_stats(sa: list[float], xsa: list[float]) -> BpbStats:
    return BpbStats(sa_mean=statistics.fmean(sa), xsa_mean=statistics.fmean(xsa), **paired_stats(sa, xsa).to_json())


class NullComparison(PairedJson):
    """The A/A null against SA: per seed, the paired tests, the margin verdict and the false-positive rates."""

    seeds: list[int]
    sa: list[float]
    null: list[float]
    diff: list[float]
    margin: dict[str, float | str | None] | None  # MarginVerdict.to_json
    rates: list[NullRates]


def null_comparison(trials: list[dict], margin: float | None) -> NullComparison | None:
    """The A/A null (sweep.null_arm) analysed as XSA is: per seed, SA from other initial weights - SA, the paired
    tests, the verdict against the margin, and how often studies of 3, 5 and half this many seeds claim an effect
    (null_rates, one per study size). None without a null pair."""
    pairs = comparison_of(trials, arm=NULL)
    seeds, sa, null, diffs = pairs.seeds, pairs.sa, pairs.xsa, pairs.diffs  # pairs.xsa: the null arm's losses
    if not seeds:
        return None
    verdict = margin_verdict(diffs, margin).to_json() if margin is not None else None
    sizes = null_study_sizes(len(diffs))
    rates = [r for r in (null_rates(diffs, size, margin) for size in sizes) if r] if margin is not None else []
    return NullComparison(
        seeds=seeds, sa=sa, null=null, diff=diffs, margin=verdict, rates=rates, **paired_stats(sa, null).to_json()
    )


def dropped_seeds(trials: list[dict]) -> list[dict]:
    """The compare seeds left out of the statistics, each with what happened to which side."""
    dropped = []
    for seed, arms in arms_by_seed(trials, "compare").items():
        sides = {a: arms.get(a, {}).get("status", "missing") for a in ("sa", "xsa")}
        if any(status != "completed" for status in sides.values()):
            dropped.append({"seed": seed, **sides})
    return dropped


def dropped_warning(drop: dict) -> str:
    what = {"diverged": "diverged", "failed": "failed", "missing": "did not run"}
    sides = [f"{a.upper()} {what.get(drop[a], 'did not finish')}" for a in ("sa", "xsa") if drop[a] != "completed"]
    warning = (
        f"seed {drop['seed']} is left out of the mean, the confidence interval and the count of seeds where XSA "
        f"is lower: {' and '.join(sides)}"
    )
    if "diverged" in (drop["sa"], drop["xsa"]):
        warning += "; a divergence at the shared LR is a result in itself, not noise: weigh it beside the verdict"
    if any(drop[a] not in ("completed", "diverged") for a in ("sa", "xsa")):
        warning += "; run the same sweep command again to retry it"
    return warning


class XsaTuning(TypedDict):
    """sweep.tune_xsa: XSA's own best LR and loss, and its loss at the LR selected on SA."""

    selected_lr: float | None
    loss_at_own_lr: float | None
    loss_at_shared_lr: float | None


# paired_stats' names -> the names the comparison has always had in results.json
RESULTS_JSON_NAMES = {
    "mean_diff": "diff_mean",
    "sd_diff": "diff_std",
    "t_ci95": "diff_ci95",
    "xsa_lower": "xsa_better_in",
    "wilcoxon_p": "wilcoxon_p_value",
    "sign_p": "sign_test_p_value",
    "t": "diff_t",
    "t_p": "diff_p_value",
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
    dropped_seeds: list[dict] = field(default_factory=list)
    margin: dict | None = None  # MarginVerdict.to_json against sweep.margin (None: a sweep from before the margin)

    @classmethod
    def of(
        cls, comparison: Comparison, dropped: list[dict] | None = None, margin: float | None = None
    ) -> "ComparisonStats":
        (sa_mean, sa_std), (xsa_mean, xsa_std) = mean_std(comparison.sa), mean_std(comparison.xsa)
        paired = paired_stats(comparison.sa, comparison.xsa)
        return cls(
            seeds=comparison.seeds,
            sa=comparison.sa,
            xsa=comparison.xsa,
            diff=comparison.diffs,
            sa_mean=sa_mean,
            sa_std=sa_std,
            xsa_mean=xsa_mean,
            xsa_std=xsa_std,
            **{ours: getattr(paired, theirs) for theirs, ours in RESULTS_JSON_NAMES.items()},
            dof=paired.pairs - 1 if paired.pairs > 1 else None,
            min_detectable_diff=min_detectable_difference(paired.sd_diff, paired.pairs),
            dropped_seeds=dropped or [],
            margin=margin_verdict(comparison.diffs, margin).to_json() if margin is not None else None,
        )


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
    search: dict[str, dict[str, dict]] = field(default_factory=dict)  # arm -> LR -> its median and runs
    comparison: ComparisonStats
    compare_table: list[dict] = field(default_factory=list)
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

    @classmethod
    def upgraded(cls, data: JsonObject) -> JsonObject:
        """Sweeps before sweep.search_seeds searched at one seed, `search_seed`."""
        if "search_seeds" not in data and "search_seed" in data:
            return data | {"search_seeds": [data["search_seed"]]}
        return data


def verdict(stats: dict, sequential: bool = False) -> str:
    n, ci = len(stats["seeds"]), stats["diff_ci95"]
    dropped = len(stats.get("dropped_seeds") or [])
    left_out = f" ({dropped} seed(s) left out: see the warnings)" if dropped else ""
    if n == 0:
        return f"No seed has both an SA and an XSA result: nothing to compare{left_out}."
    head = f"XSA - SA = {stats['diff_mean']:+.4f} on average over {n} seed(s){left_out}; XSA is lower in "
    head += f"{stats['xsa_better_in']}."
    margin = margin_text(stats.get("margin"), sequential)
    if ci is None and n == 1:
        return (
            head
            + " One seed gives no confidence interval: add seeds (sweep.seeds) for a significance statement."
            + margin
        )
    if ci is None:
        return head + " The differences are all equal: no spread, so Student's t gives no interval." + margin
    lo, hi = ci
    if hi < 0:
        meaning = "the interval excludes 0: XSA's lower loss is significant at the 5% level"
    elif lo > 0:
        meaning = "the interval excludes 0: XSA's higher loss is significant at the 5% level"
    else:
        meaning = "the interval includes 0: the difference is not significant at the 5% level"
    if sequential:  # the seeds were added until significant: the plain 5% level no longer holds
        meaning += " if no seeds had been added on sight of the results; the sequential rule below decides"
    p = stats.get("diff_p_value")
    p_text = f", p = {p:.3g}" if p is not None else ""
    ranks = ""
    if stats.get("wilcoxon_p_value") is not None:
        ranks = (
            f" Tests that do not assume normal noise: exact Wilcoxon signed-rank p = {stats['wilcoxon_p_value']:.3g}, "
            f"exact sign test p = {stats['sign_test_p_value']:.3g}."
        )
    return head + f" Paired 95% CI {interval(ci)} (Student's t, {n - 1} dof{p_text}): {meaning}." + ranks + margin


def margin_text(margin: dict | None, sequential: bool = False) -> str:
    """The verdict against the plan's margin, the claim the sweep may make (xsa_lm.stats.decision)."""
    if margin is None:
        return ""
    caveat = " (its level assumes no seeds were added on sight of the results)" if sequential else ""
    head = f" **Verdict against the plan's margin of {margin['margin']:g} nats: {margin['verdict']}**"
    return f"{head}{caveat}: {margin['why']}."


STOPPED = {
    "significant": "the corrected CI excludes 0",
    "cap": "the cap was reached without the corrected CI excluding 0",
    "incomplete": "a compare run did not finish; run the same sweep command again to continue",
}


def sequential_lines(sequential: dict) -> list[str]:
    """The stopping rule of sweep.seeds_until_significant, its correction, each look and why it stopped."""
    alpha, per_look = sequential["alpha"], sequential["alpha_per_look"]
    lines = [
        "### Sequential stopping (sweep.seeds_until_significant)",
        "",
        f"Rule: {sequential['rule']}. Every look at the data is another chance of a false positive, so each look "
        f"uses a Bonferroni-corrected level: {alpha:.0%} / {sequential['planned_looks']} planned looks = "
        f"{per_look:.4g}, i.e. a {1 - per_look:.2%} CI (Student's t, scipy.stats); the chance that any look "
        f"declares a difference where there is none stays at most {alpha:.0%}.",
    ]
    if not sequential["looks"]:
        return lines + [f"No look yet: {STOPPED[sequential['stopped']]}."]
    looks = [
        [i, look["seeds"], look["pairs"], num(look["mean"], "+.4f"), ci_text(look["ci"]), num(look["p_value"], ".3g")]
        for i, look in enumerate(sequential["looks"], start=1)
    ]
    header = ["look", "seeds", "pairs", "mean XSA - SA", "corrected CI", "p"]
    lines += ["", *markdown_table(header, looks, align="rrrrrr")]
    lines += [
        "",
        f"Stopped after {sequential['n_looks']} of at most {sequential['planned_looks']} looks, at "
        f"{sequential['seeds']} seeds: {STOPPED[sequential['stopped']]}. Corrected CI "
        f"{ci_text(sequential['ci'])}"
        + (f", p = {sequential['p_value']:.3g} against {per_look:.4g}." if sequential["p_value"] is not None else "."),
    ]
    return lines


def noise_line(stats: dict) -> str:
    """The seed-to-seed noise of each arm and of the paired difference, and what the study could have detected."""
    n = len(stats["seeds"])
    if n < 2:
        return ""
    optimistic = "; the closed form is optimistic below 4 seeds" if n < 4 else ""
    return (
        f"Noise: the per-run standard deviation over seeds is {stats['sa_std']:.4f} for SA and "
        f"{stats['xsa_std']:.4f} for XSA, {stats['diff_std']:.4f} for the paired difference. With {n} seeds "
        f"this study could detect differences larger than {stats['min_detectable_diff']:.4f} "
        f"({stats['power']:.0%} power, two-sided {stats['alpha']:.0%} level{optimistic}): a smaller true "
        "difference may well come out not significant."
    )


def design_line(results: dict) -> str:
    """One line on whether a compare run can be the search's winner (the winner's curse)."""
    seed = ", ".join(map(str, results["search_seeds"]))
    if results.get("reuse_search_run"):
        return (
            f"An SA run at search seed(s) {seed} is the search's winning run (sweep.reuse_search_run=true), "
            "selected partly for its luck while XSA's was not: the comparison is biased against XSA."
        )
    return (
        f"The compare runs use seeds disjoint from the search's (seeds {seed}), so no compare run was selected "
        "for its luck."
    )


def header_lines(results: dict) -> list[str]:
    """The title, what the sweep ran, and its warnings."""
    lines = [
        "# SA vs XSA: LR search on SA, comparison at the shared LR",
        "",
        f"- sweep directory: `{results['sweep_dir']}` (W&B group `{results['sweep_id']}`)",
        f"- training overrides: `{' '.join(results['train_overrides']) or '(defaults)'}`",
        f"- LR grid: {', '.join(f'{lr:g}' for lr in results['grid'])}; search seeds {results['search_seeds']} (each "
        f"LR scored by the median final loss over them), compare seeds {results['seeds'] or 'none (search only)'}",
    ]
    if results["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- **{w}**" for w in results["warnings"]]
    return lines


def search_lines(results: dict) -> list[str]:
    """Section 1: each LR's median final val loss over the search seeds and every run's, the selected LR marked."""
    attentions = ["sa", "xsa"] if results["xsa_tuning"] else ["sa"]
    seeds = results["search_seeds"]
    rows = []
    for lr in results["grid"]:
        mark = " **(selected)**" if lr == results["selected_lr"] else ""
        cells = [f"{lr:g}{mark}"]
        for attention in attentions:
            point = results["search"].get(attention, {}).get(f"{lr:g}", {"median": None, "runs": []})
            per_seed = ", ".join(
                num(r.get("final_val_loss")) if r.get("status") == "completed" else r.get("status", "missing")
                for r in point["runs"]
            )
            cells += [num(point["median"]), per_seed or "missing"]
        rows.append(cells)
    header = ["LR"] + [f"{a.upper()} {what}" for a in attentions for what in ("median", "per seed")]
    lines = ["", f"## 1. LR search (seeds {', '.join(map(str, seeds))}, final validation loss)", ""]
    lines += markdown_table(header, rows, align="r" + "rl" * len(attentions))
    if results.get("stalls"):
        lines += stall_lines(results["stalls"])
    return lines


def _mean_std(compare: dict, name: str) -> str:
    """A table cell: mean ± std over seeds; the mean alone below two seeds (signed for the difference)."""
    mean, std = compare[f"{name}_mean"], compare[f"{name}_std"]
    return f"{mean:.4f} ± {std:.4f}" if std is not None else format(mean, "+.4f" if name == "diff" else ".4f")


def compare_lines(results: dict) -> list[str]:
    """Section 2: SA vs XSA per seed at the shared LR, the verdict, the noise and the sequential rule."""
    lines = ["", "## 2. SA vs XSA at the shared LR", ""]
    if results["selected_lr"] is None:
        return lines + ["Not run: the search selected no LR (see the warnings)."]
    if not results["seeds"]:
        return lines + ["Not run: a search-only sweep (sweep.seeds=[]); the search's grid is the study."]
    compare = results["comparison"]
    lines += [
        f"LR {results['selected_lr']:g}, selected on SA and reused unchanged for XSA. " + design_line(results),
        "",
    ]
    rows = [[row["seed"], row["sa"], row["xsa"], row["diff"]] for row in results["compare_table"]]
    if compare["seeds"]:
        rows.append(["mean ± std", *(_mean_std(compare, name) for name in ("sa", "xsa", "diff"))])
    lines += markdown_table(["seed", "SA val loss", "XSA val loss", "XSA - SA"], rows, align="rrrr")
    sequential = results.get("sequential")
    lines += ["", verdict(compare, sequential=bool(sequential))]
    if noise_line(compare):
        lines += ["", noise_line(compare)]
    if sequential:
        lines += [""] + sequential_lines(sequential)
    lines += null_lines(results.get("null"), compare)
    return lines + bpb_lines(results.get("bpb")) + position_lines(results.get("positions"))


def null_lines(null: dict | None, compare: dict) -> list[str]:
    """The A/A null beside the comparison: what the same analysis reports when there is no effect."""
    if not null:
        return []
    ci, verdict = null["t_ci95"], null["margin"]
    ci_part = f", paired 95% CI {interval(ci)}" if ci else ""
    lines = section(
        "### The null: SA against SA (sweep.null_arm)",
        f"SA again at each compare seed, the same data order from other initial weights, minus SA: "
        f"{null['mean_diff']:+.4f} on average over {null['pairs']} seed(s){ci_part}"
        + (f"; verdict against the margin: **{verdict['verdict']}**" if verdict else "")
        + ". There is no effect here, so a verdict of better or worse, or an interval that excludes 0, is a false "
        "positive of the procedure.",
    )
    spread = [
        ["XSA - SA", num(compare.get("diff_mean"), "+.4f"), num(compare.get("diff_std"))],
        ["null - SA", num(null["mean_diff"], "+.4f"), num(null["sd_diff"])],
    ]
    lines += markdown_table(["", "mean", "sd over seeds"], spread, align="lrr")
    rates = null.get("rates") or []
    rates = [rates] if isinstance(rates, dict) else rates  # a dict: one size, from a results.json of 2026-12-02
    if rates:
        lines += [
            "",
            f"How often studies of these {rates[0]['pairs']} null pairs claim an effect, by study size. Every study: "
            "the share over all studies of that many pairs (they overlap; 95% CI by the jackknife over pairs). "
            "Disjoint: studies that share no pair, independent, with the exact binomial 95% CI. The t interval "
            f"excludes 0 in 5% of studies if the noise were normal; the verdict claims an effect when it says better "
            f"or worse than the {rates[0]['margin']:g}-nat margin.",
            "",
        ]
        header = ["study size", "t CI excludes 0", "verdict claims an effect", "disjoint studies claiming"]
        lines += markdown_table(header, [null_rate_row(r) for r in rates], align="rlll")
    return lines


def null_rate_row(r: dict) -> list:
    """How often the null's studies of one size claim an effect: by the t interval, by the verdict, disjoint."""
    claims = [f"{r[key]:.1%} {interval(r[f'{key}_ci95'], '.1%')}" for key in ("ci_excludes_0", "verdict_claims_effect")]
    disjoint = "-"
    if "disjoint_studies" in r:
        disjoint = f"{r['disjoint_claims']} of {r['disjoint_studies']} {interval(r['disjoint_claims_ci95'], '.1%')}"
    return [r["study_size"], *claims, disjoint]


def bpb_lines(bpb: dict | None) -> list[str]:
    if not bpb:
        return []
    ci_part = f", paired 95% CI {interval(bpb['t_ci95'])}" if bpb["t_ci95"] else ""
    return [
        "",
        f"In bits per byte (the loss over the UTF-8 bytes its tokens stand for, comparable across tokenizers): SA "
        f"{bpb['sa_mean']:.4f}, XSA {bpb['xsa_mean']:.4f}, XSA - SA {bpb['mean_diff']:+.4f}{ci_part}.",
    ]


def position_lines(positions: dict | None) -> list[str]:
    """XSA - SA per span of window positions and the trend across spans (xsa_lm.stats.positions)."""
    if not positions:
        return []
    lines = section(
        "### XSA - SA along the window (does the gain grow with context?)",
        f"The validation loss per equal span of positions (`val_position_buckets`, earliest first), paired over "
        f"{positions['seeds']} seed(s).",
    )
    n = positions["spans"]
    spans = [
        [f"{i} of {n}", f"{s['mean_diff']:+.4f}", interval(s["t_ci95"]), f"{s['xsa_lower']}/{s['pairs']}"]
        for i, s in enumerate(positions["per_span"], start=1)
    ]
    lines += markdown_table(["span", "XSA - SA", "95% CI (t)", "XSA lower"], spans, align="rrlr")
    if positions["slope_mean"] is not None:
        ci, p = positions["slope_ci95"], positions["slope_t_p"]
        detail = f" (95% CI {interval(ci, '+.5f')}, t p = {p:.3g})" if ci and p is not None else ""
        lines += [
            "",
            f"Trend: XSA - SA changes by {positions['slope_mean']:+.5f} nats per span on average over the seeds' own "
            f"slopes{detail}; negative means XSA's gain grows later in the window. One slope per seed: spans of one "
            "seed are not independent.",
        ]
    return lines


def tuning_lines(results: dict) -> list[str]:
    """Section 3 (sweep.tune_xsa): XSA at its own best LR against XSA at the LR selected on SA."""
    tuning = results["xsa_tuning"]
    if not tuning:
        return []
    lines = ["", "## 3. XSA at its own best LR (sweep.tune_xsa)", ""]
    if tuning["selected_lr"] is None:
        return lines + ["No usable XSA search run."]
    if tuning["selected_lr"] == results["selected_lr"]:
        meaning = "Sharing the SA-tuned LR costs XSA nothing here."
    else:
        meaning = "The shared LR is not XSA's optimum: the paper's protocol is conservative for XSA here."
    shared_lr = results["selected_lr"] or float("nan")
    return lines + [
        f"XSA's own best LR is {tuning['selected_lr']:g} (median val loss {num(tuning['loss_at_own_lr'])}, "
        f"seeds {results['search_seeds']}); at the SA-tuned LR {shared_lr:g} XSA reaches "
        f"{num(tuning['loss_at_shared_lr'])}. " + meaning
    ]


def render_markdown(results: dict) -> str:
    lines = header_lines(results) + search_lines(results) + compare_lines(results) + tuning_lines(results)
    if results.get("eval"):
        from xsa_lm.eval.run import render

        lines += ["", "## 4. Downstream evaluation (lm-evaluation-harness, zero-shot)", "", render(results["eval"])]
    lines += ["", "![LR sweep](lr_sweep.png)", "", "![Validation curves](curves.png)", ""]
    if results.get("positions"):
        lines += ["![XSA - SA along the window](positions.png)", ""]
    return "\n".join(lines)


def plot_lr_sweep(results: dict, path: Path) -> None:
    with saved_figure(path) as ax:
        for attention, color in (("sa", "tab:blue"), ("xsa", "tab:orange")):
            points = results["search"].get(attention)
            if not points:
                continue
            medians = [(p["lr"], p["median"]) for p in points.values() if p["median"] is not None]
            if medians:
                ax.plot(*zip(*sorted(medians), strict=True), "-", color=color, label=f"{attention.upper()} median")
            runs = [r for p in points.values() for r in p["runs"]]
            ok = [(r["lr"], r["final_val_loss"]) for r in runs if r.get("status") == "completed"]
            if ok:
                ax.plot(*zip(*ok, strict=True), "o", color=color, alpha=0.6, markersize=4)
            bad = [r["lr"] for r in runs if r.get("status") != "completed"]
            if bad:
                top = max((loss for _, loss in ok), default=1.0)
                label = f"{attention.upper()} diverged/failed"
                ax.plot(bad, [top] * len(bad), "x", color=color, markersize=10, label=label)
        if results["selected_lr"] is not None:
            ax.axvline(
                results["selected_lr"], color="gray", linestyle="--", label=f"selected {results['selected_lr']:g}"
            )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"LR search (seeds {', '.join(map(str, results['search_seeds']))}: each run and the median)")
        ax.legend()


def plot_curves(trials: list[dict], path: Path, selected_lr: float | None = None) -> None:
    """The validation curves of the compare runs; of a search-only sweep, the search runs at the selected LR."""
    styles = ["-", "--", ":", "-."]
    search_only = not any(t["phase"] == "compare" for t in trials)
    with saved_figure(path) as ax:
        for trial in trials:
            shown = trial["phase"] == "compare" or (search_only and trial["lr"] == selected_lr)
            if not shown or not trial.get("val_history"):
                continue
            history = trial["val_history"]
            color = "tab:blue" if trial["attention"] == "sa" else "tab:orange"
            label = f"{trial['attention'].upper()} seed {trial['seed']}"
            tokens, losses = [h["tokens"] for h in history], [h["val_loss"] for h in history]
            ax.plot(tokens, losses, styles[trial["seed"] % 4], color=color, marker="o", markersize=3, label=label)
        ax.set_xlabel("tokens")
        ax.set_ylabel("validation loss")
        ax.set_title(
            "SA vs XSA at the shared LR" + (f" ({selected_lr:g}, search runs)" if search_only and selected_lr else "")
        )
        if ax.lines:
            ax.legend()


def compare_table(trials: list[dict], seeds: list[int]) -> list[dict]:
    """A row per compare seed that ran: each side's final val loss (or its status) and XSA - SA."""
    rows, by_seed = [], arms_by_seed(trials, "compare")
    for seed in seeds:
        pair = by_seed.get(seed)
        if not pair:
            continue
        cell = {a: num(t["final_val_loss"]) if t["status"] == "completed" else t["status"] for a, t in pair.items()}
        both = all(t["status"] == "completed" for t in pair.values()) and len(pair) == 2
        diff = f"{pair['xsa']['final_val_loss'] - pair['sa']['final_val_loss']:+.4f}" if both else "-"
        rows.append({"seed": seed, "sa": cell.get("sa", "-"), "xsa": cell.get("xsa", "-"), "diff": diff})
    return rows


def xsa_tuning(search: dict[str, dict[str, dict]], selection: Selection, xsa_selection: Selection) -> XsaTuning:
    shared = search.get("xsa", {}).get(f"{selection.lr:g}", {}) if selection.lr is not None else {}
    return XsaTuning(
        selected_lr=xsa_selection.lr,
        loss_at_own_lr=xsa_selection.losses.get(xsa_selection.lr) if xsa_selection.lr is not None else None,
        loss_at_shared_lr=shared.get("median"),
    )


def build_results(
    sweep_dir: Path,
    *,
    sweep_id: str,
    grid: list[float],
    seeds: list[int],
    train_overrides: list[str],
    trials: list[dict],
    selection: Selection,
    xsa_selection: Selection | None,
    search_seeds: Sequence[int] = (0,),
    sequential: SequentialSummary | None = None,
    stall_rule: StallRule | None = None,
    margin: float | None = None,
) -> dict:
    """Everything the report shows, as one JSON-able dict. `trials` are the records, each with its `phase`;
    `seeds` are the compare seeds, `search_seeds` the search's; `sequential` the outcome of the stopping rule of
    sweep.seeds_until_significant (SequentialRule.summary), None without it; `stall_rule` the stall definition of
    the plan (the stall table needs two search seeds or more); `margin` the plan's practical margin in nats."""
    search: dict[str, dict[str, dict]] = {}
    medians = {"sa": selection.losses, "xsa": xsa_selection.losses if xsa_selection else {}}
    for trial in trials:
        if trial["phase"] == "search":
            arm = trial["attention"]
            point = search.setdefault(arm, {}).setdefault(
                f"{trial['lr']:g}", {"lr": trial["lr"], "median": medians[arm].get(trial["lr"]), "runs": []}
            )
            point["runs"].append(trial)
    dropped, pairs = dropped_seeds(trials), completed_pairs(trials)
    compare = ComparisonStats.of(comparison_of(trials), dropped, margin).to_json()
    tuning = xsa_tuning(search, selection, xsa_selection) if xsa_selection is not None else None
    warnings = list(selection.warnings)
    warnings += [f"XSA search: {w}" for w in (xsa_selection.warnings if xsa_selection else [])]
    shared = [s for s in seeds if s in search_seeds]  # allowed only with sweep.reuse_search_run=true
    reused = selection.lr is not None and bool(shared)
    if reused:
        warnings.append(
            f"the comparison at seed(s) {shared} reuses the search's SA runs at the selected LR "
            "(sweep.reuse_search_run=true): they won the search partly on their noise and XSA's runs were not "
            "selected, so the comparison is biased against XSA; for an unbiased one use compare seeds without "
            f"{shared} (sweep.seeds)"
        )
    warnings += [dropped_warning(drop) for drop in dropped]
    return {
        "sweep_dir": str(sweep_dir),
        "sweep_id": sweep_id,
        "train_overrides": train_overrides,
        "grid": grid,
        "seeds": seeds,
        "search_seeds": list(search_seeds),
        "reuse_search_run": reused,
        "selected_lr": selection.lr,
        "warnings": warnings,
        "search": search,
        "comparison": compare,
        "compare_table": compare_table(trials, seeds),
        "bpb": bits_per_byte(pairs),
        "null": null_comparison(trials, margin),
        "positions": position_differences(
            [sa.get("final_val_loss_by_position") or [] for sa, _ in pairs],
            [xsa.get("final_val_loss_by_position") or [] for _, xsa in pairs],
        ),
        "xsa_tuning": tuning,
        "sequential": sequential,
        "stalls": stall_study([t for t in trials if t["phase"] == "search"], stall_rule)
        if stall_rule is not None and len(search_seeds) >= 2
        else None,
        "trials": trials,
    }


def write_report(results: dict, sweep_dir: Path) -> str:
    """results.json, report.md and the two plots in the sweep directory; returns the markdown."""
    write_json(sweep_dir / "results.json", SweepResult.from_json(results).to_json())
    plot_lr_sweep(results, sweep_dir / "lr_sweep.png")
    plot_curves(results["trials"], sweep_dir / "curves.png", results["selected_lr"])
    if results.get("positions"):
        plot_positions(results["positions"], sweep_dir / "positions.png")
    markdown = render_markdown(results)
    write_text(sweep_dir / "report.md", markdown)
    return markdown


def plot_positions(positions: dict, path: Path) -> None:
    """XSA - SA per span of window positions: the mean over seeds with its 95% interval, and each seed."""
    spans = list(range(1, positions["spans"] + 1))
    means = [s["mean_diff"] for s in positions["per_span"]]
    cis = [s["t_ci95"] or (m, m) for s, m in zip(positions["per_span"], means, strict=True)]
    with saved_figure(path) as ax:
        ax.fill_between(spans, [c[0] for c in cis], [c[1] for c in cis], color="tab:orange", alpha=0.25, label="95% CI")
        ax.plot(spans, means, "o-", color="tab:orange", label="mean over seeds")
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set(xlabel="span of window positions (earliest first)", ylabel="XSA - SA val loss (nats)")
        ax.legend()


def log_to_wandb(results: dict, sweep_dir: Path, wandb_cfg: ReportRunSettings) -> None:
    """A `report` run in the sweep's W&B group: the trials table, the comparison, the plots, and the report's files
    (results.json, report.md, the plots) as its artifact <sweep_id>-report."""
    columns = ["phase", "attention", "lr", "seed", "status", "final_val_loss", "tokens_seen", "run_dir"]
    names = ["lr_sweep", "curves"] + (["positions"] if results.get("positions") else [])
    compare = results["comparison"]
    ci95 = compare["diff_ci95"] or (None, None)
    keys = ["sa_mean", "xsa_mean", "diff_mean", "diff_p_value", "wilcoxon_p_value", "sign_test_p_value"]
    keys += ["min_detectable_diff", "sa_std", "xsa_std"]
    log_report_run(
        sweep_dir,
        wandb_cfg,
        name=f"{results['sweep_id']}-report",
        group=results["sweep_id"],
        job_type="report",
        artifact_type="sweep-report",
        config={k: results.get(k) for k in ("grid", "seeds", "search_seeds", "train_overrides", "selected_lr")},
        table=("report/trials", columns, [[t.get(c) for c in columns] for t in results["trials"]]),
        plots={f"report/{name}": f"{name}.png" for name in names},
        summary={key: compare.get(key) for key in keys}
        | {
            "selected_lr": results["selected_lr"],
            "diff_ci95_low": ci95[0],
            "diff_ci95_high": ci95[1],
            "reuse_search_run": results.get("reuse_search_run"),
            "sequential_stopped": (results.get("sequential") or {}).get("stopped"),
            "margin_verdict": (compare.get("margin") or {}).get("verdict"),
            "bpb_diff_mean": (results.get("bpb") or {}).get("mean_diff"),
            "position_slope_mean": (results.get("positions") or {}).get("slope_mean"),
        },
    )

"""Stalls of the LR search as a rate per LR and arm (exact interval) and a test of the baseline against a candidate
stratified by LR (SA against XSA by default). A run stalls when its val loss at `at_fraction` of the run is over
`margin` nats above its LR's median (sweep.stall)."""

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from xsa_lm.records import Record
from xsa_lm.stats.decision import ClusteredTest, MantelHaenszel, clustered_test, exact_interval, mantel_haenszel
from xsa_lm.stats.paired import sign_test_p
from xsa_lm.sweep.settings import StallRule
from xsa_lm.sweep.trials import TrialRecord

DIAGNOSTICS = ("a_ii", "cos_y_v")  # does a stalled head sit on its own token: a_ii high, y along v


def loss_at_fraction(record: TrialRecord, fraction: float) -> tuple[int, float] | None:
    """(step, val loss) of the first validation at or after `fraction` of the run's steps; None without one."""
    history = record.val_history
    steps = record.steps or (history[-1]["step"] if history else 0)
    return next(((h["step"], h["val_loss"]) for h in history if h["step"] >= fraction * steps), None)


def tokens_to_reach(record: TrialRecord, threshold: float) -> float | None:
    """The tokens seen at the first validation whose loss is at or below threshold; None: never reached."""
    return next((float(h["tokens"]) for h in record.val_history if h["val_loss"] <= threshold), None)


def diagnostics_at(run_dir: str | Path, step: int) -> dict[str, float] | None:
    """The mean over layers of each attention diagnostic at the logged step nearest `step`; None: none logged."""
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        return None
    import pandas as pd  # type: ignore[import-untyped]  # no stubs in use

    frame = pd.read_csv(path)
    means = {m: frame.filter(like=f"diag/{m}/").mean(axis=1, skipna=False) for m in DIAGNOSTICS}
    logged = frame.assign(**means).dropna(subset=[*DIAGNOSTICS, "step"])
    if logged.empty:
        return None
    nearest = logged.loc[(logged["step"] - step).abs().idxmin()]
    return {m: float(nearest[m]) for m in DIAGNOSTICS}


def classify(records: Sequence[TrialRecord], rule: StallRule) -> list[dict]:
    """Each search run with its loss at the rule's fraction, whether it stalled (None: not completed), diagnostics."""
    points = [loss_at_fraction(r, rule.at_fraction) if r.status == "completed" else None for r in records]
    by_lr: dict[float, list[float]] = {}
    for record, point in zip(records, points, strict=True):
        by_lr.setdefault(record.lr, []).extend([point[1]] if point else [])
    rows = []
    for record, point in zip(records, points, strict=True):
        row = {k: getattr(record, k) for k in ("attention", "lr", "seed", "status", "final_val_loss", "run_dir")}
        row.update(stalled=None, step=None, loss_at=None)
        if point is not None:
            reference = statistics.median(by_lr[record.lr])
            row.update(step=point[0], loss_at=point[1], stalled=point[1] > reference + rule.margin, reference=reference)
            if record.run_dir:
                row["diagnostics"] = diagnostics_at(record.run_dir, point[0])
        if rule.loss_threshold is not None:
            row["tokens_to_threshold"] = tokens_to_reach(record, rule.loss_threshold)
        rows.append(row)
    return rows


@dataclass(frozen=True, kw_only=True)
class PairedFinalLosses(Record):
    per_lr: list[dict[str, float | int]]  # lr, pairs, median_diff, xsa_lower
    pairs: int
    xsa_lower: int
    sign_test_p_value: float | None
    by_seed: ClusteredTest


def paired_final_losses(rows: Sequence[dict], baseline: str, candidate: str) -> PairedFinalLosses | None:
    """Candidate - baseline final loss per (LR, seed) where both completed: per LR the median and the candidate's
    wins; over all pairs the sign test as if independent, and the test that keeps each seed's pairs together (the one
    to read). Its xsa_lower fields count the candidate's wins (the keys of the two-arm protocol's results)."""
    final = {(r["attention"], r["lr"], r["seed"]): r["final_val_loss"] for r in rows if r["stalled"] is not None}
    pairs = [
        (lr, final[(candidate, lr, seed)] - loss, seed)
        for (arm, lr, seed), loss in final.items()
        if arm == baseline and (candidate, lr, seed) in final
    ]
    if not pairs:
        return None
    by_lr: dict[float, list[float]] = {}
    for lr, diff, _ in sorted(pairs, key=lambda pair: pair[0]):
        by_lr.setdefault(lr, []).append(diff)
    diffs = [d for _, d, _ in pairs]
    return PairedFinalLosses(
        per_lr=[
            {"lr": lr, "pairs": len(d), "median_diff": statistics.median(d), "xsa_lower": sum(x < 0 for x in d)}
            for lr, d in by_lr.items()
        ],
        pairs=len(pairs),
        xsa_lower=sum(d < 0 for d in diffs),
        sign_test_p_value=sign_test_p(diffs),
        by_seed=clustered_test(diffs, [seed for _, _, seed in pairs]),
    )


@dataclass(frozen=True, kw_only=True)
class StallStudy(Record):
    rule: dict[str, float | None]  # at_fraction, margin, loss_threshold
    cells: list[dict]  # per LR and arm: runs, quartiles, stalls and their interval, diagnostics
    runs: list[dict]  # each run classified
    stalls: dict[str, int]  # per arm
    judged: dict[str, int]  # per arm: the runs that completed
    stratified_test: MantelHaenszel | None
    paired_final_losses: PairedFinalLosses | None
    baseline: str = "sa"  # studies written before the arms had names compared SA with XSA
    candidate: str = "xsa"


def stall_cell(lr: float, arm: str, runs: list[dict], rule: StallRule) -> dict:
    """One LR and arm: its runs, final-loss quartiles, stalls (exact interval), tokens to the threshold, diagnostics."""
    judged = [r for r in runs if r["stalled"] is not None]
    stalls = sum(bool(r["stalled"]) for r in judged)
    cell = {"lr": lr, "attention": arm, "runs": len(runs), "diverged_or_failed": len(runs) - len(judged)}
    quartiles = np.percentile([r["final_val_loss"] for r in judged], [25, 50, 75]).tolist() if judged else None
    cell |= {"final_loss_quartiles": quartiles, "stalls": stalls}
    cell["stall_rate_ci95"] = exact_interval(stalls, len(judged)) if judged else None
    if rule.loss_threshold is not None:
        reached = [r["tokens_to_threshold"] for r in judged if r.get("tokens_to_threshold") is not None]
        cell["reached_threshold"] = len(reached)
        cell["median_tokens_to_threshold"] = statistics.median(reached) if reached else None
    for state, wanted in (("stalled", True), ("healthy", False)):
        diags = [r["diagnostics"] for r in judged if r["stalled"] is wanted and r.get("diagnostics")]
        cell[f"diagnostics_{state}"] = (
            {m: statistics.fmean(d[m] for d in diags) for m in DIAGNOSTICS} if diags else None
        )
    return cell


def stall_study(records: Sequence[TrialRecord], rule: StallRule, baseline: str, candidate: str) -> StallStudy:
    """The stall cell of each LR and arm, the stratified test of the baseline's rate against the candidate's, and the
    paired losses (records: the search runs of these two arms)."""
    rows = classify(records, rule)
    cells, tables = [], []
    for lr in sorted({r["lr"] for r in rows}):
        arms = {arm: [r for r in rows if (r["lr"], r["attention"]) == (lr, arm)] for arm in (baseline, candidate)}
        cells += [stall_cell(lr, arm, runs, rule) for arm, runs in arms.items() if runs]
        if all(arms.values()):  # the baseline's and the candidate's (stalled, not) at this LR
            (a, b), (c, d) = ((x["stalls"], x["runs"] - x["diverged_or_failed"] - x["stalls"]) for x in cells[-2:])
            tables.append((a, b, c, d))
    completed = [r for r in rows if r["stalled"] is not None]
    return StallStudy(
        rule=asdict(rule),
        cells=cells,
        runs=rows,
        stalls={arm: sum(r["attention"] == arm and r["stalled"] for r in completed) for arm in (baseline, candidate)},
        judged={arm: sum(r["attention"] == arm for r in completed) for arm in (baseline, candidate)},
        stratified_test=mantel_haenszel(tables) if tables else None,
        paired_final_losses=paired_final_losses(rows, baseline, candidate),
        baseline=baseline,
        candidate=candidate,
    )

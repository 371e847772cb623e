"""Stalls of the LR search as a measured rate: the rule, the exact intervals, the stratified test, the attention
diagnostics read back from metrics.csv, and the report's table (the whole `xsa-lm sweep` path: test_sweep.py)."""

import csv
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from tests.golden import assert_golden
from xsa_lm.errors import UserError
from xsa_lm.reporting import render
from xsa_lm.stats.decision import exact_interval, mantel_haenszel
from xsa_lm.sweep.settings import StallRule
from xsa_lm.sweep.stalls import classify, diagnostics_at, loss_at_fraction, stall_study, tokens_to_reach
from xsa_lm.sweep.trials import TrialRecord

RULE = StallRule(at_fraction=0.4, margin=0.15)


def run(attention: str, seed: int, at_40: float, lr: float = 1e-2, status: str = "completed", *,
        final: float | None = None, run_dir: Path | None = None) -> TrialRecord:  # fmt: skip
    """A search run's record over 100 steps, validated every 20 steps: at_40 is its val loss at step 40 (40% of the
    run); the earlier validation is far above everything, so only the loss at 40% can decide a stall."""
    final = at_40 - 1.0 if final is None else final
    losses = {20: 9.0, 40: at_40, 60: at_40 - 0.4, 80: at_40 - 0.8, 100: final}
    return TrialRecord(
        id=f"{attention}_lr{lr:g}_s{seed}", phase="search", attention=attention, lr=lr, seed=seed, status=status,
        final_val_loss=final if status == "completed" else None, steps=100, run_dir=str(run_dir) if run_dir else None,
        val_history=[{"step": s, "tokens": s * 1000, "val_loss": v} for s, v in losses.items()],
    )  # fmt: skip


FIVE = [("sa", 0, 5.0), ("sa", 1, 5.0), ("sa", 2, 5.2), ("xsa", 0, 5.0), ("xsa", 1, 5.1)]
TWO_LRS = [("sa", 0, 5.0), ("sa", 1, 5.3), ("sa", 2, 5.3)] + [("xsa", s, 5.0) for s in range(3)]
TWO_LRS += [(arm, s, 8.0, 3e-2) for arm in ("sa", "xsa") for s in range(2)]
FAILING = [("sa", 0, 5.2), ("sa", 1, 5.2), ("xsa", 0, 5.0), ("xsa", 1, 1.0, 1e-2, "diverged")]
FAILING += [("sa", 2, 1.0, 1e-2, "failed")]


@pytest.mark.parametrize(
    ("runs", "margin", "references", "expected"),
    [
        # Median 5.0 at 40% of the run: 5.2 is 0.2 above it (a stall), 5.1 is 0.1 above (not); with 0.25, none.
        (FIVE, 0.15, [5.0] * 5, [False, False, True, False, False]),
        (FIVE, 0.25, [5.0] * 5, [False] * 5),
        # SA alone has the median 5.3; with XSA's three 5.0 the LR's median is 5.0 and both SA 5.3 runs stall. The
        # runs at another LR are no part of this LR's reference.
        (TWO_LRS, 0.15, [5.0] * 6 + [8.0] * 4, [False, True, True] + [False] * 7),
        (TWO_LRS[:3], 0.15, [5.3] * 3, [False] * 3),
        # Diverged and failed runs are not judged: their 1.0 would pull the median to 5.0 and make the 5.2s stalls.
        (FAILING, 0.15, [5.2, 5.2, 5.2, None, None], [False, False, False, None, None]),
    ],
)
def test_a_run_stalls_above_the_median_of_its_lr_plus_the_margin(runs, margin, references, expected) -> None:
    rows = classify([run(*r) for r in runs], StallRule(0.4, margin))
    assert [r["stalled"] for r in rows] == expected and [r.get("reference") for r in rows] == references
    assert all(r["step"] == 40 and r["loss_at"] == v[2] for r, v in zip(rows, runs, strict=True) if r.get("reference"))


def test_diverged_and_failed_runs_are_counted_apart() -> None:
    records = [run(*r) for r in FAILING]
    study = stall_study(records, RULE, "sa", "xsa")
    cells = {c["attention"]: c for c in study.cells}
    assert (cells["sa"]["runs"], cells["sa"]["diverged_or_failed"]) == (3, 1)
    assert (cells["xsa"]["runs"], cells["xsa"]["diverged_or_failed"]) == (2, 1)
    assert study.judged == {"sa": 2, "xsa": 1} and study.stalls == {"sa": 0, "xsa": 0}


@pytest.mark.parametrize(
    "bad",
    [{"at_fraction": 0.0}, {"at_fraction": 1.5}, {"margin": -0.1}, {"margin": "0.1"}, {"loss_threshold": True}],
)
def test_a_stall_rule_out_of_range_is_refused_in_one_line(bad: dict) -> None:
    with pytest.raises(UserError, match=r"^sweep.stall needs 0 < at_fraction <= 1, margin >= 0 and loss_threshold"):
        StallRule(**bad)
    assert StallRule(at_fraction=1, margin=0, loss_threshold=5) == StallRule(1.0, 0.0, 5.0)  # ints are numbers too


def test_the_loss_at_a_fraction_and_the_tokens_to_a_threshold() -> None:
    record = run("sa", 0, 5.0)  # validations at 20, 40, ..., 100
    assert loss_at_fraction(record, 0.4) == (40, 5.0)
    assert loss_at_fraction(record, 0.3) == (40, 5.0)  # the first validation at or after 30 steps
    assert loss_at_fraction(record, 0.0) == (20, 9.0)
    assert loss_at_fraction(replace(record, val_history=[]), 0.4) is None
    one = [{"step": 10, "tokens": 1, "val_loss": 3.0}]
    assert loss_at_fraction(replace(record, steps=None, val_history=one), 1.1) is None
    assert tokens_to_reach(record, 4.6) == 60_000 and tokens_to_reach(record, 3.0) is None


@pytest.mark.parametrize(("k", "n"), [(0, 5), (1, 5), (3, 10), (10, 10), (2, 25)])
def test_exact_intervals_are_clopper_pearson(k: int, n: int) -> None:
    # Clopper-Pearson from the beta quantiles (independent of binomtest): [B(0.025; k, n-k+1), B(0.975; k+1, n-k)].
    low = 0.0 if k == 0 else scipy.stats.beta.ppf(0.025, k, n - k + 1)
    high = 1.0 if k == n else scipy.stats.beta.ppf(0.975, k + 1, n - k)
    assert exact_interval(k, n) == pytest.approx((low, high), abs=1e-9)
    # By hand, no stall in five: the upper bound solves (1 - p)^5 = 0.025.
    assert exact_interval(0, 5) == pytest.approx((0.0, 1 - 0.025 ** (1 / 5)), abs=1e-9)  # (0, 0.5218)


def test_mantel_haenszel_on_a_published_example() -> None:
    # R's mantelhaen.test(Rabbits) (Cochran 1954, penicillin and rabbits, 5 strata): "Mantel-Haenszel X-squared =
    # 3.9286, df = 1, p-value = 0.04747" (continuity-corrected). Tables (a, b, c, d) per stratum.
    rabbits = [(0, 6, 0, 5), (3, 3, 0, 6), (6, 0, 2, 4), (5, 1, 6, 0), (2, 0, 5, 0)]
    test = mantel_haenszel(rabbits)
    assert test.statistic == pytest.approx(3.9286, abs=5e-5) and test.p_value == pytest.approx(0.04747, abs=5e-6)
    assert test.excess_sa_stalls == pytest.approx(3.0)
    nothing = mantel_haenszel([(0, 3, 0, 3), (0, 5, 0, 4)])  # no stall anywhere
    assert nothing.statistic is None and "nothing to test" in nothing.note


def write_metrics(run_dir: Path, rows: list[dict]) -> Path:
    """A metrics.csv as Lightning's CSVLogger writes it: one header over every key, empty cells where a row has none."""
    run_dir.mkdir(parents=True, exist_ok=True)
    columns = ["step", "train/loss", "val_loss"]
    columns += [f"diag/{m}/layer_{layer}" for m in ("a_ii", "cos_y_v", "cos_v_v") for layer in (0, 1)]
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return run_dir


def diag_row(step: int, a_ii: tuple[float, float], cos_y_v: tuple[float, float]) -> dict:
    row: dict = {"step": step, "diag/cos_v_v/layer_0": 0.9, "diag/cos_v_v/layer_1": 0.9}
    row.update({f"diag/a_ii/layer_{i}": v for i, v in enumerate(a_ii)})
    row.update({f"diag/cos_y_v/layer_{i}": v for i, v in enumerate(cos_y_v)})
    return row


def test_diagnostics_at_the_logged_step_nearest_the_asked_one(tmp_path: Path) -> None:
    rows = [
        {"step": 10, "train/loss": 6.0},
        diag_row(20, a_ii=(0.2, 0.4), cos_y_v=(0.5, 0.7)),
        {"step": 20, "val_loss": 5.5},
        {"step": 30, "train/loss": 5.0},
        diag_row(40, a_ii=(0.6, 0.8), cos_y_v=(0.1, 0.3)),
    ]
    run_dir = write_metrics(tmp_path / "run", rows)
    assert diagnostics_at(run_dir, 22) == pytest.approx({"a_ii": 0.3, "cos_y_v": 0.6})  # the layers' mean at 20
    assert diagnostics_at(run_dir, 10) == pytest.approx({"a_ii": 0.3, "cos_y_v": 0.6})  # rows without them skipped
    assert diagnostics_at(str(run_dir), 35) == pytest.approx({"a_ii": 0.7, "cos_y_v": 0.2})
    assert diagnostics_at(run_dir, 400) == pytest.approx({"a_ii": 0.7, "cos_y_v": 0.2})
    assert diagnostics_at(tmp_path / "nowhere", 40) is None  # no metrics.csv
    plain = write_metrics(tmp_path / "plain", [{"step": 10, "train/loss": 6.0}, {"step": 20, "val_loss": 5.5}])
    assert diagnostics_at(plain, 20) is None  # trained without diagnostics.every_n_steps


def test_the_study_and_its_table_count_stalls_per_lr_and_arm(tmp_path: Path) -> None:
    def logged(name: str, a_ii: float) -> Path:  # a run whose diagnostics at step 40 have this a_ii (both layers)
        return write_metrics(tmp_path / name, [diag_row(40, a_ii=(a_ii, a_ii), cos_y_v=(0.5, 0.5))])

    at_1e2 = [run("sa", 0, 5.0, run_dir=logged("sa0", 0.2)), run("sa", 1, 5.6, run_dir=logged("sa1", 0.9))]
    at_1e2 += [run("sa", 2, 5.5, run_dir=logged("sa2", 0.8)), run("xsa", 0, 5.0), run("xsa", 1, 5.0)]
    at_1e2 += [run("xsa", 2, 1.0, status="diverged")]
    at_3e2 = [run(arm, s, 6.0, lr=3e-2) for arm in ("sa", "xsa") for s in range(3)]
    rule = StallRule(at_fraction=0.4, margin=0.15, loss_threshold=4.3)
    study = stall_study(at_1e2 + at_3e2, rule, "sa", "xsa")
    cells = {(c["lr"], c["attention"]): c for c in study.cells}
    sa = cells[(1e-2, "sa")]  # the median of 5.0, 5.6, 5.5, 5.0, 5.0 is 5.0: both 5.6 and 5.5 stall
    assert (sa["runs"], sa["stalls"], sa["diverged_or_failed"]) == (3, 2, 0)
    assert sa["stall_rate_ci95"] == pytest.approx(exact_interval(2, 3))
    assert sa["diagnostics_stalled"] == pytest.approx({"a_ii": 0.85, "cos_y_v": 0.5})
    assert sa["diagnostics_healthy"] == pytest.approx({"a_ii": 0.2, "cos_y_v": 0.5})
    assert sa["final_loss_quartiles"] == pytest.approx(list(np.percentile([4.0, 4.6, 4.5], [25, 50, 75])))
    xsa = cells[(1e-2, "xsa")]
    assert (xsa["runs"], xsa["stalls"], xsa["diverged_or_failed"]) == (3, 0, 1) and xsa["diagnostics_healthy"] is None
    assert xsa["reached_threshold"] == 2 and xsa["median_tokens_to_threshold"] == 80_000  # 4.2 at step 80
    assert sa["reached_threshold"] == 1  # only seed 0 (5.0 at 40%) gets to 4.3
    assert study.stalls == {"sa": 2, "xsa": 0} and study.judged == {"sa": 6, "xsa": 5}
    assert study.stratified_test == mantel_haenszel([(2, 1, 0, 2), (0, 3, 0, 3)])

    assert_golden("stalls.md", render("stalls.md.j2", study=study).removesuffix("\n"))
    assert study.stratified_test is not None and study.stratified_test.p_value is not None
    assert math.isfinite(study.stratified_test.p_value)
    quiet = stall_study(at_3e2, StallRule(), "sa", "xsa")
    assert quiet.stratified_test is not None and quiet.stratified_test.p_value is None
    assert_golden("stalls_quiet.md", render("stalls.md.j2", study=quiet).removesuffix("\n"))


def test_final_losses_are_paired_by_lr_and_seed_with_a_pooled_sign_test():
    from xsa_lm.sweep.stalls import paired_final_losses

    def row(arm, lr, seed, loss, stalled=False):
        return {"attention": arm, "lr": lr, "seed": seed, "final_val_loss": loss, "stalled": stalled}

    rows = [row("sa", 0.01, s, 5.0 + s / 10) for s in range(3)] + [row("xsa", 0.01, s, 4.9 + s / 10) for s in range(3)]
    rows += [row("sa", 0.03, 0, 5.0), row("xsa", 0.03, 0, 5.2), row("sa", 0.03, 1, 5.0)]  # seed 1 has no XSA
    rows.append(row("xsa", 0.03, 1, 9.0, stalled=None))  # diverged: not paired
    paired = paired_final_losses(rows, "sa", "xsa")
    assert paired is not None and paired.pairs == 4 and paired.xsa_lower == 3
    assert [(c["lr"], c["pairs"], c["xsa_lower"]) for c in paired.per_lr] == [(0.01, 3, 3), (0.03, 1, 0)]
    assert paired.per_lr[0]["median_diff"] == pytest.approx(-0.1)
    assert paired.sign_test_p_value == pytest.approx(scipy.stats.binomtest(3, 4).pvalue)
    assert paired.by_seed.clusters == 3 and paired.by_seed.cluster_means == pytest.approx(
        [0.05, -0.1, -0.1]
    )  # seed 0: -0.1 and +0.2
    assert paired_final_losses([row("sa", 0.01, 0, 5.0)], "sa", "xsa") is None

"""The statistics package (xsa_lm/stats): each test against scipy and by hand, the one threshold rule of each, and
one paired record for the sweep, the scaling study and the token axis."""

import ast
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

import xsa_lm.stats
from xsa_lm.scale.report import SizeResult, TokenSize
from xsa_lm.scale.run import analyse_tokens, size_tests
from xsa_lm.stats.paired import holm, min_detectable_difference, paired_stats, paired_t, sign_test_p, wilcoxon_p
from xsa_lm.sweep.protocol import Selection
from xsa_lm.sweep.report import build_results
from xsa_lm.sweep.trials import TrialRecord


def test_the_package_imports_nothing_but_numpy_scipy_the_standard_library_and_the_record_type():
    for path in Path(xsa_lm.stats.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                inside = name.startswith("xsa_lm.stats.") or name == "xsa_lm.records"
                assert top in {"numpy", "scipy"} or top in sys.stdlib_module_names or inside, f"{path.name}: {name}"


def test_paired_t_by_hand():
    diffs = [1.0, 2.0, 3.0]  # mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641 on 2 dof
    test = paired_t(diffs)
    half = 4.303 / math.sqrt(3)  # t(0.975, 2) from printed tables
    assert test.ci == pytest.approx((2 - half, 2 + half), abs=1e-3)
    assert test.t == pytest.approx(2 * math.sqrt(3))
    # Student's t with 2 dof has the CDF 1/2 + t / (2 sqrt(2 + t^2)): two-sided p = 1 - t / sqrt(2 + t^2).
    assert test.p == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(2 + 12), abs=1e-9)  # 0.07418
    wide = paired_t(diffs, confidence=0.99)  # t(0.995, 2) = 9.925
    assert wide.ci == pytest.approx((2 - 9.9248 / math.sqrt(3), 2 + 9.9248 / math.sqrt(3)), abs=1e-3)
    for too_few in ([], [0.5], [0.1, 0.1], [0.0, 0.0, 0.0]):  # below two pairs, or no spread: no standard error
        assert paired_t(too_few) == paired_t([]) and paired_t([]).ci is None and paired_t([]).p is None


def test_minimum_detectable_difference_by_hand():
    # (t_{0.975, n-1} + t_{0.80, n-1}) * sd / sqrt(n), with the quantiles from printed tables of Student's t.
    assert min_detectable_difference(0.04, 6) == pytest.approx((2.5706 + 0.9195) * 0.04 / math.sqrt(6), abs=1e-5)
    assert min_detectable_difference(0.04, 6) == pytest.approx(0.0570, abs=1e-4)  # the rule of thumb "6 seeds, ~0.06"
    assert min_detectable_difference(0.04, 2) == pytest.approx((12.7062 + 1.3764) * 0.04 / math.sqrt(2), abs=1e-5)
    assert min_detectable_difference(0.04, 2) == pytest.approx(0.3983, abs=1e-4)  # "2 seeds, ~0.4"
    assert min_detectable_difference(0.04, 1) is None and min_detectable_difference(None, 5) is None
    # The closed form against the exact power of the two-sided test (noncentral t): about 80% from 6 pairs on.
    for n in (6, 10, 30):
        mde, dof = min_detectable_difference(1.0, n), n - 1
        assert mde is not None
        crit, shift = scipy.stats.t.ppf(0.975, dof), mde * math.sqrt(n)
        power = scipy.stats.nct.sf(crit, dof, shift) + scipy.stats.nct.cdf(-crit, dof, shift)
        assert power == pytest.approx(0.8, abs=0.006), (n, power)


def test_the_rank_tests_are_scipys_exact_wilcoxon_and_sign_tests():
    for diffs in ([-0.1, -0.2, -0.3, -0.4, -0.5], [-0.05, 0.01, -0.2, -0.3, -0.12, -0.07], [0.3, -0.1, 0.2, -0.4]):
        assert wilcoxon_p(diffs) == pytest.approx(scipy.stats.wilcoxon(diffs, method="exact").pvalue)
        lower = sum(d < 0 for d in diffs)
        assert sign_test_p(diffs) == pytest.approx(scipy.stats.binomtest(lower, len(diffs), 0.5).pvalue)
    # By hand, n = 5: all lower: both two-sided p = 2 / 2^5. One higher, with the smallest rank: P(W+ <= 1) = 2/32,
    # p = 4/32; the sign test's 4 of 5: p = 2 (1 + 5) / 32.
    assert (wilcoxon_p([-0.1, -0.2, -0.3, -0.4, -0.5]), sign_test_p([-0.1, -0.2, -0.3, -0.4, -0.5])) == pytest.approx(
        (0.0625, 0.0625)
    )
    assert (wilcoxon_p([0.05, -0.2, -0.3, -0.4, -0.5]), sign_test_p([0.05, -0.2, -0.3, -0.4, -0.5])) == pytest.approx(
        (0.125, 0.375)
    )
    # Pairs with no difference are left out: one nonzero pair is enough, and its exact p is 1.
    assert (wilcoxon_p([0.0, -0.1, -0.2]), sign_test_p([0.0, -0.1, -0.2])) == pytest.approx((0.5, 0.5))
    assert wilcoxon_p([0.0, -0.2]) == sign_test_p([0.0, -0.2]) == 1.0
    for nothing in ([], [0.0, 0.0]):
        assert wilcoxon_p(nothing) is None and sign_test_p(nothing) is None


def test_holm_by_hand():
    # Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1, then a running maximum.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, None, 0.6]) == [pytest.approx(1.0), None, pytest.approx(1.0)]


def test_the_paired_record_holds_every_test_under_one_set_of_names():
    sa = [5.21, 4.81, 5.11, 4.95, 5.02]
    xsa = [4.73, 4.80, 4.68, 4.99, 4.70]
    record = paired_stats(sa, xsa)
    diffs = np.subtract(xsa, sa)
    t = scipy.stats.ttest_rel(xsa, sa)
    assert record.t_p == pytest.approx(t.pvalue) and record.t == pytest.approx(t.statistic)
    assert record.t_ci95 == pytest.approx(tuple(t.confidence_interval(0.95)))
    assert record.wilcoxon_p == pytest.approx(scipy.stats.wilcoxon(diffs, method="exact").pvalue)
    assert record.sign_p == pytest.approx(scipy.stats.binomtest(4, 5).pvalue)
    assert (record.pairs, record.xsa_lower) == (5, 4)
    assert record.mean_diff == pytest.approx(diffs.mean()) and record.sd_diff == pytest.approx(diffs.std(ddof=1))
    as_json = record.to_json()
    assert list(as_json) == [f.name for f in dataclasses.fields(record)] and as_json["t_ci95"] == list(record.t_ci95)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.pairs = 6  # type: ignore[misc]
    empty = paired_stats([], [])
    assert [empty.mean_diff, empty.sd_diff, empty.t_p, empty.wilcoxon_p] == [None] * 4 and empty.xsa_lower == 0
    with pytest.raises(ValueError, match="shorter"):  # every SA value needs its XSA value
        paired_stats([1.0, 2.0], [1.0])


def sweep_path(sa: list[float], xsa: list[float], tmp_path: Path) -> dict:
    """The comparison of a sweep whose compare runs ended with these losses."""
    trials = [
        TrialRecord(id=f"{arm}{seed}", phase="compare", attention=arm, lr=1e-3, seed=seed, status="completed",
                    final_val_loss=v)
        for seed, pair in enumerate(zip(sa, xsa, strict=True), start=1)
        for arm, v in zip(("sa", "xsa"), pair, strict=True)
    ]  # fmt: skip
    results = build_results(
        tmp_path, sweep_id="s", grid=[1e-3], seeds=list(range(1, len(sa) + 1)), train_overrides=[], trials=trials,
        selection=Selection(lr=1e-3, losses={1e-3: 3.0}), xsa_selection=None,
    )  # fmt: skip
    return results.comparison.paired.to_json()


def scale_path(sa: list[float], xsa: list[float]) -> dict:
    """The tests of one size of a scaling study (two sizes: Holm's adjustment has a family)."""
    given = [
        SizeResult(model="a", compute=1.0, sa_runs=sa, xsa_runs=xsa),
        SizeResult(model="b", compute=2.0, sa_runs=[1.0], xsa_runs=[1.0]),
    ]
    tests = size_tests(given)[0][0].tests
    assert tests is not None
    return {k: v for k, v in tests.items() if k != "t_p_holm"}


def token_path(sa: list[float], xsa: list[float]) -> dict:
    """XSA - SA at the budget both arms trained on, from the token axis's analysis."""
    seeds = list(range(1, len(sa) + 1))

    def runs(losses: list[float], fraction: float) -> list[dict]:
        return [
            {"seed": s, "status": "completed", "final_val_loss": v, "tokens_seen": fraction * 1e6}
            for s, v in zip(seeds, losses, strict=True)
        ]

    sa_runs = {"1": runs(sa, 1), "2": runs([v - 0.5 for v in sa], 2)}  # SA's curve goes on falling at 2 B
    entry = {"model": "m", "tokens_B": 1e6, "runs": {"sa": sa_runs, "xsa": {"1": runs(xsa, 1)}}, "seeds": seeds}
    (cell,) = analyse_tokens([TokenSize.from_json(entry)], [1.0, 2.0], [1.0]).cells
    return cell["same_budget"]


@pytest.mark.parametrize(
    ("sa", "xsa"),
    [
        ([3.01, 2.95, 3.40, 3.02, 2.99], [2.97, 2.95, 3.01, 3.03, 2.90]),  # one stalled SA seed, one tie
        ([3.0, 3.1], [3.0, 3.0]),  # one nonzero difference: the rank tests' threshold
        ([3.0, 3.5], [2.75, 3.25]),  # identical differences: the t test's threshold
    ],
)
def test_the_sweep_the_scaling_study_and_the_token_axis_report_identical_numbers(sa, xsa, tmp_path: Path):
    expected = paired_stats(sa, xsa).to_json()
    assert sweep_path(sa, xsa, tmp_path) == expected
    assert scale_path(sa, xsa) == expected
    assert token_path(sa, xsa) == expected

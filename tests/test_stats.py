"""The statistics package (xsa_lm/stats): each test against scipy, by hand or by exact enumeration, the one threshold
rule of each, one paired record for the sweep, the scaling study and the token axis, and what a comparison may claim
(the verdict against a declared margin, tests of pairs that share a seed, the A/A null) where the reports give it."""

import ast
import dataclasses
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

import xsa_lm.stats
from tests.golden import assert_golden
from tests.helpers import FAST, compose_train
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.scale.report import SizeResult, TokenSize
from xsa_lm.scale.run import analyse_tokens, size_tests
from xsa_lm.scale.token_axis import per_seed_k, stalled
from xsa_lm.stats import decision
from xsa_lm.stats.decision import clustered_test, margin_verdict, null_rates, null_study_sizes
from xsa_lm.stats.paired import (
    holm,
    min_detectable_difference,
    paired_stats,
    paired_t,
    position_differences,
    sign_test_p,
    wilcoxon_p,
)
from xsa_lm.sweep.protocol import NULL, PLACEBO, Selection, select_lr
from xsa_lm.sweep.report import SweepResult, build_results, render_markdown
from xsa_lm.sweep.trials import TrialRecord
from xsa_lm.train.run import make_module, set_up_process

MARGIN = 0.01


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
    pairs = enumerate(zip(sa, xsa, strict=True), start=1)
    trials = [
        _trial("compare", arm, 1e-3, seed, v)
        for seed, pair in pairs
        for arm, v in zip(("sa", "xsa"), pair, strict=True)
    ]
    results = build_results(
        tmp_path, sweep_id="s", grid=[1e-3], seeds=list(range(1, len(sa) + 1)), train_overrides=[], trials=trials,
        arms=["sa", "xsa"], selection=Selection(lr=1e-3, losses={1e-3: 3.0}),
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


@pytest.mark.parametrize(
    ("diffs", "expected"),
    [
        ([-0.05, -0.04, -0.06, -0.05, -0.045], "better"),  # lower by ~0.05, far past the margin
        ([-0.002, 0.001, -0.001, 0.002, -0.0015], "not worse"),  # within the margin either way
        ([-0.004, -0.003, -0.005, -0.004, -0.0035], "not worse"),  # significant (p < 0.001) but 0.004 nats: no win
        ([-0.3, 0.25, -0.1, 0.2, -0.05], "inconclusive"),  # too noisy to tell
        ([0.05, 0.04, 0.06, 0.05, 0.045], "worse"),
        ([-0.05], "inconclusive"),  # one pair: no interval
    ],
)
def test_the_verdict_against_the_margin(diffs: list[float], expected: str) -> None:
    assert margin_verdict(diffs, MARGIN).verdict == expected


def test_the_verdict_reads_the_one_sided_bounds() -> None:
    diffs = [-0.03, -0.01, -0.02, -0.025, -0.015]  # mean -0.02, sd 0.0079: upper bound -0.0125 at 5% one-sided
    half = 2.1318 * np.std(diffs, ddof=1) / math.sqrt(5)  # t(0.95, 4) from printed tables
    assert margin_verdict(diffs, MARGIN).upper == pytest.approx(-0.02 + half, abs=1e-4)
    assert [margin_verdict(diffs, m).verdict for m in (MARGIN, 0.015)] == ["better", "not worse"]  # a wider margin


def test_a_seed_shared_by_five_lrs_is_one_observation() -> None:
    """The README's grid: 5 LRs x 5 seeds, XSA lower in 21 of 25 pairs. Counted as 25 independent pairs the sign
    test gives p = 0.0009; by seed, with XSA lower at every seed, no test can give less than 2 / 2^5."""
    rng = np.random.default_rng(0)
    seeds = [s for s in range(5) for _ in range(5)]
    diffs = [-0.1 + 0.02 * rng.standard_normal() if i not in (1, 7, 13, 19) else 0.01 for i in range(25)]
    test = clustered_test(diffs, seeds)
    assert test.pairs == 25 and test.clusters == 5 and test.xsa_lower == 5
    assert test.naive_sign_p == pytest.approx(0.000911, abs=1e-5)
    assert test.sign_flip_p == pytest.approx(2 / 32) and test.sign_p == pytest.approx(2 / 32)


def test_the_sign_flip_p_is_the_exact_enumeration() -> None:
    rng = np.random.default_rng(1)
    diffs = list(rng.normal(-0.02, 0.05, size=18))
    seeds = [s % 6 for s in range(18)]
    test = clustered_test(diffs, seeds)
    means = np.array([np.mean([d for d, s in zip(diffs, seeds, strict=True) if s == c]) for c in range(6)])
    observed = abs(means.mean())
    flips = [abs((means * np.array(signs)).mean()) for signs in itertools.product((1, -1), repeat=6)]
    exact = sum(f >= observed - 1e-12 for f in flips) / len(flips)
    assert test.sign_flip_p == pytest.approx(exact) and test.cluster_means == pytest.approx(list(means))


def test_the_scale_study_tests_by_seed() -> None:
    given = [SizeResult(model=m, seeds=[1, 2, 3], sa_runs=[5.0, 5.1, 5.2], xsa_runs=[4.9, 5.0, 5.1], compute=c)
             for m, c in (("a", 1.0), ("b", 2.0))]  # fmt: skip
    across = size_tests(given)[1]
    assert across["pooled_sign"]["pairs"] == 6 and across["by_seed"]["clusters"] == 3


def test_per_seed_k_reads_each_seed_on_its_own_curve() -> None:
    budgets = [100.0, 200.0, 400.0]
    sa = [[5.0, 5.3], [4.5, 5.2], [4.0, 5.1]]  # seed 0 falls 0.5 per doubling; seed 1 stalls at 5.1-5.3
    xsa = [4.5 - 0.5 * math.log2(1.5), 4.0]  # seed 0: SA's loss at 300 tokens; seed 1: below SA's whole range
    assert per_seed_k(sa, budgets, xsa, 200.0) == ["1.50", ">= 2"]
    assert stalled([4.0, 4.01, 4.02, 4.3]) == 1 and stalled([4.0]) == 0


def _trial(phase: str, attention: str, lr: float, seed: int, loss: float, **more) -> TrialRecord:
    return TrialRecord(
        id=f"{attention}{seed}", phase=phase, attention=attention, lr=lr, seed=seed, status="completed",
        final_val_loss=loss, **more,
    )  # fmt: skip


def _sweep_results(tmp_path: Path, margin: float | None, extra: list[TrialRecord] | None = None) -> SweepResult:
    search = {1e-3: 3.1, 3e-3: 3.0}
    trials = [_trial("search", "sa", lr, 0, loss) for lr, loss in search.items()]
    for seed, (sa, xsa) in enumerate([(3.00, 2.95), (3.02, 2.96), (3.01, 2.97), (3.03, 2.97)], start=1):
        trials += [
            _trial("compare", arm, 3e-3, seed, loss, final_val_bpb=loss / 2,
                   final_val_loss_by_position=[loss + 0.1 - 0.05 * i * (arm == "xsa") + 0.001 * seed for i in range(3)])
            for arm, loss in (("sa", sa), ("xsa", xsa))
        ]  # fmt: skip
    trials += extra or []
    selection = select_lr({lr: [("completed", loss)] for lr, loss in search.items()})
    return build_results(
        Path("sweep"), sweep_id="s", grid=sorted(search), seeds=[1, 2, 3, 4], train_overrides=[], trials=trials,
        arms=["sa", "xsa"], selection=selection, margin=margin,
    )  # fmt: skip


def test_the_sweep_report_gives_the_verdict_against_the_plans_margin(tmp_path: Path) -> None:
    results = _sweep_results(tmp_path, margin=0.01)
    assert results.comparison.margin is not None and results.comparison.margin.verdict == "better"
    wide = _sweep_results(tmp_path, margin=0.1).comparison  # XSA lower by 0.05: significant, yet within 0.1
    assert wide.significance == "xsa lower" and wide.margin is not None and wide.margin.verdict == "not worse"
    assert _sweep_results(tmp_path, margin=None).comparison.margin is None
    assert results.bpb is not None and results.bpb.mean_diff == pytest.approx(-0.0525 / 2)
    assert results.positions is not None and results.positions.slope_mean == pytest.approx(-0.05)
    assert_golden("sweep_margin_bpb_positions.md", render_markdown(results))


def test_the_gain_along_the_window_is_tested_one_slope_per_seed() -> None:
    rng = np.random.default_rng(2)
    sa = [[4.0 - 0.1 * b + 0.02 * rng.standard_normal() for b in range(8)] for _ in range(6)]
    xsa = [[v - 0.01 * b + 0.002 * rng.standard_normal() for b, v in enumerate(row)] for row in sa]  # grows
    grows = position_differences(sa, xsa)
    assert grows is not None and grows.seeds == 6 and grows.spans == 8 and grows.slope_t_p is not None
    assert grows.slope_mean == pytest.approx(-0.01, abs=0.001) and grows.slope_t_p < 1e-4
    assert grows.per_span[7].mean_diff == pytest.approx(-0.07, abs=0.003)
    flat = position_differences(sa, [[v - 0.03 + 0.002 * rng.standard_normal() for v in row] for row in sa])
    assert flat is not None and flat.slope_t_p is not None and flat.slope_t_p > 0.01 and flat.per_span[0].xsa_lower == 6
    assert position_differences([[]], [[]]) is None  # runs from before the spans existed


NULL_DIFFS = [-0.30, -0.25, 0.01, -0.02, 0.02, 0.00, 0.03, -0.01, 0.05, -0.04]  # two stalled SA seeds, eight quiet


@pytest.mark.parametrize(("pairs", "size"), [(8, 4), (9, 3), (10, 2)])
def test_the_null_rates_count_every_study_once(pairs: int, size: int) -> None:
    diffs = NULL_DIFFS[:pairs]
    rates = null_rates(diffs, size, MARGIN)
    assert rates is not None and (rates.pairs, rates.study_size) == (pairs, size)
    studies = list(itertools.combinations(diffs, size))  # every one counted once, by scipy
    excludes = [scipy.stats.ttest_1samp(s, 0).pvalue < 0.05 for s in studies]
    claims = [margin_verdict(s, MARGIN).verdict in ("better", "worse") for s in studies]
    assert rates.exact and rates.studies == len(studies)
    assert (rates.ci_excludes_0, rates.verdict_claims_effect) == pytest.approx((np.mean(excludes), np.mean(claims)))
    disjoint = [margin_verdict(diffs[i : i + size], MARGIN).verdict for i in range(0, pairs - size + 1, size)]
    assert rates.disjoint_studies == pairs // size
    assert rates.disjoint_claims == sum(v in ("better", "worse") for v in disjoint)
    ci = scipy.stats.binomtest(rates.disjoint_claims, pairs // size).proportion_ci(method="exact")
    assert rates.disjoint_claims_ci95 == pytest.approx([ci.low, ci.high])


def test_above_the_limit_the_null_rates_are_a_labelled_random_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = null_rates(NULL_DIFFS, 4, MARGIN)
    monkeypatch.setattr(decision, "EXACT_STUDIES", 100)  # C(10, 4) = 210 subsets
    drawn = null_rates(NULL_DIFFS, 4, MARGIN)
    assert exact is not None and drawn is not None and not drawn.exact and drawn.studies == decision.DRAWN_STUDIES
    assert drawn.verdict_claims_effect == pytest.approx(exact.verdict_claims_effect, abs=0.01)
    assert null_rates(NULL_DIFFS[:8], 5, MARGIN) is None  # 8 pairs make no two studies of 5 apart


@pytest.mark.parametrize(("n", "issue_rate"), [(3, 0.084), (5, 0.077), (12, 0.062)])
def test_the_verdicts_nominal_claim_rate_under_normal_noise(n: int, issue_rate: float) -> None:
    """Two one-sided 5% tests against a 0.01 margin at sd 0.15: the noncentral t, and 200,000 simulated studies."""
    sd, rng = 0.15, np.random.default_rng(n)
    assert decision.nominal_claim_rate(MARGIN, sd, n) == pytest.approx(issue_rate, abs=0.002)
    studies = rng.normal(0, sd, (200_000, n))
    mean, se = studies.mean(axis=1), studies.std(axis=1, ddof=1) / math.sqrt(n)
    t = scipy.stats.t.ppf(0.95, n - 1)
    claims = (mean + t * se < -MARGIN) | (mean - t * se > MARGIN)  # the verdict's rule, checked on 50 of them
    assert [margin_verdict(s, MARGIN).verdict in ("better", "worse") for s in studies[:50]] == list(claims[:50])
    assert claims.mean() == pytest.approx(issue_rate, abs=0.002)
    assert decision.nominal_claim_rate(MARGIN, sd / 200, n) == pytest.approx(0.0, abs=1e-9)  # a placebo's tiny sd


def test_the_rate_disjoint_studies_can_tell_from_5_percent_by_hand() -> None:
    """2 studies: the one-sided exact test at 5% needs both to claim (P = 0.0025; one of two: 0.0975), so power p^2 =
    0.8 at p = sqrt(0.8). 8 studies: it needs 3 (P = 0.0058; 2: 0.057), and P(X >= 3 | p) = 0.8 there."""
    assert decision.detectable_rate(2) == pytest.approx(math.sqrt(0.8))
    p = decision.detectable_rate(8)
    at_least_3 = lambda q: sum(math.comb(8, k) * q**k * (1 - q) ** (8 - k) for k in range(3, 9))
    two = math.comb(8, 2) * 0.05**2 * 0.95**6
    assert at_least_3(p) == pytest.approx(0.8) and at_least_3(0.05) < 0.05 < at_least_3(0.05) + two
    assert 0.4 < p < 0.5


def test_a_null_calibrates_studies_of_3_5_and_half_its_pairs() -> None:
    assert null_study_sizes(24) == [3, 5, 12] and null_study_sizes(12) == [3, 5, 6]
    assert null_study_sizes(4) == [2] and null_study_sizes(3) == []


def test_both_nulls_are_reported_beside_xsa_with_the_correlation_of_each_arm_with_sa(tmp_path: Path) -> None:
    results = _sweep_results(tmp_path, margin=0.01)
    assert results.null is None and results.placebo is None  # no null arm
    null_runs = [_trial("null", NULL, 3e-3, seed, loss) for seed, loss in ((1, 3.01), (2, 3.00), (3, 3.02), (4, 3.03))]
    placebo = [_trial("placebo", PLACEBO, 3e-3, s, loss) for s, loss in ((1, 3.001), (2, 3.02), (3, 3.009), (4, 3.03))]
    results = _sweep_results(tmp_path, margin=0.01, extra=null_runs + placebo)
    null = results.null
    assert null is not None and null.seeds == [1, 2, 3, 4] and null.diff == pytest.approx([0.01, -0.02, 0.01, 0.0])
    assert null.margin is not None and null.margin.verdict == "inconclusive"
    assert [r.study_size for r in null.rates] == [2]
    assert results.comparison.seeds == [1, 2, 3, 4]  # the null runs stay out of XSA's comparison
    assert results.placebo is not None and results.placebo.diff == pytest.approx([0.001, 0.0, -0.001, 0.0])
    sa, xsa = [3.00, 3.02, 3.01, 3.03], [2.95, 2.96, 2.97, 2.97]  # _sweep_results' compare losses
    corr = [results.comparison.corr, null.corr, results.placebo.corr]
    assert corr == pytest.approx([np.corrcoef(sa, arm)[0, 1] for arm in (xsa, null.null, results.placebo.null)])
    assert_golden("sweep_null.md", render_markdown(results))


def test_init_seed_draws_other_weights_and_leaves_the_seeds_stream_alone() -> None:
    spec = parse(TrainSpec, compose_train([*FAST, "logger=none"]))
    weights = {}
    for init_seed in (None, 5, 5):
        spec = spec.model_copy(update={"init_seed": init_seed})
        set_up_process(spec)
        module = make_module(spec, spec.gpt_config(512))
        weights.setdefault(init_seed, []).append((module.model.wte.weight.detach().clone(), torch.rand(1)))
    (plain, _), (first, after_first), (second, _) = weights[None][0], *weights[5]
    assert not torch.equal(plain, first) and torch.equal(first, second)
    # After the module, the random stream is the seed's own with or without init_seed: dropout, data order and the
    # rest see what a plain run with that seed sees once its weights are drawn
    set_up_process(spec)
    assert torch.equal(after_first, torch.rand(1))


def test_init_perturbation_moves_every_weight_by_its_relative_size_and_leaves_the_seeds_stream_alone() -> None:
    spec = parse(TrainSpec, compose_train([*FAST, "logger=none"]))
    built = []
    for scale in (0.0, 1e-6):
        set_up_process(spec.model_copy(update={"init_perturbation": scale}))
        module = make_module(spec.model_copy(update={"init_perturbation": scale}), spec.gpt_config(512))
        built.append(({n: w.detach().clone() for n, w in module.model.named_parameters()}, torch.rand(1)))
    (plain, after_plain), (perturbed, after_perturbed) = built
    assert torch.equal(after_plain, after_perturbed)  # the data order, dropout and the rest: the seed's own stream
    for name, w in plain.items():
        change = ((perturbed[name] - w).norm() / w.norm()).item() if w.norm() > 0 else (perturbed[name] - w).norm()
        assert change == pytest.approx(1e-6, rel=0.3) if w.norm() > 0 else change == 0, name

"""What a comparison may claim (xsa_lm/stats/decision.py): the verdict against a declared margin on constructed
inputs, and tests of pairs that share a seed, against exact enumeration; then where the sweep, the scaling study and
the token axis report them."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

from tests.golden import assert_golden
from tests.helpers import FAST, compose_train
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.scale.report import SizeResult
from xsa_lm.scale.run import size_tests
from xsa_lm.scale.token_axis import per_seed_k, stalled
from xsa_lm.stats.decision import clustered_test, margin_verdict, null_rates, null_study_sizes
from xsa_lm.stats.paired import position_differences
from xsa_lm.sweep.protocol import NULL, Trial, select_lr
from xsa_lm.sweep.report import SweepResult, build_results, render_markdown
from xsa_lm.sweep.trials import TrialRecord, trial_settings
from xsa_lm.train.run import make_module, set_up_process

MARGIN = 0.01


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
    with pytest.raises(ValueError):
        margin_verdict(diffs, -0.01)


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
        selection=selection, xsa_selection=None, margin=margin,
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


def test_the_null_rates_are_the_share_of_studies_that_claim_an_effect() -> None:
    diffs = [-0.30, -0.25, 0.01, -0.02, 0.02, 0.00, 0.03, -0.01]  # two stalled SA seeds among six quiet ones
    rates = null_rates(diffs, 4, MARGIN)
    assert rates is not None and rates.pairs == 8 and rates.study_size == 4
    studies = list(itertools.combinations(diffs, 4))  # 70: every one counted once, by scipy
    excludes = [scipy.stats.ttest_1samp(s, 0).pvalue < 0.05 for s in studies]
    claims = [margin_verdict(s, MARGIN).verdict in ("better", "worse") for s in studies]
    assert rates.ci_excludes_0 == pytest.approx(np.mean(excludes))
    assert rates.verdict_claims_effect == pytest.approx(np.mean(claims))
    low, high = rates.verdict_claims_effect_ci95
    assert 0 <= low <= rates.verdict_claims_effect <= high <= 1
    assert null_rates(diffs, 5, MARGIN) is None  # 8 pairs make no two studies of 5 apart
    disjoint = [margin_verdict(diffs[:4], MARGIN).verdict, margin_verdict(diffs[4:], MARGIN).verdict]
    assert rates.disjoint_studies == 2
    assert rates.disjoint_claims == sum(v in ("better", "worse") for v in disjoint)
    ci = scipy.stats.binomtest(rates.disjoint_claims, 2).proportion_ci(method="exact")
    assert rates.disjoint_claims_ci95 == pytest.approx([ci.low, ci.high])


def test_a_null_calibrates_studies_of_3_5_and_half_its_pairs() -> None:
    assert null_study_sizes(24) == [3, 5, 12] and null_study_sizes(12) == [3, 5, 6]
    assert null_study_sizes(4) == [2] and null_study_sizes(3) == []


def test_the_null_arm_is_sa_from_other_weights_and_is_reported_beside_xsa(tmp_path: Path) -> None:
    assert trial_settings(Trial(NULL, 1e-3, 7))[:3] == ["attention=sa", "init_seed=1000007", "optim.lr=0.001"]
    results = _sweep_results(tmp_path, margin=0.01)
    assert results.null is None  # no null arm
    null_runs = [_trial("null", NULL, 3e-3, seed, loss) for seed, loss in ((1, 3.01), (2, 3.00), (3, 3.02), (4, 3.03))]
    results = _sweep_results(tmp_path, margin=0.01, extra=null_runs)
    null = results.null
    assert null is not None and null.seeds == [1, 2, 3, 4] and null.diff == pytest.approx([0.01, -0.02, 0.01, 0.0])
    assert (
        null.margin is not None and null.margin.verdict == "inconclusive" and [r.study_size for r in null.rates] == [2]
    )
    assert results.comparison.seeds == [1, 2, 3, 4]  # the null runs stay out of XSA's comparison
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

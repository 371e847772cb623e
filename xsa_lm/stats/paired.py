"""XSA against SA over paired seeds: seed s of each arm shares its initialisation and data order, so every test runs
on the per-seed differences XSA - SA. One public function per test, and `paired_stats`, the one record of them that
the sweep, the scaling study and the token axis report.

Some SA seeds stall on a plateau at toy scale, so the differences can be bimodal and a t test alone can mislead:
beside Student's paired t stand the exact Wilcoxon signed-rank and exact sign tests, which do not assume normal noise.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from xsa_lm.records import Record

ALPHA, POWER = 0.05, 0.8  # the comparison's significance level (two-sided) and the power of its detectable difference


@dataclass(frozen=True)
class TTest:
    t: float | None
    p: float | None
    ci: tuple[float, float] | None


def paired_t(diffs: Sequence[float], confidence: float = 1 - ALPHA) -> TTest:
    """Student's paired t-test of the mean difference against 0 (scipy's ttest_1samp on the differences, the same as
    ttest_rel on the two arms): t, the two-sided p and the `confidence` interval. All None below two differences or
    when they are all equal up to rounding (no spread: no standard error)."""
    values = np.asarray(diffs, dtype=float)
    if values.size < 2 or np.std(values) <= 1e-12 * max(1.0, float(np.abs(values).max())):  # equal up to rounding
        return TTest(t=None, p=None, ci=None)
    result = scipy.stats.ttest_1samp(values, 0.0)
    ci = result.confidence_interval(confidence)
    return TTest(t=float(result.statistic), p=float(result.pvalue), ci=(float(ci.low), float(ci.high)))


def wilcoxon_p(diffs: Sequence[float]) -> float | None:
    """The exact Wilcoxon signed-rank test, two-sided; None without a nonzero difference. Like the sign test it leaves
    out pairs with no difference, which carry no sign (scipy's default zero_method, "wilcox")."""
    return float(scipy.stats.wilcoxon(diffs, method="exact").pvalue) if any(diffs) else None


def sign_test_p(diffs: Sequence[float]) -> float | None:
    """The exact sign test (binomial, 1/2), two-sided: how often XSA is lower; None without a nonzero difference.
    Over the pairs of several sizes or LRs pooled it reads the direction, not a size of effect."""
    nonzero = sum(d != 0 for d in diffs)
    return float(scipy.stats.binomtest(sum(d < 0 for d in diffs), nonzero).pvalue) if nonzero else None


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment (family-wise error), by hand because scipy.stats.false_discovery_control does
    Benjamini-Hochberg (false discovery rate) only. None stays None and does not count in the family."""
    known = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    adjusted: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        adjusted[i] = running
    return adjusted


def min_detectable_difference(sd: float | None, n: int) -> float | None:
    """The smallest true mean paired difference that a two-sided paired t-test at level ALPHA over n pairs detects
    with the power POWER, for a paired standard deviation sd. The usual closed form,
        MDE = (t_{1-ALPHA/2, n-1} + t_{POWER, n-1}) * sd / sqrt(n),
    which stands a shifted central t in for the noncentral t and ignores the opposite rejection tail. It is slightly
    optimistic for very few pairs: the exact noncentral-t value is 5% larger at n = 3, 2% at n = 4, under 1% from
    n = 6 (at n = 2 the formula's difference is detected with about 73% power, not 80%). None below two pairs."""
    if sd is None or n < 2:
        return None
    quantiles = scipy.stats.t.ppf([1 - ALPHA / 2, POWER], n - 1)
    return float(quantiles.sum()) * sd / math.sqrt(n)


@dataclass(frozen=True, kw_only=True)
class PairedStats(Record):
    """XSA - SA over paired seeds. Each test runs when its definition has the data, else its fields are None:
    - Student's paired t (t, t_p, t_ci95): two pairs or more whose differences are not all equal;
    - the exact Wilcoxon signed-rank test (wilcoxon_p) and the exact sign test (sign_p), two-sided: one pair or more
      with a nonzero difference; pairs with no difference are left out (one such pair gives p = 1, the exact answer).
    """

    pairs: int
    mean_diff: float | None  # XSA - SA; None without a pair
    sd_diff: float | None  # the sample standard deviation (n - 1) of the differences; None below two pairs
    t: float | None
    t_p: float | None
    t_ci95: tuple[float, float] | None
    wilcoxon_p: float | None
    sign_p: float | None
    xsa_lower: int  # the pairs where XSA's value is lower than SA's


def paired_stats(sa: Sequence[float], xsa: Sequence[float]) -> PairedStats:
    """Every paired test of XSA against SA, seed by seed (sa[i] and xsa[i] share a seed)."""
    diffs = [float(x) - float(s) for s, x in zip(sa, xsa, strict=True)]
    t = paired_t(diffs)
    return PairedStats(
        pairs=len(diffs),
        mean_diff=float(np.mean(diffs)) if diffs else None,
        sd_diff=float(np.std(diffs, ddof=1)) if len(diffs) > 1 else None,
        t=t.t,
        t_p=t.p,
        t_ci95=t.ci,
        wilcoxon_p=wilcoxon_p(diffs),
        sign_p=sign_test_p(diffs),
        xsa_lower=sum(d < 0 for d in diffs),
    )

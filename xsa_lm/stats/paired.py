"""XSA against SA over paired seeds (each arm's seed s shares its initialisation and data order), tested on XSA - SA:
Student's paired t beside the exact Wilcoxon and sign tests (stalled SA seeds make the differences bimodal);
`position_differences`: XSA - SA per span of window positions and its trend, one slope per seed, t-tested."""

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
    """Student's paired t-test of the differences against 0; all None below two or with no spread (all equal)."""
    values = np.asarray(diffs, dtype=float)
    if values.size < 2 or np.std(values) <= 1e-12 * max(1.0, float(np.abs(values).max())):  # equal up to rounding
        return TTest(t=None, p=None, ci=None)
    result = scipy.stats.ttest_1samp(values, 0.0)
    ci = result.confidence_interval(confidence)
    return TTest(t=float(result.statistic), p=float(result.pvalue), ci=(float(ci.low), float(ci.high)))


def wilcoxon_p(diffs: Sequence[float]) -> float | None:
    """The exact Wilcoxon signed-rank test, two-sided, without the zero differences; None without a nonzero one."""
    return float(scipy.stats.wilcoxon(diffs, method="exact").pvalue) if any(diffs) else None


def sign_test_p(diffs: Sequence[float]) -> float | None:
    """The exact sign test (binomial, 1/2), two-sided, of how often XSA is lower; None without a nonzero difference."""
    nonzero = sum(d != 0 for d in diffs)
    return float(scipy.stats.binomtest(sum(d < 0 for d in diffs), nonzero).pvalue) if nonzero else None


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment (scipy has Benjamini-Hochberg only); a None is no member of the family."""
    known = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    adjusted: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        adjusted[i] = running
    return adjusted


def min_detectable_difference(sd: float | None, n: int) -> float | None:
    """The smallest mean difference a paired t-test at ALPHA detects with POWER over n pairs of standard deviation sd,
    (t_{1-ALPHA/2, n-1} + t_{POWER, n-1}) sd / sqrt(n) (5% optimistic at n = 3, under 1% from n = 6); None below 2."""
    if sd is None or n < 2:
        return None
    quantiles = scipy.stats.t.ppf([1 - ALPHA / 2, POWER], n - 1)
    return float(quantiles.sum()) * sd / math.sqrt(n)


@dataclass(frozen=True, kw_only=True)
class PairedStats(Record):
    """XSA - SA over paired seeds; a test's fields are None where it has not the data (paired_t, wilcoxon_p)."""

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


@dataclass(frozen=True, kw_only=True)
class PositionDifferences(Record):
    seeds: int
    spans: int
    per_span: list[PairedStats]
    slopes: list[float]  # per seed: the change of XSA - SA from one span to the next
    slope_mean: float | None
    slope_t_p: float | None
    slope_ci95: list[float] | None


def position_differences(
    sa: Sequence[Sequence[float | None]], xsa: Sequence[Sequence[float | None]]
) -> PositionDifferences | None:
    """`sa[s][b]`, `xsa[s][b]`: the loss of seed s over span b; None without a seed whose runs have every span."""
    pairs = [
        ([float(v or 0) for v in a], [float(v or 0) for v in b])
        for a, b in zip(sa, xsa, strict=True)
        if len(a) == len(b) > 0 and None not in (*a, *b)
    ]
    if not pairs:
        return None
    spans = len(pairs[0][0])
    pairs = [(a, b) for a, b in pairs if len(a) == spans]
    per_span = [paired_stats([a[i] for a, _ in pairs], [b[i] for _, b in pairs]) for i in range(spans)]
    index = np.arange(spans, dtype=float)
    slopes = [float(np.polyfit(index, np.subtract(b, a), 1)[0]) for a, b in pairs] if spans > 1 else []
    trend = paired_t(slopes)
    return PositionDifferences(
        seeds=len(pairs),
        spans=spans,
        per_span=per_span,
        slopes=slopes,
        slope_mean=float(np.mean(slopes)) if slopes else None,
        slope_t_p=trend.p,
        slope_ci95=list(trend.ci) if trend.ci else None,
    )

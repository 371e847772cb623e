"""Stall rates: the exact interval of one rate, and the stratified test of SA's rate against XSA's."""

from collections.abc import Sequence
from dataclasses import dataclass

import scipy.stats

from xsa_lm.records import Record


def exact_interval(k: int, n: int) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 95% interval of a rate of k in n."""
    ci = scipy.stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True, kw_only=True)
class MantelHaenszel(Record):
    statistic: float | None
    p_value: float | None
    excess_sa_stalls: float | None = None  # observed - expected SA stalls, summed over the tables
    note: str | None = None  # why there is no test


def mantel_haenszel(tables: Sequence[tuple[int, int, int, int]]) -> MantelHaenszel:
    """The Cochran-Mantel-Haenszel test (continuity-corrected) of 2x2 tables (a, b, c, d) = (SA stalled, SA not,
    XSA stalled, XSA not), one per LR: is the stall rate of SA the same as XSA's at every LR? scipy has no
    stratified test of 2x2 tables, so the textbook formula is written here."""
    deviation = variance = 0.0
    for a, b, c, d in tables:
        n = a + b + c + d
        if n < 2:
            continue
        deviation += a - (a + b) * (a + c) / n
        variance += (a + b) * (c + d) * (a + c) * (b + d) / (n * n * (n - 1))
    if variance == 0:
        return MantelHaenszel(
            statistic=None, p_value=None, note="no stall at any LR, or every run stalled: nothing to test"
        )
    statistic = (abs(deviation) - 0.5) ** 2 / variance if abs(deviation) > 0.5 else 0.0
    return MantelHaenszel(
        statistic=statistic, p_value=float(scipy.stats.chi2.sf(statistic, 1)), excess_sa_stalls=deviation
    )

"""Does XSA's gain grow with context? XSA - SA per equal span of window positions (earliest first), paired over
seeds, and the trend across spans: one least-squares slope per seed (its spans share its runs), t-tested against 0."""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xsa_lm.records import Record
from xsa_lm.stats.paired import PairedStats, paired_stats, paired_t


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

"""Does XSA's gain grow with context? Inside one run, the validation loss per equal span of window positions
(earliest first); XSA - SA per span and seed, a paired interval per span, and a trend test across spans.

The trend is tested seed by seed: each seed's differences are regressed on the span's index (least squares), and
the slopes, one per seed, get Student's t against 0. A seed is one observation, so spans of one seed, which share
its runs, are never counted as independent.
"""

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
    """`sa[s][b]` and `xsa[s][b]`: the loss of seed s over span b. Per span the paired tests of XSA - SA; over spans
    the slope of XSA - SA per span with its t test over seeds (negative: the gain grows with position). None
    without a seed whose runs both have every span."""
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

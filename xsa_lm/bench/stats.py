"""Ratios measured over rounds: their spread, a 95% interval, and whether they meet a target.

Each round gives one ratio of two fresh processes run back to back (XSA over SA step time, say). Timing noise is
multiplicative, so the interval is a t-interval of the mean log-ratio, turned back into a ratio (a geometric mean).
A target is met only when the whole interval is on its side, missed when the whole interval is on the other, and
"not resolved" when the interval straddles it: more rounds (or a quieter machine) would decide. rounds_needed says
how many: from a pilot's spread and its distance to the target.
"""

import math
import statistics
from dataclasses import dataclass

from scipy import stats

from xsa_lm.records import Record

CONFIDENCE = 0.95
MEETS, MISSES, NOT_RESOLVED, NO_TARGET = "meets", "misses", "not resolved", "no target"
LARGE = 1e6  # rounds


@dataclass(frozen=True)
class Ratio(Record):
    """Per-round values summarized: median, geometric mean (the interval's centre), spread, interval, verdict; in
    bench.json under `ratios` (scale reads it), with the SDPA kernel and clock it was measured under."""

    median: float
    mean: float
    sd: float
    min: float
    max: float
    interval: list[float] | None  # None with fewer than 2 rounds
    confidence: float
    target: float | None
    at_most: bool  # the target is an upper bound
    verdict: str
    rounds: list[float]
    kernel: str = ""
    clock: str = ""


def interval(values: list[float]) -> tuple[float, float] | None:
    """The t-interval of the geometric mean of positive values; None with fewer than 2 values."""
    if len(values) < 2:
        return None
    logs = [math.log(v) for v in values]
    centre, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = stats.t.ppf((1 + CONFIDENCE) / 2, df=len(logs) - 1) * sd / math.sqrt(len(logs))
    return math.exp(centre - half), math.exp(centre + half)


def verdict(bounds: tuple[float, float] | None, target: float | None, at_most: bool) -> str:
    """at_most: the target is an upper bound (a step time ratio); else a lower bound (a throughput ratio, MFU)."""
    if target is None:
        return NO_TARGET
    if bounds is None:
        return NOT_RESOLVED
    low, high = bounds
    good, bad = (high <= target, low > target) if at_most else (low >= target, high < target)
    return MEETS if good else MISSES if bad else NOT_RESOLVED


def summarize(values: list[float], target: float | None, at_most: bool, kernel: str = "", clock: str = "") -> Ratio:
    bounds = interval(values)
    return Ratio(
        median=statistics.median(values),
        mean=math.exp(statistics.fmean(math.log(v) for v in values)),  # geometric: the interval's centre
        sd=statistics.stdev(values) if len(values) > 1 else 0.0,
        min=min(values),
        max=max(values),
        interval=None if bounds is None else list(bounds),
        confidence=CONFIDENCE,
        target=target,
        at_most=at_most,
        verdict=verdict(bounds, target, at_most),
        rounds=list(values),
        kernel=kernel,
        clock=clock,
    )


def rounds_needed(values: list[float], target: float) -> float:
    """The fewest rounds whose interval, at these values' spread and centre, would lie wholly on one side of the
    target: t(n - 1) x sd / sqrt(n) < |mean log-ratio - log target|. Infinite for a centre on the target; at least
    len(values) (with fewer than 2 values, or no spread, those already decide)."""
    if len(values) < 2:
        return float(len(values))
    logs = [math.log(v) for v in values]
    margin, sd = abs(statistics.fmean(logs) - math.log(target)), statistics.stdev(logs)
    if sd == 0:
        return float(len(values))
    if margin == 0:
        return math.inf
    normal = (stats.norm.ppf((1 + CONFIDENCE) / 2) * sd / margin) ** 2  # t's n is a little larger
    if normal > LARGE:
        return float(math.ceil(normal))  # far beyond any budget; t and the normal agree there
    n = max(2, len(values), math.floor(normal))
    while stats.t.ppf((1 + CONFIDENCE) / 2, df=n - 1) * sd / math.sqrt(n) >= margin:
        n += 1
    return float(n)

"""Ratios measured over rounds: spread, a 95% interval and a verdict against a target.

Timing noise is multiplicative: the interval is the t-interval of the mean log-ratio (a geometric mean). A target is
met when the whole interval is on its side, missed when it is wholly on the other, else "not resolved"."""

import math
import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats

from xsa_lm.records import Record

CONFIDENCE = 0.95
MEETS, MISSES, NOT_RESOLVED, NO_TARGET = "meets", "misses", "not resolved", "no target"
LARGE = 1e6  # rounds


@dataclass(frozen=True)
class Ratio(Record):
    """Per-round values summarized; bench.json's `ratios` (scale reads it)."""

    median: float
    mean: float  # geometric: the interval's centre
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
    if len(values) < 2:
        return None
    logs = np.log(values)
    half = stats.t.ppf((1 + CONFIDENCE) / 2, df=len(logs) - 1) * stats.sem(logs)
    return math.exp(logs.mean() - half), math.exp(logs.mean() + half)


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
        mean=float(stats.gmean(values)),
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
    """The fewest rounds with t(n - 1) x sd / sqrt(n) < |mean log-ratio - log target| at these values' spread."""
    logs, q = np.log(values), (1 + CONFIDENCE) / 2
    sd = logs.std(ddof=1) if len(values) > 1 else 0.0
    if sd == 0:
        return float(len(values))
    margin = abs(logs.mean() - math.log(target))
    if margin == 0:
        return math.inf
    normal = (stats.norm.ppf(q) * sd / margin) ** 2  # t's n is a little larger
    if normal > LARGE:
        return float(math.ceil(normal))  # far beyond any budget; t and the normal agree there
    n = max(2, len(values), math.floor(normal))
    while stats.t.ppf(q, df=n - 1) * sd / math.sqrt(n) >= margin:
        n += 1
    return float(n)

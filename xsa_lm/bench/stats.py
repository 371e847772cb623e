"""Ratios over rounds: their targets, how many rounds a pilot's spread asks for, each one's spread, 95% interval and
verdict. A round's ratio pairs steps: the median of its paired log-ratios where both arms ran interleaved in one
process, else the ratio of the two phases' median steps. Timing noise is multiplicative and heavy-tailed (a slow
burst of the device): the interval is the Hodges-Lehmann one of the rounds' log-ratios; a target is met when the whole
interval is on its side, missed when it is wholly on the other, else "not resolved"."""

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from scipy import stats

from xsa_lm.bench.loops import Arms, Kernels, Probe, TimedPhase
from xsa_lm.records import Record

CONFIDENCE = 0.95
MIN_ROUNDS = 6  # the fewest whose Hodges-Lehmann interval reaches 95% (at 5 the signed-rank test's tails are 1/32 each)
MEETS, MISSES, NOT_RESOLVED, NO_TARGET = "meets", "misses", "not resolved", "no target"
LARGE = 1e6  # rounds
# The candidate within noise of the baseline (XSA of SA); Lightning as fast as a hand-written loop; the paper-size
# model's MFU
TARGETS: dict[str, Any] = {
    "xsa_over_sa_step_time": {"cpu": 1.02, "cuda": 1.01},
    "lightning_over_plain_throughput": 0.97,
    "mfu": {"model": "paper_0.7b", "gpus": ("H100", "H200"), "at_least": 0.45},
}
# The clock rounds are planned on: a CPU step's CPU time holds up on a shared machine; a GPU step's says little.
PLANNING_CLOCK = {"cpu": "cpu", "cuda": "wall"}
Round = dict[str, TimedPhase]  # a round's result of each phase, in the order they ran


@dataclass(frozen=True)
class Ratio(Record):
    """Per-round values summarized; bench.json's `ratios` (scale reads it)."""

    median: float
    mean: float  # geometric
    sd: float
    min: float
    max: float
    interval: list[float] | None  # None with fewer than MIN_ROUNDS rounds
    confidence: float
    target: float | None
    at_most: bool  # the target is an upper bound
    verdict: str
    rounds: list[float]
    kernel: str = ""
    clock: str = ""


def verdict(bounds: tuple[float, float] | None, target: float | None, at_most: bool) -> str:
    """at_most: the target is an upper bound (a step time ratio); else a lower bound (a throughput ratio, MFU)."""
    if target is None:
        return NO_TARGET
    if bounds is None:
        return NOT_RESOLVED
    low, high = bounds
    good, bad = (high <= target, low > target) if at_most else (low >= target, high < target)
    return MEETS if good else MISSES if bad else NOT_RESOLVED


def hodges_lehmann_interval(logs: np.ndarray) -> tuple[float, float] | None:
    """The 95% interval of the centre of symmetric values: the Walsh averages between the signed-rank test's exact
    critical ranks (scipy has the test, not this interval); None below MIN_ROUNDS values."""
    n = len(logs)
    below = np.zeros(n * (n + 1) // 2 + 1)  # P(signed-rank statistic = t) under no effect, by adding ranks 1..n
    below[0] = 1.0
    for rank in range(1, n + 1):
        below = 0.5 * (below + np.concatenate([np.zeros(rank), below[:-rank]]))
    c = int(np.searchsorted(np.cumsum(below), (1 - CONFIDENCE) / 2 * (1 + 1e-9), side="right"))
    if c == 0:
        return None
    i, j = np.triu_indices(n)
    walsh = np.sort((logs[i] + logs[j]) / 2)
    return float(walsh[c - 1]), float(walsh[-c])


def summarize(values: list[float], target: float | None, at_most: bool, kernel: str = "", clock: str = "") -> Ratio:
    logs = np.log(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    spread = statistics.median(values), float(stats.gmean(values)), sd, min(values), max(values)  # as Ratio orders them
    logs_bounds = hodges_lehmann_interval(logs)
    bounds = None if logs_bounds is None else (math.exp(logs_bounds[0]), math.exp(logs_bounds[1]))
    interval, judged = None if bounds is None else list(bounds), verdict(bounds, target, at_most)
    return Ratio(*spread, interval, CONFIDENCE, target, at_most, judged, list(values), kernel, clock)


def rounds_needed(values: list[float], target: float) -> float:
    """The fewest rounds (at least MIN_ROUNDS) with t(n - 1) x sd / sqrt(n) < |mean log-ratio - log target| at these
    values' spread: the t-interval's count, which the Hodges-Lehmann interval matches within its 95% efficiency."""
    logs, q = np.log(values), (1 + CONFIDENCE) / 2
    sd = logs.std(ddof=1) if len(values) > 1 else 0.0
    if sd == 0:
        return float(max(MIN_ROUNDS, len(values)))
    margin = abs(logs.mean() - math.log(target))
    if margin == 0:
        return math.inf
    normal = (stats.norm.ppf(q) * sd / margin) ** 2  # t's n is a little larger
    if normal > LARGE:
        return float(math.ceil(normal))  # far beyond any budget; t and the normal agree there
    n = max(MIN_ROUNDS, len(values), math.floor(normal))
    while stats.t.ppf(q, df=n - 1) * sd / math.sqrt(n) >= margin:
        n += 1
    return float(n)


@dataclass(frozen=True)
class RoundsPlan:
    pilot: int
    clock: str
    needed: int | None  # None: the pilot's centre is on the target
    affordable: int
    budget_s: float
    max_rounds: int
    round_s: float
    rounds: int
    limited_by: str


def mfu_target(model: str, device: str) -> float | None:
    spec = TARGETS["mfu"]  # whole words: a GH200 is no H200
    applies = model == spec["model"] and any(re.search(rf"\b{gpu}\b", device) for gpu in spec["gpus"])
    return spec["at_least"] if applies else None


def step(result: TimedPhase, clock: str) -> float:  # the median step time (s) on the wall or CPU-time clock
    return statistics.median(result.step_times if clock == "wall" else result.cpu_step_times)


def round_ratio(top: TimedPhase, bottom: TimedPhase, clock: str) -> float:
    """Paired where both ran interleaved in one process (step i of one beside step i of the other): the median of
    the steps' log-ratios, which drift within the round cancels from; else the ratio of their median steps."""
    if top.pid != bottom.pid:
        return step(top, clock) / step(bottom, clock)
    times = (top.step_times, bottom.step_times) if clock == "wall" else (top.cpu_step_times, bottom.cpu_step_times)
    return math.exp(statistics.median(np.log(np.divide(*times)).tolist()))


def ratios(rounds: list[Round], top: str, bottom: str, clock: str) -> list[float]:
    return [round_ratio(r[top], r[bottom], clock) for r in rounds]


def plan_rounds(
    pilot: list[Round],
    kernels: Kernels,
    elapsed_s: float,
    budget_s: float,
    max_rounds: int,
    device_type: str,
    arms: Arms,
) -> RoundsPlan:
    """The rounds the headline ratio (candidate/baseline, else Lightning/plain step time) needs at the pilot's spread,
    within budget_s and max_rounds. Planned once: re-planning each round would stop when the interval happened to look
    decided, and such an interval covers less than 95%."""
    clock, (base, cand) = PLANNING_CLOCK[device_type], arms.phases(kernels.primary)
    if cand in pilot[0]:
        top, target = cand, TARGETS["xsa_over_sa_step_time"][device_type]
    else:
        top, target = "lightning", 1 / TARGETS["lightning_over_plain_throughput"]
    # without the baseline, Lightning alone: no ratio to plan for, MFU's interval needs MIN_ROUNDS
    needed = rounds_needed(ratios(pilot, top, base, clock), target) if base in pilot[0] else MIN_ROUNDS
    pace = elapsed_s / len(pilot)
    affordable = len(pilot) + max(0, math.floor((budget_s - elapsed_s) / pace))
    total = max(len(pilot), min(needed, affordable, max_rounds))
    limited_by = "needed" if total >= needed else "budget_s" if affordable <= max_rounds else "max_rounds"
    finite = None if math.isinf(needed) else int(needed)
    return RoundsPlan(len(pilot), clock, finite, affordable, budget_s, max_rounds, pace, int(total), limited_by)


def summarize_rounds(
    rounds: list[Round], probe: Probe, kernels: Kernels, *, model: str, device_type: str, tokens: int, arms: Arms
) -> tuple[dict[str, Any], dict[str, Ratio]]:
    """Per phase: median step times, tokens/s, peak memory, kernel; per comparison and clock, the ratios summarized."""
    out: dict[str, Any] = {}
    for name in rounds[0]:
        wall = statistics.median(step(r[name], "wall") for r in rounds)
        out[f"{name}_step_ms"] = 1e3 * wall
        out[f"{name}_cpu_ms"] = 1e3 * statistics.median(step(r[name], "cpu") for r in rounds)
        out[f"{name}_tokens_per_s"] = tokens / wall
        memory = [r[name].peak_memory_bytes for r in rounds]
        out[f"{name}_peak_memory_bytes"] = None if None in memory else statistics.median(cast(list[int], memory))
    out["phase_kernels"] = {name: rounds[0][name].sdpa_used for name in rounds[0]}
    primary, summary = kernels.primary, dict[str, Ratio]()
    for kernel in [k for k in kernels.timed if arms.phases(k)[1] in rounds[0]]:
        suffix, target = "" if kernel == primary else f"_{kernel}", TARGETS["xsa_over_sa_step_time"][device_type]
        baseline, candidate = arms.phases(kernel)
        for clock, key in (("wall", f"{arms.ratio}_step_time"), ("cpu", f"{arms.ratio}_cpu_time")):
            values = ratios(rounds, candidate, baseline, clock)
            summary[key + suffix] = summarize(values, target, at_most=True, kernel=kernel, clock=clock)
    base, cand = arms.phases(primary)
    if base in rounds[0]:  # throughput ratio = plain step time / Lightning step time
        target = TARGETS["lightning_over_plain_throughput"]
        for clock, key in (("wall", "lightning_over_plain_throughput"), ("cpu", "lightning_over_plain_cpu_throughput")):
            values = ratios(rounds, base, "lightning", clock)
            summary[key] = summarize(values, target, at_most=False, kernel=primary, clock=clock)
    if probe.peak_flops is not None:
        mfu = [tokens / step(r["lightning"], "wall") * probe.flops_per_token / probe.peak_flops for r in rounds]
        summary["mfu"] = summarize(mfu, mfu_target(model, probe.device), at_most=False, kernel=primary, clock="wall")
    cand_memory, base_memory = out.get(f"{cand}_peak_memory_bytes"), out.get(f"{base}_peak_memory_bytes")
    if cand_memory and base_memory:
        out[f"{arms.ratio}_peak_memory"] = cand_memory / base_memory
    return out, summary

"""The bench's rounds: each runs every phase once in a fresh process (no heap, allocator cache or compiled code
inherited), in an order that rotates so drift hits every phase alike; how many a pilot's spread asks for; the ratios."""

import math
import multiprocessing
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, cast

from xsa_lm.bench.loops import Kernels, Phase, Probe, TimedPhase, measure
from xsa_lm.bench.stats import Ratio, rounds_needed, summarize
from xsa_lm.errors import UserError

# XSA within noise of SA; Lightning as fast as a hand-written loop; the paper-size model's MFU
TARGETS: dict[str, Any] = {
    "xsa_over_sa_step_time": {"cpu": 1.02, "cuda": 1.01},
    "lightning_over_plain_throughput": 0.97,
    "mfu": {"model": "paper_0.7b", "gpus": ("H100", "H200"), "at_least": 0.45},
}
# The clock rounds are planned on: a CPU step's CPU time holds up on a shared machine; a GPU step's says little.
PLANNING_CLOCK = {"cpu": "cpu", "cuda": "wall"}
Round = dict[str, TimedPhase]  # a round's result of each phase, in the order they ran


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


def process_context() -> BaseContext:
    """Each phase's process forked from a server that imports this module (torch, Lightning) once, never CUDA."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["xsa_lm.bench.rounds"])
    return context


def child(phase: Phase, connection: Connection) -> None:
    try:
        connection.send(("ok", measure(phase)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which reports it
        connection.send(("error", traceback.format_exc()))
    finally:
        connection.close()


def run_fresh(phase: Phase, label: str, context: BaseContext) -> Probe | TimedPhase:
    """measure(phase) in a new process; a failure or a killed process ends the bench with one line naming it.
    (concurrent.futures' pool loses a killed process's exit code.)"""
    receive, send = context.Pipe(duplex=False)
    start = context.Process  # type: ignore[attr-defined]  # not on BaseContext; on the forkserver's
    process = start(target=child, args=(phase, send), name=f"xsa-lm-bench-{label}")
    process.start()
    send.close()  # the child holds the only sending end: its death ends recv() with EOFError
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "died", None
    process.join()
    if status == "ok":
        return payload
    if status == "died":
        raise UserError(
            f"bench phase {label} died (exit code {process.exitcode}; -9 is often the out-of-memory "
            "killer): lower micro_batch or context"
        )
    print(payload, end="", file=sys.stderr, flush=True)  # the child's traceback, above the one-line summary
    raise UserError(f"bench phase {label} failed: {payload.strip().splitlines()[-1]}")


def round_order(phases: list[str], kernels: list[str], r: int) -> list[str]:
    """Round r's phases: each kernel's SA and XSA back to back, SA first in even rounds; kernels, Lightning rotate."""
    shift, groups = r % len(kernels), []
    for kernel in kernels[shift:] + kernels[:shift]:
        pair = [name for name in (f"sa_{kernel}", f"xsa_{kernel}") if name in phases]
        if pair:
            groups.append(pair if r % 2 == 0 else pair[::-1])
    groups.insert(r % (len(groups) + 1), ["lightning"])
    return [name for group in groups for name in group]


def run_round(phases: dict[str, Phase], kernels: list[str], context: BaseContext, r: int, of: str) -> Round:
    """Round r: each phase in a fresh process, in round_order; a line on its medians."""
    t0, result = time.perf_counter(), Round()
    for name in round_order(list(phases), kernels, r):
        result[name] = cast(TimedPhase, run_fresh(phases[name], f"{name} (round {r + 1})", context))
    ms = [f"{k} {1e3 * step(v, 'wall'):.1f} ms ({1e3 * step(v, 'cpu'):.1f} CPU)" for k, v in result.items()]
    print(f"round {r + 1}{of} ({time.perf_counter() - t0:.0f} s): {', '.join(ms)}", flush=True)
    return result


def step(result: TimedPhase, clock: str) -> float:  # the median step time (s) on the wall or CPU-time clock
    return statistics.median(result.step_times if clock == "wall" else result.cpu_step_times)


def ratios(rounds: list[Round], top: str, bottom: str, clock: str) -> list[float]:
    return [step(r[top], clock) / step(r[bottom], clock) for r in rounds]


def plan_rounds(
    pilot: list[Round], kernels: Kernels, elapsed_s: float, budget_s: float, max_rounds: int, device_type: str
) -> RoundsPlan:
    """The rounds the headline ratio (XSA/SA, else Lightning/plain step time) needs at the pilot's spread, within
    budget_s and max_rounds. Planned once: re-planning each round would stop when the interval happened to look
    decided, and such an interval covers less than 95%."""
    clock, sa = PLANNING_CLOCK[device_type], f"sa_{kernels.primary}"
    if f"xsa_{kernels.primary}" in pilot[0]:
        top, target = f"xsa_{kernels.primary}", TARGETS["xsa_over_sa_step_time"][device_type]
    else:
        top, target = "lightning", 1 / TARGETS["lightning_over_plain_throughput"]
    # without SA, Lightning alone: no ratio to plan for
    needed = rounds_needed(ratios(pilot, top, sa, clock), target) if sa in pilot[0] else len(pilot)
    pace = elapsed_s / len(pilot)
    affordable = len(pilot) + max(0, math.floor((budget_s - elapsed_s) / pace))
    total = max(len(pilot), min(needed, affordable, max_rounds))
    limited_by = "needed" if total >= needed else "budget_s" if affordable <= max_rounds else "max_rounds"
    finite = None if math.isinf(needed) else int(needed)
    return RoundsPlan(len(pilot), clock, finite, affordable, budget_s, max_rounds, pace, int(total), limited_by)


def summarize_rounds(
    rounds: list[Round], probe: Probe, kernels: Kernels, *, model: str, device_type: str, tokens: int
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
    for kernel in [k for k in kernels.timed if f"xsa_{k}" in rounds[0]]:
        suffix, target = "" if kernel == primary else f"_{kernel}", TARGETS["xsa_over_sa_step_time"][device_type]
        for clock, key in (("wall", "xsa_over_sa_step_time"), ("cpu", "xsa_over_sa_cpu_time")):
            values = ratios(rounds, f"xsa_{kernel}", f"sa_{kernel}", clock)
            summary[key + suffix] = summarize(values, target, at_most=True, kernel=kernel, clock=clock)
    if f"sa_{primary}" in rounds[0]:  # throughput ratio = plain step time / Lightning step time
        target = TARGETS["lightning_over_plain_throughput"]
        for clock, key in (("wall", "lightning_over_plain_throughput"), ("cpu", "lightning_over_plain_cpu_throughput")):
            values = ratios(rounds, f"sa_{primary}", "lightning", clock)
            summary[key] = summarize(values, target, at_most=False, kernel=primary, clock=clock)
    if probe.peak_flops is not None:
        mfu = [tokens / step(r["lightning"], "wall") * probe.flops_per_token / probe.peak_flops for r in rounds]
        summary["mfu"] = summarize(mfu, mfu_target(model, probe.device), at_most=False, kernel=primary, clock="wall")
    xsa_memory, sa_memory = out.get(f"xsa_{primary}_peak_memory_bytes"), out.get(f"sa_{primary}_peak_memory_bytes")
    if xsa_memory and sa_memory:
        out["xsa_over_sa_peak_memory"] = xsa_memory / sa_memory
    return out, summary

"""SA against XSA in one process: each model is built once and compiled once, then timed in rounds that alternate
between the two, eager first, compiled after. `xsa-lm bench` runs every phase in a fresh process instead (no phase
inherits another's state, but each recompiles); this is for a GPU lent for minutes (scripts/gpu_check.sh)."""

import inspect
import statistics
from dataclasses import asdict, replace
from typing import Any, TypedDict

import torch

from xsa_lm.bench.loops import Batch, PlainTrainer, Setup, peak_memory
from xsa_lm.bench.stats import RatioSummary, summarize
from xsa_lm.model import GPTConfig
from xsa_lm.train.memory import estimate

PlannedMemory = dict[str, int | list[str]]  # MemoryEstimate.as_dict() and the `arguments` the estimate took


class StepTimes(TypedDict):
    step_ms: float  # the median over rounds
    tokens_per_s: float
    round_step_ms: list[float]


class ModelTimes(StepTimes, total=False):
    mfu: RatioSummary  # where the device's peak FLOP/s is known


class PairTimes(TypedDict):
    sa: ModelTimes
    xsa: ModelTimes
    xsa_over_sa_step_time: RatioSummary


class StepPeak(TypedDict):
    bytes: int
    source: str


class CudaStepPeak(StepPeak):
    max_memory_allocated: int
    allocated_before: int


def build_pair(xsa: GPTConfig, setup: Setup, *, seed: int, total_steps: int) -> dict[str, PlainTrainer]:
    """Two hand-written loops on the same initial weights: SA, and the XSA model that `xsa` describes."""
    sa = replace(xsa, attention="sa", xsa_layers=None, xsa_gate=False)
    return {name: PlainTrainer(config, setup, seed, total_steps) for name, config in (("sa", sa), ("xsa", xsa))}


def compare(
    per_round: dict[str, list[float]],
    *,
    tokens: int,
    flops_per_token: float,
    peak_flops: float | None,
    step_time_target: float | None,
    mfu_target: float | None,
) -> PairTimes:
    """Step time, tokens/s and MFU per SA and XSA (median over rounds), and XSA/SA step time and MFU as per-round values
    with their 95% interval and verdict (xsa_lm.bench.stats)."""
    out: dict[str, ModelTimes] = {}
    for name, times in per_round.items():
        median = statistics.median(times)
        out[name] = {
            "step_ms": 1e3 * median,
            "tokens_per_s": tokens / median,
            "round_step_ms": [1e3 * t for t in times],
        }
        if peak_flops is not None:
            mfu = [tokens / t * flops_per_token / peak_flops for t in times]
            out[name]["mfu"] = summarize(mfu, target=mfu_target, at_most=False)
    ratios = [x / s for x, s in zip(per_round["xsa"], per_round["sa"], strict=True)]
    step_time = summarize(ratios, target=step_time_target, at_most=True)
    return PairTimes(sa=out["sa"], xsa=out["xsa"], xsa_over_sa_step_time=step_time)


def training_state_bytes(trainer: PlainTrainer) -> int:
    """This model's weights and AdamW state: what stays allocated between its steps."""
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    state = sum(t.numel() * t.element_size() for s in trainer.opt.state.values() for t in s.values() if t.dim())
    return weights + state


def step_peak_memory(trainer: PlainTrainer, batches: list[Batch]) -> StepPeak | CudaStepPeak:
    """Peak memory of one more training step of this model. CUDA: the allocator's high-water mark over the step
    above what was allocated before it (the other model's weights stay out), plus this model's weights and AdamW
    state. CPU: loops.peak_memory's estimate (CPU has no such counter)."""
    device = trainer.setup.device
    if device.type != "cuda":
        measured, source = peak_memory(trainer, batches)
        return {"bytes": measured, "source": source}
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    trainer.run(batches, 1)
    high = torch.cuda.max_memory_allocated(device)
    return {
        "bytes": high - before + training_state_bytes(trainer),
        "max_memory_allocated": high,
        "allocated_before": before,
        "source": "torch.cuda.max_memory_allocated over a step, above what was allocated before it, "
        "plus this model's weights and AdamW state",
    }


def planned_memory(config: GPTConfig, *, micro_batch: int, precision: str, compiled: bool) -> PlannedMemory:
    """xsa_lm.train.memory.estimate for this model on one device (the plain loop holds every tensor whole), with its
    `compiled=` and `attention=` arguments where the estimate has them."""
    accepted = inspect.signature(estimate).parameters
    optional: dict[str, Any] = {
        k: v for k, v in (("compiled", compiled), ("attention", config.attention)) if k in accepted
    }
    plan = estimate(asdict(config), config.vocab_size, micro_batch, config.block_size, precision, **optional)
    return plan.as_dict() | {"arguments": sorted(optional)}

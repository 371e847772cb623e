"""`xsa-lm bench`: SA vs XSA under each SDPA kernel and Lightning vs a plain loop, each phase in a fresh process.

Each round runs every phase once; a kernel's SA and XSA back to back (alternating which goes first), the kernels'
order and Lightning's place rotating, so that drift and noisy neighbours hit every phase alike. Over the rounds,
each ratio's 95% interval and verdict (bench/stats.py); `rounds: auto` plans the rounds from a pilot's spread.
"""

import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any, cast

import hydra
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from rich.console import Console
from rich.table import Table

from xsa_lm.bench.fresh import process_context, run_fresh
from xsa_lm.bench.loops import DevicePhase, KernelsFound, Phase, TimedPhase
from xsa_lm.bench.stats import MEETS, MISSES, NO_TARGET, Ratio, rounds_needed, summarize
from xsa_lm.compat import lightning_precision_name
from xsa_lm.config.builders import model_config
from xsa_lm.config.checks import check_switches
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import check_new_file, write_json
from xsa_lm.model import GPTConfig
from xsa_lm.model.sdpa import config_problem
from xsa_lm.train import memory
from xsa_lm.train.runinfo import run_info

# XSA within noise of SA; Lightning as fast as a hand-written loop; the paper-size model's MFU
TARGETS: dict[str, Any] = {
    "xsa_over_sa_step_time": {"cpu": 1.02, "cuda": 1.01},
    "lightning_over_plain_throughput": 0.97,
    "mfu": {"model": "paper_0.7b", "gpus": ("H100", "H200"), "at_least": 0.45},
}
SMOKE = {"rounds": 2, "steps": 2, "warmup": 1}
# The clock rounds are planned on: a CPU step is the process's own work (its CPU time holds up on a shared
# machine); a GPU step's host CPU time says little about the device's.
PLANNING_CLOCK = {"cpu": "cpu", "cuda": "wall"}
Round = dict[str, TimedPhase]  # a round's result of each phase


def at_least(low: int, also: str = "", unless: tuple = ()) -> BeforeValidator:
    def check(value: Any) -> Any:
        if value not in unless and (type(value) is not int or value < low):
            raise ValueError(f"must be an integer >= {low}{also}")
        return value

    return BeforeValidator(check)


def finite_seconds(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError("must be a finite number of seconds > 0")  # inf would fail after the pilot
    return value


def kernels(value: Any) -> Any:
    problem = None if value in ("auto", "train") else config_problem(value)
    if problem:
        raise ValueError(problem.replace("auto", "auto, train"))
    return value


def comparisons(value: Any) -> Any:
    unknown = sorted(set(value) - {"xsa_over_sa", "lightning_over_plain"})
    if unknown:
        raise ValueError(f"has unknown {unknown}; choose from ['lightning_over_plain', 'xsa_over_sa']")
    return list(value)


class BenchSpec(BaseModel):
    """The bench's own settings (configs/bench.yaml), each refused in one line before any phase starts."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    device: str
    precision: str | int
    context: Annotated[int, at_least(1)]
    micro_batch: Annotated[int, at_least(1)]
    vocab_size: Annotated[int, at_least(1)]
    compile: bool
    reuse_host_memory: bool
    backends: Annotated[str | list[str], BeforeValidator(kernels)]
    rounds: Annotated[int | str, at_least(2, " or auto (an interval needs 2 rounds)", unless=("auto",))]
    pilot_rounds: Annotated[int, at_least(2)]
    budget_s: Annotated[float, BeforeValidator(finite_seconds)]
    max_rounds: Annotated[int, at_least(2)]
    steps: Annotated[int, at_least(1)]
    warmup: Annotated[int, at_least(0)]
    comparisons: Annotated[list[str], BeforeValidator(comparisons)]
    threads: Annotated[int | str | None, at_least(1, " (or auto or null)", unless=(None, "auto"))]
    seed: Annotated[int, at_least(0)]
    smoke: bool


def bench_spec(settings: dict[str, Any]) -> BenchSpec:
    try:
        return BenchSpec.model_validate(settings)
    except ValidationError as e:
        error = e.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        raise UserError(f"{key}={error['input']} {error['msg'].removeprefix('Value error, ')}") from None


@dataclass(frozen=True)
class KernelChoice(KernelsFound):
    timed: list[str]  # the kernels SA and XSA are timed under
    primary: str  # the kernel whose ratios are the headline


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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but torch sees no CUDA device: use device=cpu (or auto)")
    if device not in ("cpu", "cuda"):
        raise UserError(f"device must be auto, cpu or cuda; got {device!r}")
    return torch.device(device)


# What the hand-written loop reproduces (autocast to bf16, or none): under any other precision Lightning would train
# in another one than the plain loop (16-mixed: fp16 with a grad scaler on a GPU, bf16-mixed on CPU; *-true: weights
# cast), and the report would compare two precisions under one name.
BOTH_LOOPS = ("32-true", "bf16-mixed")


def resolve_bench_precision(precision: str | int, device: torch.device) -> str:
    """auto: fp32 on CPU, bf16 on a GPU, without asking the GPU (a CUDA context here would outlive the phases)."""
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "32-true"
    try:
        name = lightning_precision_name(precision)
    except ValueError:
        name = None  # not a precision at all: the same answer
    if name not in BOTH_LOOPS:
        raise UserError(
            f"precision={precision}: bench runs auto, {' or '.join(BOTH_LOOPS)} (what both its Lightning loop and its "
            "hand-written loop train in): set precision=auto"
        )
    return name


def sa_and_xsa(xsa: GPTConfig, context: int) -> tuple[GPTConfig, GPTConfig]:
    """(SA, XSA) at the bench's context: the XSA variant of attention=xsa, and the same model without XSA."""
    if xsa.attention != "xsa":
        raise UserError("bench compares SA with the XSA variant given by attention=xsa (its layers and gate)")
    xsa = replace(xsa, block_size=context)
    return replace(xsa, attention="sa", xsa_layers=None, xsa_gate=False), xsa


def base_phase(spec: BenchSpec, sa: GPTConfig, device: torch.device, precision: str, groups: dict) -> Phase:
    """The plain loop training SA; `groups`: the optim and scheduler groups, built in the phase's process."""
    # threads=auto: one per phase on CPU, where a second thread spins while it waits for a core on a shared machine
    # and the spinning counts as CPU time (docs/benchmark.md); torch's default on a GPU.
    threads = (1 if device.type == "cpu" else None) if spec.threads == "auto" else spec.threads
    same = spec.model_dump(include={"compile", "micro_batch", "warmup", "steps", "seed", "reuse_host_memory"})
    optim, scheduler, threads = groups["optim"], groups["scheduler"], cast(int | None, threads)
    return Phase("plain", sa, device.type, precision, optimizer=optim, scheduler=scheduler, threads=threads, **same)


def kernel_choice(backends: str | list[str], base: Phase) -> KernelChoice:
    """In a fresh process: train's kernel order and kernel here, and the kernels of `backends` that take the model's
    attention alone (`train`: train's); `primary` (train's when timed) gives the headline ratios."""
    names = () if backends in ("auto", "train") else (backends,) if isinstance(backends, str) else tuple(backends)
    kernels = replace(base, kind="kernels", sdpa=names)  # empty: every kernel the device has
    found = cast(KernelsFound, run_fresh(kernels, "kernels", process_context()))
    timed = [found.used] if backends == "train" else [k for k in found.candidates if found.takes[k]]
    if not timed:
        raise UserError(
            f"backends={backends}: none of {', '.join(found.candidates)} takes this model's attention in "
            f"{base.precision} on {base.device}; add math (it takes every shape)"
        )
    primary = found.used if found.used in timed else timed[0]
    return KernelChoice(**asdict(found), timed=timed, primary=primary)


def make_phases(comparisons: list[str], base: Phase, xsa: GPTConfig, kernels: KernelChoice) -> dict[str, Phase]:
    """`sa_<kernel>` and `xsa_<kernel>` per timed kernel, and `lightning` (the headline) under train's order."""
    phases = {}
    for kernel in kernels.timed:
        plain_sa = "lightning_over_plain" in comparisons and kernel == kernels.primary
        if "xsa_over_sa" in comparisons or plain_sa:
            phases[f"sa_{kernel}"] = replace(base, sdpa=(kernel,))
        if "xsa_over_sa" in comparisons:
            phases[f"xsa_{kernel}"] = replace(base, model=xsa, sdpa=(kernel,))
    phases["lightning"] = replace(base, kind="lightning", sdpa=tuple(kernels.order))
    return phases


def round_order(phases: list[str], kernels: list[str], r: int) -> list[str]:
    """Round r's phases: each kernel's SA and XSA back to back, SA first in even rounds; kernels, Lightning rotate."""
    shift = r % len(kernels)
    groups = []
    for kernel in kernels[shift:] + kernels[:shift]:
        pair = [name for name in (f"sa_{kernel}", f"xsa_{kernel}") if name in phases]
        if pair:
            groups.append(pair if r % 2 == 0 else pair[::-1])
    groups.insert(r % (len(groups) + 1), ["lightning"])
    return [name for group in groups for name in group]


def median_step(result: TimedPhase, clock: str) -> float:
    return statistics.median(result.step_times if clock == "wall" else result.cpu_step_times)


def run_rounds(phases: dict[str, Phase], kernels: list[str], *, first: int, count: int, of: str) -> list[Round]:
    context, results = process_context(), []
    for r in range(first, first + count):
        t0, result = time.perf_counter(), Round()
        for name in round_order(list(phases), kernels, r):
            result[name] = cast(TimedPhase, run_fresh(phases[name], label=f"{name} (round {r + 1})", context=context))
        results.append(result)
        ms = ", ".join(f"{k} {v.step_ms_median:.1f} ms ({v.cpu_ms_median:.1f} CPU)" for k, v in result.items())
        print(f"round {r + 1}{of} ({time.perf_counter() - t0:.0f} s): {ms}", flush=True)
    return results


def per_round_ratios(rounds: list[Round], top: str, bottom: str, clock: str) -> list[float]:
    return [median_step(r[top], clock) / median_step(r[bottom], clock) for r in rounds]


def plan_rounds(
    pilot: list[Round], kernels: KernelChoice, elapsed_s: float, budget_s: float, max_rounds: int, device_type: str
) -> RoundsPlan:
    """The rounds the headline ratio (XSA/SA, else Lightning/plain step time) needs at the pilot's spread, within
    budget_s and max_rounds. Planned once: re-planning each round would stop when the interval happened to look
    decided, and such an interval covers less than 95%."""
    clock, primary = PLANNING_CLOCK[device_type], kernels.primary
    if f"xsa_{primary}" in pilot[0]:
        top, target = f"xsa_{primary}", TARGETS["xsa_over_sa_step_time"][device_type]
    else:
        top, target = "lightning", 1 / TARGETS["lightning_over_plain_throughput"]
    has_sa = f"sa_{primary}" in pilot[0]  # else Lightning alone: no ratio to plan for
    needed = rounds_needed(per_round_ratios(pilot, top, f"sa_{primary}", clock), target) if has_sa else len(pilot)
    pace = elapsed_s / len(pilot)
    affordable = len(pilot) + max(0, math.floor((budget_s - elapsed_s) / pace))
    total = max(len(pilot), min(needed, affordable, max_rounds))
    limited_by = "needed" if total >= needed else "budget_s" if affordable <= max_rounds else "max_rounds"
    finite = None if math.isinf(needed) else int(needed)
    return RoundsPlan(len(pilot), clock, finite, affordable, budget_s, max_rounds, pace, int(total), limited_by)


def model_label(model: dict, preset: dict) -> str:
    """The model's name, with the fields it sets apart from its preset's: `tiny (n_layer=6)`."""
    changed = [f"{key!s}={model[key]}" for key in model if key != "name" and model[key] != preset.get(key)]
    return f"{model['name']} ({', '.join(changed)})" if changed else str(model["name"])


def mfu_target(model: str, device: str) -> float | None:
    spec = TARGETS["mfu"]  # whole words: a GH200 is no H200
    applies = model == spec["model"] and any(re.search(rf"\b{gpu}\b", device) for gpu in spec["gpus"])
    return spec["at_least"] if applies else None


def summarize_rounds(
    rounds: list[Round], info: DevicePhase, *, model: str, device_type: str, tokens: int, kernels: KernelChoice
) -> tuple[dict[str, Any], dict[str, Ratio]]:
    """Per phase: median step times, tokens/s, peak memory, kernel; per comparison and clock, the ratios summarized."""
    out: dict = {}
    for name in rounds[0]:
        wall = statistics.median(median_step(r[name], "wall") for r in rounds)
        out[f"{name}_step_ms"] = 1e3 * wall
        out[f"{name}_cpu_ms"] = 1e3 * statistics.median(median_step(r[name], "cpu") for r in rounds)
        out[f"{name}_tokens_per_s"] = tokens / wall
        memory = [r[name].peak_memory_bytes for r in rounds]
        measured = [m for m in memory if m is not None]
        out[f"{name}_peak_memory_bytes"] = statistics.median(measured) if len(measured) == len(memory) else None
    out["phase_kernels"] = {name: rounds[0][name].sdpa_used for name in rounds[0]}
    primary, ratios = kernels.primary, dict[str, Ratio]()
    step_target = TARGETS["xsa_over_sa_step_time"][device_type]
    for kernel in [k for k in kernels.timed if f"xsa_{k}" in rounds[0]]:
        suffix = "" if kernel == primary else f"_{kernel}"
        for clock, key in (("wall", "xsa_over_sa_step_time"), ("cpu", "xsa_over_sa_cpu_time")):
            values = per_round_ratios(rounds, f"xsa_{kernel}", f"sa_{kernel}", clock)
            ratios[key + suffix] = summarize(values, step_target, at_most=True, kernel=kernel, clock=clock)
    if f"sa_{primary}" in rounds[0]:  # throughput ratio = plain step time / Lightning step time
        for clock, key in (("wall", "lightning_over_plain_throughput"), ("cpu", "lightning_over_plain_cpu_throughput")):
            values = per_round_ratios(rounds, f"sa_{primary}", "lightning", clock)
            target = TARGETS["lightning_over_plain_throughput"]
            ratios[key] = summarize(values, target, at_most=False, kernel=primary, clock=clock)
    if info.peak_flops is not None:
        per_round = [median_step(r["lightning"], "wall") for r in rounds]
        mfu = [tokens / t * info.flops_per_token / info.peak_flops for t in per_round]
        target = mfu_target(model, info.device)
        ratios["mfu"] = summarize(mfu, target, at_most=False, kernel=primary, clock="wall")
    xsa_memory, sa_memory = out.get(f"xsa_{primary}_peak_memory_bytes"), out.get(f"sa_{primary}_peak_memory_bytes")
    if xsa_memory and sa_memory:
        out["xsa_over_sa_peak_memory"] = xsa_memory / sa_memory
    return out, ratios


def bench(spec: BenchSpec, *, xsa: GPTConfig, groups: dict, model: str, config: dict) -> dict[str, Any]:
    """The report (bench.json); `model`: the label (model_label), `config`: the composed config, kept in it."""
    if spec.smoke:
        spec = spec.model_copy(update=SMOKE)
    device = resolve_device(spec.device)
    precision = resolve_bench_precision(spec.precision, device)
    sa, xsa = sa_and_xsa(xsa, spec.context)
    base = base_phase(spec, sa, device, precision, groups)
    tokens = spec.micro_batch * spec.context
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]
    kernels = kernel_choice(spec.backends, base)
    print(kernel_line(asdict(kernels)), flush=True)
    phases = make_phases(spec.comparisons, base, xsa, kernels)
    auto = spec.rounds == "auto"
    first = spec.pilot_rounds if auto else int(spec.rounds)
    t_rounds = time.perf_counter()
    rounds = run_rounds(phases, kernels.timed, first=0, count=first, of=" (pilot)" if auto else f"/{first}")
    plan = None
    if auto:
        elapsed, budget = time.perf_counter() - t_rounds, spec.budget_s
        plan = plan_rounds(rounds, kernels, elapsed, budget, spec.max_rounds, device.type)
        print(plan_line(asdict(plan)), flush=True)
        extra = plan.rounds - len(rounds)
        rounds += run_rounds(phases, kernels.timed, first=len(rounds), count=extra, of=f"/{plan.rounds}")
    device_phase = replace(phases["lightning"], kind="device")
    info = cast(DevicePhase, run_fresh(device_phase, label="device", context=process_context()))
    summary, ratios = summarize_rounds(
        rounds, info, model=model, device_type=device.type, tokens=tokens, kernels=kernels
    )
    return {
        **{key: value for key, value in asdict(info).items() if key != "pid"},  # the device, its peak FLOP/s, ...
        "precision": precision,
        "model": model,
        **spec.model_dump(include={"compile", "context", "micro_batch", "smoke", "steps", "warmup"}),
        "tokens_per_step": tokens,
        "vocab_size": phases["lightning"].model.vocab_size,
        "rounds": len(rounds),
        "rounds_setting": spec.rounds,
        "rounds_plan": None if plan is None else asdict(plan),
        "sdpa": asdict(kernels),
        "xsa_memory": xsa_memory(xsa, tokens=tokens, precision=precision),
        "phases": list(phases),
        "fresh_process_per_phase": True,
        "clocks": {"wall": "time.perf_counter, device-synchronised", "cpu": "time.process_time: all its threads"},
        # The headline: the trainer `xsa-lm train` runs (Lightning, SA).
        "tokens_per_s": summary["lightning_tokens_per_s"],
        "step_time_ms": summary["lightning_step_ms"],
        **summary,
        "peak_memory_source": rounds[0][next(iter(rounds[0]))].peak_memory_source,
        # Point estimates (the median of the per-round ratios) as top-level keys; the statistics beside them.
        **{key: s.median for key, s in ratios.items()},
        "ratios": {key: s.to_json() for key, s in ratios.items()},
        "targets": {key: s.target for key, s in ratios.items()},
        "verdicts": {key: s.verdict for key, s in ratios.items()},
        "per_round": [{name: asdict(phase) for name, phase in r.items()} for r in rounds],
        "runtime_s": time.perf_counter() - t_start,
        "load_avg_1min": [load_before, os.getloadavg()[0]],  # before, after: above the thread count = noisy run
        "model_config": asdict(phases["lightning"].model),
        "config": config,
        "run_info": run_info(attention={"order": kernels.order, "used": kernels.used}),
    }


def xsa_memory(model: GPTConfig, *, tokens: int, precision: str) -> dict[str, int]:
    """What one XSA layer adds at this step's size as `xsa-lm plan` counts it: saved, and backward temporaries."""
    compute, weights = memory.dtype_bytes(precision)
    shape = asdict(model)
    saved = memory.block_saved_per_token(shape, compute=compute, residual=weights, exclusive=True)["xsa"]
    return {
        "saved_per_layer": tokens * saved,
        "temporaries_eager": tokens * memory.xsa_transient_per_token(shape, compute=compute),
        "temporaries_compiled": tokens * memory.xsa_transient_per_token(shape, compute=compute, compiled=True),
    }


def xsa_memory_line(xsa: dict[str, int]) -> str:
    mib = 2**20
    return (
        f"XSA's memory per layer (the plan's count): saves {xsa['saved_per_layer'] / mib:.2f} MiB for the backward; "
        f"backward temporaries {xsa['temporaries_eager'] / mib:.2f} MiB eager, "
        f"{xsa['temporaries_compiled'] / mib:.2f} MiB compiled"
    )


def kernel_line(kernels: dict) -> str:
    not_taken = [k for k in kernels["candidates"] if not kernels["takes"][k]]
    skipped = f" (not taking this model's attention: {', '.join(not_taken)})" if not_taken else ""
    return (
        f"SDPA kernels: xsa-lm train's order here (sdpa_backends=auto) {', '.join(kernels['order'])} runs "
        f"{kernels['used']} for this model; timing SA and XSA under {', '.join(kernels['timed'])}{skipped}"
    )


def plan_line(plan: dict) -> str:
    needed = "no finite number (the pilot's centre is on the target)" if plan["needed"] is None else plan["needed"]
    return (
        f"rounds: the pilot's spread ({plan['clock']} clock) needs {needed} rounds for the 95% interval to decide the "
        f"target; {plan['affordable']} fit in budget_s={plan['budget_s']:g} ({plan['round_s']:.0f} s a round), "
        f"max_rounds={plan['max_rounds']}: running {plan['rounds']}"
    )


PHASE_LABELS = {"sa": "SA (plain loop)", "xsa": "XSA (plain loop)", "lightning": "SA (Lightning)"}
RATIO_LABELS = {
    "xsa_over_sa": "XSA/SA step time",
    "lightning_over_plain": "Lightning/plain tokens/s",
    "mfu": "MFU (Lightning, SA)",
}
CLOCK_LABELS = {"wall": "wall", "cpu": "CPU time"}
COLOURS = {MEETS: "green", MISSES: "red", NO_TARGET: "dim"}


def phase_table(r: dict) -> Table:
    compiled = ", compiled" if r["compile"] else ""
    table = Table(
        title=f"xsa-lm bench: {r['model']}, context {r['context']} x {r['micro_batch']}, {r['precision']}{compiled}, "
        f"{r['device']}; {r['rounds']} rounds x {r['steps']} steps, a fresh process per phase"
    )
    for col in ("phase", "SDPA kernel", "step ms (wall)", "step ms (CPU time)", "tokens/s", "peak memory"):
        table.add_column(col, justify="left" if col in ("phase", "SDPA kernel") else "right")
    for name in r["phases"]:
        memory = r[f"{name}_peak_memory_bytes"]
        memory_cell = "" if memory is None else f"{memory / 2**20:,.1f} MiB"
        label = PHASE_LABELS[name.split("_")[0]]
        cells = [f"{r[f'{name}_step_ms']:.1f}", f"{r[f'{name}_cpu_ms']:.1f}", f"{r[f'{name}_tokens_per_s']:,.0f}"]
        table.add_row(label, r["phase_kernels"][name], *cells, memory_cell)
    return table


def ratio_table(r: dict) -> Table:
    table = Table(title=f"per-round ratios: median, geometric mean, spread, {100 * 0.95:.0f}% t-interval")
    columns = ("ratio", "kernel", "clock", "median", "mean", "sd", "min - max", "95% interval", "target", "verdict")
    for col in columns:
        table.add_column(col, justify="left" if col in ("ratio", "kernel", "clock") else "right")
    for key, s in r["ratios"].items():
        fmt: Callable[[float], str] = (lambda v: f"{100 * v:.1f}%") if key == "mfu" else (lambda v: f"{v:.3f}")
        bounds = "n/a" if s["interval"] is None else f"{fmt(s['interval'][0])} - {fmt(s['interval'][1])}"
        target = "" if s["target"] is None else f"{'<=' if s['at_most'] else '>='} {fmt(s['target'])}"
        colour = COLOURS.get(s["verdict"], "yellow")
        spread = f"{fmt(s['min'])} - {fmt(s['max'])}"
        label = next(label for prefix, label in RATIO_LABELS.items() if key.startswith(prefix))
        cells = [label, s["kernel"], CLOCK_LABELS[s["clock"]], fmt(s["median"]), fmt(s["mean"])]
        table.add_row(*cells, fmt(s["sd"]), spread, bounds, target, f"[{colour}]{s['verdict']}[/]")
    if r.get("xsa_over_sa_peak_memory"):
        table.add_row("XSA/SA peak memory", r["sdpa"]["primary"], "", f"{r['xsa_over_sa_peak_memory']:.3f}", *[""] * 6)
    return table


def print_tables(r: dict) -> None:
    console = Console(width=max(Console().width, 140))
    console.print(phase_table(r))
    console.print(ratio_table(r))
    peak = "unknown" if r["peak_flops"] is None else f"{r['peak_flops'] / 1e12:.3f} TFLOP/s"
    print(
        f"MFU = tokens/s x {r['flops_per_token'] / 1e6:.2f} MFLOP/token (flop counter: "
        f"{r['flops_per_token_flop_counter'] / 1e6:.2f}) / {peak} ({r['peak_flops_source']})"
    )
    print(kernel_line(r["sdpa"]))
    print(xsa_memory_line(r["xsa_memory"]))
    if r["rounds_plan"]:
        print(plan_line(r["rounds_plan"]))
    load = r["load_avg_1min"]
    smoke = " (smoke: a few steps, numbers not meaningful)" if r["smoke"] else ""
    print(f"runtime {r['runtime_s']:.0f} s; 1-min load average {load[0]:.1f} -> {load[1]:.1f}{smoke}")


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="bench")
@one_line_errors
def main(cfg: DictConfig) -> None:
    check_switches(cfg, keys=("overwrite", "smoke", "compile", "reuse_host_memory"))
    if cfg.out is None or cfg.out == "":
        said = "null" if cfg.out is None else ""
        raise UserError(f"out={said}: bench writes its results to a file; give one, e.g. out=bench.json")
    out = Path(str(cfg.out))
    check_new_file(out, overwrite=cfg.overwrite, example="bench.json")
    config = cast(dict, OmegaConf.to_container(cfg, resolve=True))
    spec = bench_spec(config)
    if spec.context > cfg.model.block_size:
        raise UserError(f"context={spec.context} is above model.block_size={cfg.model.block_size}: lower it")
    preset = compose(config_name="bench", overrides=[f"model={HydraConfig.get().runtime.choices['model']}"]).model
    label = model_label(config["model"], cast(dict, OmegaConf.to_container(preset, resolve=True)))
    groups = {"optim": config["optim"], "scheduler": config["scheduler"]}
    result = bench(spec, xsa=model_config(cfg, spec.vocab_size), groups=groups, model=label, config=config)
    try:  # exclusive creation unless overwrite: a file another run wrote meanwhile is never replaced
        write_json(out, result, replace=cfg.overwrite)
    except FileExistsError:
        raise UserError(f"out={out} appeared during the run: not overwritten; choose another path") from None
    print_tables(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

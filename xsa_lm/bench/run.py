"""`xsa-lm bench`: SA vs XSA and Lightning vs a plain loop, each phase in a fresh process; a table and a JSON file.

Every round runs the phases (a plain loop training SA, the same loop training XSA, Lightning fitting SA) one after
another, each in its own fresh process, in an order that changes from round to round, so drift and noisy neighbours
hit all of them alike. Each round gives one XSA/SA step time ratio and one Lightning/plain throughput ratio; over the
rounds, their spread, a 95% interval and a verdict against the target (xsa_lm.bench.stats). Peak memory of a
training step comes from the same processes; tokens/s and MFU from the Lightning ones (what `xsa-lm train` runs).
"""

import itertools
import os
import re
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from xsa_lm.bench.fresh import process_context, run_fresh
from xsa_lm.bench.loops import Phase
from xsa_lm.bench.stats import MEETS, MISSES, NO_TARGET, summarize
from xsa_lm.compat import lightning_precision_name
from xsa_lm.config.builders import model_config
from xsa_lm.errors import UserError, exit_on_user_error, one_line_errors
from xsa_lm.files import write_json
from xsa_lm.train.runinfo import run_info

# XSA within noise of SA; Lightning as fast as a hand-written loop; the paper-size model's MFU
TARGETS: dict[str, Any] = {
    "xsa_over_sa_step_time": {"cpu": 1.02, "cuda": 1.01},
    "lightning_over_plain_throughput": 0.97,
    "mfu": {"model": "paper_0.7b", "gpus": ("H100", "H200"), "at_least": 0.45},
}
COMPARISONS = {"xsa_over_sa": ("sa", "xsa"), "lightning_over_plain": ("sa", "lightning")}
SMOKE = {"rounds": 2, "steps": 2, "warmup": 1}


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


def resolve_bench_precision(precision: str, device: torch.device) -> str:
    """auto: fp32 on CPU (even where torch would offer bf16), bf16 on a GPU. Decided without asking the GPU whether
    it has bf16: that would create a CUDA context in this process, which only waits for the phases."""
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


def make_phases(cfg: DictConfig, n: dict, device: torch.device, precision: str) -> dict[str, Phase]:
    """The phases this run needs: `sa` and `xsa` (the plain loop), `lightning` (always: the headline tokens/s and
    MFU) and `device` (peak FLOP/s, FLOPs per token)."""
    xsa = model_config(cfg, cfg.vocab_size)
    if xsa.attention != "xsa":
        raise UserError("bench compares SA with the XSA variant given by attention=xsa (its layers and gate)")
    xsa = replace(xsa, block_size=cfg.context)
    sa = replace(xsa, attention="sa", xsa_layers=None, xsa_gate=False)
    unknown = set(cfg.comparisons) - set(COMPARISONS)
    if unknown:
        raise UserError(f"comparisons: unknown {sorted(unknown)}; choose from {sorted(COMPARISONS)}")
    base = Phase(
        kind="plain",
        model=sa,
        device=device.type,
        precision=precision,
        compile=cfg.compile,
        optimizer=cast(dict, OmegaConf.to_container(cfg.optim, resolve=True)),  # DictConfigs give dicts
        scheduler=cast(dict, OmegaConf.to_container(cfg.scheduler, resolve=True)),
        micro_batch=cfg.micro_batch,
        warmup=n["warmup"],
        steps=n["steps"],
        seed=cfg.seed,
        threads=cfg.threads,
        reuse_host_memory=bool(cfg.reuse_host_memory),
    )
    every = {"sa": base, "xsa": replace(base, model=xsa), "lightning": replace(base, kind="lightning")}
    needed = {"lightning"} | {name for c in cfg.comparisons for name in COMPARISONS[c]}
    return {name: every[name] for name in ("sa", "xsa", "lightning") if name in needed}


def run_rounds(phases: dict[str, Phase], rounds: int) -> list[dict[str, dict]]:
    """Each round runs every phase once, each in a fresh process; the order cycles through all permutations."""
    orders, context, results = list(itertools.permutations(phases)), process_context(), []
    for r in range(rounds):
        t0, result = time.perf_counter(), {}
        for name in orders[r % len(orders)]:
            result[name] = run_fresh(phases[name], label=f"{name} (round {r + 1})", context=context)
        results.append(result)
        ms = ", ".join(f"{k} {1e3 * statistics.median(v['step_times']):.1f} ms" for k, v in result.items())
        print(f"round {r + 1}/{rounds} ({time.perf_counter() - t0:.0f} s): {ms}", flush=True)
    return results


def mfu_target(model: str, device: str) -> float | None:
    spec = TARGETS["mfu"]  # whole words: a GH200 is no H200
    applies = model == spec["model"] and any(re.search(rf"\b{gpu}\b", device) for gpu in spec["gpus"])
    return spec["at_least"] if applies else None


def summarize_rounds(rounds: list[dict[str, dict]], info: dict, *, model: str, device_type: str, tokens: int) -> dict:
    """Per phase: median step time, tokens/s, peak memory; per comparison: the per-round ratios summarized."""
    step = {name: [statistics.median(r[name]["step_times"]) for r in rounds] for name in rounds[0]}
    out: dict = {}
    for name, times in step.items():
        out[f"{name}_step_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_tokens_per_s"] = tokens / statistics.median(times)
        memory = [r[name]["peak_memory_bytes"] for r in rounds]
        out[f"{name}_peak_memory_bytes"] = None if None in memory else statistics.median(memory)
    ratios = {}
    if "xsa" in step:
        ratios["xsa_over_sa_step_time"] = summarize(
            [x / s for x, s in zip(step["xsa"], step["sa"], strict=True)],
            target=TARGETS["xsa_over_sa_step_time"][device_type],
            at_most=True,
        )
    if "sa" in step:  # throughput ratio = plain step time / Lightning step time
        ratios["lightning_over_plain_throughput"] = summarize(
            [p / lt for p, lt in zip(step["sa"], step["lightning"], strict=True)],
            target=TARGETS["lightning_over_plain_throughput"],
            at_most=False,
        )
    if info["peak_flops"] is not None:
        mfu = [tokens / t * info["flops_per_token"] / info["peak_flops"] for t in step["lightning"]]
        ratios["mfu"] = summarize(mfu, target=mfu_target(model, info["device"]), at_most=False)
    if out.get("xsa_peak_memory_bytes") and out.get("sa_peak_memory_bytes"):
        out["xsa_over_sa_peak_memory"] = out["xsa_peak_memory_bytes"] / out["sa_peak_memory_bytes"]
    return out | {"ratios": ratios}


FLOPS_KEYS = ("flops_per_token", "flops_per_token_flop_counter", "peak_flops", "peak_flops_source")


def with_step_medians(round_results: dict[str, dict]) -> dict[str, dict]:
    """One round's results, each phase's with its median step time in ms."""
    return {
        name: {**result, "step_ms_median": 1e3 * statistics.median(result["step_times"])}
        for name, result in round_results.items()
    }


def check_sizes(cfg: DictConfig) -> None:
    """The whole numbers of a bench, before any phase starts (a zero would fail inside a phase's process)."""
    lowest = {"micro_batch": 1, "context": 1, "steps": 1, "warmup": 0, "vocab_size": 1, "seed": 0, "threads": 1}
    for key, low in lowest.items():
        value = cfg[key]
        if (key != "threads" or value is not None) and (type(value) is not int or value < low):
            raise UserError(f"{key}={value!r} must be an integer >= {low}" + (" (or null)" if key == "threads" else ""))
    if cfg.context > cfg.model.block_size:
        raise UserError(f"context={cfg.context} is above model.block_size={cfg.model.block_size}: lower it")


def bench(cfg: DictConfig) -> dict:
    n = {k: cfg[k] for k in ("rounds", "steps", "warmup")} | (SMOKE if cfg.smoke else {})
    if n["rounds"] < 2:
        raise UserError(f"rounds={n['rounds']}: at least 2 are needed for an interval")
    check_sizes(cfg)
    device = resolve_device(cfg.device)
    precision = resolve_bench_precision(cfg.precision, device)
    phases = make_phases(cfg, n, device, precision)
    tokens = cfg.micro_batch * cfg.context
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]
    rounds = run_rounds(phases, n["rounds"])
    info = run_fresh(replace(phases["lightning"], kind="device"), label="device", context=process_context())
    summary = summarize_rounds(rounds, info, model=cfg.model.name, device_type=device.type, tokens=tokens)
    ratios = summary.pop("ratios")
    lightning = statistics.median(statistics.median(r["lightning"]["step_times"]) for r in rounds)
    memory_source = rounds[0][next(iter(rounds[0]))]["peak_memory_source"]
    return {
        "device": info["device"],
        "precision": precision,
        "compile": cfg.compile,
        "model": cfg.model.name,
        "context": cfg.context,
        "micro_batch": cfg.micro_batch,
        "tokens_per_step": tokens,
        "vocab_size": phases["lightning"].model.vocab_size,
        "smoke": cfg.smoke,
        "host_memory_reuse": info["host_memory_reuse"],
        "threads": info["threads"],
        **n,
        "phases": list(phases),
        "fresh_process_per_phase": True,
        # The headline: the trainer `xsa-lm train` runs (Lightning, SA).
        "tokens_per_s": tokens / lightning,
        "step_time_ms": 1e3 * lightning,
        **summary,
        "peak_memory_source": memory_source,
        # Point estimates (the median of the per-round ratios) as top-level keys; the statistics beside them.
        **{key: s["median"] for key, s in ratios.items()},
        "ratios": ratios,
        "targets": {key: s["target"] for key, s in ratios.items()},
        "verdicts": {key: s["verdict"] for key, s in ratios.items()},
        **{key: info[key] for key in FLOPS_KEYS},
        "per_round": [with_step_medians(r) for r in rounds],
        "runtime_s": time.perf_counter() - t_start,
        "load_avg_1min": [load_before, os.getloadavg()[0]],  # before, after: above the thread count = noisy run
        "model_config": asdict(phases["lightning"].model),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "run_info": run_info(),
    }


LABELS = {"sa": "SA (plain loop)", "xsa": "XSA (plain loop)", "lightning": "SA (Lightning)"}
RATIO_LABELS = {
    "xsa_over_sa_step_time": "XSA/SA step time",
    "lightning_over_plain_throughput": "Lightning/plain tokens/s",
    "mfu": "MFU (Lightning, SA)",
}
COLOURS = {MEETS: "green", MISSES: "red", NO_TARGET: "dim"}


def phase_table(r: dict) -> Table:
    compiled = ", compiled" if r["compile"] else ""
    table = Table(
        title=f"xsa-lm bench: {r['model']}, context {r['context']} x {r['micro_batch']}, {r['precision']}{compiled}, "
        f"{r['device']}; {r['rounds']} rounds x {r['steps']} steps, a fresh process per phase"
    )
    for col in ("phase", "step ms (median)", "tokens/s", "peak memory"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for name in r["phases"]:
        memory = r[f"{name}_peak_memory_bytes"]
        memory_cell = "" if memory is None else f"{memory / 2**20:,.1f} MiB"
        table.add_row(LABELS[name], f"{r[f'{name}_step_ms']:.1f}", f"{r[f'{name}_tokens_per_s']:,.0f}", memory_cell)
    return table


def ratio_table(r: dict) -> Table:
    table = Table(title=f"per-round ratios: median, geometric mean, spread, {100 * 0.95:.0f}% t-interval")
    for col in ("ratio", "median", "mean", "sd", "min - max", "95% interval", "target", "verdict"):
        table.add_column(col, justify="left" if col == "ratio" else "right")
    for key, s in r["ratios"].items():
        fmt = (lambda v: f"{100 * v:.1f}%") if key == "mfu" else (lambda v: f"{v:.3f}")
        bounds = "n/a" if s["interval"] is None else f"{fmt(s['interval'][0])} - {fmt(s['interval'][1])}"
        target = "" if s["target"] is None else f"{'<=' if s['at_most'] else '>='} {fmt(s['target'])}"
        colour = COLOURS.get(s["verdict"], "yellow")
        spread = f"{fmt(s['min'])} - {fmt(s['max'])}"
        cells = [RATIO_LABELS[key], fmt(s["median"]), fmt(s["mean"]), fmt(s["sd"]), spread, bounds, target]
        table.add_row(*cells, f"[{colour}]{s['verdict']}[/]")
    if r.get("xsa_over_sa_peak_memory"):
        table.add_row("XSA/SA peak memory", f"{r['xsa_over_sa_peak_memory']:.3f}", *[""] * 6)
    return table


def print_tables(r: dict) -> None:
    console = Console(width=max(Console().width, 120))
    console.print(phase_table(r))
    console.print(ratio_table(r))
    peak = "unknown" if r["peak_flops"] is None else f"{r['peak_flops'] / 1e12:.3f} TFLOP/s"
    print(
        f"MFU = tokens/s x {r['flops_per_token'] / 1e6:.2f} MFLOP/token (flop counter: "
        f"{r['flops_per_token_flop_counter'] / 1e6:.2f}) / {peak} ({r['peak_flops_source']})"
    )
    load = r["load_avg_1min"]
    smoke = " (smoke: a few steps, numbers not meaningful)" if r["smoke"] else ""
    print(f"runtime {r['runtime_s']:.0f} s; 1-min load average {load[0]:.1f} -> {load[1]:.1f}{smoke}")


def write(out: Path, result: dict, overwrite: bool) -> None:
    """Exclusive creation unless overwrite: a file another run wrote meanwhile is never replaced."""
    try:
        write_json(out, result, replace=overwrite)
    except FileExistsError:
        raise UserError(f"out={out} appeared during the run: not overwritten; choose another path") from None


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="bench")
@one_line_errors
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        out = Path(cfg.out)
        if out.exists() and not cfg.overwrite:  # checked first, so that minutes of benchmarking are not lost
            raise UserError(f"out={out} exists: choose another path or add overwrite=true")
        result = bench(cfg)
        write(out, result, overwrite=cfg.overwrite)
    print_tables(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

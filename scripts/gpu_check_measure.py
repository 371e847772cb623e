"""The measurements of scripts/gpu_check.sh that are not `xsa-lm` commands. Each result goes into DIR as soon as it is
taken (gpu_check_summary.record), so a step stopped at its time limit keeps what it measured until then.

    python scripts/gpu_check_measure.py DIR xsa_orthogonality --shape 12,64,2048 --shape 6,256,2048
    python scripts/gpu_check_measure.py DIR bench_gpt2_124m --model gpt2_124m --context 2048 --micro-batch 8

`xsa_orthogonality`: max |cos(z, v)| of XSA's fused op against xsa_reference under bf16 autocast, per
heads,head_dim,context. Any other name: SA and XSA of one model preset in this one process (each compiled once), eager
then compiled: step time per round, XSA/SA with its interval, tokens/s, MFU, the SDPA kernels that run, and the peak
memory of a step against xsa_lm.train.memory.estimate.
"""

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from gpu_check_summary import record
from gpu_xsa_lm import use_working_tree

TOTAL_STEPS = 1000  # the LR schedule's length: the measured steps stay in its warm-up, as a run's first steps do


def orthogonality(directory: Path, key: str, device: torch.device, shapes: list[tuple[int, int, int]]) -> None:
    from xsa_lm.bench.probes import orthogonality_holds, xsa_orthogonality
    from xsa_lm.train.hardware import device_name

    result = {"device": device_name(device), "shapes": []}
    for heads, head_dim, context in shapes:
        measured = xsa_orthogonality(device, heads=heads, head_dim=head_dim, context=context)
        result["shapes"].append(measured | {"holds": orthogonality_holds(measured)})
        record(directory, key, result)
        print(f"{key}: {heads}x{head_dim} at {context}: max |cos(z, v)| {measured['max_abs_cos']}", flush=True)


def model_pair(args: argparse.Namespace):
    """The bench config for this preset (as `xsa-lm bench model=... attention=xsa` composes it) and its XSA model."""
    from hydra import compose, initialize_config_module

    from xsa_lm.config.builders import model_config

    overrides = [
        f"model={args.model}",
        "attention=xsa",
        f"context={args.context}",
        f"micro_batch={args.micro_batch}",
        f"vocab_size={args.vocab_size}",
        *args.override,
    ]
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        cfg = compose(config_name="bench", overrides=overrides)
    return cfg, replace(model_config(cfg, cfg.vocab_size), block_size=args.context)


def bench(directory: Path, key: str, device: torch.device, args: argparse.Namespace) -> None:
    """SA and XSA built once, measured eager and then compiled; the result recorded after every measurement."""
    from xsa_lm.bench.interleaved import build_pair
    from xsa_lm.bench.loops import N_BATCHES, Setup, make_batches
    from xsa_lm.bench.run import resolve_bench_precision
    from xsa_lm.config.builders import build
    from xsa_lm.train.hardware import device_name, peak_flops

    t_start = time.perf_counter()
    cfg, config = model_pair(args)
    precision = resolve_bench_precision("auto", device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    setup = Setup(
        device, precision=precision, compile=False, optimizer=build(cfg.optim), scheduler=build(cfg.scheduler)
    )
    trainers = build_pair(config, setup, seed=cfg.seed, total_steps=TOTAL_STEPS)
    batches = make_batches(
        N_BATCHES,
        micro_batch=args.micro_batch,
        context=args.context,
        vocab=config.vocab_size,
        seed=0,
        pin=device.type == "cuda",
    )
    peak, source = peak_flops(device, precision)
    result: dict = {
        "model": cfg.model.name,
        "device": device_name(device),
        "precision": precision,
        "context": args.context,
        "micro_batch": args.micro_batch,
        "tokens_per_step": args.micro_batch * args.context,
        "vocab_size": config.vocab_size,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": trainers["sa"].model.flops_per_token(args.context),
        "peak_flops": peak,
        "peak_flops_source": source,
    }

    def save(what: str) -> None:
        seconds = round(time.perf_counter() - t_start, 1)
        record(directory, key, result | {"seconds": seconds})
        print(f"{key}: {what} recorded at {seconds} s", flush=True)

    save("setup")
    for phase in ("eager", "compiled"):
        measure_phase(phase, trainers, batches, args=args, result=result, save=save)


def measure_phase(
    phase: str, trainers: dict, batches: list, *, args: argparse.Namespace, result: dict, save: Callable[[str], None]
) -> None:
    """Warm-up (and compilation), timed rounds, the SDPA kernels of a step and its peak memory, into result."""
    from xsa_lm.bench.interleaved import compare, memory_against_plan, timed_rounds
    from xsa_lm.bench.probes import sdpa_kernels
    from xsa_lm.bench.run import TARGETS, mfu_target

    compiled = phase == "compiled"
    result[f"warmup_s_{phase}"] = {}
    for name, trainer in trainers.items():
        if compiled:
            trainer.compile()
        t0 = time.perf_counter()
        trainer.run(batches, args.warmup)  # compilation, when compiled, happens in the first of these
        result[f"warmup_s_{phase}"][name] = round(time.perf_counter() - t0, 1)
        save(f"{phase} warm-up of {name}")
    result[phase] = compare(
        timed_rounds(trainers, batches, rounds=args.rounds, steps=args.steps),
        tokens=result["tokens_per_step"],
        flops_per_token=result["flops_per_token"],
        peak_flops=result["peak_flops"],
        step_time_target=TARGETS["xsa_over_sa_step_time"][trainers["sa"].setup.device.type],
        mfu_target=mfu_target(result["model"], result["device"]),
    )
    times = ", ".join(f"{name} {result[phase][name]['step_ms']:.1f} ms" for name in trainers)
    save(f"{phase} step times ({times})")
    kernels = {name: sdpa_kernels(lambda t=trainer: t.step(batches[0])) for name, trainer in trainers.items()}
    result[f"kernels_{phase}"] = kernels
    save(f"{phase} SDPA backends {kernels['sa']['backends']}")
    result[f"memory_{phase}"] = {}
    for name, trainer in trainers.items():
        measured = memory_against_plan(trainer, batches, micro_batch=args.micro_batch, compiled=compiled)
        result[f"memory_{phase}"][name] = measured
        save(f"{phase} peak memory of {name} ({measured['measured_over_planned']:.2f} x the estimate)")


def shape(text: str) -> tuple[int, int, int]:
    heads, head_dim, context = (int(v) for v in text.split(","))
    return heads, head_dim, context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="the check's directory (check.json, measurements.json)")
    parser.add_argument("key", help="xsa_orthogonality, or the name a model's results are recorded under")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", type=shape, action="append", default=[], help="heads,head_dim,context")
    parser.add_argument("--model", default="gpt2_124m", help="a preset of configs/model")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=50257, help="where the preset leaves it to the tokenizer")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and phase")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override of the bench config")
    args = parser.parse_args()
    use_working_tree()
    device = torch.device(args.device)
    if args.key == "xsa_orthogonality":
        orthogonality(args.directory, args.key, device, args.shape)
    else:
        bench(args.directory, args.key, device, args)


if __name__ == "__main__":
    main()

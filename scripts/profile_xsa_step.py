"""Where XSA's extra time goes in a compiled training step: the device time per step of each kernel, SA beside XSA,
from torch.profiler over a few steps of the bench's plain loop (each block compiled as training compiles it).

    python scripts/profile_xsa_step.py                        # gpt2_124m, 8 x 2048 tokens, bf16, on the GPU
    python scripts/profile_xsa_step.py --device cpu --model tiny --context 64 --micro-batch 2 --vocab-size 512

On a machine without xsa-lm installed (the GPU check's), with the bundle: PYTHONPATH=build/gpu-bundle/site. Kernels
that Inductor numbers per graph (triton_..._4 in one model, _5 in the other) are paired by their name without that
number. Prints a table, XSA minus SA, largest first; --out FILE writes the same as JSON.
"""

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_xsa_lm import use_working_tree  # noqa: E402

use_working_tree()
import gpu_check_measure  # noqa: E402

from xsa_lm.bench.loops import PlainTrainer, make_batches  # noqa: E402
from xsa_lm.errors import UserError  # noqa: E402
from xsa_lm.train.module import compile_model  # noqa: E402

WARMUP_STEPS = 3  # compiling, then autotuning and the allocator settling


def kernel_times(trainer: PlainTrainer, batches: list, *, steps: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per step of each kernel (CUDA) or operator (CPU), its own time, summed over its calls."""
    cuda = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        trainer.run(batches, steps)
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        microseconds = event.self_device_time_total if cuda else event.self_cpu_time_total
        if microseconds > 0:
            times[re.sub(r"_\d+$", "", event.key)] += microseconds / steps / 1e3
    return dict(times)


def compare(sa: dict[str, float], xsa: dict[str, float]) -> list[dict]:
    """Per kernel: SA's and XSA's ms per step and their difference, the largest difference first."""
    rows = [{"kernel": k, "sa_ms": sa.get(k, 0.0), "xsa_ms": xsa.get(k, 0.0)} for k in sa.keys() | xsa.keys()]
    for row in rows:
        row["xsa_minus_sa_ms"] = row["xsa_ms"] - row["sa_ms"]
    return sorted(rows, key=lambda r: -abs(r["xsa_minus_sa_ms"]))


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="gpt2_124m")
    parser.add_argument("--context", type=positive, default=2048)
    parser.add_argument("--micro-batch", type=positive, default=8)
    parser.add_argument("--vocab-size", type=positive, default=50304)
    parser.add_argument("--steps", type=positive, default=3)
    parser.add_argument("--override", action="append", default=[], help="a bench config override, e.g. model.n_layer=2")
    parser.add_argument("--rows", type=positive, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: {args.out.parent} is not a folder")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: --device cpu profiles on the CPU")
    try:
        spec = gpu_check_measure.bench_spec(args)
    except (HydraException, OmegaConfBaseException, UserError) as e:  # an unknown model, a bad override
        parser.error(str(e).splitlines()[0])
    setup = gpu_check_measure.plain_setup(spec, device)
    precision, measured = setup.precision, {}
    for name, config in zip(("sa", "xsa"), spec.models, strict=True):
        trainer = PlainTrainer(config, setup, spec.seed, WARMUP_STEPS + args.steps)
        compile_model(trainer.model)
        batches = make_batches(config, micro_batch=args.micro_batch, seed=0, device=device)
        trainer.run(batches, WARMUP_STEPS)
        measured[name] = kernel_times(trainer, batches, steps=args.steps, device=device)
    rows = compare(measured["sa"], measured["xsa"])
    totals = {name: sum(times.values()) for name, times in measured.items()}
    print(f"{spec.model.name}, {args.micro_batch} x {args.context} tokens, {precision}, compiled, on {device.type}:")
    print(f"kernel time per step: SA {totals['sa']:.3f} ms, XSA {totals['xsa']:.3f} ms")
    print("| XSA - SA (ms) | SA (ms) | XSA (ms) | kernel |\n|---:|---:|---:|---|")
    for row in rows[: args.rows]:
        cells = (row["xsa_minus_sa_ms"], row["sa_ms"], row["xsa_ms"])
        print("| " + " | ".join(f"{c:+.3f}" if i == 0 else f"{c:.3f}" for i, c in enumerate(cells)), end="")
        print(f" | {row['kernel'][:120]} |")
    if args.out:
        args.out.write_text(json.dumps({"device": device.type, "totals_ms": totals, "kernels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The measurements of scripts/gpu_check.sh that are not `xsa-lm` commands. Each result goes into DIR as soon as it is
taken (gpu_check_summary.record), and each step measures what matters most first, so a step stopped at its limit
keeps the important part.

    python scripts/gpu_check_measure.py DIR xsa_bf16 --shape 12,64,2048 --shape 6,256,2048
    python scripts/gpu_check_measure.py DIR bench_gpt2_124m --model gpt2_124m --context 2048 --backends cudnn,flash

`xsa_bf16`: XSA in bf16 against fp64 on the same inputs, per heads,head_dim,context: the gradients (and output) of the
fused exclusive_output_projection, eager and compiled, against xsa_reference + F.linear in fp64, then the forward's
orthogonality (max |cos(z, v)|). Any other key: SA and XSA of one model preset in this process (`xsa-lm bench` runs
each phase in a fresh process instead: no phase inherits another's state, but each recompiles; this is for a GPU lent
for minutes), compiled as training compiles them (each block on its own), under each SDPA backend in turn, the first
with the most rounds: paired rounds of step times -> XSA/SA with its 95% interval, tokens/s, MFU, the backend that ran
(from torch.profiler's names), peak memory against xsa_lm.train.memory; then eager. GPU_CHECK_DEADLINE (Unix
seconds, set by gpu_check.sh) ends optional work in time.
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check_summary import record
from gpu_xsa_lm import use_working_tree

TOTAL_STEPS = 1000  # the LR schedule's length: the measured steps stay in its warm-up, as a run's first steps do
# bf16's unit roundoff: rounding to nearest moves x by at most 2^-8 |x|. The fused op's output and its gradients for
# y, v and W_o may differ from fp64 on the same inputs by 2 roundings, as ||bf16 - fp64|| / ||fp64|| (dL/dz = dL/dout
# W_o is rounded, then the gradient itself); the gate's gradient, a sum over tokens of -(g . v) c that cancels, by 2
# roundings of each term: 2 x 2^-8 (|exact| + sum |g| . |v| |c|) per head. tests/test_attention.py holds the op to
# these bounds on CPU with W_o in bf16. Under autocast W_o is fp32 and its rounding to bf16 is one more, inside the
# bound in practice: at most 0.86 x 2^-8 measured on CPU (both variants, both shapes of the GPU check at T512).
BF16_UNIT = 2.0**-8
GRADIENT_BOUND = 2 * BF16_UNIT
RESOLUTION = 0.01  # an XSA/SA interval narrower than this can tell a 1% difference from none
XSA_EPS = 1e-6
KEPT_NORM = 0.01  # |z_i| below this share of |y_i|: too little left of y_i to have a direction
# The aten operator scaled_dot_product_attention dispatched to -> its backend.
SDPA_BACKENDS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
}
KERNEL_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")  # device kernels of SDPA's backends
MAX_NAME = 160  # templated kernel names run to kilobytes
MAX_NAMES = 12


class Deadline:
    """When this step must end (GPU_CHECK_DEADLINE, Unix seconds): optional work that would run past it is skipped
    rather than cut off mid-way."""

    def __init__(self) -> None:
        self.at = float(os.environ.get("GPU_CHECK_DEADLINE", "inf"))

    def left(self) -> float:
        return self.at - time.time()


def compile_seconds() -> dict[str, float]:
    """torch.compile's cumulative wall seconds in this process by phase (torch._dynamo.utils.compile_times), those of
    half a second or more: `_compile.compile_inner` is all of it, `GraphLowering.codegen` the generating and building
    of kernels (C++ with a compiler on CPU, Triton on a GPU). What the next check's time limits are derived from."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)  # type: ignore[misc]  # csv: (names, values)
    return {name: round(float(v), 1) for name, v in zip(names, values, strict=True) if float(v) >= 0.5}


# ---- XSA in bf16 ------------------------------------------------------------------------------------------------


def attention_inputs(device: torch.device, *, heads: int, head_dim: int, context: int, batch: int, seed: int):
    """y and v as an XSA layer gets them under bf16 autocast (v from a linear layer, y from causal SDPA), in the
    layer's (B, T, H_kv, G, D) layout, and a W_o initialised as the model initialises it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = heads * head_dim
    x = torch.randn(batch, context, width, generator=g).to(device)
    w_qkv = (torch.randn(3 * width, width, generator=g) / width**0.5).to(device)
    w_o = (0.02 * torch.randn(width, width, generator=g)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16), torch.no_grad():
        qkv = F.linear(x, w_qkv).view(batch, context, 3 * heads, head_dim).transpose(1, 2)
        q, k, v = qkv.split(heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y_t, v_t = y.transpose(1, 2).unflatten(2, (heads, 1)), v.transpose(1, 2).unsqueeze(3)
    grad_out = torch.randn(batch, context, width, generator=g).to(device, torch.bfloat16)
    return y_t.contiguous(), v_t.contiguous(), w_o, grad_out


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()


def projection_grads(
    fn: Callable, inputs: dict[str, torch.Tensor], grad_out: torch.Tensor, *, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """out = fn(y, v, scale, W_o) and its gradients for each input: under bf16 autocast (dtype None), or with every
    input in `dtype` and no autocast."""
    leaves = {name: (t if dtype is None else t.to(dtype)).detach().requires_grad_() for name, t in inputs.items()}
    autocast = torch.autocast(grad_out.device.type, dtype=torch.bfloat16) if dtype is None else contextlib.nullcontext()
    with autocast:
        out = fn(leaves["y"], leaves["v"], leaves["scale"], leaves["W_o"])
    out.backward(grad_out if dtype is None else grad_out.to(dtype))
    return {"out": out.detach()} | {name: t.grad for name, t in leaves.items()}


def fused(y, v, scale, w_o):
    from xsa_lm.model.xsa import exclusive_output_projection

    return exclusive_output_projection(y, v, w_o, None, eps=XSA_EPS, scale=scale)


def plain(y, v, scale, w_o):
    from xsa_lm.model import xsa_reference

    return F.linear(xsa_reference(y, v, XSA_EPS, scale).flatten(-3), w_o)


def gate_error_bound(inputs: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], grad_out: torch.Tensor):
    """Per head, 2 roundings of each term of the gate's gradient: 2^-8 (|exact| + sum |g| . |v| |c|) with g = dL/dz."""
    y, v, w_o = (inputs[k].double() for k in ("y", "v", "W_o"))
    grad_z = (grad_out.double() @ w_o).view(y.shape)
    coef = (y * v).sum(-1, keepdim=True) / ((v * v).sum(-1, keepdim=True) + XSA_EPS)
    magnitude = ((grad_z.abs() * v.abs()).sum(-1, keepdim=True) * coef.abs()).sum_to_size(inputs["scale"].shape)
    return GRADIENT_BOUND * (exact["scale"].abs() + magnitude)


def xsa_gradients(
    device: torch.device, *, heads: int, head_dim: int, context: int, batch: int = 2, compiled: bool = True
) -> dict:
    """The output and gradients of the fused op in bf16 against xsa_reference + F.linear in fp64 on the same values:
    eager and compiled under autocast with W_o in fp32 (bf16-mixed, every strategy), eager with every input in bf16
    (bf16-true); plain autograd of the paper formula under autocast for scale. The gated variant (scale tanh 0.5):
    it has every term of the backward. Relative errors ||bf16 - fp64|| / ||fp64||; the gate's against its bound."""
    y, v, w_o, grad_out = attention_inputs(device, heads=heads, head_dim=head_dim, context=context, batch=batch, seed=1)
    inputs = {"y": y, "v": v, "scale": torch.full((heads, 1, 1), math.tanh(0.5), device=device), "W_o": w_o}
    exact = projection_grads(plain, inputs, grad_out, dtype=torch.float64)
    gate_bound = gate_error_bound(inputs, exact, grad_out)
    variants = {
        "fused": (fused, None),
        "fused_compiled": (torch.compile(fused, dynamic=False), None),
        "fused_bf16_weights": (fused, torch.bfloat16),
        "plain_autograd": (plain, None),
    }
    if not compiled:
        del variants["fused_compiled"]
    errors, holds = {}, {}
    for name, (fn, dtype) in variants.items():
        measured = projection_grads(fn, inputs, grad_out, dtype=dtype)
        relative = {key: relative_error(measured[key], exact[key]) for key in exact if key != "scale"}
        gate_over_bound = ((measured["scale"].double() - exact["scale"]).abs() / gate_bound).max().item()
        holds[name] = max(relative.values()) <= GRADIENT_BOUND and gate_over_bound <= 1
        errors[name] = relative | {"scale_over_its_bound": gate_over_bound}
    return {
        "shape": [batch, heads, context, head_dim],
        "dtype": str(y.dtype).removeprefix("torch."),
        "relative_error": errors,
        "bound": GRADIENT_BOUND,
        "holds_per_variant": holds,
        "holds": all(ok for name, ok in holds.items() if name.startswith("fused")),
    }


def max_abs_cos(z: torch.Tensor, v: torch.Tensor, kept: torch.Tensor) -> float:
    """The largest |cos(z_i, v_i)| over the kept tokens and heads, in fp64 from the given (rounded) values."""
    z64, v64 = z.double(), v.double()
    cos = (z64 * v64).sum(-1) / (z64.norm(dim=-1) * v64.norm(dim=-1)).clamp_min(1e-30)
    return cos[kept].abs().max().item()


def xsa_orthogonality(device: torch.device, *, heads: int, head_dim: int, context: int, batch: int = 2) -> dict:
    """max |cos(z, v)| of XSA's fused op (eager and compiled) and of xsa_reference, on y and v as the model makes
    them under bf16 autocast (attention_inputs). The exact reference shows the floor that bf16 rounding of z sits
    above (in fp64); before XSA, |cos(y, v)| for scale."""
    from xsa_lm.model import exclusive_projection, xsa_reference

    y, v, _, _ = attention_inputs(device, heads=heads, head_dim=head_dim, context=context, batch=batch, seed=0)
    with torch.autocast(device.type, dtype=torch.bfloat16), torch.no_grad():
        fused = exclusive_projection(y, v)
        reference = xsa_reference(y, v)
        compiled = torch.compile(exclusive_projection, dynamic=False)(y, v)
    exact = xsa_reference(y.double(), v.double())
    # Tokens whose y_i is (nearly) parallel to v_i are left out: there z_i is (nearly) zero and its direction is
    # rounding noise (the first token attends only to itself: y_0 = v_0).
    kept = exact.norm(dim=-1) > KEPT_NORM * y.double().norm(dim=-1)
    return {
        "shape": [batch, heads, context, head_dim],
        "dtype": str(y.dtype).removeprefix("torch."),
        "max_abs_cos": {
            "fused": max_abs_cos(fused, v, kept),
            "fused_compiled": max_abs_cos(compiled, v, kept),
            "reference": max_abs_cos(reference, v, kept),
            "reference_fp64": max_abs_cos(exact, v, kept),
            "before_xsa": max_abs_cos(y, v, kept),
        },
        "tokens_left_out": int((~kept).sum()),
        "max_abs_difference": {
            "fused_vs_reference": (fused.double() - reference.double()).abs().max().item(),
            "fused_vs_fp64": (fused.double() - exact).abs().max().item(),
        },
    }


def orthogonality_holds(result: dict, slack: float = 2.0, floor: float = 1e-3) -> bool:
    """The fused op (eager and compiled) is as orthogonal as the paper formula in the same dtype: within `slack`x
    its max |cos|, or below `floor` outright."""
    cos = result["max_abs_cos"]
    bound = max(slack * cos["reference"], floor)
    return cos["fused"] <= bound and cos["fused_compiled"] <= bound


def xsa_bf16(directory: Path, key: str, device: torch.device, shapes: list[tuple[int, int, int]]) -> None:
    from xsa_lm.train.hardware import device_name

    result: dict = {"device": device_name(device), "gradients": [], "orthogonality": []}
    # Gradients first (the forward's orthogonality was checked on GPUs before); compiled for the first shape only:
    # each compile costs seconds of the loan, and the compiled code is the same for every shape.
    for i, (heads, head_dim, context) in enumerate(shapes):
        measured = xsa_gradients(device, heads=heads, head_dim=head_dim, context=context, compiled=i == 0)
        result["gradients"].append(measured)
        record(directory, key, result)
        worst = {
            k: f"{max(e for n, e in v.items() if n != 'scale_over_its_bound'):.1e}"
            for k, v in measured["relative_error"].items()
        }
        print(f"{key}: {heads}x{head_dim} at {context}: gradients, worst relative error {worst}", flush=True)
    for heads, head_dim, context in shapes:
        measured = xsa_orthogonality(device, heads=heads, head_dim=head_dim, context=context)
        result["orthogonality"].append(measured | {"holds": orthogonality_holds(measured)})
        result["compile_seconds"] = compile_seconds()
        record(directory, key, result)
        print(f"{key}: {heads}x{head_dim} at {context}: max |cos(z, v)| {measured['max_abs_cos']}", flush=True)


# ---- SDPA kernels -----------------------------------------------------------------------------------------------


def kernel_choices(config, setup, names: list[str]) -> dict[str, dict]:
    """Per name ("auto", the run's default order, or one kernel): the order xsa_lm.model.sdpa resolves it to on this
    device and the kernel SDPA then runs for this model's attention, or why none runs."""
    from xsa_lm.bench.loops import attention_kernel
    from xsa_lm.errors import UserError
    from xsa_lm.model.sdpa import resolve, sdpa_backends

    out: dict[str, dict] = {}
    for name in names:
        try:
            order = resolve(name, setup.device)
            with sdpa_backends(order):
                out[name] = {"order": order, "runs": attention_kernel(config, setup)}
        except (UserError, RuntimeError) as error:  # RuntimeError: CUDA's "No available kernel" for this shape
            out[name] = {"order": None, "runs": None, "reason": str(error).splitlines()[0][:200]}
    return out


def to_measure(choices: dict[str, dict]) -> list[str]:
    """The names whose kernel runs, each kernel once: `auto` first, a single kernel it already ran left out."""
    seen, names = set(), []
    for name, choice in choices.items():
        if choice["runs"] is not None and choice["runs"] not in seen:
            seen.add(choice["runs"])
            names.append(name)
    return names


# ---- SA against XSA ---------------------------------------------------------------------------------------------


def bench_spec(args: argparse.Namespace):
    """The bench's spec for this preset, as `xsa-lm bench model=... attention=xsa` composes and parses it."""
    from hydra import compose, initialize_config_module

    from xsa_lm.bench.run import BenchSpec
    from xsa_lm.config.spec import parse

    overrides = [
        f"model={args.model}",
        "attention=xsa",
        f"context={args.context}",
        f"micro_batch={args.micro_batch}",
        f"vocab_size={args.vocab_size}",
        *args.override,
    ]
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        return parse(BenchSpec, compose(config_name="bench", overrides=overrides))


def plain_setup(spec, device: torch.device):
    """The plain loop's setup as the bench builds it: precision auto (bf16 on a GPU), TF32 matmuls on CUDA, eager."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return replace(spec.setup_on(device), compile=False)


def paired_rounds(trainers: dict, batches: list, *, rounds: int, steps: int, deadline: Deadline) -> dict:
    """Per model, the median step time (s) of each round, and each round's XSA/SA ratio: the median of its paired
    log-ratios. A round interleaves `steps` steps of SA and of XSA one by one (xsa_lm.bench.loops.interleaved: ABBA,
    one synchronisation), so drift within the round hits both alike. No round is started that would end past the
    deadline (the second on: the first is the step's purpose)."""
    from xsa_lm.bench.loops import interleaved

    per_round: dict[str, list[float]] = {"sa": [], "xsa": [], "ratio": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        (sa, _), (xsa, _) = interleaved([trainers["sa"], trainers["xsa"]], batches, steps)
        per_round["sa"].append(statistics.median(sa))
        per_round["xsa"].append(statistics.median(xsa))
        per_round["ratio"].append(math.exp(statistics.median(math.log(x / s) for x, s in zip(xsa, sa, strict=True))))
        if deadline.left() < 2 * (time.perf_counter() - t0):
            break
    return per_round


def summarize_phase(per_round: dict, result: dict, *, device_type: str) -> dict:
    """Per SA and XSA the step time and tokens/s (the median over rounds) and, where the device's peak FLOP/s is
    known, MFU per round; XSA/SA step time per round with its 95% interval and verdict (xsa_lm.bench.stats), and
    whether that interval resolves 1%."""
    from xsa_lm.bench.stats import TARGETS, mfu_target, summarize

    tokens, peak, out = result["tokens_per_step"], result["peak_flops"], {}
    for name in ("sa", "xsa"):
        times = per_round[name]
        median = statistics.median(times)
        out[name] = {
            "step_ms": 1e3 * median,
            "tokens_per_s": tokens / median,
            "round_step_ms": [1e3 * t for t in times],
        }
        if peak is not None:
            mfu = [tokens / t * result["flops_per_token"] / peak for t in times]
            target = mfu_target(result["model"], result["device"])
            out[name]["mfu"] = summarize(mfu, target=target, at_most=False).to_json()
    ratio = summarize(per_round["ratio"], target=TARGETS["xsa_over_sa_step_time"][device_type], at_most=True).to_json()
    resolved = ratio["interval"] is not None and ratio["interval"][1] - ratio["interval"][0] <= RESOLUTION
    ratio |= {"resolution": RESOLUTION, "resolved": resolved}
    return out | {"xsa_over_sa_step_time": ratio, "rounds_done": len(per_round["sa"])}


def sdpa_kernels(fn: Callable[[], object]) -> dict:
    """Which SDPA backend fn() runs (forward and backward), from the names of the operators (host) and of the kernels
    (device) profiled while it runs."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    on_host = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU}
    on_device = {e.name for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU}
    attention = sorted(k for k in on_device if any(word in k.lower() for word in KERNEL_WORDS))
    return {
        "backends": sorted({backend for op, backend in SDPA_BACKENDS.items() if op in on_host}),
        "operators": sorted(op for op in on_host if op in SDPA_BACKENDS or "scaled_dot_product" in op),
        "kernels": [name[:MAX_NAME] for name in attention[:MAX_NAMES]],  # each cut to MAX_NAME characters
        "kernel_count": len(attention),
    }


def kernels_ran(trainers: dict, batch) -> dict:
    """The SDPA kernels one more training step of each model runs, from its profile."""
    return {name: sdpa_kernels(lambda t=t: t.step(batch)) for name, t in trainers.items()}


def measure_kernel(order: list[str], trainers: dict, batches: list, *, args, rounds: int, deadline: Deadline) -> dict:
    """Both models compiled anew under this SDPA order (the warm-up), the kernels that ran, the paired rounds."""
    from xsa_lm.model.sdpa import sdpa_backends

    torch._dynamo.reset()  # a compiled graph keeps the kernel it was traced with, whatever the order around it
    out: dict = {"order": order, "warmup_s": {}}
    with sdpa_backends(order):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.run(batches, args.warmup)
            out["warmup_s"][name] = round(time.perf_counter() - t0, 1)
        out["kernels"] = kernels_ran(trainers, batches[0])
        t0 = time.perf_counter()
        out["per_round"] = paired_rounds(trainers, batches, rounds=rounds, steps=args.steps, deadline=deadline)
        out["timed_s"] = round(time.perf_counter() - t0, 1)
    return out


def step_memory(trainer, batches: list) -> dict:
    """Peak memory of one more training step: on CUDA the allocator's high-water mark, on CPU the allocator's peak
    from torch.profiler's memory events; both above what was allocated before the step, plus this model's weights
    and AdamW state, what stays allocated between its steps (the other model's stay out)."""
    device, cuda = trainer.setup.device, {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer.run(batches, 1)
        cuda = {"max_memory_allocated": torch.cuda.max_memory_allocated(device), "allocated_before": before}
        peak = cuda["max_memory_allocated"] - before
        source = "torch.cuda.max_memory_allocated over a step, above what was allocated before it"
    else:
        from calibrate_memory import allocator_peak

        peak = allocator_peak(lambda: trainer.run(batches, 1))
        source = "the CPU allocator's peak over a step (torch.profiler)"
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    state = sum(t.numel() * t.element_size() for s in trainer.opt.state.values() for t in s.values() if t.dim())
    return {"bytes": peak + weights + state, **cuda, "source": f"{source}, plus this model's weights and AdamW state"}


def memory_phase(trainers: dict, batches: list, *, order: list[str], micro_batch: int, compiled: bool) -> dict:
    """Per model, the measured peak of a step against xsa_lm.train.memory's estimate for the same shape on one device
    (the plain loop holds every tensor whole)."""
    from xsa_lm.model.sdpa import sdpa_backends
    from xsa_lm.train.memory import estimate

    out = {}
    with sdpa_backends(order):
        for name, trainer in trainers.items():
            measured = step_memory(trainer, batches)
            config, precision = trainer.model.config, trainer.setup.precision
            shape = (config.vocab_size, micro_batch, config.block_size, precision)
            exclusive = config.attention_class.exclusive_memory
            plan = estimate(asdict(config), *shape, compiled=compiled, exclusive=exclusive)
            planned = plan.as_dict() | {"arguments": ["exclusive", "compiled"]}  # the estimate's optional ones given
            out[name] = {
                "measured": measured,
                "planned": planned,
                "measured_over_planned": measured["bytes"] / planned["total"],
            }
    return out


def bench(directory: Path, key: str, device: torch.device, args: argparse.Namespace) -> None:
    """SA and XSA built once and compiled once per SDPA kernel, the result recorded after every measurement: the
    first kernel's rounds and the compiled memory first, the other kernels while the deadline allows, eager last."""
    from xsa_lm.bench.loops import PlainTrainer, make_batches
    from xsa_lm.train.hardware import device_name, peak_flops
    from xsa_lm.train.module import compile_model

    deadline, t_start = Deadline(), time.perf_counter()
    spec = bench_spec(args)
    models = dict(zip(("sa", "xsa"), spec.models, strict=True))
    setup = plain_setup(spec, device)
    # Two hand-written loops on the same initial weights, each compiled as training compiles: each block on its own,
    # the head with the loss
    trainers = {name: PlainTrainer(config, setup, spec.seed, TOTAL_STEPS) for name, config in models.items()}
    for trainer in trainers.values():
        compile_model(trainer.model)
    config = models["xsa"]
    batches = make_batches(config, micro_batch=args.micro_batch, seed=0, device=device)
    precision = setup.precision
    peak, source = peak_flops(device, precision)
    result: dict = {
        "model": spec.model.name,
        "device": device_name(device),
        "precision": precision,
        "context": args.context,
        "micro_batch": args.micro_batch,
        "tokens_per_step": args.micro_batch * args.context,
        "vocab_size": config.vocab_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": trainers["sa"].model.flops_per_token(args.context),
        "peak_flops": peak,
        "peak_flops_source": source,
        "kernel_choices": kernel_choices(config, setup, args.backends),
        "compiled": {},
        "errors": {},
        "skipped": [],
    }

    def save(what: str) -> None:
        seconds = round(time.perf_counter() - t_start, 1)
        record(directory, key, result | {"seconds": seconds, "compile_seconds": compile_seconds()})
        print(f"{key}: {what} recorded at {seconds} s", flush=True)

    runs = {name: choice["runs"] for name, choice in result["kernel_choices"].items()}
    save(f"setup (SDPA kernel per order: {runs})")
    compiled_kernels(trainers, batches, args=args, result=result, deadline=deadline, save=save)
    if result["compiled"] and args.eager_rounds:
        first = next(iter(result["compiled"]))
        eager(trainers, batches, name=first, args=args, result=result, deadline=deadline, save=save)


def compiled_kernels(trainers: dict, batches: list, *, args, result: dict, deadline: Deadline, save) -> None:
    """Each SDPA kernel in turn, into result["compiled"]. The first that runs gets args.rounds rounds and the peak
    memory after them; a further one args.other_rounds, when the time left allows what it is expected to take. A
    kernel that fails is recorded and the others go on."""
    last_cost = None
    for name in to_measure(result["kernel_choices"]):
        first = next(iter(result["compiled"].values()), None)
        if first is not None:
            expected = further_kernel_cost(first, last_cost, rounds=args.other_rounds)
            if deadline.left() < 1.1 * expected:
                result["skipped"].append(f"compiled {name}: {deadline.left():.0f} s left, {expected:.0f} s expected")
                save(f"compiled {name} skipped")
                continue
        t0, order = time.perf_counter(), result["kernel_choices"][name]["order"]
        rounds = args.rounds if first is None else args.other_rounds
        try:
            measured = measure_kernel(order, trainers, batches, args=args, rounds=rounds, deadline=deadline)
        except RuntimeError as error:  # torch's: a kernel that fails to compile or run, out of memory
            traceback.print_exc()
            result["errors"][name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            save(f"compiled {name} failed")
            continue
        last_cost = None if first is None else time.perf_counter() - t0
        per_round = measured.pop("per_round")
        device_type = trainers["sa"].setup.device.type
        result["compiled"][name] = measured | summarize_phase(per_round, result, device_type=device_type)
        save(f"compiled {name} ({measured['timed_s']} s timed, warm-up {measured['warmup_s']} s)")
        if first is None:
            result["memory_compiled"] = memory_phase(
                trainers, batches, order=order, micro_batch=args.micro_batch, compiled=True
            )
            save(f"compiled peak memory under {name}")
            if args.cuda_graph_rounds:
                cuda_graphs(trainers, batches, name=name, args=args, result=result, deadline=deadline, save=save)


def cuda_graphs(trainers: dict, batches: list, *, name: str, args, result: dict, deadline: Deadline, save) -> None:
    """The first kernel's models compiled anew with Inductor's CUDA graphs (what torch.compile's
    mode="reduce-overhead" sets: each compiled region replayed as one graph, no host launch per kernel), when the
    time left allows a further kernel's cost: their step times beside those without. On CPU the option changes
    nothing (no CUDA graphs): the rehearsal runs the code path only."""
    import torch._inductor.config as inductor

    expected = further_kernel_cost(result["compiled"][name], None, rounds=args.cuda_graph_rounds)
    if deadline.left() < 1.1 * expected:
        result["skipped"].append(f"CUDA graphs: {deadline.left():.0f} s left, {expected:.0f} s expected")
        save("CUDA graphs skipped")
        return
    order = result["kernel_choices"][name]["order"]
    try:
        with inductor.patch({"triton.cudagraphs": True}):  # read when the warm-up compiles
            measured = measure_kernel(
                order, trainers, batches, args=args, rounds=args.cuda_graph_rounds, deadline=deadline
            )
    except RuntimeError as error:  # as a kernel's: recorded, and the step goes on
        traceback.print_exc()
        result["cuda_graphs"] = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"}
        save("CUDA graphs failed")
        return
    per_round = measured.pop("per_round")
    device_type = trainers["sa"].setup.device.type
    result["cuda_graphs"] = measured | {"without": name} | summarize_phase(per_round, result, device_type=device_type)
    save(f"CUDA graphs ({measured['timed_s']} s timed, warm-up {measured['warmup_s']} s)")


def further_kernel_cost(first: dict, last: float | None, *, rounds: int) -> float:
    """Seconds one more kernel is expected to take: as long as the last further one, else compiling at 60% of the
    first kernel's warm-up (which also paid the process's one-time compile costs; measured on CPU: 50%) and `rounds`
    rounds as long as the first kernel's."""
    if last is not None:
        return last
    per_round = first["timed_s"] / max(first["rounds_done"], 1)
    return 0.6 * sum(first["warmup_s"].values()) + rounds * per_round


def eager(trainers: dict, batches: list, *, name: str, args, result: dict, deadline: Deadline, save) -> None:
    """The same models with their compiled regions bypassed, under the first order, if the time left allows four
    times the compiled rounds' (eager is slower, then two memory steps)."""
    from xsa_lm.model.sdpa import sdpa_backends

    compiled = result["compiled"][name]
    step_s = (compiled["sa"]["step_ms"] + compiled["xsa"]["step_ms"]) / 1e3
    needed = 4 * step_s * args.steps * args.eager_rounds + 4 * step_s
    if deadline.left() < needed:
        result["skipped"].append(f"eager: {deadline.left():.0f} s left, about {needed:.0f} s needed")
        save("eager skipped")
        return
    order = result["kernel_choices"][name]["order"]
    with torch.compiler.set_stance("force_eager"), sdpa_backends(order):
        for trainer in trainers.values():
            trainer.run(batches, 1)
        per_round = paired_rounds(trainers, batches, rounds=args.eager_rounds, steps=args.steps, deadline=deadline)
        kernels = kernels_ran(trainers, batches[0])
    device_type = trainers["sa"].setup.device.type
    result["eager"] = {"order": order, "kernels": kernels} | summarize_phase(per_round, result, device_type=device_type)
    save("eager rounds")
    with torch.compiler.set_stance("force_eager"):
        result["memory_eager"] = memory_phase(
            trainers, batches, order=order, micro_batch=args.micro_batch, compiled=False
        )
    save("eager peak memory")


def shape(text: str) -> tuple[int, int, int]:
    heads, head_dim, context = (int(v) for v in text.split(","))
    return heads, head_dim, context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="the check's directory (check.json, measurements.json)")
    parser.add_argument("key", help="xsa_bf16, or the name a model's results are recorded under")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", type=shape, action="append", default=[], help="heads,head_dim,context")
    parser.add_argument("--model", default="gpt2_124m", help="a preset of configs/model")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=50257, help="where the preset leaves it to the tokenizer")
    parser.add_argument(
        "--backends",
        type=lambda s: s.split(","),
        default=["auto"],
        help="SDPA orders in turn: auto (the run's) or a kernel",
    )
    parser.add_argument("--rounds", type=int, default=20, help="paired rounds under the first backend")
    parser.add_argument("--other-rounds", type=int, default=20, help="paired rounds under each other backend")
    parser.add_argument("--eager-rounds", type=int, default=0, help="paired rounds eager (0: none)")
    parser.add_argument("--cuda-graph-rounds", type=int, default=0, help="paired rounds with CUDA graphs (0: none)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and backend (compiling)")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override of the bench config")
    args = parser.parse_args()
    use_working_tree()
    device = torch.device(args.device)
    if args.key == "xsa_bf16":
        xsa_bf16(args.directory, args.key, device, args.shape)
    else:
        bench(args.directory, args.key, device, args)


if __name__ == "__main__":
    main()
    # Everything is recorded and flushed: skip the interpreter's teardown of torch's native state, which takes
    # seconds on a loaded machine, and the step's time limit counts them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

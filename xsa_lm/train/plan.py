"""What `xsa-lm plan` says of a training config (the command: sweep/plan.py): the per-device memory for DDP and FSDP,
eager and compiled, and the largest micro-batch that fits (memory.py's estimate, the one `xsa-lm train` checks:
RunShape.estimate); and the GPU-hours of its runs on one H100 at the MFU we measured."""

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from xsa_lm.config.spec import TrainSpec
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.sdpa import resolve
from xsa_lm.train import memory
from xsa_lm.train.devices import compile_enabled, uses_cuda


@dataclass(frozen=True)
class RunShape:
    """What fixes a training run's memory per device, as `xsa-lm train` would run it."""

    model: GPTConfig  # its vocab_size padded as the run pads it
    micro_batch_size: int
    block_size: int  # data.block_size: the tokens of one window
    global_batch_tokens: int
    precision: str  # Lightning's name (TrainerSpec.resolved_precision)
    devices: int  # every process of the run
    strategy: str  # ddp | fsdp
    compiled: bool
    activation_checkpointing: bool
    gradient_as_bucket_view: bool = False  # DDP's (Lightning's default: off)

    @property
    def accumulation(self) -> int | None:
        """Micro-batches per optimizer step on each device (None when not a whole number)."""
        per_micro_step = self.micro_batch_size * self.devices * self.block_size
        whole = per_micro_step and not self.global_batch_tokens % per_micro_step
        return self.global_batch_tokens // per_micro_step if whole else None

    def memory_args(self) -> dict:
        """memory.estimate's arguments for this run, all but micro_batch_size."""
        same = "block_size precision strategy activation_checkpointing compiled gradient_as_bucket_view".split()
        return {name: getattr(self, name) for name in same} | dict(
            model=asdict(self.model),
            vocab_size=self.model.vocab_size,
            world_size=self.devices,
            exclusive=self.model.attention_class.exclusive_memory,
            accumulation=self.accumulation or 1,
        )

    def estimate(self, **changes: Any) -> memory.MemoryEstimate:
        """memory.estimate of this run, or of this run with `changes` to its arguments (e.g. compiled=True)."""
        return memory.estimate(**{"micro_batch_size": self.micro_batch_size, **self.memory_args(), **changes})


def run_shape(spec: TrainSpec) -> RunShape:
    """The run `xsa-lm train` would start from this spec, before its tokenizer exists: the model's vocabulary, else
    the tokenizer's size (GPT-2's by default)."""
    trainer, strategy = spec.trainer, spec.trainer.strategy
    return RunShape(
        spec.gpt_config(spec.model.vocab_size or spec.tokenizer.vocab_size or 50257),
        spec.micro_batch_size,
        spec.block_size,
        spec.global_batch_tokens,
        precision=trainer.resolved_precision,
        devices=trainer.world_size,
        strategy=trainer.strategy_kind,
        compiled=compile_enabled(spec.compile, accelerator=trainer.accelerator),
        activation_checkpointing=trainer.activation_checkpointing,
        # a plain `ddp` is Lightning's default: off
        gradient_as_bucket_view=isinstance(strategy, dict) and bool(strategy.get("gradient_as_bucket_view")),
    )


@dataclass(frozen=True)
class SdpaPlan:
    setting: str | list[str]  # sdpa_backends
    device: str
    order: list[str] | None  # None: resolved on the run's GPU, which is not on this machine


@dataclass(frozen=True)
class StrategyPlan:
    per_device_bytes: dict[str, int]  # MemoryEstimate.as_dict, of the mode the run trains in
    eager_bytes: dict[str, int]
    compiled_bytes: dict[str, int]
    fits: bool
    max_micro_batch_size: int
    max_dividing_micro_batch_size: int
    accumulation_at_max_dividing: int | None


@dataclass(frozen=True)
class Plan:
    """`xsa-lm plan`'s answer (the JSON file of out=)."""

    model: str
    strategy: str
    devices: int
    precision: str
    activation_checkpointing: bool
    attention: str
    compiled: bool
    micro_batch_size: int
    block_size: int
    n_sinks: int
    parameters: int
    available_bytes: int
    available_from: str
    global_batch_tokens: int
    accumulation: int | None
    per_device_bytes: dict[str, int]
    max_micro_batch_size: int
    strategies: dict[str, StrategyPlan]  # ddp and fsdp
    sdpa_backends: SdpaPlan
    xsa_saved_bytes: int
    xsa_temporaries_bytes: dict[str, int]  # eager and compiled
    cross_entropy_transient_bytes: dict[str, int]
    loss_chunk_micro_batches: dict[str, int]  # micro_batch_fit's, of the trainer's strategy and mode


LOSS_CHUNK = 1024  # tokens, where model.loss_chunk is 0: fp32 logits of 206 MB at GPT-2's vocabulary, a full matmul


def micro_batch_fit(available: int, **memory_args: Any) -> dict[str, int]:
    """The largest micro-batch that fits in `available` bytes (memory.estimate's arguments but micro_batch_size) with
    the whole logits and with the chunked loss (model.loss_chunk tokens, else LOSS_CHUNK): `xsa-lm plan`'s and
    `xsa-lm bench`'s line."""
    chunk = memory_args["model"].get("loss_chunk") or LOSS_CHUNK
    return {"loss_chunk": chunk, **memory.largest_micro_batches(available, chunk, **memory_args)}


def make_plan(run: RunShape, *, model_name: str, available: int, available_from: str, sdpa: SdpaPlan) -> Plan:
    """Both strategies' memory per device, eager and compiled, the largest micro-batches that fit in `available`
    bytes, and what XSA adds: what it saves in every layer, and its temporaries against the cross-entropy's."""
    steps = lambda m: replace(run, micro_batch_size=m).accumulation  # noqa: E731
    strategies: dict[str, StrategyPlan] = {}
    for name in ("ddp", "fsdp"):
        one = replace(run, strategy=name)
        eager, compiled = one.estimate(compiled=False), one.estimate(compiled=True)
        need = compiled if run.compiled else eager
        largest = memory.largest_micro_batch(available, **one.memory_args())
        dividing = next((m for m in range(largest, 0, -1) if steps(m)), 0)
        sizes = (need.as_dict(), eager.as_dict(), compiled.as_dict())
        strategies[name] = StrategyPlan(*sizes, need.total <= available, largest, dividing, steps(dividing))
    model, (compute, weights) = asdict(run.model), memory.dtype_bytes(run.precision)
    xsa = run.model.attention_class.exclusive_memory
    tokens = run.micro_batch_size * run.block_size
    positions = tokens + run.micro_batch_size * run.model.n_sinks
    saved = memory.block_saved_per_token(model, compute=compute, residual=weights, exclusive=True)["xsa"]
    modes, chosen = {"eager": False, "compiled": True}, strategies[run.strategy]
    same = "strategy devices precision activation_checkpointing compiled micro_batch_size block_size accumulation"
    return Plan(
        model=model_name,
        **{name: getattr(run, name) for name in [*same.split(), "global_batch_tokens"]},
        attention=run.model.attention,
        n_sinks=run.model.n_sinks,
        parameters=memory.parameter_count(model, run.model.vocab_size),
        available_bytes=available,
        available_from=available_from,
        per_device_bytes=chosen.per_device_bytes,
        max_micro_batch_size=chosen.max_micro_batch_size,
        strategies=strategies,
        sdpa_backends=sdpa,
        xsa_saved_bytes=run.model.n_layer * positions * saved if xsa else 0,
        xsa_temporaries_bytes={
            mode: positions * memory.xsa_transient_per_token(model, compute=compute, compiled=c) if xsa else 0
            for mode, c in modes.items()
        },
        cross_entropy_transient_bytes={mode: cross_entropy_bytes(run, compiled=c) for mode, c in modes.items()},
        loss_chunk_micro_batches=micro_batch_fit(available, **run.memory_args()),
    )


def cross_entropy_bytes(run: RunShape, *, compiled: bool) -> int:
    """The cross-entropy's buffers at the backward's peak: the whole logits' gradient, or the chunked loss's."""
    model, (compute, weights), tokens = asdict(run.model), memory.dtype_bytes(run.precision), run.micro_batch_size
    tokens *= run.block_size
    if run.model.loss_chunk:
        return memory.chunked_cross_entropy_bytes(model, run.model.vocab_size, tokens, compute=compute, weights=weights)
    return tokens * memory.cross_entropy_transient_per_token(run.model.vocab_size, compute=compute, compiled=compiled)


def attention_kernels(setting: str | list[str], *, accelerator: str) -> SdpaPlan:
    """The SDPA kernels the run may use, most preferred first; none where the run's GPU is not on this machine."""
    if uses_cuda(accelerator):
        device = torch.device("cuda", torch.cuda.current_device())
        return SdpaPlan(setting, torch.cuda.get_device_name(device), resolve(setting, device))
    if accelerator in ("gpu", "cuda"):
        return SdpaPlan(setting, "cuda", None)
    return SdpaPlan(setting, "cpu", resolve(setting, torch.device("cpu")))


def table(plan: Plan) -> str:
    gib = lambda b: f"{b / memory.GIB:.2f}"  # noqa: E731
    n = plan.n_sinks
    sinks = f" (+ {n} attention sink{'s' if n > 1 else ''} in every block)" if n else ""
    lines = [
        f"xsa-lm plan | {plan.model}: {plan.parameters / 1e9:.3f}B parameters | {plan.devices} device(s), "
        f"{plan.precision}, micro-batch {plan.micro_batch_size} x {plan.block_size} tokens{sinks}, activation "
        f"checkpointing {'on' if plan.activation_checkpointing else 'off'}, attention {plan.attention}, "
        f"{'compiled' if plan.compiled else 'eager'} | memory per device "
        f"{gib(plan.available_bytes)} GiB ({plan.available_from})",
        "",
        "| strategy | mode | weights | gradients | AdamW state | 16-bit weight copies | DDP buckets | activations | "
        "backward peak | total (GiB) | fits | largest micro-batch | largest dividing the global batch "
        "(accumulation) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, s in plan.strategies.items():
        mark = " (trainer)" if name == plan.strategy else ""
        for mode, b in (("eager", s.eager_bytes), ("compiled", s.compiled_bytes)):
            run = (mode == "compiled") == plan.compiled  # the mode the run trains in: fits and micro-batches
            fits = ("yes" if s.fits else "no") if run else ""
            largest = f"{s.max_micro_batch_size} | {s.max_dividing_micro_batch_size} " if run else " | "
            accumulation = f"({s.accumulation_at_max_dividing})" if run else ""
            lines.append(
                f"| {name}{mark} | {mode} | {gib(b['params'])} | {gib(b['grads'])} | {gib(b['optimizer'])} | "
                f"{gib(b['weight_copies'])} | {gib(b['ddp_buckets'])} | {gib(b['activations'])} | "
                f"{gib(b['transient'])} | {gib(b['total'])} | {fits} | {largest}{accumulation} |"
            )
    lines += ["", sdpa_line(plan.sdpa_backends), xsa_line(plan), loss_chunk_line(plan.loss_chunk_micro_batches)]
    return "\n".join([*lines, batch_line(plan)])


def loss_chunk_line(fit: dict[str, int]) -> str:
    """The micro-batch the chunked loss allows (micro_batch_fit)."""
    return (
        f"cross-entropy: the largest micro-batch is {fit['whole_logits']} with the whole logits, {fit['chunked_loss']} "
        f"with the loss {fit['loss_chunk']} tokens at a time (model.loss_chunk={fit['loss_chunk']})"
    )


def sdpa_line(kernels: SdpaPlan) -> str:
    setting = kernels.setting if isinstance(kernels.setting, str) else ",".join(kernels.setting)
    if kernels.order is not None:
        order = ", ".join(kernels.order)
        return f"SDPA kernels on {kernels.device} (sdpa_backends={setting}), the first that fits runs: {order}"
    listed = "cudnn (sm80 and newer), flash, efficient, math" if setting == "auto" else "this order, less any it lacks"
    return f"SDPA kernels (sdpa_backends={setting}): chosen on the run's GPU (none here): {listed}"


def xsa_line(plan: Plan) -> str:
    if not plan.xsa_saved_bytes:  # a variant without XSA's memory (exclusive_memory)
        return f"XSA's memory: none (attention {plan.attention})"
    mode = "compiled" if plan.compiled else "eager"
    size = lambda n: f"{n / memory.GIB:.2f} GiB" if n >= memory.GIB else f"{n / 2**20:.1f} MiB"  # noqa: E731
    xsa, cross_entropy = plan.xsa_temporaries_bytes[mode], plan.cross_entropy_transient_bytes[mode]
    return (
        f"XSA's memory ({mode}): {size(plan.xsa_saved_bytes)} saved for the backward (per token, fp32 "
        f"(y . v) / ||v||^2 per head and 1 / ||v||^2 per KV head, in every layer); the temporaries of one layer's "
        f"backward {size(xsa)}, against the cross-entropy backward's {size(cross_entropy)}: the backward peak is "
        f"{'XSA' if xsa > cross_entropy else 'the cross-entropy'}'s"
    )


def batch_line(plan: Plan) -> str:
    step = plan.micro_batch_size * plan.devices * plan.block_size
    if plan.accumulation is not None:
        per_step = f"{plan.accumulation} micro-batch(es) of {step:,} tokens per optimizer step"
        return f"global_batch_tokens={plan.global_batch_tokens:,}: {per_step}"
    return (
        f"global_batch_tokens={plan.global_batch_tokens:,} is not a multiple of micro_batch_size x devices x "
        f"data.block_size = {plan.micro_batch_size} x {plan.devices} x {plan.block_size} = {step:,}: `xsa-lm train` "
        f"refuses this config; set global_batch_tokens to a multiple of {step:,}"
    )


H100_BF16_PEAK = 989.4e12  # FLOP/s: the H100 SXM's dense bf16 (datasheet), the H200's too
# Training MFU measured on one H200 (results/gpu_check_h200: compiled, cuDNN attention, bf16, micro-batch 8 x 2048
# tokens): XSA's, the lower arm (SA's: gpt2_124m 38.7%, paper_0.7b 51.2%). gpt2_124m from bench_rerun.md (summary.md:
# 39.2%), paper_0.7b from summary.md. An estimate for an H100: the same peak, less memory bandwidth.
MEASURED_MFU = {"gpt2_124m": 0.371, "paper_0.7b": 0.482}
MFU_SOURCE = "XSA's, measured on one H200: results/gpu_check_h200"


@dataclass(frozen=True)
class RunCompute:
    """What one run of a training config computes: runs x tokens x flops per token / (MFU x peak) is GPU time."""

    model: str
    tokens: int  # per run: trainer.max_steps x global_batch_tokens
    flops_per_token: float  # GPT.flops_per_token at the run's context
    mfu: float | None  # None: no measured MFU for this model, and none given

    def gpu_hours(self, runs: int) -> float:
        """At this MFU (nan without one: gpu_hours_table says so instead)."""
        return runs * self.tokens * self.flops_per_token / ((self.mfu or math.nan) * H100_BF16_PEAK) / 3600


def run_compute(spec: TrainSpec, mfu: float | None = None) -> RunCompute:
    """One run's tokens and FLOPs per token (the model built on the meta device: no memory), at `mfu`, else the one
    measured for the model."""
    with torch.device("meta"):
        model = GPT(run_shape(spec).model)
    return RunCompute(
        spec.model.name,
        spec.trainer.max_steps * spec.global_batch_tokens,
        model.flops_per_token(spec.block_size),
        mfu if mfu is not None else MEASURED_MFU.get(spec.model.name),
    )


def gpu_hours_table(compute: RunCompute, runs: dict[str, int] | None = None, given_mfu: bool = False) -> str:
    """The GPU-hours on one H100 of one run of this config, and of `runs` (phase -> runs) per phase and in all."""
    if compute.mfu is None:
        return (
            f"GPU-hours: no measured MFU for model {compute.model} (measured: {', '.join(MEASURED_MFU)}): `xsa-lm "
            "plan` estimates them with one given, e.g. mfu=0.4"
        )
    source = "given: mfu=" if given_mfu else MFU_SOURCE
    line = (
        f"GPU-hours on one H100, an estimate: {compute.tokens / 1e9:.3g}B tokens x {compute.flops_per_token / 1e9:.3g} "
        f"GFLOP/token per run ({compute.gpu_hours(1):,.1f} GPU-hours) at MFU {compute.mfu:.1%} ({source}) of "
        f"{H100_BF16_PEAK / 1e12:.1f} TFLOP/s (dense bf16)"
    )
    if not runs:
        return line
    rows = {**runs, "total": sum(runs.values())}.items()
    lines = [f"| {phase} | {n} | {compute.gpu_hours(n):,.1f} |" for phase, n in rows]
    return "\n".join([line, "", "| phase | runs | GPU-hours |", "|---|---:|---:|", *lines])

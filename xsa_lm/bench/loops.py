"""The contenders: a hand-written training loop and Lightning fitting LMModule on the same model, batches, optimizer
and schedule; each step timed by the wall clock and by the process's CPU time (which barely moves on a shared
machine, where the wall clock also counts the waits for a core), and peak memory. `measure` runs one phase."""

import contextlib
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import measure_flops
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from xsa_lm.compat import QUIET_TRAINER
from xsa_lm.config.builders import build
from xsa_lm.errors import UserError
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.sdpa import backend_used, resolve, sdpa_backends
from xsa_lm.train.hardware import device_name, peak_flops, synchronize
from xsa_lm.train.host_memory import reuse_freed_host_memory
from xsa_lm.train.module import LMModule, param_groups

Batch = tuple[torch.Tensor, torch.Tensor]
N_BATCHES = 8  # distinct random batches, cycled


@dataclass(frozen=True)
class ProcessFacts:
    pid: int
    threads: int
    host_memory_reuse: bool


@dataclass(frozen=True)
class KernelsFound:
    order: list[str]
    used: str
    candidates: list[str]
    takes: dict[str, bool]


@dataclass(frozen=True)
class DevicePhase(ProcessFacts):
    device: str
    peak_flops: float | None
    peak_flops_source: str
    flops_per_token: float
    flops_per_token_flop_counter: float


@dataclass(frozen=True)
class TimedPhase(ProcessFacts):
    step_times: list[float]  # seconds, start to start
    cpu_step_times: list[float]
    sdpa_used: str
    peak_memory_bytes: int | None
    peak_memory_source: str
    step_ms_median: float  # wall clock
    cpu_ms_median: float


PhaseResult = KernelsFound | DevicePhase | TimedPhase  # measure()'s, for a phase of kind kernels, device, else


@dataclass(frozen=True)
class Phase:
    """What a fresh process needs to run one phase (plain values: it is pickled)."""

    kind: str  # plain (the hand-written loop), lightning, device (FLOP/s, nothing timed) or kernels
    model: GPTConfig
    device: str
    precision: str
    compile: bool
    optimizer: dict  # Hydra nodes (optim, scheduler), built in the child
    scheduler: dict
    micro_batch: int
    warmup: int
    steps: int
    seed: int
    threads: int | None
    reuse_host_memory: bool
    sdpa: tuple[str, ...] = ()  # the SDPA kernels allowed, most preferred first (empty: torch's own)


def make_batches(config: GPTConfig, *, micro_batch: int, seed: int, device: torch.device) -> list[Batch]:
    """Random tokens, pinned for CUDA: a step's time does not depend on what the tokens say."""
    g = torch.Generator().manual_seed(seed)
    shape = (micro_batch, config.block_size + 1)
    tokens = [torch.randint(0, config.vocab_size, shape, generator=g) for _ in range(N_BATCHES)]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    return [(x.pin_memory(), y.pin_memory()) for x, y in batches] if device.type == "cuda" else batches


@dataclass(frozen=True)
class Setup:
    device: torch.device
    precision: str
    compile: bool
    optimizer: Any  # a functools.partial of the optimizer: its keywords are read
    scheduler: Callable

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision.startswith("bf16"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


class PlainTrainer:
    """The loop a researcher writes by hand (nanoGPT's): autocast, fused AdamW with LMModule's parameter groups,
    clipping at 1, the LR schedule, non-blocking copies of pinned batches, and no read-back of the loss."""

    def __init__(self, config: GPTConfig, setup: Setup, seed: int, total_steps: int) -> None:
        torch.manual_seed(seed)
        self.setup = setup
        self.model = GPT(config).to(setup.device)
        self.step_fn = torch.compile(self.model) if setup.compile else self.model
        keywords = setup.optimizer.keywords
        fused = {} if "fused" in keywords else {"fused": True}  # as LMModule.configure_optimizers
        self.opt = setup.optimizer(param_groups(self.model, keywords.get("weight_decay", 0.0)), **fused)
        self.sched = setup.scheduler(self.opt, total_steps=total_steps)
        self.cpu_stamps: list[float] = []  # the last run's, on the process's CPU-time clock

    def step(self, batch: Batch) -> None:
        x, y = (t.to(self.setup.device, non_blocking=True) for t in batch)
        with self.setup.autocast():
            # The logits dropped before the backward, as LMModule.training_step's return drops them: kept, they
            # held 1.6 GB more through it (gpt2_124m, 8 x 2048 tokens, on an H200) than training does
            loss = self.step_fn(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, batches: list[Batch], n: int) -> list[float]:
        """n steps; n + 1 device-synchronised wall-clock stamps (those on the CPU-time clock in cpu_stamps)."""
        stamps, self.cpu_stamps = [], []
        for i in range(n):
            synchronize(self.setup.device)
            stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())
            self.step(batches[i % len(batches)])
        synchronize(self.setup.device)
        self.cpu_stamps.append(time.process_time())
        return stamps + [time.perf_counter()]


class StepTimer(L.Callback):
    """A device-synchronised stamp at each batch start (start to start covers all Lightning does); on CUDA, the
    allocator's high-water mark over the last batch."""

    def __init__(self, device: torch.device, last_batch: int) -> None:
        self.device = device
        self.last_batch = last_batch
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []  # the process's CPU time at the same stamps
        self.peak_memory: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        synchronize(self.device)
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        if batch_idx == self.last_batch and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.last_batch and self.device.type == "cuda":
            self.peak_memory = torch.cuda.max_memory_allocated(self.device)


def fit_lightning(config: GPTConfig, setup: Setup, batches: list[Batch], *, n: int, seed: int) -> StepTimer:
    """A fresh Trainer.fit of LMModule for n steps, as `xsa-lm train` configures it, without logging or checkpoints."""
    torch.manual_seed(seed)
    module = LMModule(config, setup.optimizer, setup.scheduler, total_steps=n, compile=setup.compile, spike_factor=None)
    timer = StepTimer(setup.device, last_batch=n - 1)
    trainer = L.Trainer(
        max_steps=n,
        accelerator=setup.device.type,
        devices=1,
        precision=setup.precision,  # type: ignore[arg-type]  # a config string: Lightning checks it
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
        **QUIET_TRAINER,
    )
    cycled = [batches[i % len(batches)] for i in range(n)]  # a list is a map-style dataset
    trainer.fit(module, DataLoader(cycled, batch_size=None, shuffle=False, num_workers=0))  # type: ignore[arg-type]
    return timer


def step_times(stamps: list[float]) -> list[float]:
    return [t1 - t0 for t0, t1 in zip(stamps, stamps[1:], strict=False)]


def saved_for_backward(run: Callable[[], object], model: torch.nn.Module) -> int:
    """Bytes of the storages autograd saves while `run` builds its graph, each once, the model's own excluded."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def peak_memory(trainer: PlainTrainer, batches: list[Batch]) -> tuple[int, str]:
    """Peak memory of one more training step: CUDA's high-water mark; on CPU (no such counter) the weights,
    gradients and optimizer state plus every tensor saved for the backward, where SA and XSA differ."""
    setup = trainer.setup
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
        trainer.run(batches, 1)
        return torch.cuda.max_memory_allocated(setup.device), "torch.cuda.max_memory_allocated over a training step"
    static = sum(p.numel() * p.element_size() * 2 for p in trainer.model.parameters())  # weights + gradients
    static += sum(b.numel() * b.element_size() for b in trainer.model.buffers())  # RoPE's tables
    static += sum(t.numel() * t.element_size() for s in trainer.opt.state.values() for t in s.values())
    with setup.autocast():
        saved = saved_for_backward(lambda: trainer.step_fn(*batches[0]), trainer.model)
    return static + saved, "estimate: weights, gradients, AdamW state and tensors saved for backward"


def counted_flops_per_token(config: GPTConfig, setup: Setup, batch: Batch) -> float:
    """Lightning's measure_flops for one forward and backward, per token: checks the model's formula."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = GPT(config).to(setup.device)
    x, y = (t.to(setup.device) for t in batch)
    # The counter knows SDPA's math, flash (CUDA) and efficient kernels, not the CPU flash kernel: math on CPU.
    math_on_cpu = sdpa_kernel(SDPBackend.MATH) if setup.device.type == "cpu" else contextlib.nullcontext()
    with setup.autocast(), math_on_cpu:
        flops = measure_flops(model, lambda: model(x, y)[1], loss_fn=lambda loss: loss)
    return flops / x.numel()


def kernels_taking(config: GPTConfig, setup: Setup, candidates: tuple[str, ...]) -> KernelsFound:
    """`auto`'s kernel order here, the kernel it runs, and which candidates take the attention alone."""
    order = resolve("auto", setup.device)
    with sdpa_backends(order):
        used = attention_kernel(config, setup)
    wanted = resolve(list(candidates) if candidates else "auto", setup.device)
    takes = {}
    for name in wanted:
        with sdpa_backends([name]):
            try:
                takes[name] = attention_kernel(config, setup) == name
            except UserError:  # no kernel allowed takes it: this one does not
                takes[name] = False
    return KernelsFound(order=order, used=used, candidates=wanted, takes=takes)


def attention_kernel(config: GPTConfig, setup: Setup) -> str:
    dtype = torch.bfloat16 if setup.precision.startswith("bf16") else torch.float32
    seq, heads, kv_heads = config.block_size + config.n_sinks, config.n_head, config.n_kv_head
    return backend_used(
        heads=heads, kv_heads=kv_heads, seq=seq, head_dim=config.head_dim, dtype=dtype, device=setup.device
    )


def measure(phase: Phase) -> PhaseResult:
    """Run one phase in this (fresh) process: `warmup` untimed steps, then `steps` timed ones, and peak memory."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in ("does not have many workers", "no `val_dataloader`", "isinstance.treespec, LeafSpec"):
        warnings.filterwarnings("ignore", f".*{message}.*")
    if phase.threads:
        torch.set_num_threads(phase.threads)
    host_memory_reuse = phase.reuse_host_memory and reuse_freed_host_memory()
    device = torch.device(phase.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    optimizer, scheduler = (build(OmegaConf.create(group)) for group in (phase.optimizer, phase.scheduler))
    setup = Setup(device, phase.precision, phase.compile, optimizer, scheduler)
    batches = make_batches(phase.model, micro_batch=phase.micro_batch, seed=phase.seed, device=device)
    if phase.kind == "kernels":
        return kernels_taking(phase.model, setup, phase.sdpa)
    facts = ProcessFacts(pid=os.getpid(), threads=torch.get_num_threads(), host_memory_reuse=host_memory_reuse)
    with sdpa_backends(phase.sdpa) if phase.sdpa else contextlib.nullcontext():
        if phase.kind == "device":
            return device_facts(phase, setup, batches, facts)
        return timed(phase, setup, batches, facts)


def device_facts(phase: Phase, setup: Setup, batches: list[Batch], facts: ProcessFacts) -> DevicePhase:
    config = phase.model
    peak, source = peak_flops(setup.device, phase.precision)
    first = (batches[0][0][:1], batches[0][1][:1])  # one sequence: the count per token is the same, the memory less
    return DevicePhase(
        **asdict(facts),
        device=device_name(setup.device),
        peak_flops=peak,
        peak_flops_source=source,
        flops_per_token=GPT(config).flops_per_token(config.block_size),
        flops_per_token_flop_counter=counted_flops_per_token(config, setup, first),
    )


def timed(phase: Phase, setup: Setup, batches: list[Batch], facts: ProcessFacts) -> TimedPhase:
    config, w = phase.model, phase.warmup
    # Steps w..w+steps-1 are timed start-to-start; one extra step's start closes the last timed one.
    total = w + phase.steps + 1
    memory: int | None
    if phase.kind == "plain":
        trainer = PlainTrainer(config, setup, phase.seed, total)
        times = step_times(trainer.run(batches, total - 1)[w:])
        cpu_times = step_times(trainer.cpu_stamps[w:])
        memory, source = peak_memory(trainer, batches)
    elif phase.kind == "lightning":
        timer = fit_lightning(config, setup, batches, n=total, seed=phase.seed)
        times, cpu_times = step_times(timer.starts[w:]), step_times(timer.cpu_starts[w:])
        memory = timer.peak_memory  # CUDA only: the CPU estimate needs the plain loop's own forward
        source = "torch.cuda.max_memory_allocated over the last step of the fit" if memory else "not measured"
    else:
        raise ValueError(f"unknown bench phase kind {phase.kind!r}")
    return TimedPhase(
        **asdict(facts),
        step_times=times,
        cpu_step_times=cpu_times,
        sdpa_used=attention_kernel(config, setup),
        peak_memory_bytes=memory,
        peak_memory_source=source,
        step_ms_median=1e3 * statistics.median(times),
        cpu_ms_median=1e3 * statistics.median(cpu_times),
    )

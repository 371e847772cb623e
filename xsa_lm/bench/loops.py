"""The contenders: a hand-written loop and Lightning fitting LMModule on the same model, batches, optimizer and
schedule; each step timed on the device's clock (CUDA events, one synchronisation per phase; the wall clock on CPU)
and by the process's CPU time (which holds up on a shared machine). The two attention options' plain loops run in one
process, their steps interleaved (ABBA), so that drift hits both alike. Each phase runs in a fresh process (no heap,
allocator cache, threads or compiled code inherited), in an order that rotates between rounds."""

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader

from xsa_lm.compat import QUIET_TRAINER, quiet_srun_hint, quiet_third_party
from xsa_lm.errors import UserError
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.sdpa import backend_used, resolve, sdpa_backends
from xsa_lm.train.hardware import device_name, peak_flops, synchronize
from xsa_lm.train.host_memory import reuse_freed_host_memory
from xsa_lm.train.module import LMModule, param_groups

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Setup:
    device: torch.device
    precision: str
    compile: bool
    optimizer: Any  # a functools.partial of the optimizer: its keywords are read
    scheduler: Callable
    compile_mode: str | None = None  # torch.compile's mode for the plain loops, e.g. reduce-overhead (CUDA graphs)

    @property
    def bf16(self) -> bool:
        return self.precision.startswith("bf16")

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)


@dataclass(frozen=True)
class Phase:
    """What a fresh process needs to run one phase (it is pickled)."""

    kind: Literal["plain", "lightning", "probe"]  # probe: the kernels and the device, nothing timed
    model: GPTConfig  # the baseline's
    setup: Setup
    micro_batch: int
    warmup: int
    steps: int
    seed: int
    threads: int | None
    reuse_host_memory: bool
    sdpa: tuple[str, ...] = ()  # the SDPA kernels allowed, most preferred first (empty: torch's own)
    candidate: GPTConfig | None = None  # plain: the other option's model, its steps interleaved with the baseline's

    @property
    def models(self) -> tuple[GPTConfig, ...]:
        return (self.model,) if self.candidate is None else (self.model, self.candidate)


@dataclass(frozen=True)
class ProcessFacts:
    pid: int
    threads: int
    host_memory_reuse: bool


class Arms(NamedTuple):
    """The two attention options a bench times, by name: the baseline and the candidate (configs/bench.yaml)."""

    baseline: str
    candidate: str

    def phases(self, kernel: str) -> tuple[str, str]:
        """The plain-loop phases of both arms under `kernel`, e.g. sa_flash and xsa_flash."""
        return f"{self.baseline}_{kernel}", f"{self.candidate}_{kernel}"

    @property
    def ratio(self) -> str:
        """The start of the candidate/baseline ratios' keys, e.g. xsa_over_sa (xsa_over_sa_step_time)."""
        return f"{self.candidate}_over_{self.baseline}"


@dataclass(frozen=True)
class Kernels:
    order: list[str]  # train's (sdpa_backends=auto) on this device
    used: str  # the kernel it runs for this model
    candidates: list[str]
    takes: dict[str, bool]  # whether a candidate alone takes the model's attention
    timed: list[str] = field(default_factory=list)  # the kernels both arms are timed under (chosen by the parent)
    primary: str = ""  # the kernel whose ratios are the headline: train's when timed


@dataclass(frozen=True)
class Probe(ProcessFacts):
    """A first process's findings: the kernels, the device and its peak FLOP/s, the model's FLOPs per token."""

    kernels: Kernels
    device: str
    peak_flops: float | None
    peak_flops_source: str
    flops_per_token: float
    flops_per_token_flop_counter: float


@dataclass(frozen=True)
class TimedPhase(ProcessFacts):
    step_times: list[float]  # seconds, start to start, on the device's clock
    cpu_step_times: list[float]
    sdpa_used: str
    peak_memory_bytes: int | None
    peak_memory_source: str
    gpu: dict[str, float] | None = None  # clocks, power and temperature after the timed steps (NVML), None on CPU


def gpu_state(device: torch.device) -> dict[str, float] | None:
    """The GPU's SM clock (MHz), power (W) and temperature (C) through torch.cuda's NVML calls: a round whose ratio is
    off can be told from a throttled one. None on CPU, or without pynvml (torch's NVML binding, not a dependency)."""
    if device.type != "cuda":
        return None
    try:
        return {
            "sm_clock_mhz": torch.cuda.clock_rate(device),
            "power_w": torch.cuda.power_draw(device) / 1e3,
            "temperature_c": torch.cuda.temperature(device),
        }
    except ModuleNotFoundError:
        return None


def make_batches(config: GPTConfig, *, micro_batch: int, seed: int, device: torch.device) -> list[Batch]:
    """Random tokens, pinned for CUDA: a step's time does not depend on what the tokens say."""
    g = torch.Generator().manual_seed(seed)
    shape = (micro_batch, config.block_size + 1)
    tokens = [torch.randint(0, config.vocab_size, shape, generator=g) for _ in range(8)]  # cycled
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    return [(x.pin_memory(), y.pin_memory()) for x, y in batches] if device.type == "cuda" else batches


class Clocks(L.Callback):
    """A stamp at each step's start on the device's clock (a CUDA event, or the wall clock on CPU) and the CPU-time
    clock, with no synchronisation between steps: the host runs ahead as in training, and step_times() waits once. As a
    callback, one at each batch start (start to start covers all Lightning does; its ThroughputMonitor synchronises
    every batch and has no CPU-time clock)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps, self.events = device, list[tuple[float, float]](), list[torch.cuda.Event]()

    def stamp(self) -> None:
        if self.device.type == "cuda":
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()
        self.stamps.append((time.perf_counter(), time.process_time()))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.stamp()
        if len(self.stamps) == trainer.max_steps and self.device.type == "cuda":  # the fit's peak: its last step's
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_times(self, skip: int = 0) -> list[list[float]]:
        """Each step's seconds (start to start) after the first `skip`: [the device's clock, the CPU-time clock]."""
        walls, cpu = np.diff(self.stamps, axis=0).T.tolist()
        if self.events:
            self.events[-1].synchronize()
            walls = [start.elapsed_time(end) / 1e3 for start, end in zip(self.events, self.events[1:], strict=False)]
        return [walls[skip:], cpu[skip:]]


class PlainTrainer:
    """The loop a researcher writes by hand (nanoGPT's): autocast, fused AdamW with LMModule's parameter groups,
    clipping at 1, the LR schedule, non-blocking copies of pinned batches, and no read-back of the loss."""

    def __init__(self, config: GPTConfig, setup: Setup, seed: int, total_steps: int) -> None:
        torch.manual_seed(seed)
        self.setup = setup
        self.model = GPT(config).to(setup.device)
        self.step_fn = torch.compile(self.model, mode=setup.compile_mode) if setup.compile else self.model
        keywords = setup.optimizer.keywords
        fused = {} if "fused" in keywords else {"fused": True}  # as LMModule.configure_optimizers
        self.opt = setup.optimizer(param_groups(self.model, keywords.get("weight_decay", 0.0)), **fused)
        self.sched = setup.scheduler(self.opt, total_steps=total_steps)

    def step(self, batch: Batch) -> None:
        x, y = (t.to(self.setup.device, non_blocking=True) for t in batch)
        if self.setup.compile_mode == "reduce-overhead":  # a new step for CUDA graphs, whose outputs it may reuse
            torch.compiler.cudagraph_mark_step_begin()
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
        """n steps; their n + 1 start stamps in seconds from the first, on the device's clock."""
        walls = interleaved([self], batches, n)[0][0]
        return np.cumsum([0.0, *walls]).tolist()

    def resident_bytes(self) -> int:
        """What stays allocated between its steps: weights, buffers (RoPE's tables) and AdamW's state."""
        state = [t for s in self.opt.state.values() for t in s.values()]
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers(), *state])


def interleaved(trainers: Sequence[PlainTrainer], batches: list[Batch], n: int) -> list[list[list[float]]]:
    """n steps of each trainer on the same batches, interleaved step by step in ABBA order (A B, B A, A B, ...), so
    that drift and the order within a pair cancel; one synchronisation at the end. Per trainer, its steps' seconds
    (start to start): [on the device's clock, on the CPU-time clock]."""
    clocks, order = Clocks(trainers[0].setup.device), list[int]()
    for i in range(n):
        for k in range(len(trainers)) if i % 2 == 0 else reversed(range(len(trainers))):
            clocks.stamp()
            trainers[k].step(batches[i % len(batches)])
            order.append(k)
    clocks.stamp()
    walls, cpu = clocks.step_times()
    picked = [[k == arm for arm in order] for k in range(len(trainers))]
    return [[[t for t, mine in zip(times, pick, strict=True) if mine] for times in (walls, cpu)] for pick in picked]


def fit_lightning(config: GPTConfig, setup: Setup, batches: list[Batch], *, n: int, seed: int) -> Clocks:
    """A fresh Trainer.fit of LMModule for n steps, as `xsa-lm train` configures it, without logging or checkpoints."""
    torch.manual_seed(seed)
    module = LMModule(config, setup.optimizer, setup.scheduler, total_steps=n, compile=setup.compile, spike_factor=None)
    clocks = Clocks(setup.device)
    trainer = L.Trainer(
        max_steps=n,
        accelerator=setup.device.type,
        devices=1,
        precision=setup.precision,  # type: ignore[arg-type]  # a config string: Lightning checks it
        gradient_clip_val=1.0,
        callbacks=[clocks],
        **QUIET_TRAINER,
    )
    cycled = [batches[i % len(batches)] for i in range(n)]  # a list is a map-style dataset
    trainer.fit(module, DataLoader(cycled, batch_size=None))  # type: ignore[arg-type]  # no val loader: no validation
    return clocks


def saved_for_backward(run: Callable[[], object], model: torch.nn.Module) -> int:
    """Bytes of the storages autograd saves while `run` builds its graph, each once, the model's own excluded."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def peak_memory(trainer: PlainTrainer, batches: list[Batch]) -> tuple[int, str]:
    """Peak memory of one more training step of this trainer alone (another's weights may share the process): on
    CUDA the high-water mark above what was allocated before it, plus its resident bytes; on CPU (no such counter)
    its resident bytes, gradients and every tensor saved for the backward, where SA and XSA differ."""
    setup, model, held = trainer.setup, trainer.model, trainer.resident_bytes()
    if setup.device.type == "cuda":
        synchronize(setup.device)
        before = torch.cuda.memory_allocated(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
        trainer.run(batches, 1)
        peak = torch.cuda.max_memory_allocated(setup.device) - before + held
        return peak, "torch.cuda.max_memory_allocated over a step above its start, plus its weights and state"
    held += sum(p.numel() * p.element_size() for p in model.parameters())  # gradients
    with setup.autocast():
        saved = saved_for_backward(lambda: trainer.step_fn(*batches[0]), model)
    return held + saved, "estimate: weights, gradients, AdamW state and tensors saved for backward"


def attention_kernel(config: GPTConfig, setup: Setup) -> str:
    heads, kv_heads, dtype = config.n_head, config.n_kv_head, torch.bfloat16 if setup.bf16 else torch.float32
    seq, head_dim = config.block_size + config.n_sinks, config.head_dim
    return backend_used(heads=heads, kv_heads=kv_heads, seq=seq, head_dim=head_dim, dtype=dtype, device=setup.device)


def probe(phase: Phase, batch: Batch, facts: ProcessFacts) -> Probe:
    """`auto`'s kernel order here, the kernel it runs, which of phase.sdpa (empty: every kernel) take the attention;
    the FLOPs per token by the model's formula and by Lightning's measure_flops over one sequence's forward and
    backward under train's order (the counter knows no CPU flash kernel: math on CPU)."""
    setup, order, takes = phase.setup, resolve("auto", phase.setup.device), {}
    with sdpa_backends(order):
        used = attention_kernel(phase.model, setup)
    candidates = resolve(list(phase.sdpa) or "auto", setup.device)
    for name in candidates:
        with sdpa_backends([name]), contextlib.suppress(UserError):  # no kernel allowed takes it: not this one
            takes[name] = attention_kernel(phase.model, setup) == name
        takes.setdefault(name, False)
    kernels, peak = Kernels(order, used, candidates, takes), peak_flops(setup.device, setup.precision)
    model = GPT(phase.model).to(setup.device)
    x, y = (t[:1].to(setup.device) for t in batch)
    math_on_cpu = sdpa_kernel(SDPBackend.MATH) if setup.device.type == "cpu" else sdpa_backends(kernels.order)
    with setup.autocast(), math_on_cpu:
        counted = measure_flops(model, lambda: model(x, y)[1], loss_fn=lambda loss: loss)
    flops = model.flops_per_token(phase.model.block_size), counted / x.numel()  # by the formula, by the counter
    return Probe(facts.pid, facts.threads, facts.host_memory_reuse, kernels, device_name(setup.device), *peak, *flops)


def measure(phase: Phase) -> Probe | list[TimedPhase]:
    """Run one phase in this (fresh) process: `warmup` untimed steps, then `steps` timed ones (start to start: one more
    step's start closes the last), and peak memory; a plain phase of two models interleaves their steps. Its results,
    one per model."""
    logging.disable(logging.INFO)  # Lightning's (GPU available, ...): this process prints nothing else
    for message in ("does not have many workers", "no `val_dataloader`"):
        warnings.filterwarnings("ignore", f".*{message}.*")
    quiet_third_party()
    quiet_srun_hint()  # even in a SLURM job: a phase runs on one device by design
    if phase.threads:
        torch.set_num_threads(phase.threads)
    if phase.setup.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    batches = make_batches(phase.model, micro_batch=phase.micro_batch, seed=phase.seed, device=phase.setup.device)
    facts = ProcessFacts(os.getpid(), torch.get_num_threads(), phase.reuse_host_memory and reuse_freed_host_memory())
    if phase.kind == "probe":
        return probe(phase, batches[0], facts)
    config, setup, total = phase.model, phase.setup, phase.warmup + phase.steps + 1
    memory: list[tuple[int | None, str]]
    with sdpa_backends(phase.sdpa) if phase.sdpa else contextlib.nullcontext():
        if phase.kind == "plain":
            trainers = [PlainTrainer(model, setup, phase.seed, total) for model in phase.models]
            interleaved(trainers, batches, phase.warmup)
            times, gpu = interleaved(trainers, batches, phase.steps), gpu_state(setup.device)
            memory = [peak_memory(trainer, batches) for trainer in trainers]
        else:
            clocks = fit_lightning(config, setup, batches, n=total, seed=phase.seed)
            times, gpu = [clocks.step_times(phase.warmup)], gpu_state(setup.device)
            # on CPU the estimate needs the plain loop's own forward
            peak = torch.cuda.max_memory_allocated(setup.device) if setup.device.type == "cuda" else None
            source = "torch.cuda.max_memory_allocated over the last step of the fit" if peak else "not measured"
            memory = [(peak, source)]
        used = [attention_kernel(model, setup) for model in phase.models]
    return [
        TimedPhase(
            **vars(facts),
            step_times=wall,
            cpu_step_times=cpu,
            sdpa_used=kernel,
            peak_memory_bytes=bytes_,
            peak_memory_source=source,
            gpu=gpu,
        )
        for (wall, cpu), kernel, (bytes_, source) in zip(times, used, memory, strict=True)
    ]


def round_order(units: list[str], r: int) -> list[str]:
    """Round r's processes (each kernel's plain loops of both arms, Lightning) rotated by r, so that drift and noisy
    neighbours hit each alike."""
    shift = r % len(units)
    return units[shift:] + units[:shift]


def child(phase: Phase, connection: Connection) -> None:
    # Ctrl-C reaches the whole process group: the parent owns the interrupt and ends this process (run_fresh)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result: tuple[str, Any] = ("ok", measure(phase))
    except Exception:  # noqa: BLE001 - everything goes back to the parent, which reports it
        result = ("error", traceback.format_exc())
    with contextlib.suppress(BrokenPipeError):  # the parent is gone: no one to tell
        connection.send(result)


def run_fresh(phase: Phase, label: str) -> Probe | list[TimedPhase]:
    """measure(phase) in a process forked from a server that imports this module once (never CUDA); a failure or a
    killed process ends the bench in one line naming it (concurrent.futures' pool loses a killed one's exit code), and
    Ctrl-C ends the process before the parent's one line."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["xsa_lm.bench.loops"])
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=child, args=(phase, send), name=f"xsa-lm-bench-{label}")
    process.start()
    send.close()  # the child holds the only sending end: its death ends recv() with EOFError
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "died", None
    except KeyboardInterrupt:
        process.terminate()  # quietly: SIGTERM's default action, no traceback
        raise
    finally:
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

"""Training-step benchmark on CPU: SA vs XSA, and Lightning vs a plain PyTorch loop.

1. SA vs XSA: tokens/s of a full fp32 training step (forward with targets, backward, AdamW, zero_grad)
   for the tiny preset, and the XSA/SA step-time ratio (target <= 1.03).
2. Lightning vs plain: the same SA model, data, AdamW + warmup-cosine schedule and grad clipping at 1.0,
   trained by a minimal loop and by lightning.Trainer fitting LMModule (target: throughput ratio >= 0.95).
   Lightning's start-up is excluded: a callback stamps every batch and only steps after warm-up count.

Both comparisons run in ONE process and are INTERLEAVED: the two contenders alternate in rounds (the order
flips every round) on the same random token batches, so CPU frequency drift and other tenants of a shared
machine hit both equally. Step times are start-to-start; ratios are medians of per-round median ratios,
which shrug off the occasional stalled step. Loads above the thread count still inflate the noise: the
JSON records the load average so a noisy run can be spotted and repeated.

    python scripts/bench_train.py --out bench_train.json     # ~2 min on 2 CPU cores
    python scripts/bench_train.py --quick                    # smoke test, ~20 s
"""

import argparse
import json
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial

import lightning as L
import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, Dataset

from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train.module import LMModule, param_groups
from xsa_lm.train.schedule import warmup_cosine_scheduler

TARGETS = {"xsa_over_sa_step_time": 1.03, "lightning_over_plain_throughput": 0.95}
# Dense bf16 peak FLOP/s by GPU name (datasheets, SXM parts); for MFU on GPUs. On CPU the peak is measured.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12, "A10G": 70e12}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # configs/optim/adamw.yaml
SCHED = {"warmup_steps": 100, "min_lr_ratio": 0.1}  # configs/scheduler/warmup_cosine.yaml
DIMS = ("n_layer", "d_model", "n_head", "head_dim", "vocab_size", "block_size")
Batch = tuple[torch.Tensor, torch.Tensor]
Run = Callable[[], list[float]]  # one timed run: returns step times in seconds


def measured_matmul_peak(n: int = 1024, repeats: int = 20) -> float:
    """This CPU's fp32 matmul FLOP/s (best of `repeats` n x n x n products): the denominator of MFU on CPU."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_batches(n: int, micro_batch: int, block: int, vocab: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (micro_batch, block + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


class PlainTrainer:
    """Model + AdamW with LMModule's param groups; with total_steps, also warmup-cosine LR and clipping at 1."""

    def __init__(self, config: GPTConfig, seed: int, total_steps: int | None = None) -> None:
        torch.manual_seed(seed)
        self.model = GPT(config)
        self.opt = torch.optim.AdamW(param_groups(self.model, ADAMW["weight_decay"]), **ADAMW)
        self.sched = warmup_cosine_scheduler(self.opt, total_steps=total_steps, **SCHED) if total_steps else None
        self.losses: list[float] = []

    def run(self, batches: list[Batch], n: int) -> list[float]:
        """n training steps cycling over batches; returns n + 1 time stamps (each step's start, then the end)."""
        stamps = []
        for i in range(n):
            stamps.append(time.perf_counter())
            _, loss = self.model(*batches[i % len(batches)])
            loss.backward()
            if self.sched is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.losses.append(loss.item())
        return stamps + [time.perf_counter()]


class CycledBatches(Dataset):
    def __init__(self, batches: list[Batch], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Batch:
        return self.batches[i % len(self.batches)]


class StepTimer(L.Callback):
    """Stamps each batch; start-to-start also covers what Lightning does after on_train_batch_end (LR step)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self.losses.append(outputs["loss"].item())


def fit_lightning(config: GPTConfig, batches: list[Batch], n: int, seed: int) -> StepTimer:
    """A fresh Trainer.fit of LMModule for n steps on the given batches."""
    torch.manual_seed(seed)
    opt, sched = partial(torch.optim.AdamW, **ADAMW), partial(warmup_cosine_scheduler, **SCHED)
    module = LMModule(config, optimizer=opt, scheduler=sched, total_steps=n)
    timer = StepTimer()
    trainer = L.Trainer(
        max_steps=n, accelerator="cpu", devices=1, precision="32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(module, DataLoader(CycledBatches(batches, n), batch_size=None, shuffle=False, num_workers=0))
    return timer


def compare(runs: dict[str, Run], rounds: int, tokens: int) -> dict[str, float | list[float]]:
    """Alternate the two runs for `rounds` rounds (flipping the order); medians, tokens/s and b/a time ratios."""
    a, b = runs
    times: dict[str, list[list[float]]] = {a: [], b: []}
    for r in range(rounds):
        for name in (a, b) if r % 2 == 0 else (b, a):
            times[name].append(runs[name]())
    med = {k: statistics.median(t for steps in v for t in steps) for k, v in times.items()}
    per_round = [statistics.median(tb) / statistics.median(ta) for ta, tb in zip(times[a], times[b], strict=True)]
    out: dict[str, float | list[float]] = {f"{k}_step_ms": 1e3 * m for k, m in med.items()}
    out |= {f"{k}_tokens_per_s": tokens / m for k, m in med.items()}
    return out | {"ratio": statistics.median(per_round), "ratio_pooled": med[b] / med[a], "ratio_rounds": per_round}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for dim, default in zip(DIMS, (4, 128, 4, 32, 4096, 128), strict=True):
        flags = [f"--{dim.replace('_', '-')}"] + (["--context"] if dim == "block_size" else [])
        p.add_argument(*flags, type=int, default=default, help=f"GPTConfig.{dim} (default {default})")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30, help="SA/XSA: interleaved rounds (short, so noise is shared)")
    p.add_argument("--steps", type=int, default=5, help="SA/XSA: timed steps per attention type per round")
    p.add_argument("--loop-rounds", type=int, default=5, help="plain/Lightning: interleaved rounds (fresh fits)")
    p.add_argument("--loop-steps", type=int, default=20, help="plain/Lightning: timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (per model, per fit)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: a few steps of each, ~20 s")
    p.add_argument("--out", default="bench_train.json", help="JSON results file")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.loop_rounds, args.loop_steps, args.warmup = 4, 2, 2, 3, 1

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in ("does not have many workers", "no `val_dataloader`", "isinstance.treespec, LeafSpec"):
        warnings.filterwarnings("ignore", f".*{message}.*")
    torch.set_num_threads(args.threads)
    dims = {k: getattr(args, k) for k in DIMS}
    sa, xsa = GPTConfig(**dims, attention="sa"), GPTConfig(**dims, attention="xsa")
    batches = make_batches(8, args.micro_batch, args.block_size, args.vocab_size, args.seed)
    tokens, w, n = args.micro_batch * args.block_size, args.warmup, args.warmup + args.loop_steps
    diffs = lambda stamps: [t1 - t0 for t0, t1 in zip(stamps, stamps[1:], strict=False)]
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]

    # 1. SA vs XSA: two persistent models from the same seed, warmed up once, then many short rounds.
    models = {"sa": PlainTrainer(sa, args.seed), "xsa": PlainTrainer(xsa, args.seed)}
    for m in models.values():
        m.run(batches, w)
    runs = {k: partial(lambda m: diffs(m.run(batches, args.steps)), m) for k, m in models.items()}
    attn = compare(runs, args.rounds, tokens)

    # 2. Plain loop vs Lightning: a fresh SA model from the same seed each round; steps w..n-1 are timed
    # start-to-start (n + 1 stamps: Lightning runs one extra step whose start closes the last timed one).
    plains: list[PlainTrainer] = []
    fits: list[StepTimer] = []

    def plain_run() -> list[float]:
        plains.append(PlainTrainer(sa, args.seed, total_steps=n + 1))
        return diffs(plains[-1].run(batches, n)[w:])

    def fit_run() -> list[float]:
        fits.append(fit_lightning(sa, batches, n + 1, args.seed))
        return diffs(fits[-1].starts[w:])

    loop = compare({"plain": plain_run, "lightning": fit_run}, args.loop_rounds, tokens)
    runtime = time.perf_counter() - t_start

    xsa_ratio, lit_ratio = attn.pop("ratio"), 1.0 / loop.pop("ratio")  # step-time ratio -> throughput ratio
    peak = measured_matmul_peak()
    flops_per_token = models["sa"].model.flops_per_token(args.block_size)  # the same formula for SA and XSA
    between = statistics.median(f.starts[i + 1] - f.ends[i] for f in fits for i in range(w, n))
    result = {
        "device": f"cpu (torch {torch.__version__}, lightning {L.__version__})",
        "torch_threads": torch.get_num_threads(), **dims, "micro_batch": args.micro_batch,
        "rounds": args.rounds, "steps_per_round": args.steps, "loop_rounds": args.loop_rounds,
        "loop_steps_per_round": args.loop_steps, "warmup_steps": args.warmup,
        **{k: v for k, v in attn.items() if not k.startswith("ratio")},
        "xsa_over_sa_step_time": xsa_ratio, "xsa_over_sa_step_time_pooled": attn["ratio_pooled"],
        "xsa_over_sa_step_time_rounds": attn["ratio_rounds"],
        **{k: v for k, v in loop.items() if not k.startswith("ratio")},
        "lightning_over_plain_throughput": lit_ratio,
        "lightning_over_plain_throughput_pooled": 1.0 / loop["ratio_pooled"],
        "lightning_over_plain_throughput_rounds": [1.0 / r for r in loop["ratio_rounds"]],
        "lightning_between_batches_ms": 1e3 * between,  # batch_end -> next batch_start: LR step, loop, data
        "tokens_per_s": attn["sa_tokens_per_s"], "flops_per_token": flops_per_token,
        "peak_flops": peak, "peak_flops_source": "measured: best fp32 1024^3 matmul on this CPU",
        "mfu": attn["sa_tokens_per_s"] * flops_per_token / peak,
        "mfu_xsa": attn["xsa_tokens_per_s"] * flops_per_token / peak,
        "same_first_loss": all(f.losses[0] == pl.losses[0] for f, pl in zip(fits, plains, strict=True)),
        "targets": TARGETS,
        "targets_met": {
            "xsa_over_sa_step_time": xsa_ratio <= TARGETS["xsa_over_sa_step_time"],
            "lightning_over_plain_throughput": lit_ratio >= TARGETS["lightning_over_plain_throughput"],
        },
        "runtime_s": runtime,
        "load_avg_1min": [load_before, os.getloadavg()[0]],  # before, after; above torch_threads = noisy run
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    title = f"SA/XSA {args.rounds}x{args.steps} steps, plain/Lightning {args.loop_rounds}x{args.loop_steps} steps"
    table = Table(title=f"bench_train: {title}, {args.threads} threads")
    for col in ("run", "step ms", "tokens/s", "ratio", "pooled", "target"):
        table.add_column(col, justify="left" if col == "run" else "right")
    met = lambda key: "[green]met[/]" if result["targets_met"][key] else "[red]missed[/]"
    for label, key in (("SA", "sa"), ("XSA", "xsa"), ("plain (SA)", "plain"), ("Lightning (SA)", "lightning")):
        table.add_row(label, f"{result[key + '_step_ms']:.1f}", f"{result[key + '_tokens_per_s']:,.0f}")
        if key == "xsa":
            ratios = f"{xsa_ratio:.3f}", f"{attn['ratio_pooled']:.3f}"
            table.add_row("XSA/SA time", "", "", *ratios, f"<=1.03 {met('xsa_over_sa_step_time')}")
    ratios = f"{lit_ratio:.3f}", f"{result['lightning_over_plain_throughput_pooled']:.3f}"
    table.add_row("Lightning/plain tput", "", "", *ratios, f">=0.95 {met('lightning_over_plain_throughput')}")
    Console().print(table)
    load = result["load_avg_1min"]
    print(f"MFU (SA) {100 * result['mfu']:.1f}% = {result['tokens_per_s']:,.0f} tokens/s x "
          f"{flops_per_token / 1e6:.2f} MFLOP/token / {peak / 1e9:.1f} GFLOP/s measured matmul peak")  # fmt: skip
    print(f"runtime {runtime:.0f} s; 1-min load average {load[0]:.1f} -> {load[1]:.1f}; wrote {args.out}")


if __name__ == "__main__":
    main()

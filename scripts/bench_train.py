"""Training-step benchmark on CPU: SA vs XSA, and Lightning vs a plain PyTorch loop.

1. SA vs XSA: tokens/s of a full fp32 training step (forward with targets, backward, AdamW, zero_grad)
   for the tiny preset, and the XSA/SA step-time ratio (target <= 1.03).
2. Lightning vs plain: the same SA model, data, AdamW + warmup-cosine schedule and grad clipping at 1.0,
   trained by a minimal loop and by lightning.Trainer fitting LMModule (target: throughput ratio >= 0.95).
   Lightning's start-up is excluded: a callback stamps each batch start and only steps after warm-up count.

Both comparisons run in ONE process and are INTERLEAVED: the two contenders alternate in rounds (with the
order flipped every round) on the same random token batches, so CPU frequency drift, other tenants and
thermal noise hit both equally. Step times are start-to-start, medians per round; ratios are medians of
the per-round ratios, which are robust to the occasional stalled step on a shared machine.

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
from torch.utils.data import DataLoader, Dataset

from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train.module import LMModule, param_groups
from xsa_lm.train.schedule import warmup_cosine_scheduler

TARGETS = {"xsa_over_sa_step_time": 1.03, "lightning_over_plain_throughput": 0.95}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # configs/optim/adamw.yaml
SCHED = {"warmup_steps": 100, "min_lr_ratio": 0.1}  # configs/scheduler/warmup_cosine.yaml
Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(n: int, micro_batch: int, block: int, vocab: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (micro_batch, block + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def step_times(stamps: list[float], warmup: int, steps: int) -> list[float]:
    """Start-to-start durations of the `steps` steps after `warmup` (needs warmup + steps + 1 stamps)."""
    s = stamps[warmup : warmup + steps + 1]
    return [b - a for a, b in zip(s, s[1:], strict=False)]


class PlainTrainer:
    """Model + AdamW (LMModule's param groups); optionally warmup-cosine LR and grad clipping at 1.0."""

    def __init__(self, config: GPTConfig, seed: int, total_steps: int | None = None) -> None:
        torch.manual_seed(seed)
        self.model = GPT(config)
        self.opt = torch.optim.AdamW(param_groups(self.model, ADAMW["weight_decay"]), **ADAMW)
        self.sched = warmup_cosine_scheduler(self.opt, total_steps=total_steps, **SCHED) if total_steps else None

    def step(self, batch: Batch) -> float:
        _, loss = self.model(*batch)
        loss.backward()
        if self.sched is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def run(self, batches: list[Batch], n: int) -> list[float]:
        """n steps over batches[0], batches[1], ...; returns n + 1 time stamps (each start, then the end)."""
        stamps = []
        for i in range(n):
            stamps.append(time.perf_counter())
            self.step(batches[i % len(batches)])
        return stamps + [time.perf_counter()]


class CycledBatches(Dataset):
    def __init__(self, batches: list[Batch], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Batch:
        return self.batches[i % len(self.batches)]


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())


def lightning_stamps(config: GPTConfig, batches: list[Batch], n: int, seed: int) -> list[float]:
    """A fresh Trainer.fit of LMModule for n steps; returns each step's start time stamp."""
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
    return timer.starts


def interleave(runs: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[list[float]]]:
    """Call each run once per round, flipping the order every round; collect their step times."""
    times: dict[str, list[list[float]]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(runs[name]())
    return times


def summarize(times: dict[str, list[list[float]]], tokens: int, a: str, b: str) -> dict[str, float]:
    """Median step time and tokens/s of a and b (all timed steps pooled), and b/a step-time ratios."""
    med = {k: statistics.median(t for r in v for t in r) for k, v in times.items()}
    per_round = [statistics.median(rb) / statistics.median(ra) for ra, rb in zip(times[a], times[b], strict=True)]
    return {
        f"{a}_step_ms": 1e3 * med[a], f"{b}_step_ms": 1e3 * med[b],
        f"{a}_tokens_per_s": tokens / med[a], f"{b}_tokens_per_s": tokens / med[b],
        "ratio_pooled": med[b] / med[a], "ratio_per_round": statistics.median(per_round),
        "ratio_rounds": per_round,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--block-size", "--context", type=int, default=128, help="context length (tokens per row)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=25, help="timed steps per contender per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per comparison")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 rounds x 3 steps, 1 warm-up step")
    p.add_argument("--out", default="bench_train.json", help="JSON results file")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
    torch.set_num_threads(args.threads)
    dims = {k: getattr(args, k) for k in ("n_layer", "d_model", "n_head", "head_dim", "vocab_size", "block_size")}
    config = {att: GPTConfig(**dims, attention=att) for att in ("sa", "xsa")}
    batches = make_batches(8, args.micro_batch, args.block_size, args.vocab_size, args.seed)
    tokens, n = args.micro_batch * args.block_size, args.warmup + args.steps
    t_start = time.perf_counter()

    # 1. SA vs XSA: two persistent models from the same seed, same batches, alternating every round.
    models = {att: PlainTrainer(config[att], args.seed) for att in ("sa", "xsa")}
    attn_runs = {att: partial(lambda m: step_times(m.run(batches, n), args.warmup, args.steps), m) for att, m in models.items()}  # fmt: skip
    attn = summarize(interleave(attn_runs, args.rounds), tokens, "sa", "xsa")

    # 2. Plain loop vs Lightning: fresh model from the same seed each round, n + 1 steps, timed after warm-up.
    loop_runs = {
        "plain": lambda: step_times(PlainTrainer(config["sa"], args.seed, n + 1).run(batches, n + 1), args.warmup, args.steps),
        "lightning": lambda: step_times(lightning_stamps(config["sa"], batches, n + 1, args.seed), args.warmup, args.steps),
    }  # fmt: skip
    loop = summarize(interleave(loop_runs, args.rounds), tokens, "plain", "lightning")
    runtime = time.perf_counter() - t_start

    xsa_ratio, lit_ratio = attn["ratio_per_round"], 1.0 / loop["ratio_per_round"]  # step time -> throughput
    result = {
        "device": f"cpu ({torch.__version__}, lightning {L.__version__})",
        "torch_threads": torch.get_num_threads(), **dims, "micro_batch": args.micro_batch,
        "steps_per_round": args.steps, "warmup_steps": args.warmup, "rounds": args.rounds,
        "sa_step_ms": attn["sa_step_ms"], "xsa_step_ms": attn["xsa_step_ms"],
        "sa_tokens_per_s": attn["sa_tokens_per_s"], "xsa_tokens_per_s": attn["xsa_tokens_per_s"],
        "xsa_over_sa_step_time": xsa_ratio, "xsa_over_sa_step_time_pooled": attn["ratio_pooled"],
        "xsa_over_sa_step_time_rounds": attn["ratio_rounds"],
        "plain_step_ms": loop["plain_step_ms"], "lightning_step_ms": loop["lightning_step_ms"],
        "plain_tokens_per_s": loop["plain_tokens_per_s"], "lightning_tokens_per_s": loop["lightning_tokens_per_s"],
        "lightning_over_plain_throughput": lit_ratio, "lightning_over_plain_throughput_pooled": 1 / loop["ratio_pooled"],
        "lightning_over_plain_throughput_rounds": [1 / r for r in loop["ratio_rounds"]],
        "targets": TARGETS,
        "targets_met": {
            "xsa_over_sa_step_time": xsa_ratio <= TARGETS["xsa_over_sa_step_time"],
            "lightning_over_plain_throughput": lit_ratio >= TARGETS["lightning_over_plain_throughput"],
        },
        "runtime_s": runtime,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench_train: {args.rounds} rounds x {args.steps} steps, {result['torch_threads']} threads")
    for col in ("run", "step ms (median)", "tokens/s", "ratio (per-round median / pooled)", "target"):
        table.add_column(col, justify="left" if col == "run" else "right")
    ok = lambda key: "[green]met[/]" if result["targets_met"][key] else "[red]missed[/]"
    table.add_row("SA", f"{attn['sa_step_ms']:.1f}", f"{attn['sa_tokens_per_s']:,.0f}", "", "")
    table.add_row("XSA", f"{attn['xsa_step_ms']:.1f}", f"{attn['xsa_tokens_per_s']:,.0f}",
                  f"XSA/SA time {xsa_ratio:.3f} / {attn['ratio_pooled']:.3f}", f"<= 1.03 {ok('xsa_over_sa_step_time')}")  # fmt: skip
    table.add_row("plain loop (SA)", f"{loop['plain_step_ms']:.1f}", f"{loop['plain_tokens_per_s']:,.0f}", "", "")
    table.add_row("Lightning (SA)", f"{loop['lightning_step_ms']:.1f}", f"{loop['lightning_tokens_per_s']:,.0f}",
                  f"L/plain tput {lit_ratio:.3f} / {1 / loop['ratio_pooled']:.3f}", f">= 0.95 {ok('lightning_over_plain_throughput')}")  # fmt: skip
    Console().print(table)
    print(f"runtime {runtime:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()

"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio x peak."""

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> LambdaLR:
    return LambdaLR(
        optimizer, partial(warmup_cosine, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    )


def continue_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Set the LRs to the schedule's at its current step: a restored optimizer holds the old schedule's."""
    if not isinstance(scheduler, LambdaLR):
        return
    groups = scheduler.optimizer.param_groups
    for group, base, multiplier in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * multiplier(scheduler.last_epoch)


def peak_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> float | None:
    """The highest LR a LambdaLR schedule gave its first `steps` steps: below optim.lr while the warmup lasts."""
    if steps <= 0 or not isinstance(scheduler, LambdaLR):
        return None
    multipliers = [max(f(step) for step in range(steps)) for f in scheduler.lr_lambdas]
    return float(max(base * m for base, m in zip(scheduler.base_lrs, multipliers, strict=True)))

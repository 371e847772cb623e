"""The paper's protocol as pure functions: the LR grid, the trials of each phase, the LR selection, and the
statistics of the comparison. No processes, files or plots here (see trials.py and report.py)."""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from xsa_lm.errors import UserError

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal limit, corrected).
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042]  # fmt: skip


@dataclass(frozen=True)
class Trial:
    """One training run of the sweep. A trial is identified by (attention, lr, seed) alone, so the SA run of the
    search at the selected LR is the same trial as the SA run of the comparison for that seed."""

    attention: str
    lr: float
    seed: int

    @property
    def id(self) -> str:
        return f"{self.attention}_lr{self.lr:.3g}_s{self.seed}"


@dataclass
class Selection:
    lr: float | None  # None: no search run finished without diverging
    losses: dict[float, float | None]  # lr -> final val loss of a usable run (None: diverged, failed or missing)
    warnings: list[str] = field(default_factory=list)


def lr_grid(lrs: Sequence[float] | None, lr_range: dict | None) -> list[float]:
    """The sorted, de-duplicated LR grid: an explicit list, or {min, max, num} log-spaced."""
    if lrs:
        grid = [float(lr) for lr in lrs]
    elif lr_range:
        lo, hi, num = float(lr_range["min"]), float(lr_range["max"]), int(lr_range["num"])
        if not (0 < lo < hi) or num < 2:
            raise UserError(f"sweep.lr_range needs 0 < min < max and num >= 2, got {dict(lr_range)}")
        grid = [lo * (hi / lo) ** (i / (num - 1)) for i in range(num)]
        grid = [float(f"{lr:.4g}") for lr in grid]  # readable trial names: 1e-4, 3.162e-4, ...
    else:
        raise UserError("the sweep needs an LR grid: set sweep.lrs=[...] or sweep.lr_range={min:..,max:..,num:..}")
    if any(not math.isfinite(lr) or lr <= 0 for lr in grid):
        raise UserError(f"every LR of the grid must be a positive number, got {grid}")
    return sorted(set(grid))


def search_trials(grid: Sequence[float], seed: int, attentions: Sequence[str]) -> list[Trial]:
    return [Trial(attention, lr, seed) for attention in attentions for lr in grid]


def compare_trials(lr: float, seeds: Sequence[int]) -> list[Trial]:
    return [Trial(attention, lr, seed) for seed in seeds for attention in ("sa", "xsa")]


def usable_loss(status: str | None, loss: float | None, diverge_above: float) -> float | None:
    """The final val loss of a run that can be compared, else None. A run counts as diverged when training
    stopped on a NaN/inf loss, or its final loss is not finite or above the bound."""
    if status != "completed" or loss is None or not math.isfinite(loss) or loss > diverge_above:
        return None
    return loss


def select_lr(results: dict[float, tuple[str | None, float | None]], diverge_above: float) -> Selection:
    """The LR with the lowest final val loss among the search runs (lr -> (status, final val loss)).
    Diverged, failed and missing runs are never selected. A tie goes to the smaller LR, the safer choice."""
    losses = {lr: usable_loss(status, loss, diverge_above) for lr, (status, loss) in sorted(results.items())}
    selection = Selection(lr=None, losses=losses)
    failed = [lr for lr, (status, _) in sorted(results.items()) if status not in ("completed", "diverged")]
    if failed:
        selection.warnings.append(
            f"the search runs at LR {', '.join(f'{lr:g}' for lr in failed)} did not finish (failed or "
            "interrupted): the selection ignores them; run the same sweep command again to retry them"
        )
    usable = [(loss, lr) for lr, loss in losses.items() if loss is not None]
    if not usable:
        selection.warnings.append(
            "no LR is usable: every search run diverged (NaN/inf loss, or a final val loss above the bound "
            "sweep.diverge_above) or failed; lower the LR grid (sweep.lrs) and run the sweep again"
        )
        return selection
    selection.lr = min(usable)[1]
    grid = sorted(results)
    if len(grid) == 1:
        selection.warnings.append(
            f"the grid holds one LR ({selection.lr:g}): nothing was searched, so it is not known to be the best; "
            "give sweep.lrs values below and above it and run the same command again"
        )
    elif selection.lr in (grid[0], grid[-1]):
        side, extend = ("lowest", "below") if selection.lr == grid[0] else ("highest", "above")
        selection.warnings.append(
            f"the best LR {selection.lr:g} is the {side} LR of the grid: the optimum may lie {extend} it; "
            f"extend the grid {extend} {selection.lr:g} (sweep.lrs) and run the same command again"
        )
    return selection


@dataclass
class Comparison:
    seeds: list[int]
    sa: list[float]
    xsa: list[float]

    @property
    def diffs(self) -> list[float]:
        return [x - s for s, x in zip(self.sa, self.xsa, strict=True)]


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def t_quantile_975(dof: int) -> float:
    if dof <= len(T_975):
        return T_975[dof - 1]
    z = 1.959964  # Cornish-Fisher expansion around the normal quantile: within 1e-4 of the exact value above 30 dof
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def paired_ci(diffs: Sequence[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean paired difference (Student's t); None below two pairs."""
    if len(diffs) < 2:
        return None
    mean, std = mean_std(diffs)
    half = t_quantile_975(len(diffs) - 1) * std / math.sqrt(len(diffs))
    return mean - half, mean + half

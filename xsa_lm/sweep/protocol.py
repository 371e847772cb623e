"""The paper's protocol as pure functions: the LR grid, the trials of each phase, the LR selection, and the
sequential stopping rule (no processes, files or plots; the tests of the comparison are xsa_lm.stats)."""

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from xsa_lm.config.spec import SEED_MAX
from xsa_lm.errors import UserError
from xsa_lm.records import Record
from xsa_lm.stats.paired import ALPHA, paired_t


@dataclass(frozen=True)
class Trial:
    """One training run, identified by (attention, lr, seed) alone: a rerun, or another phase, reuses it."""

    attention: str
    lr: float
    seed: int

    @property
    def id(self) -> str:
        return f"{self.attention}_lr{self.lr:.3g}_s{self.seed}"


@dataclass
class Selection:
    lr: float | None  # None: no LR has a usable median
    losses: dict[float, float | None]  # lr -> median final val loss over the search seeds (None: not usable)
    warnings: list[str] = field(default_factory=list)


def lr_grid(lrs: Sequence[float] | None, lr_range: dict | None, preset: Sequence[float] | None = None) -> list[float]:
    """The sorted LR grid: sweep.lrs, sweep.lr_range log-spaced, or else the model preset's (sweep.lr_grids)."""
    if lrs is not None and len(lrs) == 0:
        raise UserError(
            "the sweep needs an LR grid: sweep.lrs=[] is empty; give it LRs, or null for the grid of the "
            "model preset (sweep.lr_grids)"
        )
    if lrs and lr_range:  # one would be ignored without a word
        raise UserError(
            "sweep.lrs and sweep.lr_range are both set, and the grid is one of them: set the other to null (e.g. "
            "sweep.lrs=null for the log-spaced range)"
        )
    from_range = bool(lr_range and not lrs)
    if lr_range and not lrs:
        lo, hi, num = float(lr_range["min"]), float(lr_range["max"]), int(lr_range["num"])
        lrs = [float(f"{lo * (hi / lo) ** (i / (num - 1)):.4g}") for i in range(num)]  # readable: 1e-4, 3.162e-4
    if not (lrs or preset):
        raise UserError("the sweep needs an LR grid: set sweep.lrs=[...] or sweep.lr_range={min:..,max:..,num:..}")
    grid = sorted({float(lr) for lr in lrs or preset or []})
    named = {lr: f"lr{lr:.3g}" for lr in grid}  # the LR's part of a trial's id
    for a, b in itertools.pairwise(grid):  # one name, one run folder and record: the second LR would reuse the first's
        if named[a] == named[b]:
            source = "sweep.lr_range gives" if from_range else "the LR grid has"
            raise UserError(
                f"{source} {a:g} and {b:g}, which name one run (lr{a:.3g}: runs are named by 3 significant digits): "
                "use LRs that differ within 3 significant digits" + (", or fewer points" if from_range else "")
            )
    return grid


def check_seeds(
    seeds: Sequence[int] | None, search_seeds: Sequence[int], reuse_search_run: bool = False, name: str = "sweep.seeds"
) -> list[int]:
    """The compare seeds (none: search only), no search seed unless sweep.reuse_search_run (its winner was lucky)."""
    seeds = list(seeds or [])
    shared = [s for s in seeds if s in search_seeds]
    if shared and not reuse_search_run:
        fresh = (s for s in itertools.count() if s not in seeds and s not in search_seeds)  # the same number, new
        instead = [s if s not in search_seeds else next(fresh) for s in seeds]
        listed = lambda values: f"[{','.join(map(str, values))}]"  # as typed on a command line
        raise UserError(
            f"{name}={listed(seeds)} contains the search seed(s) {listed(shared)} (sweep.search_seeds): the "
            "compare phase would reuse the search's winning baseline run (sweep.baseline), selected partly for its "
            "luck, which biases the comparison against the candidates; use seeds without them (e.g. "
            f"{name}={listed(instead)}) or set sweep.reuse_search_run=true to accept the bias"
        )
    return seeds


def search_trials(grid: Sequence[float], seeds: Sequence[int], attentions: Sequence[str]) -> list[Trial]:
    return [Trial(attention, lr, seed) for attention in attentions for lr in grid for seed in seeds]


def compare_trials(lr: float, seeds: Sequence[int], arms: Sequence[str]) -> list[Trial]:
    """Every arm (the baseline, then the candidates) at the selected LR, seed by seed."""
    return [Trial(attention, lr, seed) for seed in seeds for attention in arms]


NULL = "null"  # the init null's trials: the baseline with other initial weights
PLACEBO = "placebo"  # the placebo's trials: the baseline from its own initial weights, perturbed by sweep.placebo_scale
NULL_TRIALS = {"init": NULL, "placebo": PLACEBO}  # sweep.null_arm's arms -> their trials' arm name
FINISHED = ("completed", "diverged")  # a trial's final status: a rerun reuses it


def null_init_seed(seed: int) -> int:
    return (seed + 1_000_000) % (SEED_MAX + 1)  # the null arm's weights: far from every trial's own


def select_lr(results: dict[float, list[tuple[str | None, float | None]]]) -> Selection:
    """The LR of the lowest median loss (lr -> [(status, loss)]; a tie: the smaller LR; diverged: +inf), or None."""
    losses: dict[float, float | None] = {}
    for lr, runs in sorted(results.items()):
        done = [loss if s == "completed" and loss is not None else math.inf for s, loss in runs if s in FINISHED]
        median = statistics.median([x if math.isfinite(x) else math.inf for x in done]) if done else math.inf
        losses[lr] = float(median) if math.isfinite(median) else None
    selection = Selection(lr=None, losses=losses)
    failed = [lr for lr, runs in sorted(results.items()) if any(s not in FINISHED for s, _ in runs)]
    if failed:
        selection.warnings.append(
            f"search runs at LR {', '.join(f'{lr:g}' for lr in failed)} did not finish (failed or interrupted): "
            "the selection ignores them; run the same sweep command again to retry them"
        )
    usable = [(loss, lr) for lr, loss in losses.items() if loss is not None]
    if not usable:
        selection.warnings.append(
            "no LR is usable: at every LR half the search runs or more diverged (NaN/inf loss, or a final val loss "
            "above the bound sweep.diverge_above) or failed; lower the LR grid (sweep.lrs) and run the sweep again"
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
    """A candidate's final losses against the baseline's, paired by seed (fields named as in results.json)."""

    seeds: list[int]
    sa: list[float]  # the baseline's
    xsa: list[float]  # the candidate's

    @property
    def diffs(self) -> list[float]:
        return [x - s for s, x in zip(self.sa, self.xsa, strict=True)]


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def seed_sequence(seeds: Sequence[int], search_seeds: Sequence[int], cap: int) -> list[int]:
    """sweep.seeds, then the integers after the largest of them but search seeds, up to cap seeds in all."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < max(len(seeds), 2):
        raise UserError(
            f"sweep.seeds_until_significant must be an integer of at least 2 and at least the number of sweep.seeds "
            f"({len(seeds)}), got {cap!r}: it caps the compare seeds, sweep.seeds included"
        )
    if not seeds:
        raise UserError("sweep.seeds_until_significant needs compare seeds to start from: set sweep.seeds=[1,2]")
    fresh = (s for s in itertools.count(max(seeds) + 1) if s not in search_seeds)
    sequence = [*seeds, *itertools.islice(fresh, cap - len(seeds))]
    if sequence[-1] > SEED_MAX:
        raise UserError(
            f"sweep.seeds_until_significant={cap} would add seeds up to {sequence[-1]}, beyond the largest seed "
            f"{SEED_MAX}: start sweep.seeds lower"
        )
    return sequence


@dataclass(frozen=True, kw_only=True)
class Look(Record):
    seeds: int
    pairs: int
    mean: float | None
    ci: tuple[float, float] | None
    p_value: float | None
    significant: bool


@dataclass(frozen=True, kw_only=True)
class SequentialSummary(Record):
    rule: str
    correction: str
    cap: int
    first_look: int
    planned_looks: int
    alpha: float
    alpha_per_look: float
    confidence: float
    n_looks: int
    looks: list[Look]
    stopped: str  # significant | cap | incomplete (a trial did not finish: rerun to continue)
    seeds: int | None
    ci: tuple[float, float] | None
    p_value: float | None


@dataclass(frozen=True)
class SequentialRule:
    """A seed pair more per look up to cap until the CI excludes 0, each look at Bonferroni's alpha / looks."""

    cap: int
    first_look: int  # the seeds of the first look: sweep.seeds, at least 2 (no CI below two pairs)
    alpha: float = ALPHA
    contrast: str = "XSA - SA"  # the difference it tests, by the arms' names

    @classmethod
    def plan(cls, n_seeds: int, cap: int, contrast: str = "XSA - SA") -> "SequentialRule":
        return cls(cap=cap, first_look=min(max(n_seeds, 2), cap), contrast=contrast)

    @property
    def looks(self) -> int:
        return self.cap - self.first_look + 1

    @property
    def alpha_per_look(self) -> float:
        return self.alpha / self.looks

    def look(self, n_seeds: int, diffs: Sequence[float]) -> Look:
        test = paired_t(diffs, confidence=1 - self.alpha_per_look)
        significant = test.ci is not None and (test.ci[0] > 0 or test.ci[1] < 0)
        mean = statistics.fmean(diffs) if diffs else None
        return Look(seeds=n_seeds, pairs=len(diffs), mean=mean, ci=test.ci, p_value=test.p, significant=significant)

    def stopped(self, look: Look) -> str | None:
        """Why the sequence stops after this look (significant, cap), or None."""
        if look.significant:
            return "significant"
        return "cap" if look.seeds >= self.cap else None

    def summary(self, looks: list[Look], stopped: str) -> SequentialSummary:
        last = looks[-1] if looks else None
        return SequentialSummary(
            rule=f"one seed pair at a time from {self.first_look} to {self.cap} compare seeds, until the "
            f"corrected paired CI of {self.contrast} excludes 0",
            correction="bonferroni",
            cap=self.cap,
            first_look=self.first_look,
            alpha=self.alpha,
            planned_looks=self.looks,
            alpha_per_look=self.alpha_per_look,
            confidence=1 - self.alpha_per_look,
            n_looks=len(looks),
            looks=looks,
            stopped=stopped,
            seeds=last.seeds if last else None,
            ci=last.ci if last else None,
            p_value=last.p_value if last else None,
        )

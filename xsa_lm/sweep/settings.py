"""The type and range of every setting of `xsa-lm sweep` (configs/sweep/paper.yaml) and `xsa-lm scale`
(configs/_scale.yaml), each on its field as config/schema.py has them, checked before the sweep or study directory
gets anything. Hydra types a command-line value by its look: `sweep.lrs=1e-3` is a number, not a list, and
`sweep.diverge_above=-1` a fine int (with it every run "diverged"). The rules that tie settings together stay with the
code that uses them (protocol.py, scale/); these come first, so that those see the types they expect.
"""

import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import Field, dataclass, fields
from typing import Literal

from omegaconf import DictConfig, ListConfig, OmegaConf

from xsa_lm.config.checks import field_problems
from xsa_lm.config.schema import SEED_MAX, Rule, is_a, knob
from xsa_lm.errors import UserError


def plain(value: object) -> object:
    """A config list or dict as a Python one (anything else unchanged), also for messages."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def is_list(value: object) -> bool:
    return isinstance(value, list | tuple | ListConfig)


def positive_numbers(example: str, nullable: bool = False) -> Rule:
    """A list of distinct positive numbers ([] is left to the code that needs some, which says why)."""

    def check(value) -> str | None:  # null, where the field allows it: Check.problem
        if not is_list(value) or any(not is_a(float, v) or v <= 0 for v in value):
            return f"must be a list of positive numbers, e.g. {example}" + (", or null" if nullable else "")
        twice = sorted(v for v, n in Counter(float(v) for v in value).items() if n > 1)
        return f"lists {', '.join(f'{v:g}' for v in twice)} twice: list each value once" if twice else None

    return check


def seed_list(nullable: bool = False) -> Rule:
    """Distinct seeds, each in the range `seed` takes (numpy's, which Lightning's seed_everything enforces)."""

    def check(value) -> str | None:
        if value is None and nullable:
            return None
        ints = is_list(value) and all(is_a(int, s) and 0 <= s <= SEED_MAX for s in value)
        if not ints or len(set(value)) != len(value):
            return f"must be a list of distinct integers from 0 to {SEED_MAX}" + (", or null" if nullable else "")
        return None

    return check


def lr_range(value) -> str | None:
    """{min, max, num}: num LRs log-spaced from min to max."""
    good = (
        isinstance(value, dict | DictConfig)
        and set(value) == {"min", "max", "num"}
        and is_a(float, value["min"])
        and is_a(float, value["max"])
        and 0 < value["min"] < value["max"]
        and is_a(int, value["num"])
        and value["num"] >= 2
    )
    return None if good else "must be {min:..,max:..,num:..} with 0 < min < max and an integer num >= 2, or null"


def lr_grids(value) -> str | None:
    """Model name -> its LR grid (a non-empty list of positive numbers)."""
    if not isinstance(value, dict | DictConfig):
        return "must map model names to LR lists, e.g. {tiny:[3e-3,1e-2,3e-2],default:[1e-4,3e-4]}"
    grid = positive_numbers("[1e-4,3e-4]")
    for name, lrs in value.items():
        problem = grid(lrs) or (None if not is_list(lrs) or len(lrs) else "must not be empty")
        if problem:
            return f"has {name!s}: {plain(lrs)}, which {problem}"
    return None


def stall(value) -> str | None:
    """null, or the stall rule's keys (sweep/stalls.py StallRule checks their values)."""
    keys = {"at_fraction", "margin", "loss_threshold"}
    if value is None or (isinstance(value, dict | DictConfig) and set(value) <= keys):
        return None
    return f"must be null or hold only {', '.join(sorted(keys))}"


def command_prefix(value) -> str | None:
    """The words put before each trial's command: [] (none), or a program found on PATH and its arguments."""
    if value is None or (is_list(value) and not value):
        return None
    if not is_list(value) or any(not isinstance(word, str) or not word for word in value):
        return "must be a list of words, e.g. [srun,--ntasks=1], or [] for none"
    if shutil.which(value[0]) is None:
        return f"starts with {value[0]}, which is no program on PATH (nor an executable file): install it or fix it"
    return None


def eval_tasks(value) -> str | None:
    """null (no downstream evaluation), `paper`, a task name or YAML file, or a list of them."""
    words = list(value) if is_list(value) else [value]
    if value is None or (words and all(isinstance(w, str) and w for w in words)):
        return None
    return "must be null, paper, or a list of lm-eval task names or task YAML files"


def checked_elsewhere(value) -> None:
    """A setting whose rule needs other settings: the code that uses it checks it, before anything is written."""
    return None


@dataclass
class SweepSettings:
    """`xsa-lm sweep`'s settings (configs/sweep/paper.yaml says what each does)."""

    lrs: list[float] | None = knob(rule=positive_numbers("[1e-3,3e-3]", nullable=True))  # null: lr_range, lr_grids
    lr_range: dict[str, float] | None = knob(rule=lr_range)  # {min, max, num}: log-spaced
    lr_grids: dict[str, list[float]] | None = knob(rule=lr_grids)  # model name -> its grid
    search_seeds: list[int] = knob(rule=seed_list())  # each LR scored by the median final loss over them
    seeds: list[int] | None = knob(rule=seed_list(nullable=True), hint="[]: a search-only sweep")  # compare seeds
    reuse_search_run: bool = knob()  # true: a search seed among the compare seeds (biased against XSA)
    seeds_until_significant: int | None = knob(rule=checked_elsewhere)  # protocol.py seed_sequence: >= the seeds
    margin: float = knob(ge=0, hint="the practical margin in nats of XSA - SA, fixed in the plan before the runs")
    null_arm: bool = knob()  # an A/A null beside the comparison
    tune_xsa: bool = knob()  # also grid-search XSA
    stall: dict[str, float | None] | None = knob(rule=stall)  # when a search run stalls (sweep/stalls.py)
    diverge_above: float | None = knob(
        gt=0, hint="a final val loss above it counts as diverged; null: ln(vocabulary size), a uniform guess"
    )
    max_parallel: int = knob(ge=1)  # trials at once
    launch_prefix: list[str] = knob(rule=command_prefix)  # put before each trial, e.g. [srun, --ntasks=1]
    wandb_report: bool = knob()  # a report run in the sweep's W&B group
    eval_tasks: str | list[str] | None = knob(rule=eval_tasks)  # xsa-lm eval on the compare runs; null: none
    eval_limit: float | None = knob(gt=0, hint="the first N examples per task; null: all")


@dataclass
class ScaleSettings:
    """`xsa-lm scale`'s settings (configs/_scale.yaml says what each does)."""

    axis: Literal["size", "tokens"] = knob()  # the sizes at one token budget, or token budgets per size
    models: list[str] = knob(rule=checked_elsewhere)  # scale/run.py check_models: presets, two or more on size
    seeds: list[int] | None = knob(
        rule=seed_list(nullable=True), hint="the compare seeds at every size; null: sweep.seeds"
    )
    fit: str = knob(rule=checked_elsewhere)  # scale/run.py check_analysis: auto or a form of scale/fit.py
    bootstrap_resamples: int = knob(ge=100)  # behind the bootstrap intervals
    bootstrap_seed: int = knob(ge=0, le=SEED_MAX)  # the same resamples on every rerun
    wandb_report: bool = knob()  # a scale-report run in the study's W&B group
    tokens_per_param: float = knob(gt=0)  # B = this x the non-embedding parameters
    sa_budgets: list[float] = knob(rule=positive_numbers("[0.5,1,2]"))  # in units of B
    xsa_budgets: list[float] = knob(rule=positive_numbers("[0.5,1]"))  # in units of B, among SA's
    lr_per_budget: bool = knob()  # SA's LR searched at every SA budget
    warmup_fraction: float | None = knob(
        ge=0, lt=1, hint="the share of each run's steps spent warming up; null: the recipe's"
    )
    allow_repeated_data: bool = knob()  # false: a budget past one epoch is refused
    measure_throughput: bool = knob()  # xsa-lm bench SA vs XSA at each size
    bench_rounds: int = knob(ge=2)  # of the throughput bench
    bench: str | None = knob(rule=checked_elsewhere)  # scale/run.py load_bench: a results.json of `xsa-lm bench`


# Each group's settings by name, as the commands check them (check_settings).
SWEEP_RULES = {f.name: f for f in fields(SweepSettings)}
SCALE_RULES = {f.name: f for f in fields(ScaleSettings)}


def check_settings(node: DictConfig, rules: Mapping[str, Field], group: str) -> None:
    """Every key of the group against its field, in one line naming each bad value; a key without a field is one the
    command does not have (`+sweep.lr=...`), a field without a key a config that lost it."""
    bad = [
        f"{group}.{key}: not a setting of `xsa-lm {group}` (it has {', '.join(rules)})"
        for key in map(str, node)
        if key not in rules
    ]
    bad += field_problems(node, rules.values(), f"{group}.")
    if bad:
        raise UserError("; ".join(bad))
